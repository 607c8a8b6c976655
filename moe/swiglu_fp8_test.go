package moe

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

func TestKernelsCompileSwiGLUFP8(t *testing.T) { dt.CheckCompiles(t, swigluMXProg, swigluBwProg) }

// swigluFP8Case is a case of the fused SwiGLU and quantization: h [M, 2F] at an element
// offset of its storage (1: not 16-byte aligned, the element-by-element loads), group
// sizes (nil: none) and the used rows (−1: all).
type swigluFP8Case struct {
	M, F   int
	sizes  []int32
	used   int
	offset int
}

var swigluFP8Cases = []swigluFP8Case{
	{1, 16, nil, -1, 0}, {33, 16, nil, -1, 0}, {130, 48, nil, 100, 0}, {77, 40, nil, -1, 1},
	{300, 80, []int32{129, 0, 1, 127, 43}, -1, 0}, // empty, tiny and past-128 groups
	{257, 32, []int32{0, 257}, -1, 0},             // one skewed group
	{200, 64, []int32{0, 0, 200, 0}, 150, 0},      // unused rows in the last group, as a capacity layer's
	{77, 40, []int32{0, 40, 37}, -1, 1},
	{64, 20, []int32{10, 54}, -1, 0}, // F*2 bytes not a multiple of 16: element loads
	{150, 24, []int32{5, 145}, 120, 0},
	{0, 16, []int32{0, 0}, -1, 0}, {0, 16, nil, -1, 0}, {40, 0, nil, -1, 0},
}

// swigluFP8Options are the options of each recipe the fused tests run.
var (
	swigluBwOptions = []quant.BlockOptions{
		{Dir: quant.Rowwise}, {Dir: quant.Columnwise}, {Dir: quant.Both},
		{Dir: quant.Both, Scale: quant.ScalePow2}, {Dir: quant.Both, Format: quant.E5M2},
	}
	swigluMXOptions = []quant.Options{
		{Dir: quant.Rowwise}, {Dir: quant.Columnwise, Transpose: true}, {Dir: quant.Both, Transpose: true},
		{Dir: quant.Both}, {Dir: quant.Both, Swizzle: true, Mode: quant.FLOOR}, {Dir: quant.Columnwise, Format: quant.E5M2},
	}
)

// swigluInput makes h [M, 2F] of typ at the case's offset from random values with
// ±Inf and NaN sprinkled in (the limits of silu), and the used rows (nil: all).
func swigluInput(t testing.TB, s *device.Stream, tc swigluFP8Case, typ device.DType, seed uint64) (h, used *device.Tensor) {
	t.Helper()
	r := dt.Rand(seed)
	v := randn(r, typ, tc.M*2*tc.F, 3)
	for i := range v {
		switch r.IntN(97) {
		case 0:
			v[i] = float32(math.Inf(1 - 2*r.IntN(2)))
		case 1:
			v[i] = float32(math.NaN())
		}
	}
	base := up(t, s, typ, append(make([]float32, tc.offset), v...), tc.offset+len(v))
	h = dt.Must(base.View(tc.offset, tc.M, 2*tc.F))
	if tc.used >= 0 {
		used = upI32(t, s, []int32{int32(tc.used)}, 1)
	}
	return h, used
}

// swigluOn returns, on the CPU, SwiGLU's output computed on s (its kernel on a GPU)
// from h over the used rows: the tensor the fused quantization must quantize as its own.
func swigluOn(t testing.TB, s *device.Stream, h, used *device.Tensor) *device.Tensor {
	t.Helper()
	a := alloc(t, s, h.DType(), h.Dim(0), h.Dim(1)/2)
	defer a.Free()
	dt.NoErr(t, swiglu(s, a, h, used))
	return dt.Must(device.FromFloat32(device.CPU().Stream(), h.DType(), down(t, s, a), a.Shape()...))
}

// groups returns sizes on s (nil for nil).
func groups(t testing.TB, s *device.Stream, sizes []int32) *device.Tensor {
	if sizes == nil {
		return nil
	}
	return upI32(t, s, sizes, len(sizes))
}

// bytesOf returns the bytes of each tensor (nil for nil).
func bytesOf(t testing.TB, s *device.Stream, ts ...*device.Tensor) [][]byte {
	t.Helper()
	out := make([][]byte, len(ts))
	for i, x := range ts {
		if x != nil {
			out[i] = make([]byte, x.Bytes())
			dt.NoErr(t, x.CopyToHost(s, out[i]))
		}
	}
	return out
}

// poisonAll poisons the tensors that are not nil.
func poisonAll(t testing.TB, s *device.Stream, ts ...*device.Tensor) {
	t.Helper()
	for _, x := range ts {
		if x != nil {
			dt.Poison(t, s, x)
		}
	}
}

// TestSwiGLUFP8 checks the fused SwiGLU and quantization, both recipes, every
// direction, bf16 and f32, on every device, with outputs poisoned first: bit for bit
// quant's quantization on the CPU of SwiGLU's output computed on the same device (the
// GPU's SwiGLU kernel on a GPU), over row counts past multiples of 128, short blocks,
// unused rows, unaligned sources, empty, tiny and skewed groups.
func TestSwiGLUFP8(t *testing.T) {
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, tc := range swigluFP8Cases {
			for _, typ := range dtypes() {
				h, used := swigluInput(t, s, tc, typ, uint64(4000+10*ci))
				a := swigluOn(t, s, h, used)
				for oi, opt := range swigluBwOptions {
					t.Run(name("blockwise/", tc, "/", typ, "/", oi), func(t *testing.T) {
						opt.GroupSizes = groups(t, cpu, tc.sizes)
						want := dt.Must(quant.QuantizeBlockwise(cpu, a, opt))
						defer want.Free()
						opt.GroupSizes = groups(t, s, tc.sizes)
						q := dt.Must(quant.AllocBlockwise(s, tc.M, tc.F, opt))
						defer q.Free()
						poisonAll(t, s, q.Row, q.RowScale, q.ColT, q.ColTScale)
						dt.NoErr(t, swigluBlockwise("test", s, q, h, used, opt))
						if diff := cmp.Diff(bytesOf(t, cpu, want.Row, want.RowScale, want.ColT, want.ColTScale),
							bytesOf(t, s, q.Row, q.RowScale, q.ColT, q.ColTScale)); diff != "" {
							t.Errorf("Row, RowScale, ColT, ColTScale (-unfused +fused):\n%s", diff)
						}
						if q.Status != nil {
							dt.NoErr(t, q.Status.Check(s))
						}
					})
				}
				for oi, opt := range swigluMXOptions {
					t.Run(name("mxfp8/", tc, "/", typ, "/", oi), func(t *testing.T) {
						opt.GroupSizes = groups(t, cpu, tc.sizes)
						want := dt.Must(quant.Quantize(cpu, a, opt))
						defer want.Free()
						opt.GroupSizes = groups(t, s, tc.sizes)
						q := dt.Must(quant.Alloc(s, tc.M, tc.F, opt))
						defer q.Free()
						poisonAll(t, s, q.Row, q.RowScale, q.Col, q.ColT, q.ColScale)
						dt.NoErr(t, swigluMXFP8("test", s, q, h, used, opt))
						if diff := cmp.Diff(bytesOf(t, cpu, want.Row, want.RowScale, want.Col, want.ColT, want.ColScale),
							bytesOf(t, s, q.Row, q.RowScale, q.Col, q.ColT, q.ColScale)); diff != "" {
							t.Errorf("Row, RowScale, Col, ColT, ColScale (-unfused +fused):\n%s", diff)
						}
						if q.Status != nil {
							dt.NoErr(t, q.Status.Check(s))
						}
					})
				}
				device.FreeAll(h, used)
			}
		}
	})
}

// TestSwiGLUFP8Exported checks that SwiGLUBlockwise and SwiGLUMXFP8 quantize all rows of
// h as SwiGLU computes them, then quantized, on every device.
func TestSwiGLUFP8Exported(t *testing.T) {
	cpu := device.CPU().Stream()
	tc := swigluFP8Case{M: 150, F: 48, sizes: []int32{20, 0, 130}, used: -1}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		h, _ := swigluInput(t, s, tc, device.BF16, 4999)
		defer h.Free()
		a := swigluOn(t, s, h, nil)
		bo := quant.BlockOptions{Dir: quant.Both, GroupSizes: groups(t, s, tc.sizes)}
		bq := dt.Must(quant.AllocBlockwise(s, tc.M, tc.F, bo))
		defer bq.Free()
		dt.NoErr(t, SwiGLUBlockwise(s, bq, h, bo))
		bo.GroupSizes = groups(t, cpu, tc.sizes)
		bw := dt.Must(quant.QuantizeBlockwise(cpu, a, bo))
		defer bw.Free()
		if diff := cmp.Diff(bytesOf(t, cpu, bw.Row, bw.RowScale, bw.ColT, bw.ColTScale), bytesOf(t, s, bq.Row, bq.RowScale, bq.ColT, bq.ColTScale)); diff != "" {
			t.Errorf("SwiGLUBlockwise (-unfused +fused):\n%s", diff)
		}
		mo := quant.Options{Dir: quant.Both, Transpose: true, GroupSizes: groups(t, s, tc.sizes)}
		mq := dt.Must(quant.Alloc(s, tc.M, tc.F, mo))
		defer mq.Free()
		dt.NoErr(t, SwiGLUMXFP8(s, mq, h, mo))
		mo.GroupSizes = groups(t, cpu, tc.sizes)
		mw := dt.Must(quant.Quantize(cpu, a, mo))
		defer mw.Free()
		if diff := cmp.Diff(bytesOf(t, cpu, mw.Row, mw.RowScale, mw.ColT, mw.ColScale), bytesOf(t, s, mq.Row, mq.RowScale, mq.ColT, mq.ColScale)); diff != "" {
			t.Errorf("SwiGLUMXFP8 (-unfused +fused):\n%s", diff)
		}
	})
}
