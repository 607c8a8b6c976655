package device_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// scaleProgram returns a program whose kernel k writes p[i] = i·c; a fresh program
// (and so a fresh compile, the kernel cache aside) for each c.
func scaleProgram(c int) *device.Program {
	return device.NewProgram(fmt.Sprintf("scale%d.cu", c), fmt.Sprintf(
		`extern "C" __global__ void k(float *p, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] = float(i) * %d.0f; }`, c))
}

// TestLoad checks Device.Load: on the CPU it does nothing; on a GPU it loads every
// program once however many goroutines ask, Loaded lists them, their kernels run, and
// a program that does not compile fails the call, and its later Kernel calls, with
// NVRTC's log while the others load.
func TestLoad(t *testing.T) {
	c := device.CPU()
	dt.NoErr(t, c.Load(scaleProgram(1)))
	if n := len(c.Loaded()); n != 0 {
		t.Errorf("cpu: Loaded lists %d programs, want none", n)
	}
	for _, d := range dt.Devices(t) {
		if !d.IsCUDA() {
			continue
		}
		t.Run(d.String(), func(t *testing.T) {
			progs := []*device.Program{scaleProgram(2), scaleProgram(3), scaleProgram(5)}
			var wg sync.WaitGroup
			errs := make([]error, 4)
			for i := range errs {
				wg.Add(1)
				go func() { defer wg.Done(); errs[i] = d.Load(append(progs, progs[0])...) }()
			}
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Fatalf("Load, goroutine %d: %v", i, err)
				}
			}
			loaded := d.Loaded()
			for _, p := range progs {
				if !slices.Contains(loaded, p) {
					t.Errorf("Loaded lacks %s", p.Name)
				}
			}
			s := d.Stream()
			const n = 1000
			for i, p := range progs {
				k := dt.Must(d.Kernel(p, "k"))
				y := dt.Must(device.FromFloat32(s, device.F32, slices.Repeat([]float32{-7}, n), n)) // poisoned
				dt.NoErr(t, k.Launch(s, device.D1((n+255)/256), device.D1(256), 0, y, int32(n)))
				got := dt.Must(y.Float32s(s))
				want := make([]float32, n)
				for j := range want {
					want[j] = float32(j) * float32([]int{2, 3, 5}[i])
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("%s: (-want +got)\n%s", p.Name, diff)
				}
				y.Free()
			}
			broken := device.NewProgram("broken_load.cu", `extern "C" __global__ void k(float *p) { p[0] = not_declared; }`)
			good := scaleProgram(7)
			err := d.Load(broken, good)
			if err == nil || !strings.Contains(err.Error(), "broken_load.cu") || !strings.Contains(err.Error(), "not_declared") {
				t.Errorf("Load of a broken program: %v, want an error naming it with NVRTC's log", err)
			}
			if _, err := d.Kernel(broken, "k"); err == nil || !strings.Contains(err.Error(), "not_declared") {
				t.Errorf("Kernel of the broken program after Load: %v", err)
			}
			loaded = d.Loaded()
			if !slices.Contains(loaded, good) || slices.Contains(loaded, broken) {
				t.Errorf("after a failed Load: Loaded has the good program %v, the broken one %v; want true, false",
					slices.Contains(loaded, good), slices.Contains(loaded, broken))
			}
		})
	}
}

// ExampleDevice_Load compiles a program before its first use; on the CPU it does nothing.
func ExampleDevice_Load() {
	d := device.CPU() // or device.Open("cuda:0")
	p := device.NewProgram("scale.cu", `extern "C" __global__ void k(float *p) { p[threadIdx.x] *= 2.0f; }`)
	fmt.Println(d.Load(p), len(d.Loaded()))
	// Output: <nil> 0
}
