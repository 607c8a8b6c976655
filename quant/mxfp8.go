package quant

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// Options select what Quantize produces. The zero value is E4M3, RCEIL, rowwise,
// plain (unswizzled) scales, no groups.
type Options struct {
	Format  Format
	Mode    ScaleMode
	Dir     Direction
	Swizzle bool // scales in the 128×4 tiled layout of block-scaled tensor cores

	// Transpose, with Dir Columnwise or Both, writes the columnwise data transposed, into
	// MXFP8.ColT [K, 32·T], instead of Col: the K-major operand that Hopper's FP8 GEMMs
	// read for the weight gradient (contracting over tokens). The scales and the rowwise
	// data do not change. It needs a Dir with columnwise data.
	Transpose bool

	// NK says that QuantizeMXFP8Weights' w is stored [G, N, K] (PyTorch Linear layout)
	// rather than [G, K, N]. Quantize, Alloc and QuantizeInto refuse it.
	NK bool

	// GroupSizes, if not nil, is an I32[G] tensor on the source's device: the rows of x
	// are G consecutive groups of these sizes (experts' tokens), and every output is the
	// concatenation of what Quantize gives on each group alone. Its contents are read on
	// the device, in stream order; sizes that are negative or do not sum to M turn
	// every element into the NaN code 0x7F and every scale into the NaN code 0xFF, and
	// are recorded in Status.
	GroupSizes *device.Tensor

	// Status, if not nil, is where invalid group sizes are recorded: a device.Status on
	// the source's device, which calls of this and other packages may share, to be
	// checked once with its Check. Nil means the MXFP8's own Status.
	Status *device.Status
}

// MXFP8 is a tensor quantized to MXFP8 by Quantize: elements of Format with one E8M0
// scale per 32 elements, rowwise, columnwise or both. All its tensors are on one
// device. See the package documentation for the layouts.
type MXFP8 struct {
	M, K       int
	Format     Format
	Mode       ScaleMode // the scale rule of the last quantization into it
	Dir        Direction
	Swizzled   bool
	Transposed bool // the columnwise data is ColT (Options.Transpose), not Col
	Groups     int  // G: the most groups a grouped layout holds (0 without groups)

	// Row is the rowwise data, Format.DType() [M, K]; RowScale its E8M0 scales,
	// [32·T, roundup(ceil(K/32), 4)] (T = Tiles()). Nil unless Dir is Rowwise or Both.
	Row, RowScale *device.Tensor
	// Col is the columnwise data, Format.DType() [M, K] in the source's element order;
	// ColScale its E8M0 scales, [T, roundup(K, 128)], the scale of column k in tile t at
	// (t, k). Nil unless Dir is Columnwise or Both; Col is nil when Transposed.
	Col, ColScale *device.Tensor
	// ColT is the columnwise data transposed (Options.Transpose), Format.DType()
	// [K, 32·T]: token column p = 32t + i is row i of tile t in the layout's tile order,
	// so ColT[k][p] is Col[row(p)][k], with ColScale's scale (t, k). Without groups
	// row(p) = p; with groups, group g's rows start at column 128·P_g,
	// P_g = Σ_{h<g} ceil(M_h/128). Padding columns (rows past a group's end, padding
	// tiles) are code 0. Nil unless Transposed.
	ColT *device.Tensor
	// Status records the invalid group sizes of quantizations into q with a nil
	// Options.Status: the first one until Status.Reset, as an error of Status.Check,
	// the only call that waits for the device. Nil without groups; Free frees it.
	Status *device.Status

	grouped bool
	g       geom
	tiles   *device.Tensor // I32[T, 4] tile descriptors (grouped only)
	gtab    *device.Tensor // I32[2·(G+1)] per-group scratch of the GPU (grouped GPU only)
}

// Tiles returns T, the number of 32-row tiles of q's layout: ceil(M/128)·4 without
// groups, 4·(floor(M/128) + min(G, M)) with G groups; 0 for a nil q.
func (q *MXFP8) Tiles() int {
	if q == nil {
		return 0
	}
	return q.g.ntiles
}

// Alloc allocates, on s, an MXFP8 for an m×k source quantized with opt, for
// QuantizeInto. With opt.GroupSizes the layout has room for opt.GroupSizes.Len()
// groups; the sizes themselves are read by QuantizeInto. The tensors are new: they
// share no memory with any other.
func Alloc(s *device.Stream, m, k int, opt Options) (*MXFP8, error) {
	const fn = "Alloc"
	if s == nil {
		return nil, fmt.Errorf("quant: %s: nil stream", fn)
	}
	if err := checkOptions(fn, s, opt); err != nil {
		return nil, err
	}
	if err := checkShapeArgs(fn, m, k); err != nil {
		return nil, err
	}
	return alloc(fn, s, m, k, opt, fmt.Sprintf("shape m×k = %d×%d", m, k))
}

// alloc is Alloc for fn, whose options are checked, of an m×k source that what
// describes.
func alloc(fn string, s *device.Stream, m, k int, opt Options, what string) (*MXFP8, error) {
	groups, err := groupCount(fn, opt.GroupSizes, m)
	if err != nil {
		return nil, err
	}
	g := newGeom(m, k, groups, opt.GroupSizes != nil)
	if err := g.check(); err != nil {
		return nil, fmt.Errorf("quant: %s: %s: %w", fn, what, err)
	}
	q := &MXFP8{M: m, K: k, Format: opt.Format, Mode: opt.Mode, Dir: opt.Dir, Swizzled: opt.Swizzle, Transposed: opt.Transpose,
		Groups: groups, grouped: opt.GroupSizes != nil, g: g}
	ts := device.NewTemps(s)
	defer ts.Free()
	if opt.Dir.rows() {
		q.Row = ts.Alloc(opt.Format.DType(), m, k)
		q.RowScale = ts.Alloc(device.E8M0, g.rowScaleShape()...)
	}
	if opt.Dir.cols() {
		if opt.Transpose {
			q.ColT = ts.Alloc(opt.Format.DType(), g.colTShape()...)
		} else {
			q.Col = ts.Alloc(opt.Format.DType(), m, k)
		}
		q.ColScale = ts.Alloc(device.E8M0, g.colScaleShape()...)
	}
	if q.grouped {
		q.tiles = ts.Alloc(device.I32, g.ntiles, 4)
		if s.Device().IsCUDA() {
			q.gtab = ts.Alloc(device.I32, 2*(groups+1))
		}
		if ts.Err() == nil {
			q.Status, err = device.NewStatus(s)
		}
	}
	if err == nil {
		err = ts.Err()
	}
	if err != nil {
		return nil, fmt.Errorf("quant: %s: %s: %w", fn, what, err)
	}
	ts.Keep()
	return q, nil
}

// Free releases q's tensors and Status (see device.Tensor.Free). Freeing a nil q does
// nothing.
func (q *MXFP8) Free() error {
	if q == nil {
		return nil
	}
	return errors.Join(device.FreeAll(q.Row, q.RowScale, q.Col, q.ColT, q.ColScale, q.tiles, q.gtab), q.Status.Free())
}

// FreeOn is Free in stream order on s instead of on the streams that allocated q's
// tensors (see device.Tensor.FreeOn), for a q last used on s; the Status is freed as by
// Free. Freeing a nil q does nothing.
func (q *MXFP8) FreeOn(s *device.Stream) error {
	if q == nil {
		return nil
	}
	if s == nil {
		return errors.New("quant: MXFP8.FreeOn: nil stream")
	}
	return errors.Join(freeAllOn(s, q.Row, q.RowScale, q.Col, q.ColT, q.ColScale, q.tiles, q.gtab), q.Status.Free())
}

// DropRows frees q's rowwise form, Row and RowScale (see device.Tensor.Free), and sets
// q.Dir to Columnwise: for a q quantized in both directions whose rowwise form has been
// read and whose columnwise form is kept. q is then as Alloc makes it for Columnwise,
// its columnwise data and tile descriptors unchanged. It does nothing when q holds no
// rowwise form; a nil q, or one without a columnwise form, is an error.
func (q *MXFP8) DropRows() error {
	switch {
	case q == nil:
		return errors.New("quant: MXFP8.DropRows: q is nil")
	case !q.Dir.cols():
		return fmt.Errorf("quant: MXFP8.DropRows: q.Dir is %v: q holds no columnwise form to keep (free q instead)", q.Dir)
	}
	err := device.FreeAll(q.Row, q.RowScale)
	q.Row, q.RowScale, q.Dir = nil, nil, Columnwise
	return err
}

// check returns an error of fn unless q is as Alloc made it (but for Mode and
// Swizzled, which calls may change) and its tensors of direction use are there and
// live on s's device.
func (q *MXFP8) check(fn string, s *device.Stream, use Direction) error {
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	if q.M != q.g.m || q.K != q.g.k || q.Groups != q.g.groups || !q.Format.valid() || !q.Dir.valid() || (q.Transposed && !q.Dir.cols()) {
		return fmt.Errorf("quant: %s: q is %d×%d %v %v (transposed %v) with %d groups, allocated as %d×%d with %d: want q as Alloc made it",
			fn, q.M, q.K, q.Format, q.Dir, q.Transposed, q.Groups, q.g.m, q.g.k, q.g.groups)
	}
	if err := checkParts(fn, s, q.Dir, ": ",
		part{"q.Row", q.Row, use.rows(), q.Format.DType(), []int{q.M, q.K}},
		part{"q.RowScale", q.RowScale, use.rows(), device.E8M0, q.g.rowScaleShape()},
		part{"q.Col", q.Col, use.cols() && !q.Transposed, q.Format.DType(), []int{q.M, q.K}},
		part{"q.ColT", q.ColT, use.cols() && q.Transposed, q.Format.DType(), q.g.colTShape()},
		part{"q.ColScale", q.ColScale, use.cols(), device.E8M0, q.g.colScaleShape()},
	); err != nil {
		return err
	}
	return checkTables(fn, s, q.grouped, "tile table", "Alloc", q.tiles, q.gtab)
}

// Quantize quantizes x, a BF16 or F32 [M, K] tensor, to MXFP8 as opt says, enqueued on
// s. Outputs are allocated on s: they share no memory with x. On a GPU it does not
// wait for the device: group sizes stay there.
func Quantize(s *device.Stream, x *device.Tensor, opt Options) (*MXFP8, error) {
	const fn = "Quantize"
	if s == nil {
		return nil, fmt.Errorf("quant: %s: nil stream", fn)
	}
	if err := checkOptions(fn, s, opt); err != nil {
		return nil, err
	}
	if err := checkSource(fn, s, x); err != nil {
		return nil, err
	}
	q, err := alloc(fn, s, x.Dim(0), x.Dim(1), opt, "x is "+x.String())
	if err != nil {
		return nil, err
	}
	if err := quantizeInto(fn, s, q, input{x: x}, opt); err != nil {
		q.Free()
		return nil, err
	}
	return q, nil
}

// QuantizeInto is Quantize into q, which Alloc made for x's shape and opt's format,
// direction, swizzle and grouping (opt.GroupSizes may hold fewer groups than q.Groups,
// and may differ from call to call). It allocates nothing: for training loops and
// benchmarks. q's tensors must not overlap x or opt.GroupSizes.
func QuantizeInto(s *device.Stream, q *MXFP8, x *device.Tensor, opt Options) error {
	return quantizeInto("QuantizeInto", s, q, input{x: x}, opt)
}

// quantizeInto is QuantizeInto for fn, from the tensor or the source in.
func quantizeInto(fn string, s *device.Stream, q *MXFP8, in input, opt Options) error {
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if err := checkOptions(fn, s, opt); err != nil {
		return err
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	if err := q.check(fn, s, q.Dir); err != nil {
		return err
	}
	if (q.Row != nil) != q.Dir.rows() || (q.Col != nil) != (q.Dir.cols() && !q.Transposed) || (q.ColT != nil) != (q.Dir.cols() && q.Transposed) {
		return fmt.Errorf("quant: %s: q's tensors do not match q.Dir %v (transposed %v)", fn, q.Dir, q.Transposed)
	}
	if err := in.check(fn, s, q.M, q.K); err != nil {
		return err
	}
	if err := checkHolds(fn, opt.Format, q.Format, opt.Dir, q.Dir); err != nil {
		return err
	}
	if opt.Swizzle != q.Swizzled {
		return fmt.Errorf("quant: %s: opt.Swizzle is %v, q has Swizzled %v", fn, opt.Swizzle, q.Swizzled)
	}
	if opt.Transpose != q.Transposed {
		return fmt.Errorf("quant: %s: opt.Transpose is %v, q has Transposed %v", fn, opt.Transpose, q.Transposed)
	}
	st, err := intoStatus(fn, s, opt.GroupSizes, opt.Status, q.Status, q.grouped, q.Groups, q.M)
	if err != nil {
		return err
	}
	q.Mode = opt.Mode
	if s.Device().IsCUDA() {
		return quantizeGPU(s, q, in, opt.GroupSizes, st)
	}
	return quantizeCPU(s, q, in, opt.GroupSizes, st)
}

// checkSource returns an error of fn unless x is a live BF16 or F32 matrix on s's device.
func checkSource(fn string, s *device.Stream, x *device.Tensor) error {
	if err := x.Check(s, "x"); err != nil {
		return fmt.Errorf("quant: %s: %w", fn, err)
	}
	if dt := x.DType(); (dt != device.BF16 && dt != device.F32) || x.Rank() != 2 {
		return fmt.Errorf("quant: %s: x is %v: want bf16 or f32 [M, K]", fn, x)
	}
	return nil
}

// checkOptions returns an error of fn unless opt's fields are valid on s.
func checkOptions(fn string, s *device.Stream, opt Options) error {
	switch {
	case !opt.Format.valid():
		return fmt.Errorf("quant: %s: opt.Format is %v: want E4M3 or E5M2", fn, opt.Format)
	case !opt.Mode.valid():
		return fmt.Errorf("quant: %s: opt.Mode is %v: want RCEIL or FLOOR", fn, opt.Mode)
	case !opt.Dir.valid():
		return fmt.Errorf("quant: %s: opt.Dir is %v: want Rowwise, Columnwise or Both", fn, opt.Dir)
	case opt.Transpose && !opt.Dir.cols():
		return fmt.Errorf("quant: %s: opt.Transpose is set with opt.Dir %v: it transposes columnwise data, want Columnwise or Both", fn, opt.Dir)
	case opt.NK:
		return fmt.Errorf("quant: %s: opt.NK is set: it applies to QuantizeMXFP8Weights only", fn)
	}
	if gs := opt.GroupSizes; gs != nil {
		if err := gs.Check(s, "opt.GroupSizes"); err != nil {
			return fmt.Errorf("quant: %s: %w", fn, err)
		}
		if gs.DType() != device.I32 || gs.Rank() != 1 {
			return fmt.Errorf("quant: %s: opt.GroupSizes is %v: want i32[G]", fn, gs)
		}
	}
	if opt.Status != nil {
		if err := opt.Status.Usable(s, "opt.Status"); err != nil {
			return fmt.Errorf("quant: %s: %w", fn, err)
		}
	}
	return nil
}

// Dequantize writes q's rowwise (dir Rowwise) or columnwise (dir Columnwise: from Col,
// or from ColT when q is Transposed, back into rows) values into dst, a BF16 or F32
// [M, K] tensor, enqueued on s: element·2^(scale−127) computed exactly in float32, then
// rounded once to dst's dtype. NaN elements and NaN scales give NaN; rows of a
// quantization with invalid group sizes are all NaN. The rows of ColT's columns are
// those of the tiles of the last quantization into q. dst must not overlap q's tensors.
func Dequantize(s *device.Stream, dst *device.Tensor, q *MXFP8, dir Direction) error {
	const fn = "Dequantize"
	if s == nil {
		return fmt.Errorf("quant: %s: nil stream", fn)
	}
	if q == nil {
		return fmt.Errorf("quant: %s: q is nil", fn)
	}
	var data, scale *device.Tensor
	switch dir {
	case Rowwise:
		data, scale = q.Row, q.RowScale
	case Columnwise:
		data, scale = q.Col, q.ColScale
		if q.Transposed {
			data = q.ColT
		}
	default:
		return fmt.Errorf("quant: %s: dir is %v: want Rowwise or Columnwise", fn, dir)
	}
	if (dir == Rowwise && !q.Dir.rows()) || (dir == Columnwise && !q.Dir.cols()) {
		return fmt.Errorf("quant: %s: dir is %v: q holds %v data only", fn, dir, q.Dir)
	}
	if err := q.check(fn, s, dir); err != nil { // and data is there
		return err
	}
	if err := checkDst(fn, s, dst, q.M, q.K); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return dequantizeGPU(s, dst, q, dir, data, scale)
	}
	return dequantizeCPU(s, dst, q, dir, data, scale)
}
