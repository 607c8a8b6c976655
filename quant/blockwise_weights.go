package quant

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// wGeom is the shape of a weight quantization: w_g is R×C in memory (R = K, C = N, or
// with NK R = N, C = K), cut into nrt×nct blocks of 128×128.
type wGeom struct {
	g, k, n  int
	nk       bool
	r, c     int
	nrt, nct int
}

func newWGeom(g, k, n int, nk bool) wGeom {
	w := wGeom{g: g, k: k, n: n, nk: nk, r: k, c: n}
	if nk {
		w.r, w.c = n, k
	}
	w.nrt, w.nct = ceilDiv(w.r, BlockSize), ceilDiv(w.c, BlockSize)
	return w
}

// scaleOff returns the offset in Scales of the scale of block (rt, ct) of w_g.
func (w wGeom) scaleOff(g, rt, ct int) int {
	if w.nk {
		return (g*w.nct+ct)*w.nrt + rt
	}
	return (g*w.nrt+rt)*w.nct + ct
}

func (w wGeom) scalesShape() []int {
	return []int{w.g, ceilDiv(w.k, BlockSize), ceilDiv(w.n, BlockSize)}
}

// QuantizeWeights quantizes expert weights w in 128×128 blocks, enqueued on s, from one
// read of w: w is a BF16 or F32 [G, K, N] tensor, or [G, N, K] with opt.NK. K and N must
// be multiples of 16 (rows of FP8 elements of whole 16-byte units, as the GEMMs' tensor
// memory accesses need). It reads opt.Format, opt.Scale and opt.NK; weights have no
// groups of rows, so opt.GroupSizes must be nil. Outputs are allocated on s: they share
// no memory with w.
func QuantizeWeights(s *device.Stream, w *device.Tensor, opt BlockOptions) (*BlockwiseWeights, error) {
	const fn = "QuantizeWeights"
	if s == nil {
		return nil, fmt.Errorf("quant: %s: nil stream", fn)
	}
	switch {
	case !opt.Format.valid():
		return nil, fmt.Errorf("quant: %s: opt.Format is %v: want E4M3 or E5M2", fn, opt.Format)
	case !opt.Scale.valid():
		return nil, fmt.Errorf("quant: %s: opt.Scale is %v: want ScaleF32 or ScalePow2", fn, opt.Scale)
	case opt.GroupSizes != nil:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is %v: want nil, weights have no groups of rows", fn, opt.GroupSizes)
	}
	k, n, err := checkWeightSource(fn, s, w, opt.NK)
	if err != nil {
		return nil, err
	}
	g := newWGeom(w.Dim(0), k, n, opt.NK)
	if g.r > math.MaxInt32-BlockSize || g.c > math.MaxInt32-BlockSize || (g.nrt*g.nct > 0 && g.g > math.MaxInt32/(g.nrt*g.nct)) {
		return nil, fmt.Errorf("quant: %s: w is %v: more than 2^31 kernel blocks or rows", fn, w)
	}
	ts := device.NewTemps(s)
	defer ts.Free()
	q := &BlockwiseWeights{G: g.g, K: k, N: n, Format: opt.Format, Scale: opt.Scale, wg: g}
	q.KMajor = ts.Alloc(opt.Format.DType(), g.g, n, k)
	q.NMajor = ts.Alloc(opt.Format.DType(), g.g, k, n)
	q.Scales = ts.Alloc(device.F32, g.scalesShape()...)
	if err := ts.Err(); err != nil {
		return nil, fmt.Errorf("quant: %s: w is %v: %w", fn, w, err)
	}
	if err := quantizeWeightsInto(s, q, w); err != nil {
		return nil, fmt.Errorf("quant: %s: %w", fn, err)
	}
	ts.Keep()
	return q, nil
}

// checkWeightSource returns K and N of w, the expert weights of a quantization of fn,
// and an error unless w is a live BF16 or F32 tensor on s's device, [G, K, N] (or with
// nk [G, N, K]) with K and N multiples of 16.
func checkWeightSource(fn string, s *device.Stream, w *device.Tensor, nk bool) (k, n int, err error) {
	if err := w.Check(s, "w"); err != nil {
		return 0, 0, fmt.Errorf("quant: %s: %w", fn, err)
	}
	layout := "[G, K, N]"
	if nk {
		layout = "[G, N, K] (opt.NK)"
	}
	if dt := w.DType(); (dt != device.BF16 && dt != device.F32) || w.Rank() != 3 {
		return 0, 0, fmt.Errorf("quant: %s: w is %v: want bf16 or f32 %s", fn, w, layout)
	}
	k, n = w.Dim(1), w.Dim(2)
	if nk {
		k, n = n, k
	}
	for _, d := range []struct {
		name string
		v    int
	}{{"K", k}, {"N", n}} {
		if d.v%16 != 0 {
			return 0, 0, fmt.Errorf("quant: %s: w is %v %s: %s = %d is not a multiple of 16 (FP8 rows of whole 16-byte units)", fn, w, layout, d.name, d.v)
		}
	}
	return k, n, nil
}

// quantizeWeightsInto quantizes w, checked to have q's shape and orientation, into q.
func quantizeWeightsInto(s *device.Stream, q *BlockwiseWeights, w *device.Tensor) error {
	if s.Device().IsCUDA() {
		return quantizeWeightsGPU(s, q, w)
	}
	return quantizeWeightsCPU(s, q, w)
}

// Free releases q's tensors (see device.Tensor.Free). Freeing a nil q does nothing.
func (q *BlockwiseWeights) Free() error {
	if q == nil {
		return nil
	}
	return device.FreeAll(q.KMajor, q.NMajor, q.Scales)
}

// DequantizeWeights writes q's values into dst, a BF16 or F32 [G, K, N] tensor,
// enqueued on s: decode(element)·scale in float32 (from NMajor; KMajor holds the same
// codes), then rounded once to dst's dtype, NaN as the quiet NaN. dst must not overlap
// q's tensors.
func DequantizeWeights(s *device.Stream, dst *device.Tensor, q *BlockwiseWeights) error {
	const fn = "DequantizeWeights"
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	g := q.wg
	if q.G != g.g || q.K != g.k || q.N != g.n || !q.Format.valid() || !q.Scale.valid() {
		return fmt.Errorf("quant: %s: q is %d×%d×%d %v %v, quantized as %d×%d×%d: want q as QuantizeWeights made it",
			fn, q.G, q.K, q.N, q.Format, q.Scale, g.g, g.k, g.n)
	}
	for _, c := range []struct {
		name  string
		t     *device.Tensor
		dt    device.DType
		shape []int
	}{
		{"q.NMajor", q.NMajor, q.Format.DType(), []int{g.g, g.k, g.n}},
		{"q.Scales", q.Scales, device.F32, g.scalesShape()},
	} {
		if err := c.t.CheckShape(s, c.name, c.dt, c.shape...); err != nil {
			return fmt.Errorf("quant: %s: %w", fn, err)
		}
	}
	if err := checkDst(fn, s, dst, g.g, g.k, g.n); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return dequantizeWeightsGPU(s, dst, q)
	}
	return dequantizeWeightsCPU(s, dst, q)
}
