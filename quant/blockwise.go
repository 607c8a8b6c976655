package quant

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// Blockwise FP8 (DeepSeek-V3's recipe, the one Hopper's FP8 GEMMs use): activations and
// gradients in 1×128 blocks along the contracted dimension, weights in 128×128 blocks,
// one float32 scale per block. See the package documentation for the rules.

// BlockSize is the blockwise recipe's block length: 1×128 for activations and gradients,
// 128×128 for weights.
const BlockSize = 128

// ScaleKind is how a blockwise scale is chosen from its block's largest magnitude amax.
type ScaleKind int

// The scale kinds.
const (
	ScaleF32  ScaleKind = iota // amax/Max in float32
	ScalePow2                  // amax/Max rounded up to a power of two (UE8M0, as DeepSeek-V3.1 and DeepGEMM)
)

// String returns "f32" or "pow2".
func (k ScaleKind) String() string {
	switch k {
	case ScaleF32:
		return "f32"
	case ScalePow2:
		return "pow2"
	}
	return fmt.Sprintf("ScaleKind(%d)", int(k))
}

func (k ScaleKind) valid() bool { return k == ScaleF32 || k == ScalePow2 }

// BlockOptions select what the blockwise quantizations produce. The zero value is E4M3,
// float32 scales, rowwise, no groups.
type BlockOptions struct {
	Format Format    // element format: E4M3, or E5M2 (gradients)
	Scale  ScaleKind // how scales are chosen
	Dir    Direction // QuantizeBlockwise: Row (Rowwise), ColT (Columnwise) or both

	// GroupSizes, if not nil, is an I32[G] tensor on the source's device: the M rows of x
	// are G consecutive groups of these sizes, read on the device in stream order.
	// Columnwise blocks restart at each group's first row (see Blockwise.ColT).
	// Rowwise blocks lie within a row and do not depend on the groups.
	GroupSizes *device.Tensor

	// Status, if not nil, is where invalid group sizes are recorded; nil means the
	// Blockwise's own Status.
	Status *device.Status

	// NK says that QuantizeWeights' w is stored [G, N, K] (PyTorch Linear layout)
	// rather than [G, K, N].
	NK bool
}

// Blockwise is an activation or gradient x [M, K] quantized in 1×128 blocks by
// QuantizeBlockwise: elements of Format, one float32 scale per block, x ≈ q·s. All its
// tensors are on one device.
type Blockwise struct {
	M, K   int
	Format Format
	Scale  ScaleKind
	Dir    Direction
	Groups int // G: the groups a grouped layout holds (0 without groups)

	// Row is Format.DType() [M, K]: blocks of 128 along each row (the last one of a row
	// may be short). RowScale is F32 [ceil(K/128), roundup(M, 4)]: the scale of row m,
	// block b at (b, m), scale blocks outer and rows contiguous; padding entries are 0.
	// Nil unless Dir is Rowwise or Both.
	Row, RowScale *device.Tensor

	// ColT is the transposed form, Format.DType() [K, Mp], that the weight gradient
	// (contracting over rows) reads: ColT[k][p] is x[row(p)][k] quantized in blocks of
	// 128 along p. Without groups row(p) = p and Mp = roundup(M, 128). With G groups,
	// group g's rows start at column 128·P_g, P_g = Σ_{h<g} ceil(M_h/128), blocks never
	// straddle two groups, and Mp = 128·(floor(M/128) + min(G, M)), a bound that does not
	// depend on the sizes. Padding columns are 0. ColTScale is F32 [Mp/128, K]: the
	// scale of column k, block t at (t, k); padding blocks' scales are 0. Nil unless
	// Dir is Columnwise or Both.
	ColT, ColTScale *device.Tensor

	// Status records the invalid group sizes of quantizations into the Blockwise with a
	// nil BlockOptions.Status. Nil without groups; Free frees it.
	Status *device.Status

	alloc bwAlloc
}

// BlockwiseWeights are expert weights w quantized in 128×128 blocks by QuantizeWeights,
// in the two orientations the FP8 GEMMs read, sharing one set of scales. All its
// tensors are on one device.
type BlockwiseWeights struct {
	G, K, N int
	Format  Format
	Scale   ScaleKind

	// KMajor is Format.DType() [G, N, K], the contraction over K contiguous: the forward's
	// operand (y = x·w_g). NMajor is Format.DType() [G, K, N], the contraction over N
	// contiguous: the input gradient's operand (dx = dy·w_gᵀ).
	KMajor, NMajor *device.Tensor
	// Scales is F32 [G, ceil(K/128), ceil(N/128)]: the scale of the block of rows
	// [128i, 128i+128) of K and columns [128j, 128j+128) of N of w_g at (g, i, j).
	Scales *device.Tensor

	wg wGeom // the shape QuantizeWeights quantized
}

// bwAlloc is what AllocBlockwise made a Blockwise for: its layout and the tensors that
// the exported fields must still hold.
type bwAlloc struct {
	g     bwGeom
	tiles *device.Tensor // I32[T, 2] token-block descriptors {row0, n} (grouped only)
	gtab  *device.Tensor // I32[2·(G+1)] per-group scratch of the GPU (grouped GPU only)
}

// AllocBlockwise allocates, on s, a Blockwise for an m×k source quantized with opt, for
// QuantizeBlockwiseInto. With opt.GroupSizes the layout has room for
// opt.GroupSizes.Len() groups; the sizes themselves are read by QuantizeBlockwiseInto.
// The tensors are new: they share no memory with any other.
func AllocBlockwise(s *device.Stream, m, k int, opt BlockOptions) (*Blockwise, error) {
	const fn = "AllocBlockwise"
	if err := checkBlockOptions(fn, s, opt); err != nil {
		return nil, err
	}
	if err := checkShapeArgs(fn, m, k); err != nil {
		return nil, err
	}
	return allocBlockwise(fn, s, m, k, opt, fmt.Sprintf("shape m×k = %d×%d", m, k))
}

// allocBlockwise is AllocBlockwise for fn, whose options are checked, of an m×k source
// that what describes.
func allocBlockwise(fn string, s *device.Stream, m, k int, opt BlockOptions, what string) (*Blockwise, error) {
	groups, err := groupCount(fn, opt.GroupSizes, m)
	if err != nil {
		return nil, err
	}
	g := newBwGeom(m, k, groups, opt.GroupSizes != nil)
	if err := g.check(); err != nil {
		return nil, fmt.Errorf("quant: %s: %s: %w", fn, what, err)
	}
	q := &Blockwise{M: m, K: k, Format: opt.Format, Scale: opt.Scale, Dir: opt.Dir, Groups: groups, alloc: bwAlloc{g: g}}
	ts := device.NewTemps(s)
	defer ts.Free()
	if opt.Dir.rows() {
		q.Row = ts.Alloc(opt.Format.DType(), m, k)
		q.RowScale = ts.Alloc(device.F32, g.rowScaleShape()...)
	}
	if opt.Dir.cols() {
		q.ColT = ts.Alloc(opt.Format.DType(), g.colTShape()...)
		q.ColTScale = ts.Alloc(device.F32, g.colTScaleShape()...)
	}
	err = ts.Err()
	if g.grouped && err == nil {
		q.alloc.tiles = ts.Alloc(device.I32, g.ntiles, 2)
		if s.Device().IsCUDA() {
			q.alloc.gtab = ts.Alloc(device.I32, 2*(groups+1))
		}
		if err = ts.Err(); err == nil {
			// Padding descriptors until the first quantization.
			err = device.Fill(s, q.alloc.tiles, 0)
		}
		if err == nil {
			q.Status, err = device.NewStatus(s)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("quant: %s: %s: %w", fn, what, err)
	}
	ts.Keep()
	return q, nil
}

// Free releases q's tensors and Status (see device.Tensor.Free). Freeing a nil q does
// nothing.
func (q *Blockwise) Free() error {
	if q == nil {
		return nil
	}
	return errors.Join(device.FreeAll(q.Row, q.RowScale, q.ColT, q.ColTScale, q.alloc.tiles, q.alloc.gtab), q.Status.Free())
}

// FreeOn is Free in stream order on s instead of on the streams that allocated q's
// tensors (see device.Tensor.FreeOn), for a q last used on s; the Status is freed as by
// Free. Freeing a nil q does nothing.
func (q *Blockwise) FreeOn(s *device.Stream) error {
	if q == nil {
		return nil
	}
	if s == nil {
		return errors.New("quant: Blockwise.FreeOn: nil stream")
	}
	return errors.Join(freeAllOn(s, q.Row, q.RowScale, q.ColT, q.ColTScale, q.alloc.tiles, q.alloc.gtab), q.Status.Free())
}

// DropRows frees q's rowwise form, Row and RowScale (see device.Tensor.Free), and sets
// q.Dir to Columnwise: for a q quantized in both directions whose rowwise form has been
// read and whose columnwise form is kept. q is then as AllocBlockwise makes it for
// Columnwise, its columnwise data and token blocks unchanged. It does nothing when q
// holds no rowwise form; a nil q, or one without a columnwise form, is an error.
func (q *Blockwise) DropRows() error {
	switch {
	case q == nil:
		return errors.New("quant: Blockwise.DropRows: q is nil")
	case !q.Dir.cols():
		return fmt.Errorf("quant: Blockwise.DropRows: q.Dir is %v: q holds no columnwise form to keep (free q instead)", q.Dir)
	}
	err := device.FreeAll(q.Row, q.RowScale)
	q.Row, q.RowScale, q.Dir = nil, nil, Columnwise
	return err
}

// check returns an error of fn unless q is as AllocBlockwise made it (but for Scale,
// which quantizations may change) and its tensors of direction use are live on s's
// device.
func (q *Blockwise) check(fn string, s *device.Stream, use Direction) error {
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	g := q.alloc.g
	if q.M != g.m || q.K != g.k || q.Groups != g.groups || !q.Format.valid() || !q.Scale.valid() || !q.Dir.valid() {
		return fmt.Errorf("quant: %s: q is %d×%d %v %v %v with %d groups, allocated as %d×%d with %d: want q as AllocBlockwise made it",
			fn, q.M, q.K, q.Format, q.Scale, q.Dir, q.Groups, g.m, g.k, g.groups)
	}
	if (q.Row != nil) != q.Dir.rows() || (q.ColT != nil) != q.Dir.cols() {
		return fmt.Errorf("quant: %s: q's tensors do not match q.Dir %v: want q as AllocBlockwise made it", fn, q.Dir)
	}
	if err := checkParts(fn, s, q.Dir, ", ",
		part{"q.Row", q.Row, use.rows(), q.Format.DType(), []int{g.m, g.k}},
		part{"q.RowScale", q.RowScale, use.rows(), device.F32, g.rowScaleShape()},
		part{"q.ColT", q.ColT, use.cols(), q.Format.DType(), g.colTShape()},
		part{"q.ColTScale", q.ColTScale, use.cols(), device.F32, g.colTScaleShape()},
	); err != nil {
		return err
	}
	return checkTables(fn, s, g.grouped, "token blocks", "AllocBlockwise", q.alloc.tiles, q.alloc.gtab)
}

// checkBlockOptions returns an error of fn unless s is a stream and opt's fields are
// valid on it for QuantizeBlockwise.
func checkBlockOptions(fn string, s *device.Stream, opt BlockOptions) error {
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if !opt.Scale.valid() {
		return fmt.Errorf("quant: %s: opt.Scale is %v: want ScaleF32 or ScalePow2", fn, opt.Scale)
	}
	if opt.NK {
		return fmt.Errorf("quant: %s: opt.NK is set: it applies to QuantizeWeights only", fn)
	}
	return checkOptions(fn, s, Options{Format: opt.Format, Dir: opt.Dir, GroupSizes: opt.GroupSizes, Status: opt.Status})
}

// QuantizeBlockwise quantizes x, a BF16 or F32 [M, K] tensor, in 1×128 blocks as opt
// says, enqueued on s: Row and RowScale for Rowwise, ColT and ColTScale for Columnwise,
// all four for Both, from one read of x. Outputs are allocated on s: they share no
// memory with x. On a GPU it does not wait for the device: group sizes stay there, and
// invalid ones are recorded in opt.Status or the result's Status.
func QuantizeBlockwise(s *device.Stream, x *device.Tensor, opt BlockOptions) (*Blockwise, error) {
	const fn = "QuantizeBlockwise"
	if err := checkBlockOptions(fn, s, opt); err != nil {
		return nil, err
	}
	if err := checkSource(fn, s, x); err != nil {
		return nil, err
	}
	q, err := allocBlockwise(fn, s, x.Dim(0), x.Dim(1), opt, "x is "+x.String())
	if err != nil {
		return nil, err
	}
	if err := quantizeBlockwiseInto(fn, opQuantizeBlockwise, s, q, input{x: x}, opt); err != nil {
		q.Free()
		return nil, err
	}
	return q, nil
}

// QuantizeBlockwiseInto is QuantizeBlockwise into q, which AllocBlockwise made for x's
// shape and opt's format, direction and grouping (opt.GroupSizes may hold fewer groups
// than q.Groups, and may differ from call to call; opt.Scale may differ from q.Scale,
// which it replaces). It allocates nothing: for training loops and benchmarks. q's
// tensors must not overlap x or opt.GroupSizes.
func QuantizeBlockwiseInto(s *device.Stream, q *Blockwise, x *device.Tensor, opt BlockOptions) error {
	return quantizeBlockwiseInto("QuantizeBlockwiseInto", opQuantizeBlockwiseInto, s, q, input{x: x}, opt)
}

// quantizeBlockwiseInto is QuantizeBlockwiseInto for fn, whose status records have op,
// from the tensor or the source in.
func quantizeBlockwiseInto(fn string, op int, s *device.Stream, q *Blockwise, in input, opt BlockOptions) error {
	if err := checkBlockOptions(fn, s, opt); err != nil {
		return err
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	if err := q.check(fn, s, q.Dir); err != nil {
		return err
	}
	if err := in.check(fn, s, q.M, q.K); err != nil {
		return err
	}
	if err := checkHolds(fn, opt.Format, q.Format, opt.Dir, q.Dir); err != nil {
		return err
	}
	st, err := intoStatus(fn, s, opt.GroupSizes, opt.Status, q.Status, q.alloc.g.grouped, q.Groups, q.M)
	if err != nil {
		return err
	}
	q.Scale = opt.Scale
	if s.Device().IsCUDA() {
		return quantizeBlockwiseGPU(s, q, in, opt.GroupSizes, st, op)
	}
	return quantizeBlockwiseCPU(s, q, in, opt.GroupSizes, st, op)
}

// DequantizeBlockwise writes q's values from Row (dir Rowwise) or from ColT (dir
// Columnwise) into dst, a BF16 or F32 [M, K] tensor, enqueued on s: decode(element)·scale
// in float32, then rounded once to dst's dtype. NaN gives the quiet NaN; a block of
// scale +Inf gives NaN or ±Inf throughout. Dequantizing ColT needs the token blocks of
// the last quantization into q (rows not in a block, as after invalid group sizes, are
// left alone). dst must not overlap q's tensors.
func DequantizeBlockwise(s *device.Stream, dst *device.Tensor, q *Blockwise, dir Direction) error {
	const fn = "DequantizeBlockwise"
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	switch {
	case dir != Rowwise && dir != Columnwise:
		return fmt.Errorf("quant: %s: dir is %v: want Rowwise or Columnwise", fn, dir)
	case (dir == Rowwise && q.Row == nil) || (dir == Columnwise && q.ColT == nil):
		return fmt.Errorf("quant: %s: dir is %v: q holds %v data only", fn, dir, q.Dir)
	}
	if err := q.check(fn, s, dir); err != nil {
		return err
	}
	if err := checkDst(fn, s, dst, q.M, q.K); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return dequantizeBlockwiseGPU(s, dst, q, dir)
	}
	return dequantizeBlockwiseCPU(s, dst, q, dir)
}
