package device_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/cuda"
)

func TestOpenSpecs(t *testing.T) {
	for _, spec := range []string{"cpu"} {
		d, err := device.Open(spec)
		if err != nil || d.String() != spec {
			t.Errorf("Open(%q) = %v, %v", spec, d, err)
		}
	}
	for _, spec := range []string{"tpu", "cuda:x", "cuda:-1", "cuda:"} {
		if _, err := device.Open(spec); err == nil || !strings.Contains(err.Error(), spec) {
			t.Errorf("Open(%q): want an error naming it, got %v", spec, err)
		}
	}
	n, _ := device.CUDACount()
	spec := "cuda:7"
	if n >= 7 {
		spec = "cuda:" + string(rune('0'+n))
	}
	_, err := device.Open(spec)
	if err == nil {
		t.Fatalf("Open(%q) with %d GPUs: no error", spec, n)
	}
	if !strings.Contains(err.Error(), spec) {
		t.Errorf("Open(%q): error does not name the device: %v", spec, err)
	}
	if n > 0 && !strings.Contains(err.Error(), "no such GPU") {
		t.Errorf("Open(%q) with %d GPUs: %v", spec, n, err)
	}
	t.Logf("Open(%q): %v", spec, err)
}

// TestMissingLibcuda runs this test binary again with DROPLESS_LIBCUDA pointing nowhere.
func TestMissingLibcuda(t *testing.T) {
	if os.Getenv("DROPLESS_TEST_CHILD") == "missing-libcuda" {
		_, err := device.Open("cuda")
		if err == nil {
			t.Fatal("Open(cuda) without libcuda: no error")
		}
		if !strings.Contains(err.Error(), "/nonexistent/libcuda.so.1") {
			t.Fatalf("error does not name the library: %v", err)
		}
		d, err := device.Open("")
		if err != nil || d.IsCUDA() {
			t.Fatalf("Open(\"\") without libcuda: %v, %v; want the CPU", d, err)
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMissingLibcuda$", "-test.v")
	cmd.Env = append(os.Environ(), "DROPLESS_TEST_CHILD=missing-libcuda", "DROPLESS_LIBCUDA=/nonexistent/libcuda.so.1", "DROPLESS_DEVICE=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child failed: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "--- PASS: TestMissingLibcuda") {
		t.Fatalf("child did not run the test:\n%s", out)
	}
}

func TestList(t *testing.T) {
	infos, err := device.List()
	if len(infos) == 0 || infos[0].Spec != "cpu" {
		t.Fatalf("List() = %v: want the CPU first", infos)
	}
	for _, in := range infos {
		t.Logf("%s\t%s\t%s", in.Spec, in.Name, in.Detail)
	}
	if err != nil {
		t.Logf("no GPU: %v", err)
	}
}

func TestCrossDeviceCopy(t *testing.T) {
	g := dt.GPU(t)
	c := device.CPU()
	a := dt.Must(c.Alloc(device.F32, 8))
	b := dt.Must(g.Alloc(device.F32, 8))
	defer b.Free()
	if err := device.Copy(g.Stream(), b, a); err == nil || !strings.Contains(err.Error(), "cpu") {
		t.Errorf("Copy from a CPU tensor on a GPU stream: %v", err)
	}
	if err := device.Copy(c.Stream(), a, b); err == nil {
		t.Error("Copy from a GPU tensor on the CPU stream: no error")
	}
}

func TestPoolDoesNotGrow(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		maxLen := 1 << 19
		if !d.IsCUDA() {
			maxLen = 1 << 10 // the CPU has no pool; keep the run short
		}
		cycle := func(i int) {
			x := dt.Must(s.Alloc(device.BF16, 1+(i*7919)%maxLen))
			dt.NoErr(t, device.Fill(s, x, float64(i)))
			dt.NoErr(t, x.Free())
		}
		for i := range 100 {
			cycle(i)
		}
		dt.NoErr(t, s.Synchronize())
		before, _, err := d.PoolStats()
		dt.NoErr(t, err)
		start := time.Now()
		for i := range 10000 {
			cycle(i)
		}
		dt.NoErr(t, s.Synchronize())
		after, used, err := d.PoolStats()
		dt.NoErr(t, err)
		t.Logf("10000 allocate/fill/free cycles in %v; pool reserved %d → %d bytes, %d in use", time.Since(start), before, after, used)
		if after > before {
			t.Errorf("pool grew from %d to %d bytes", before, after)
		}
	})
}

func TestWrapForeignPointer(t *testing.T) {
	g := dt.GPU(t)
	var p cuda.DevicePtr
	dt.NoErr(t, g.Do(func() error {
		var err error
		p, err = cuda.MemAlloc(4096)
		return err
	}))
	defer g.Do(func() error { return cuda.MemFree(p) })
	x, err := g.Wrap(uintptr(p), device.I32, 1024)
	dt.NoErr(t, err)
	dt.NoErr(t, device.Fill(g.Stream(), x, 42))
	got := make([]int32, 1024)
	dt.NoErr(t, device.Download(g.Stream(), x, got))
	for i, v := range got {
		if v != 42 {
			t.Fatalf("element %d = %d", i, v)
		}
	}
	dt.NoErr(t, x.Free()) // not owned: a no-op
	if _, err := g.Wrap(0x1000, device.F32, 4); err == nil {
		t.Error("Wrap of a pointer that is not device memory: no error")
	}
}
