package cu_test

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"gorgonia.org/cu"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	dlcu "github.com/dropless/dropless/interop/cu"
	"github.com/dropless/dropless/quant"
)

// gpu is a test's GPU as cu sees it: the test's goroutine is locked to its thread with
// d's primary context current, cs is a cu stream and s the same stream for dropless.
// The cu memory it allocates is freed, after cs's work, when the test ends.
type gpu struct {
	t   *testing.T
	d   *device.Device
	cs  cu.Stream
	s   *device.Stream
	mem []cu.DevicePtr
}

// newGPU returns t's gpu, or skips t without a GPU (fails it with DROPLESS_REQUIRE_GPU=1).
// Subtests run on goroutines of their own: each needs its own.
func newGPU(t *testing.T) *gpu {
	t.Helper()
	d := dt.GPU(t)
	ctx := dt.Must(dlcu.Context(d))
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	dt.NoErr(t, cu.SetCurrentContext(ctx))
	g := &gpu{t: t, d: d, cs: dt.Must(cu.MakeStream(cu.NonBlocking))}
	g.s = dt.Must(dlcu.WrapStream(d, g.cs))
	t.Cleanup(func() {
		dt.NoErr(t, g.cs.Synchronize())
		dt.NoErr(t, g.s.Close())
		for _, p := range g.mem {
			dt.NoErr(t, cu.MemFree(p))
		}
		dt.NoErr(t, g.cs.Destroy())
	})
	return g
}

// alloc returns n bytes of cu memory.
func (g *gpu) alloc(n int) cu.DevicePtr {
	g.t.Helper()
	p := dt.Must(cu.MemAlloc(int64(n)))
	g.mem = append(g.mem, p)
	return p
}

// tensor returns a tensor of dt and shape over new cu memory holding b (poisoned with
// 0xFF for nil b), written on cs.
func (g *gpu) tensor(b []byte, dtype device.DType, shape ...int) *device.Tensor {
	g.t.Helper()
	n := dtype.Size()
	for _, d := range shape {
		n *= d
	}
	p := g.alloc(n)
	if b == nil {
		dt.NoErr(g.t, cu.MemsetD8Async(p, 0xFF, int64(n), g.cs))
	} else {
		dt.NoErr(g.t, cu.MemcpyHtoDAsync(p, unsafe.Pointer(&b[0]), int64(n), g.cs))
	}
	return dt.Must(dlcu.Wrap(g.d, p, dtype, shape...))
}

// poison sets every byte of x, a tensor of dropless's, to 0xFF with cu on cs.
func (g *gpu) poison(x *device.Tensor) {
	g.t.Helper()
	dt.NoErr(g.t, cu.MemsetD8Async(dt.Must(dlcu.Ptr(x)), 0xFF, int64(x.Bytes()), g.cs))
}

// bytes copies x back with cu on cs, after the work enqueued there.
func (g *gpu) bytes(x *device.Tensor) []byte {
	g.t.Helper()
	b := make([]byte, x.Bytes())
	dt.NoErr(g.t, cu.MemcpyDtoHAsync(unsafe.Pointer(&b[0]), dt.Must(dlcu.Ptr(x)), int64(len(b)), g.cs))
	dt.NoErr(g.t, g.cs.Synchronize())
	return b
}

// cpuTensor returns a CPU tensor of dt and shape holding b.
func cpuTensor(t *testing.T, b []byte, dtype device.DType, shape ...int) *device.Tensor {
	t.Helper()
	x := dt.Must(device.CPU().Alloc(dtype, shape...))
	dt.NoErr(t, x.CopyFromHost(device.CPU().Stream(), b))
	return x
}

// encode returns v in dtype's bytes.
func encode(dtype device.DType, v []float32) []byte {
	b := make([]byte, len(v)*dtype.Size())
	device.EncodeFloat32(dtype, b, v)
	return b
}

// groupSizes splits total rows into G groups, about a quarter of them empty.
func groupSizes(r *rand.Rand, G, total int) []int32 {
	w := make([]float64, G)
	sum := 0.0
	for g := range w {
		if r.IntN(4) != 0 || g == 0 {
			w[g] = 0.25 + r.Float64()
		}
		sum += w[g]
	}
	sizes := make([]int32, G)
	left := total
	for g := range sizes {
		sizes[g] = int32(math.Floor(w[g] / sum * float64(total)))
		left -= int(sizes[g])
	}
	sizes[0] += int32(left)
	return sizes
}

// checkClose compares the GPU's ragged_dot result with the CPU's, with gemm's own
// tolerances: relative 1/128 for bf16 results of bf16 products, 1e-5 otherwise, and an
// absolute floor of a small part of the result's RMS.
func checkClose(t *testing.T, in, out device.DType, got, want []byte) {
	t.Helper()
	g := make([]float32, len(got)/out.Size())
	c := make([]float32, len(want)/out.Size())
	device.DecodeFloat32(out, g, got)
	device.DecodeFloat32(out, c, want)
	var ss float64
	for _, v := range c {
		ss += float64(v) * float64(v)
	}
	rms := math.Sqrt(ss / float64(max(len(c), 1)))
	rel, abs := 1e-5, 1e-5*rms
	if out == device.BF16 {
		rel, abs = 1.0/128, 1e-3*rms
	}
	bad := 0
	for i := range c {
		if d := math.Abs(float64(g[i]) - float64(c[i])); !(d <= rel*math.Abs(float64(c[i]))+abs) {
			if bad == 0 {
				t.Errorf("y element %d = %v, CPU %v (%v·%v)", i, g[i], c[i], in, out)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d elements of y differ from the CPU's", bad, len(c))
	}
}

// firstDiff describes the first byte where got and want differ, or returns "".
func firstDiff(got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			n := 0
			for j := i; j < len(got); j++ {
				if got[j] != want[j] {
					n++
				}
			}
			return fmt.Sprintf("byte %d of %d is %#02x, want %#02x (%d bytes differ)", i, len(got), got[i], want[i], n)
		}
	}
	return ""
}

// TestRaggedDotAndQuantize runs gemm.RaggedDot and quant.Quantize on memory that cu
// allocated and wrote, on cu's stream, copies the results back with cu and compares
// them with the CPU's on the same random inputs: ragged_dot within gemm's tolerances,
// MXFP8 bit for bit. The quantization's outputs are dropless's, poisoned through Ptr;
// a device.Status on the wrapped stream must record no invalid sizes.
func TestRaggedDotAndQuantize(t *testing.T) {
	cases := []struct {
		name       string
		in, out    device.DType
		G, M, K, N int
		short      bool // sizes sum to less than M (the rows after are zeros), and x is quantized without groups
		opt        quant.Options
	}{
		{"bf16", device.BF16, device.BF16, 8, 512, 256, 384, false, quant.Options{Dir: quant.Both, Swizzle: true}},
		{"bf16-f32-short", device.BF16, device.F32, 3, 200, 72, 136, true, quant.Options{Format: quant.E5M2}},
		{"f32", device.F32, device.F32, 5, 300, 64, 96, false, quant.Options{Dir: quant.Both, Mode: quant.FLOOR}},
		{"f32-bf16-odd-short", device.F32, device.BF16, 2, 130, 33, 17, true, quant.Options{Dir: quant.Columnwise}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := newGPU(t)
			r := dt.Rand(uint64(100 + i))
			rows := c.M
			if c.short {
				rows = c.M - 1 - r.IntN(c.M/4)
			}
			sizes := groupSizes(r, c.G, rows)
			xb := encode(c.in, dt.Normal(r, c.M*c.K, 1))
			wb := encode(c.in, dt.Normal(r, c.G*c.K*c.N, float32(1/math.Sqrt(float64(c.K)))))
			sb := make([]byte, 4*c.G)
			for g, n := range sizes {
				binary.LittleEndian.PutUint32(sb[4*g:], uint32(n))
			}

			// The GPU: cu's memory and stream.
			x := g.tensor(xb, c.in, c.M, c.K)
			w := g.tensor(wb, c.in, c.G, c.K, c.N)
			gs := g.tensor(sb, device.I32, c.G)
			y := g.tensor(nil, c.out, c.M, c.N)
			st := dt.Must(device.NewStatus(g.s)) // where the kernels record invalid sizes
			t.Cleanup(func() { dt.NoErr(t, st.Free()) })
			dt.NoErr(t, gemm.RaggedDot(g.s, y, x, w, gs, &gemm.Options{Status: st}))
			opt := c.opt
			opt.Status = st
			if !c.short {
				opt.GroupSizes = gs
			}
			q := dt.Must(quant.Alloc(g.s, c.M, c.K, opt))
			t.Cleanup(func() { dt.NoErr(t, q.Free()) })
			outs := []*device.Tensor{q.Row, q.RowScale, q.Col, q.ColScale}
			for _, o := range outs {
				if o != nil {
					g.poison(o)
				}
			}
			dt.NoErr(t, quant.QuantizeInto(g.s, q, x, opt))
			dt.NoErr(t, st.Check(g.s))

			// The CPU, on the same bytes.
			cs := device.CPU().Stream()
			cx := cpuTensor(t, xb, c.in, c.M, c.K)
			cy := dt.Must(cs.Alloc(c.out, c.M, c.N))
			cgs := cpuTensor(t, sb, device.I32, c.G)
			dt.NoErr(t, gemm.RaggedDot(cs, cy, cx, cpuTensor(t, wb, c.in, c.G, c.K, c.N), cgs, nil))
			copt := c.opt
			if !c.short {
				copt.GroupSizes = cgs
			}
			cq := dt.Must(quant.Quantize(cs, cx, copt))

			checkClose(t, c.in, c.out, g.bytes(y), cy.HostBytes())
			for j, o := range outs {
				if o == nil {
					continue
				}
				want := []*device.Tensor{cq.Row, cq.RowScale, cq.Col, cq.ColScale}[j].HostBytes()
				if diff := firstDiff(g.bytes(o), want); diff != "" {
					t.Errorf("quant %s %v: %s", []string{"Row", "RowScale", "Col", "ColScale"}[j], o, diff)
				}
			}
		})
	}
}

// TestRoundTrip checks that the conversions give back the handles they were given,
// that Context is the primary context cu retains, and that a wrapped tensor's Free
// leaves cu's memory alone.
func TestRoundTrip(t *testing.T) {
	g := newGPU(t)
	dev := dt.Must(dlcu.Device(g.d))
	if want := dt.Must(cu.GetDevice(g.d.Ordinal())); dev != want {
		t.Errorf("Device(%v) = %v, want %v", g.d, dev, want)
	}
	primary := dt.Must(dev.RetainPrimaryCtx())
	defer dev.ReleasePrimaryCtx()
	if ctx := dt.Must(dlcu.Context(g.d)); ctx != primary {
		t.Errorf("Context(%v) = %v, the primary context is %v", g.d, ctx, primary)
	}

	p := g.alloc(64)
	x := dt.Must(dlcu.Wrap(g.d, p, device.F32, 4, 4))
	if got := dt.Must(dlcu.Ptr(x)); got != p {
		t.Errorf("Ptr(Wrap(%v)) = %v", p, got)
	}
	v := dt.Must(x.Rows(1, 3))
	if got, want := dt.Must(dlcu.Ptr(v)), p+16; got != want {
		t.Errorf("Ptr of rows 1-3 of Wrap(%v) = %v, want %v", p, got, want)
	}
	inner := dt.Must(dlcu.Wrap(g.d, p+48, device.F32, 4))
	if got := dt.Must(dlcu.Ptr(inner)); got != p+48 {
		t.Errorf("Ptr(Wrap(%v)) = %v", p+48, got)
	}
	if got := dt.Must(dlcu.Stream(g.s)); got != g.cs {
		t.Errorf("Stream(WrapStream(%v)) = %v", g.cs, got)
	}

	// Free of a wrapped tensor leaves the memory to cu, which still reads it.
	dt.NoErr(t, device.Fill(g.s, x, 3))
	dt.NoErr(t, x.Free())
	b := make([]byte, 64)
	dt.NoErr(t, g.cs.Synchronize())
	dt.NoErr(t, cu.MemcpyDtoH(unsafe.Pointer(&b[0]), p, 64))
	got := make([]float32, 16)
	device.DecodeFloat32(device.F32, got, b)
	want := []float32{3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("cu memory after the wrapped tensor's Free (-want +got):\n%s", diff)
	}

	// cu work on the device's own stream, seen through Stream, is ordered with dropless's.
	ds := g.d.Stream()
	y := dt.Must(ds.Alloc(device.F32, 16))
	defer y.Free()
	dt.NoErr(t, device.Fill(ds, y, 1))
	dt.NoErr(t, cu.MemsetD32Async(dt.Must(dlcu.Ptr(y)), uint(math.Float32bits(5)), 16, dt.Must(dlcu.Stream(ds))))
	if diff := cmp.Diff([]float32{5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5}, dt.Must(y.Float32s(ds))); diff != "" {
		t.Errorf("a dropless tensor after cu's memset on the device's stream (-want +got):\n%s", diff)
	}
}

// errCase is a case of the error tables: the error of one call and what it must say.
type errCase struct {
	name   string
	err    error
	want   string
	prefix bool // want is the error's beginning; the rest is device's or the driver's
}

// errOf returns the error of a call that returns a value and an error.
func errOf(_ any, err error) error { return err }

// checkErrors fails t for each case whose error is not the one wanted.
func checkErrors(t *testing.T, cases []errCase) {
	t.Helper()
	for _, c := range cases {
		got := "<nil>"
		if c.err != nil {
			got = c.err.Error()
		}
		if c.prefix && strings.HasPrefix(got, c.want) {
			continue
		}
		if diff := cmp.Diff(c.want, got); diff != "" {
			t.Errorf("%s: error (-want +got):\n%s", c.name, diff)
		}
	}
}

// TestErrors checks the error of every function for nil, zero, CPU, freed, closed and
// out-of-range arguments.
func TestErrors(t *testing.T) {
	g := newGPU(t)
	cpu := device.CPU()
	p := g.alloc(64)
	freed := dt.Must(g.s.Alloc(device.F32, 4))
	dt.NoErr(t, freed.Free())
	closed := dt.Must(g.d.NewStream())
	dt.NoErr(t, closed.Close())
	empty := dt.Must(g.s.Alloc(device.F32, 0))
	legacy := dt.Must(g.d.WrapStream(0))
	cpuT := dt.Must(cpu.Alloc(device.F32, 4))
	host := cu.DevicePtr(unsafe.Pointer(&g.mem[0]))
	size, base, err := p.AddressRange() // 64 bytes from p, or more if the driver rounds up
	dt.NoErr(t, err)
	over := int(size)/4 + 4          // f32 elements: 16 bytes more than the allocation
	overInside := int(size-32)/2 + 1 // bf16 elements from p+32: 2 bytes more

	checkErrors(t, []errCase{
		{"Device nil", errOf(dlcu.Device(nil)), "cu: Device: d is nil", false},
		{"Device cpu", errOf(dlcu.Device(cpu)), "cu: Device: d is cpu: want a CUDA device", false},
		{"Context nil", errOf(dlcu.Context(nil)), "cu: Context: d is nil", false},
		{"Context cpu", errOf(dlcu.Context(cpu)), "cu: Context: d is cpu: want a CUDA device", false},
		{"Wrap nil device", errOf(dlcu.Wrap(nil, p, device.F32, 4)), "cu: Wrap: d is nil", false},
		{"Wrap cpu", errOf(dlcu.Wrap(cpu, p, device.F32, 4)), "cu: Wrap: d is cpu: want a CUDA device", false},
		{"Wrap 0", errOf(dlcu.Wrap(g.d, 0, device.F32, 4)), "cu: Wrap: p is 0: want device memory from cu.MemAlloc", false},
		{"Wrap invalid dtype", errOf(dlcu.Wrap(g.d, p, device.Invalid, 4)), "cu: Wrap: device: invalid dtype", true},
		{"Wrap negative shape", errOf(dlcu.Wrap(g.d, p, device.F32, 4, -1)), "cu: Wrap: device: shape [4 -1]: dimension 1 is negative", false},
		{"Wrap past the allocation", errOf(dlcu.Wrap(g.d, p, device.F32, over)),
			fmt.Sprintf("cu: Wrap: f32[%d] needs %d bytes from %v, the allocation holds %d bytes from %v", over, 4*over, p, size, base), false},
		{"Wrap inside, past the end", errOf(dlcu.Wrap(g.d, p+32, device.BF16, overInside)),
			fmt.Sprintf("cu: Wrap: bf16[%d] needs %d bytes from %v, the allocation holds %d bytes from %v", overInside, 2*overInside, p+32, size, base), false},
		{"Wrap host memory", errOf(dlcu.Wrap(g.d, host, device.F32, 1)), "cu: Wrap: ", true},
		{"Ptr nil", errOf(dlcu.Ptr(nil)), "cu: Ptr: t is nil", false},
		{"Ptr zero tensor", errOf(dlcu.Ptr(&device.Tensor{})), "cu: Ptr: t is nil", false},
		{"Ptr cpu", errOf(dlcu.Ptr(cpuT)), "cu: Ptr: t is f32[4]@cpu: want a tensor on a CUDA device", false},
		{"Ptr freed", errOf(dlcu.Ptr(freed)), fmt.Sprintf("cu: Ptr: t f32[4]@%v was freed", g.d), false},
		{"Ptr empty", errOf(dlcu.Ptr(empty)), fmt.Sprintf("cu: Ptr: t f32[0]@%v holds no device memory", g.d), false},
		{"WrapStream nil device", errOf(dlcu.WrapStream(nil, g.cs)), "cu: WrapStream: d is nil", false},
		{"WrapStream cpu", errOf(dlcu.WrapStream(cpu, g.cs)), "cu: WrapStream: d is cpu: want a CUDA device", false},
		{"WrapStream zero", errOf(dlcu.WrapStream(g.d, cu.Stream{})), "cu: WrapStream: s is the zero cu.Stream (CUDA's legacy stream): want a stream from cu.MakeStream", false},
		{"Stream nil", errOf(dlcu.Stream(nil)), "cu: Stream: s is nil", false},
		{"Stream cpu", errOf(dlcu.Stream(cpu.Stream())), "cu: Stream: s is a cpu stream: want a stream of a CUDA device", false},
		{"Stream closed", errOf(dlcu.Stream(closed)), "cu: Stream: s was closed", false},
		{"Stream legacy", errOf(dlcu.Stream(legacy)), "cu: Stream: s wraps CUDA's legacy stream: want a stream with a handle", false},
	})
}

// TestOtherContext checks that Wrap and WrapStream refuse memory and a stream of a
// context that cu.MakeContext created beside the primary one. It skips where the GPU's
// compute mode allows a process one context only.
func TestOtherContext(t *testing.T) {
	g := newGPU(t)
	primary := dt.Must(dlcu.Context(g.d))
	dev := dt.Must(dlcu.Device(g.d))
	other, err := dev.MakeContext(cu.SchedAuto) // current on this thread from here
	if err != nil {
		t.Skipf("no second context on %v: %v", g.d, err)
	}
	op, err1 := cu.MemAlloc(64)
	ostream, err2 := cu.MakeStream(cu.NonBlocking)
	defer func() {
		dt.NoErr(t, cu.SetCurrentContext(other))
		if err2 == nil {
			dt.NoErr(t, ostream.Destroy())
		}
		if err1 == nil {
			dt.NoErr(t, cu.MemFree(op))
		}
		dt.NoErr(t, other.Destroy())
		dt.NoErr(t, cu.SetCurrentContext(primary))
	}()
	dt.NoErr(t, err1)
	dt.NoErr(t, err2)
	dt.NoErr(t, cu.SetCurrentContext(primary))

	h := fmt.Sprintf("%#x", uintptr(unsafe.Pointer(ostream.C())))
	checkErrors(t, []errCase{
		{"Wrap", errOf(dlcu.Wrap(g.d, op, device.F32, 4)),
			fmt.Sprintf("cu: Wrap: %v belongs to context %v, not to %v's primary context %v: allocate it with the primary context current (see Context)", op, other, g.d, primary), false},
		{"WrapStream", errOf(dlcu.WrapStream(g.d, ostream)),
			fmt.Sprintf("cu: WrapStream: stream %s belongs to context %v, not to %v's primary context %v: create it with the primary context current (see Context)", h, other, g.d, primary), false},
	})
}
