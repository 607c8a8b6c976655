package quant

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// MXFP8Weights are expert weights w quantized to MXFP8 by QuantizeMXFP8Weights in the two
// orientations that the FP8 GEMMs read, each blocked along its contracted dimension and
// with scales of its own (a 1×32 block's transpose is not a block). All its tensors are
// on one device.
type MXFP8Weights struct {
	G, K, N int
	Format  Format
	Mode    ScaleMode

	// KMajor is Format.DType() [G, N, K] (forward operand, contraction over K contiguous),
	// quantized in 1×32 blocks along K for each column n. KScale is E8M0
	// [G, ceil(K/128), N, 4]: the scale of w_g[k][n]'s block k/32 at (g, k/128, n, (k/32)%4),
	// so that the scales of one 128-deep step of 128 columns are 512 contiguous bytes.
	KMajor, KScale *device.Tensor
	// NMajor is Format.DType() [G, K, N] (input-gradient operand, contraction over N
	// contiguous), quantized in 1×32 blocks along N for each row k. NScale is E8M0
	// [G, ceil(N/128), K, 4]: the scale of w_g[k][n]'s block n/32 at (g, n/128, k, (n/32)%4).
	NMajor, NScale *device.Tensor

	wg mxwGeom // the shape QuantizeMXFP8Weights quantized
}

// mxwGeom is the shape of an MXFP8 weight quantization: w_g is r×c in memory (r = K,
// c = N, or with nk r = N, c = K). The orientation of w's own layout, direct [G, r, c],
// is blocked along c with scales [G, cb, r, 4]; the transposed one, trans [G, c, r],
// along r with scales [G, rb, c, 4]. The kernels cut w_g into nrt×nct tiles of 32 rows
// by 256 columns.
type mxwGeom struct {
	g, k, n  int
	nk       bool
	r, c     int
	rb, cb   int // ceil(r/128), ceil(c/128)
	nrt, nct int
}

func newMXWGeom(g, k, n int, nk bool) mxwGeom {
	w := mxwGeom{g: g, k: k, n: n, nk: nk, r: k, c: n}
	if nk {
		w.r, w.c = n, k
	}
	w.rb, w.cb = ceilDiv(w.r, 128), ceilDiv(w.c, 128)
	w.nrt, w.nct = ceilDiv(w.r, blockSize), ceilDiv(w.c, tileCols)
	return w
}

// check returns an error if the weights are too large for the kernels' 32-bit indices
// and grids.
func (w mxwGeom) check() error {
	const lim = math.MaxInt32
	dq := ceilDiv(w.r, 32) * ceilDiv(w.c, 32) // the dequantization's tiles of 32×32
	if w.r > lim-tileCols || w.c > lim-tileCols || (dq > 0 && w.g > lim/dq) {
		return fmt.Errorf("more than 2^31 kernel blocks or rows")
	}
	return nil
}

func (w mxwGeom) kScaleShape() []int { return []int{w.g, ceilDiv(w.k, 128), w.n, 4} }
func (w mxwGeom) nScaleShape() []int { return []int{w.g, ceilDiv(w.n, 128), w.k, 4} }

// directScaleOff and transScaleOff return the offsets of the scales of block b of row r
// of w_g's direct orientation (blocks along c) and of block b of column c of the
// transposed one (blocks along r).
func (w mxwGeom) directScaleOff(g, r, b int) int { return ((g*w.cb+b/4)*w.r+r)*4 + b%4 }
func (w mxwGeom) transScaleOff(g, c, b int) int  { return ((g*w.rb+b/4)*w.c+c)*4 + b%4 }

// orient returns q's tensors as the direct and transposed orientations of w's layout.
func (w mxwGeom) orient(q *MXFP8Weights) (direct, directScale, trans, transScale *device.Tensor) {
	if w.nk {
		return q.KMajor, q.KScale, q.NMajor, q.NScale
	}
	return q.NMajor, q.NScale, q.KMajor, q.KScale
}

// QuantizeMXFP8Weights quantizes expert weights w to MXFP8 in both orientations from one
// read of w, enqueued on s: w is a BF16 or F32 [G, K, N] tensor, or [G, N, K] with opt.NK,
// and K and N must be multiples of 16 (rows of FP8 elements of whole 16-byte units, as
// the GEMMs' tensor memory accesses need). Every block is quantized as Quantize
// quantizes a rowwise block, with opt.Format and opt.Mode: KMajor's blocks are those of
// Quantize of the rows of w_gᵀ, NMajor's those of the rows of w_g; a last block of 16
// elements is short, its missing values counting as zeros in the scale. Scale slots of
// blocks past K or N in the last 128 are 0, as the padding scales of Quantize.
//
// It reads opt.Format, opt.Mode and opt.NK. opt.Dir is not read: both orientations are
// always made. Weights have no groups of rows and one scale layout, so opt.GroupSizes
// and opt.Status must be nil and opt.Swizzle and opt.Transpose false. Outputs are
// allocated on s: they share no memory with w.
func QuantizeMXFP8Weights(s *device.Stream, w *device.Tensor, opt Options) (*MXFP8Weights, error) {
	const fn = "QuantizeMXFP8Weights"
	if s == nil {
		return nil, fmt.Errorf("quant: %s: nil stream", fn)
	}
	switch {
	case !opt.Format.valid():
		return nil, fmt.Errorf("quant: %s: opt.Format is %v: want E4M3 or E5M2", fn, opt.Format)
	case !opt.Mode.valid():
		return nil, fmt.Errorf("quant: %s: opt.Mode is %v: want RCEIL or FLOOR", fn, opt.Mode)
	case opt.GroupSizes != nil:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is %v: want nil, weights have no groups of rows", fn, opt.GroupSizes)
	case opt.Status != nil:
		return nil, fmt.Errorf("quant: %s: opt.Status is set: want nil, weights have no group sizes to check", fn)
	case opt.Swizzle:
		return nil, fmt.Errorf("quant: %s: opt.Swizzle is set: want false, the weights' scales have the layouts of KScale and NScale", fn)
	case opt.Transpose:
		return nil, fmt.Errorf("quant: %s: opt.Transpose is set: want false, the weights are always in both orientations", fn)
	}
	k, n, err := checkWeightSource(fn, s, w, opt.NK)
	if err != nil {
		return nil, err
	}
	g := newMXWGeom(w.Dim(0), k, n, opt.NK)
	if err := g.check(); err != nil {
		return nil, fmt.Errorf("quant: %s: w is %v: %w", fn, w, err)
	}
	ts := device.NewTemps(s)
	defer ts.Free()
	q := &MXFP8Weights{G: g.g, K: k, N: n, Format: opt.Format, Mode: opt.Mode, wg: g}
	q.KMajor = ts.Alloc(opt.Format.DType(), g.g, n, k)
	q.KScale = ts.Alloc(device.E8M0, g.kScaleShape()...)
	q.NMajor = ts.Alloc(opt.Format.DType(), g.g, k, n)
	q.NScale = ts.Alloc(device.E8M0, g.nScaleShape()...)
	if err := ts.Err(); err != nil {
		return nil, fmt.Errorf("quant: %s: w is %v: %w", fn, w, err)
	}
	if err := quantizeMXFP8WeightsInto(s, q, w); err != nil {
		return nil, fmt.Errorf("quant: %s: %w", fn, err)
	}
	ts.Keep()
	return q, nil
}

// quantizeMXFP8WeightsInto quantizes w, checked to have q's shape and orientation, into q
// with q's format and rule.
func quantizeMXFP8WeightsInto(s *device.Stream, q *MXFP8Weights, w *device.Tensor) error {
	if s.Device().IsCUDA() {
		return quantizeMXFP8WeightsGPU(s, q, w)
	}
	return quantizeMXFP8WeightsCPU(s, q, w)
}

// Free releases q's tensors (see device.Tensor.Free). Freeing a nil q does nothing.
func (q *MXFP8Weights) Free() error {
	if q == nil {
		return nil
	}
	return device.FreeAll(q.KMajor, q.KScale, q.NMajor, q.NScale)
}

// DequantizeMXFP8Weights writes w [G, K, N] (F32 or BF16) from KMajor/KScale when kMajor,
// else from NMajor/NScale, into dst, enqueued on s: element·2^(scale−127) computed exactly
// in float32, then rounded once to dst's dtype, NaN elements as the quiet NaN. The
// tensors of the other orientation are not read. dst must not overlap q's tensors.
func DequantizeMXFP8Weights(s *device.Stream, dst *device.Tensor, q *MXFP8Weights, kMajor bool) error {
	const fn = "DequantizeMXFP8Weights"
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	g := q.wg
	if q.G != g.g || q.K != g.k || q.N != g.n || !q.Format.valid() || !q.Mode.valid() {
		return fmt.Errorf("quant: %s: q is %d×%d×%d %v %v, quantized as %d×%d×%d: want q as QuantizeMXFP8Weights made it",
			fn, q.G, q.K, q.N, q.Format, q.Mode, g.g, g.k, g.n)
	}
	parts := []part{
		{"q.NMajor", q.NMajor, !kMajor, q.Format.DType(), []int{g.g, g.k, g.n}},
		{"q.NScale", q.NScale, !kMajor, device.E8M0, g.nScaleShape()},
		{"q.KMajor", q.KMajor, kMajor, q.Format.DType(), []int{g.g, g.n, g.k}},
		{"q.KScale", q.KScale, kMajor, device.E8M0, g.kScaleShape()},
	}
	for _, c := range parts {
		if c.used {
			if err := c.t.CheckShape(s, c.name, c.dt, c.shape...); err != nil {
				return fmt.Errorf("quant: %s: %w", fn, err)
			}
		}
	}
	if err := checkDst(fn, s, dst, g.g, g.k, g.n); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return dequantizeMXFP8WeightsGPU(s, dst, q, kMajor)
	}
	return dequantizeMXFP8WeightsCPU(s, dst, q, kMajor)
}
