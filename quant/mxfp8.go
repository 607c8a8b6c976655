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

	// GroupSizes, if not nil, is an I32[G] tensor on the source's device: the rows of x
	// are G consecutive groups of these sizes (experts' tokens), and every output is the
	// concatenation of what Quantize gives on each group alone. Its contents are read on
	// the device, in stream order; sizes that are negative or do not sum to M are
	// reported by MXFP8.Err and turn every element into the NaN code 0x7F and every
	// scale into the NaN code 0xFF.
	GroupSizes *device.Tensor
}

// MXFP8 is a tensor quantized to MXFP8 by Quantize: elements of Format with one E8M0
// scale per 32 elements, rowwise, columnwise or both. All its tensors are on one
// device. See the package documentation for the layouts.
type MXFP8 struct {
	M, K     int
	Format   Format
	Mode     ScaleMode // the scale rule of the last quantization into it
	Dir      Direction
	Swizzled bool
	Groups   int // G: the most groups a grouped layout holds (0 without groups)

	// Row is the rowwise data, Format.DType() [M, K]; RowScale its E8M0 scales,
	// [32·T, roundup(ceil(K/32), 4)] (T = Tiles()). Nil unless Dir is Rowwise or Both.
	Row, RowScale *device.Tensor
	// Col is the columnwise data, Format.DType() [M, K] in the source's element order;
	// ColScale its E8M0 scales, [T, roundup(K, 128)]. Nil unless Dir is Columnwise or Both.
	Col, ColScale *device.Tensor

	grouped bool
	g       geom
	tiles   *device.Tensor // I32[T, 4] tile descriptors (grouped only)
	gtab    *device.Tensor // I32[2·(G+1)] per-group scratch of the GPU (grouped GPU only)
	status  *device.Tensor // I32[1] group-size validation status (grouped only)
}

// Tiles returns T, the number of 32-row tiles of q's layout: ceil(M/128)·4 without
// groups, 4·(floor(M/128) + min(G, M)) with G groups.
func (q *MXFP8) Tiles() int { return q.g.ntiles }

// Alloc allocates, on s, an MXFP8 for an m×k source quantized with opt, for
// QuantizeInto. With opt.GroupSizes the layout has room for opt.GroupSizes.Len()
// groups; the sizes themselves are read by QuantizeInto.
func Alloc(s *device.Stream, m, k int, opt Options) (*MXFP8, error) {
	if err := checkOptions(s, opt); err != nil {
		return nil, err
	}
	if m < 0 || k < 0 {
		return nil, fmt.Errorf("quant: Alloc: shape %d×%d: want m, k ≥ 0", m, k)
	}
	groups := 0
	if opt.GroupSizes != nil {
		groups = opt.GroupSizes.Len()
		if groups == 0 && m > 0 {
			return nil, fmt.Errorf("quant: opt.GroupSizes has no groups for %d rows", m)
		}
	}
	g := newGeom(m, k, groups, opt.GroupSizes != nil)
	if err := g.check(); err != nil {
		return nil, err
	}
	q := &MXFP8{M: m, K: k, Format: opt.Format, Mode: opt.Mode, Dir: opt.Dir, Swizzled: opt.Swizzle, Groups: groups, grouped: opt.GroupSizes != nil, g: g}
	var err error
	alloc := func(dt device.DType, shape ...int) *device.Tensor {
		if err != nil {
			return nil
		}
		var t *device.Tensor
		t, err = s.Alloc(dt, shape...)
		return t
	}
	if opt.Dir.rows() {
		q.Row = alloc(opt.Format.DType(), m, k)
		q.RowScale = alloc(device.E8M0, g.rowScaleShape()...)
	}
	if opt.Dir.cols() {
		q.Col = alloc(opt.Format.DType(), m, k)
		q.ColScale = alloc(device.E8M0, g.colScaleShape()...)
	}
	if q.grouped {
		q.tiles = alloc(device.I32, g.ntiles, 4)
		q.status = alloc(device.I32, 1)
		if s.Device().IsCUDA() {
			q.gtab = alloc(device.I32, 2*(groups+1))
		}
	}
	if err != nil {
		q.Free()
		return nil, fmt.Errorf("quant: Alloc %d×%d: %w", m, k, err)
	}
	return q, nil
}

// Free releases q's tensors (see device.Tensor.Free).
func (q *MXFP8) Free() error {
	var errs []error
	for _, t := range []*device.Tensor{q.Row, q.RowScale, q.Col, q.ColScale, q.tiles, q.gtab, q.status} {
		if t != nil {
			errs = append(errs, t.Free())
		}
	}
	return errors.Join(errs...)
}

// Err waits for the work on s and returns an error if the group sizes of the last
// quantization into q were invalid (negative, or not summing to M). It is the only
// call of the package that waits for the device; nil for layouts without groups.
func (q *MXFP8) Err(s *device.Stream) error {
	if q.status == nil {
		return nil
	}
	st := make([]int32, 1)
	if err := device.Download(s, q.status, st); err != nil {
		return err
	}
	return statusError(st[0], q.M)
}

// Quantize quantizes x, a BF16 or F32 [M, K] tensor, to MXFP8 as opt says, enqueued on
// s. Outputs are allocated on s. On a GPU it does not wait for the device: group sizes
// stay there.
func Quantize(s *device.Stream, x *device.Tensor, opt Options) (*MXFP8, error) {
	if err := x.Check(s, "Quantize source x"); err != nil {
		return nil, err
	}
	if x.Rank() != 2 {
		return nil, fmt.Errorf("quant: Quantize: source x is %v: want rank 2 [M, K]", x)
	}
	q, err := Alloc(s, x.Dim(0), x.Dim(1), opt)
	if err != nil {
		return nil, err
	}
	if err := QuantizeInto(s, q, x, opt); err != nil {
		q.Free()
		return nil, err
	}
	return q, nil
}

// QuantizeInto is Quantize into q, which Alloc made for x's shape and opt's format,
// direction, swizzle and grouping (opt.GroupSizes may hold fewer groups than q.Groups,
// and may differ from call to call). It allocates nothing: for training loops and
// benchmarks.
func QuantizeInto(s *device.Stream, q *MXFP8, x *device.Tensor, opt Options) error {
	if err := checkOptions(s, opt); err != nil {
		return err
	}
	if q == nil {
		return errors.New("quant: QuantizeInto: q is nil")
	}
	if err := x.Check(s, "QuantizeInto source x"); err != nil {
		return err
	}
	if dt := x.DType(); dt != device.BF16 && dt != device.F32 {
		return fmt.Errorf("quant: source x is %v: want bf16 or f32", x)
	}
	if x.Rank() != 2 || x.Dim(0) != q.M || x.Dim(1) != q.K {
		return fmt.Errorf("quant: source x is %v: want [%d %d], the shape q was allocated for", x, q.M, q.K)
	}
	switch {
	case opt.Format != q.Format:
		return fmt.Errorf("quant: opt.Format %v, q holds %v", opt.Format, q.Format)
	case opt.Dir != q.Dir:
		return fmt.Errorf("quant: opt.Dir %v, q holds %v", opt.Dir, q.Dir)
	case opt.Swizzle != q.Swizzled:
		return fmt.Errorf("quant: opt.Swizzle %v, q has Swizzled %v", opt.Swizzle, q.Swizzled)
	case opt.GroupSizes == nil && q.grouped:
		return errors.New("quant: opt.GroupSizes is nil, q has a grouped layout")
	case opt.GroupSizes != nil && !q.grouped:
		return errors.New("quant: opt.GroupSizes is set, q has an ungrouped layout")
	case opt.GroupSizes != nil && opt.GroupSizes.Len() > q.Groups:
		return fmt.Errorf("quant: opt.GroupSizes has %d groups, q has room for %d", opt.GroupSizes.Len(), q.Groups)
	case opt.GroupSizes != nil && opt.GroupSizes.Len() == 0 && q.M > 0:
		return fmt.Errorf("quant: opt.GroupSizes has no groups for %d rows", q.M)
	}
	for _, t := range []*device.Tensor{q.Row, q.RowScale, q.Col, q.ColScale, q.tiles, q.gtab, q.status} {
		if t != nil {
			if err := t.Check(s, "QuantizeInto output"); err != nil {
				return err
			}
		}
	}
	if (q.Row == nil) == q.Dir.rows() || (q.Col == nil) == q.Dir.cols() {
		return fmt.Errorf("quant: q's tensors do not match its direction %v", q.Dir)
	}
	q.Mode = opt.Mode
	if s.Device().IsCUDA() {
		return quantizeGPU(s, q, x, opt.GroupSizes)
	}
	return quantizeCPU(s, q, x, opt.GroupSizes)
}

func checkOptions(s *device.Stream, opt Options) error {
	switch {
	case !opt.Format.valid():
		return fmt.Errorf("quant: opt.Format %v: want E4M3 or E5M2", opt.Format)
	case !opt.Mode.valid():
		return fmt.Errorf("quant: opt.Mode %v: want RCEIL or FLOOR", opt.Mode)
	case !opt.Dir.valid():
		return fmt.Errorf("quant: opt.Dir %v: want Rowwise, Columnwise or Both", opt.Dir)
	}
	if gs := opt.GroupSizes; gs != nil {
		if err := gs.Check(s, "opt.GroupSizes"); err != nil {
			return err
		}
		if gs.DType() != device.I32 || gs.Rank() != 1 {
			return fmt.Errorf("quant: opt.GroupSizes is %v: want i32[G]", gs)
		}
	}
	return nil
}

// Dequantize writes q's rowwise (dir Rowwise) or columnwise (dir Columnwise) values
// into dst, a BF16 or F32 [M, K] tensor, enqueued on s: element·2^(scale−127) computed
// exactly in float32, then rounded once to dst's dtype. NaN elements and NaN scales give
// NaN; rows of a quantization with invalid group sizes are all NaN.
func Dequantize(s *device.Stream, dst *device.Tensor, q *MXFP8, dir Direction) error {
	if q == nil {
		return errors.New("quant: Dequantize: q is nil")
	}
	if err := dst.Check(s, "Dequantize destination dst"); err != nil {
		return err
	}
	if dt := dst.DType(); dt != device.BF16 && dt != device.F32 {
		return fmt.Errorf("quant: Dequantize destination dst is %v: want bf16 or f32", dst)
	}
	if dst.Rank() != 2 || dst.Dim(0) != q.M || dst.Dim(1) != q.K {
		return fmt.Errorf("quant: Dequantize destination dst is %v: want [%d %d]", dst, q.M, q.K)
	}
	var data, scale *device.Tensor
	switch dir {
	case Rowwise:
		data, scale = q.Row, q.RowScale
	case Columnwise:
		data, scale = q.Col, q.ColScale
	default:
		return fmt.Errorf("quant: Dequantize direction %v: want Rowwise or Columnwise", dir)
	}
	if data == nil || scale == nil {
		return fmt.Errorf("quant: Dequantize %v: q holds %v data only", dir, q.Dir)
	}
	for _, t := range []*device.Tensor{data, scale, q.tiles} {
		if t != nil {
			if err := t.Check(s, "Dequantize operand q"); err != nil {
				return err
			}
		}
	}
	if s.Device().IsCUDA() {
		return dequantizeGPU(s, dst, q, dir, data, scale)
	}
	return dequantizeCPU(s, dst, q, dir, data, scale)
}
