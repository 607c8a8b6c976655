package device_test

import (
	"bytes"
	"fmt"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// download returns t's bytes.
func download(t *testing.T, s *device.Stream, x *device.Tensor) []byte {
	t.Helper()
	b := make([]byte, x.Bytes())
	dt.NoErr(t, x.CopyToHost(s, b))
	return b
}

func upload(t *testing.T, s *device.Stream, typ device.DType, b []byte, shape ...int) *device.Tensor {
	t.Helper()
	x := dt.Must(s.Alloc(typ, shape...))
	dt.NoErr(t, x.CopyFromHost(s, b))
	return x
}

// cpuRef runs op on the CPU with copies of the inputs and returns the output bytes.
func TestFill(t *testing.T) {
	values := []float64{0, 1, -2.5, 448, 1e30, -1e-30, math.Inf(1), math.NaN(), 3.7e9, -7}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, typ := range device.DTypes {
			for _, n := range []int{1, 3, 17, 4099} {
				for _, v := range values {
					x := dt.Must(s.Alloc(typ, n))
					dt.Poison(t, s, x)
					dt.NoErr(t, device.Fill(s, x, v))
					got := download(t, s, x)
					want := bytes.Repeat(elemBytes(typ, v), n)
					if !bytes.Equal(got, want) {
						t.Fatalf("Fill(%v[%d], %v): got % x..., want % x...", typ, n, v, got[:min(16, len(got))], want[:min(16, len(want))])
					}
					x.Free()
				}
			}
		}
	})
}

// elemBytes encodes v as Fill documents, computed on the CPU device.
func elemBytes(typ device.DType, v float64) []byte {
	s := device.CPU().Stream()
	x, _ := s.Alloc(typ, 1)
	device.Fill(s, x, v)
	return append([]byte(nil), x.HostBytes()...)
}

func TestFillInView(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x := dt.Must(s.Alloc(device.BF16, 1000))
		dt.NoErr(t, device.Fill(s, x, 1))
		v := dt.Must(x.View(3, 500))
		dt.NoErr(t, device.Fill(s, v, -2))
		got := dt.Must(x.Float32s(s))
		for i, g := range got {
			want := float32(1)
			if i >= 3 && i < 503 {
				want = -2
			}
			if g != want {
				t.Fatalf("element %d = %v, want %v", i, g, want)
			}
		}
		x.Free()
	})
}

func TestCopy(t *testing.T) {
	r := dt.Rand(1)
	devs := dt.Devices(t)
	for _, tc := range []struct {
		typ               device.DType
		n, srcOff, dstOff int
	}{
		{device.F32, 1 << 20, 0, 0}, {device.BF16, 12345, 0, 0}, {device.BF16, 12345, 1, 3},
		{device.E4M3, 100003, 7, 0}, {device.I64, 9, 0, 1}, {device.F32, 1, 0, 0}, {device.E8M0, 31, 0, 0},
	} {
		src := dt.Bytes(r, (tc.n+tc.srcOff)*tc.typ.Size())
		var ref []byte
		for _, d := range devs {
			s := d.Stream()
			a := upload(t, s, tc.typ, src, tc.n+tc.srcOff)
			b := dt.Must(s.Alloc(tc.typ, tc.n+tc.dstOff))
			dt.Poison(t, s, b)
			av := dt.Must(a.View(tc.srcOff, tc.n))
			bv := dt.Must(b.View(tc.dstOff, tc.n))
			dt.NoErr(t, device.Copy(s, bv, av))
			got := download(t, s, b)
			if ref == nil {
				ref = got
				want := append(bytes.Repeat([]byte{0xFF}, tc.dstOff*tc.typ.Size()), src[tc.srcOff*tc.typ.Size():]...)
				if !bytes.Equal(got, want) {
					t.Fatalf("%v: Copy %+v: wrong bytes", d, tc)
				}
			} else if !bytes.Equal(got, ref) {
				t.Fatalf("%v: Copy %+v differs from the CPU", d, tc)
			}
			a.Free()
			b.Free()
		}
	}
}

// castSource returns n source elements of typ: every code for 8- and 16-bit types
// (repeated to n), random bits and special values for the others.
func castSource(typ device.DType, n int, seed uint64) []byte {
	r := dt.Rand(seed)
	b := make([]byte, n*typ.Size())
	switch typ.Size() {
	case 1:
		for i := range b {
			b[i] = byte(i)
		}
	case 2:
		for i := 0; i < n; i++ {
			b[2*i], b[2*i+1] = byte(i), byte(i>>8)
		}
	default:
		b = dt.Bytes(r, len(b))
		if typ == device.F32 {
			// Mix in ordinary magnitudes, which random bits rarely hit.
			f := make([]float32, n/2)
			for i := range f {
				f[i] = float32(r.NormFloat64() * math.Pow(2, float64(r.IntN(80)-40)))
			}
			device.EncodeFloat32(device.F32, b, f)
		}
		if typ == device.I32 || typ == device.I64 {
			for i := 0; i < n/2; i++ { // small integers too
				v := int64(r.IntN(2001) - 1000)
				for j := 0; j < typ.Size(); j++ {
					b[i*typ.Size()+j] = byte(v >> (8 * j))
				}
			}
		}
	}
	return b
}

// TestCast checks every pair of dtypes: the GPU's result equals the CPU's bit for bit,
// over every code of the 8- and 16-bit sources.
func TestCast(t *testing.T) {
	devs := dt.Devices(t)
	const n = 65536 + 37
	for _, from := range device.DTypes {
		src := castSource(from, n, uint64(from))
		for _, to := range device.DTypes {
			var ref []byte
			for _, d := range devs {
				s := d.Stream()
				a := upload(t, s, from, src, n)
				b := dt.Must(s.Alloc(to, n))
				dt.Poison(t, s, b)
				dt.NoErr(t, device.Cast(s, b, a))
				got := download(t, s, b)
				if ref == nil {
					ref = got
					want := make([]byte, n*to.Size())
					device.ConvertBytes(to, want, from, src, n)
					if !bytes.Equal(got, want) {
						t.Fatalf("%v: Cast %v→%v differs from ConvertBytes", d, from, to)
					}
				} else if i := firstDiff(got, ref); i >= 0 {
					e := i / to.Size()
					t.Errorf("%v: Cast %v→%v: element %d (source % x): got % x, CPU % x", d, from, to, e,
						src[e*from.Size():(e+1)*from.Size()], got[e*to.Size():(e+1)*to.Size()], ref[e*to.Size():(e+1)*to.Size()])
				}
				a.Free()
				b.Free()
			}
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func TestOpErrors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		a := dt.Must(s.Alloc(device.F32, 10))
		b := dt.Must(s.Alloc(device.F32, 11))
		c := dt.Must(s.Alloc(device.BF16, 10))
		for name, err := range map[string]error{
			"Copy sizes":       device.Copy(s, a, b),
			"Copy dtypes":      device.Copy(s, a, c),
			"Cast sizes":       device.Cast(s, c, b),
			"CopyFromHost len": a.CopyFromHost(s, make([]byte, 39)),
			"CopyToHost len":   a.CopyToHost(s, make([]byte, 41)),
			"Upload type":      device.Upload(s, a, []uint16{1}),
			"View range":       errOf(a.View(5, 6)),
			"Reshape":          errOf(a.Reshape(3, 4)),
		} {
			if err == nil {
				t.Errorf("%s: no error", name)
			} else {
				t.Logf("%s: %v", name, err)
			}
		}
		a.Free()
		if err := device.Fill(s, a, 1); err == nil {
			t.Error("Fill of a freed tensor: no error")
		}
		b.Free()
		c.Free()
	})
}

func errOf[T any](_ T, err error) error { return err }

func TestShapeErrors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, shape := range [][]int{{-1}, {3, -2}, {1 << 40, 1 << 40}, {math.MaxInt, 2}} {
			if _, err := s.Alloc(device.F32, shape...); err == nil {
				t.Errorf("Alloc %v: no error", shape)
			} else {
				t.Logf("Alloc %v: %v", shape, err)
			}
		}
		if _, err := s.Alloc(device.Invalid, 3); err == nil {
			t.Error("Alloc of an invalid dtype: no error")
		}
		x := dt.Must(s.Alloc(device.F32, 0, 5))
		if x.Len() != 0 {
			t.Errorf("empty tensor has %d elements", x.Len())
		}
		dt.NoErr(t, device.Fill(s, x, 1))
		x.Free()
	})
}

func TestGraphReplay(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		const n = 1<<20 + 5
		src := dt.Must(device.FromFloat32(s, device.F32, dt.Normal(dt.Rand(2), n, 3), n))
		mid := dt.Must(s.Alloc(device.BF16, n))
		out := dt.Must(s.Alloc(device.F32, n))
		dt.Poison(t, s, mid, out)
		dt.NoErr(t, s.BeginCapture())
		dt.NoErr(t, device.Cast(s, mid, src))
		dt.NoErr(t, device.Cast(s, out, mid))
		g, err := s.EndCapture()
		dt.NoErr(t, err)
		defer g.Close()
		if got := download(t, s, out); !bytes.Equal(got, bytes.Repeat([]byte{0xFF}, len(got))) {
			t.Fatal("captured work ran before the graph was launched")
		}
		want := make([]byte, n*4)
		srcb := download(t, s, src)
		tmp := make([]byte, n*2)
		device.ConvertBytes(device.BF16, tmp, device.F32, srcb, n)
		device.ConvertBytes(device.F32, want, device.BF16, tmp, n)
		for rep := range 3 {
			dt.Poison(t, s, out)
			dt.NoErr(t, g.Launch(s))
			if got := download(t, s, out); !bytes.Equal(got, want) {
				t.Fatalf("replay %d: wrong result", rep)
			}
		}
		for _, x := range []*device.Tensor{src, mid, out} {
			x.Free()
		}
	})
}

func TestRoundTrip(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		size := 64 << 20
		if d.IsCUDA() {
			size = 1 << 30
		}
		s := d.Stream()
		src := dt.Bytes(dt.Rand(3), size)
		x := upload(t, s, device.E4M3, src, size)
		got := download(t, s, x)
		if i := firstDiff(got, src); i >= 0 {
			t.Fatalf("%d-byte round trip differs at byte %d", size, i)
		}
		x.Free()
		t.Logf("%d MiB round trip bit-exact", size>>20)
	})
}

// TestEventsOrderStreams: work on b (a priority stream) waits for a's event.
func TestEventsOrderStreams(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		a := dt.Must(d.NewStream())
		b := dt.Must(d.NewPriorityStream())
		defer a.Close()
		defer b.Close()
		n := 1 << 20
		big := 1 << 28 // slow work on a before x is written
		if !d.IsCUDA() {
			big = 1 << 20
		}
		ws := dt.Must(a.Alloc(device.F32, big))
		wd := dt.Must(a.Alloc(device.F32, big))
		x := dt.Must(a.Alloc(device.F32, n))
		y := dt.Must(a.Alloc(device.F32, n))
		dt.NoErr(t, device.Fill(a, x, 1))
		dt.NoErr(t, device.Fill(a, y, 0))
		dt.NoErr(t, a.Synchronize())
		for rep := range 5 {
			for range 4 {
				dt.NoErr(t, device.Copy(a, wd, ws))
			}
			v := float64(rep + 2)
			dt.NoErr(t, device.Fill(a, x, v))
			e := dt.Must(a.Record())
			dt.NoErr(t, b.Wait(e))
			dt.NoErr(t, device.Copy(b, y, x))
			got := dt.Must(y.Float32s(b))
			for i, g := range got {
				if g != float32(v) {
					t.Fatalf("rep %d: y[%d] = %v, want %v: b ran before a's event", rep, i, g, v)
				}
			}
			e.Close()
		}
		dt.NoErr(t, a.Synchronize())
		for _, x := range []*device.Tensor{ws, wd, x, y} {
			x.Free()
		}
	})
}

func TestCompileError(t *testing.T) {
	dt.RequireNVRTC(t)
	p := device.NewProgram("broken.cu", `extern "C" __global__ void k(float *p) { p[0] = not_declared; }`)
	err := p.CheckCompile("")
	if err == nil {
		t.Fatal("no error for a kernel that does not compile")
	}
	for _, want := range []string{"broken.cu", "NVRTC_ERROR_COMPILATION", "not_declared"} {
		if !bytes.Contains([]byte(err.Error()), []byte(want)) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	for _, d := range dt.Devices(t) {
		if !d.IsCUDA() {
			continue
		}
		if _, err := d.Kernel(p, "k"); err == nil || !bytes.Contains([]byte(err.Error()), []byte("not_declared")) {
			t.Errorf("%v: Kernel of a broken program: %v", d, err)
		}
	}
}

func ExampleCast() {
	s := device.CPU().Stream()
	x, _ := device.FromFloat32(s, device.F32, []float32{1, 0.1, 500, -3.3e-3}, 4)
	y, _ := s.Alloc(device.E4M3, 4)
	device.Cast(s, y, x)
	v, _ := y.Float32s(s)
	fmt.Println(v)
	// Output: [1 0.1015625 448 -0.00390625]
}

// TestEventDevice checks Event.Device: the event's device while it is open, nil after
// Close and for a nil event.
func TestEventDevice(t *testing.T) {
	d := device.CPU()
	e := dt.Must(d.NewEvent())
	if got := e.Device(); got != d {
		t.Errorf("Device of an open event: %v, want %v", got, d)
	}
	dt.NoErr(t, e.Close())
	if got := e.Device(); got != nil {
		t.Errorf("Device of a closed event: %v, want nil", got)
	}
	if got := (*device.Event)(nil).Device(); got != nil {
		t.Errorf("Device of a nil event: %v, want nil", got)
	}
}

// TestStreamMultiprocessors checks SetMultiprocessors' count as Multiprocessors reports
// it: the device's by default and after 0, the count set otherwise, 0 for a nil stream.
func TestStreamMultiprocessors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		all := d.Multiprocessors()
		for _, c := range []struct{ set, want int }{{-1, all}, {1, 1}, {all, all}, {0, all}} {
			if c.set >= 0 {
				dt.NoErr(t, s.SetMultiprocessors(c.set))
			}
			if got := s.Multiprocessors(); got != c.want {
				t.Errorf("Multiprocessors() after SetMultiprocessors(%d) = %d, want %d", c.set, got, c.want)
			}
		}
	})
	if got := (*device.Stream)(nil).Multiprocessors(); got != 0 {
		t.Errorf("Multiprocessors of a nil stream = %d, want 0", got)
	}
}

// A stream whose products leave the device's last quarter of multiprocessors to the
// kernels of other streams; 0 gives them all back.
func ExampleStream_SetMultiprocessors() {
	d := device.CPU()
	s, err := d.NewStream()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	all := d.Multiprocessors()
	if err := s.SetMultiprocessors(max(all-all/4, 1)); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(s.Multiprocessors() <= all)
	if err := s.SetMultiprocessors(0); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(s.Multiprocessors() == all)
	// Output:
	// true
	// true
}
