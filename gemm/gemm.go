package gemm

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// WeightLayout says how the weights w (or, for RaggedDotWeightGrad, the gradient dw) are stored.
type WeightLayout int

// The weight layouts.
const (
	KN WeightLayout = iota // w[G,K,N]
	NK                     // w[G,N,K] (PyTorch Linear layout)
)

// String returns "KN" or "NK".
func (l WeightLayout) String() string {
	switch l {
	case KN:
		return "KN"
	case NK:
		return "NK"
	}
	return fmt.Sprintf("WeightLayout(%d)", int(l))
}

// Options modify a call. The zero value (or a nil *Options) means layout KN, overwrite
// and the device's own Status.
type Options struct {
	Layout     WeightLayout   // layout of w (RaggedDot, RaggedDotInputGrad) or of dw (RaggedDotWeightGrad)
	Accumulate bool           // RaggedDotWeightGrad: dw += x_gᵀ·dy_g instead of dw = ...
	Status     *device.Status // optional status that records invalid sizes; nil: the device's own (see CheckStatus)
}

// form is one of the three ragged_dot forms.
type form int

const (
	forward    form = 1 // RaggedDot
	inputGrad  form = 2 // RaggedDotInputGrad
	weightGrad form = 3 // RaggedDotWeightGrad

	blockForward    form = 4 // RaggedDotBlockwise
	blockInputGrad  form = 5 // RaggedDotBlockwiseInputGrad
	blockWeightGrad form = 6 // RaggedDotBlockwiseWeightGrad

	mxForward    form = 7 // RaggedDotMXFP8
	mxInputGrad  form = 8 // RaggedDotMXFP8InputGrad
	mxWeightGrad form = 9 // RaggedDotMXFP8WeightGrad
)

func (f form) String() string {
	switch f {
	case forward:
		return "RaggedDot"
	case inputGrad:
		return "RaggedDotInputGrad"
	case weightGrad:
		return "RaggedDotWeightGrad"
	case blockForward:
		return "RaggedDotBlockwise"
	case blockInputGrad:
		return "RaggedDotBlockwiseInputGrad"
	case blockWeightGrad:
		return "RaggedDotBlockwiseWeightGrad"
	case mxForward:
		return "RaggedDotMXFP8"
	case mxInputGrad:
		return "RaggedDotMXFP8InputGrad"
	case mxWeightGrad:
		return "RaggedDotMXFP8WeightGrad"
	}
	return "gemm"
}

// base returns the bf16 or f32 form that f computes: forward, inputGrad or weightGrad.
// Each family (bf16 and f32, blockwise FP8, MXFP8) numbers its forms in that order.
func (f form) base() form { return (f-1)%3 + 1 }

// weightGradForm returns the weight-gradient form of f's family: the one that
// Options.Accumulate applies to.
func (f form) weightGradForm() form { return f - f.base() + weightGrad }

// argNames returns the names of f's output and its two operands, as the errors name
// them.
func (f form) argNames() [3]string {
	switch f.base() {
	case forward:
		return [3]string{"y", "x", "w"}
	case inputGrad:
		return [3]string{"dx", "dy", "w"}
	}
	return [3]string{"dw", "x", "dy"}
}

// call is one checked call: the GEMM C = A·B of the form, in the terms of the kernels.
type call struct {
	f      form
	layout WeightLayout
	accum  bool
	status *device.Status

	out, a, b, sizes *device.Tensor
	// M: rows of x (and of y, dx, dy); K, N: the weight matrix's dimensions; G: groups.
	M, K, N, G int

	// op, if not 0, is the form that errors and status records name: a blockwise FP8
	// call that runs as the form f on operands it dequantized.
	op form
}

// name returns the form that the call's errors and status records name.
func (c *call) name() form {
	if c.op != 0 {
		return c.op
	}
	return c.f
}

// RaggedDot computes y[M,N] = x[M,K]·w[g] for the rows of each group g: rows are sorted
// by group, group g owning sizes[g] rows after those of groups 0..g-1, and w is
// [G,K,N] (opt.Layout KN) or [G,N,K] (NK). Rows past sum(sizes) are written as zeros.
// x and w are BF16 or F32 (the same dtype); y is BF16 or F32; products are summed in
// f32. sizes is an I32[G] tensor. All tensors are on s's device and the work is
// enqueued on s.
//
// Sizes must be non-negative and sum to at most M. On the CPU invalid sizes are an
// error at once (or, in a captured graph, recorded in the Status). On a GPU the sizes
// are read only by the kernels, without a host synchronization: invalid sizes set the
// Status (opt.Status, else the device's own, see CheckStatus) and the kernels write
// nothing.
//
// On an H100 or H200, a bf16 call whose K or N is not a multiple of 8, or one of whose
// tensors is not 16-byte aligned, runs on zero-padded copies of the tensors that need
// them (see the package doc, Unaligned shapes): up to 2·M·K8 + 2·G·K8·N8 + e·M·N8 bytes
// (K8, N8: K and N rounded up to multiples of 8; e: the size of y's elements), allocated
// in stream order on s for the call and freed in stream order after it. Where they
// cannot be allocated, the call runs the portable kernels instead.
//
// y must not overlap x, w or sizes; x and w may overlap each other.
func RaggedDot(s *device.Stream, y, x, w, sizes *device.Tensor, opt *Options) error {
	c, err := check(forward, s, y, x, w, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

// RaggedDotInputGrad computes dx[M,K] = dy[M,N]·w[g]ᵀ for the rows of each group g:
// the gradient of RaggedDot with respect to x, with w [G,K,N] (opt.Layout KN) or
// [G,N,K] (NK) as for RaggedDot. Rows past sum(sizes) are written as zeros. dtypes,
// devices, streams, the handling of invalid sizes and the padded copies of unaligned
// shapes are as for RaggedDot, the copies taking up to 2·M·N8 + 2·G·K8·N8 + e·M·K8 bytes
// (e: the size of dx's elements). dx must not overlap dy, w or sizes; dy and w may
// overlap each other.
func RaggedDotInputGrad(s *device.Stream, dx, dy, w, sizes *device.Tensor, opt *Options) error {
	c, err := check(inputGrad, s, dx, dy, w, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

// RaggedDotWeightGrad computes dw[g] = x_gᵀ·dy_g for each group g, where x_g and dy_g
// are the group's rows of x[M,K] and dy[M,N]: the gradient of RaggedDot with respect
// to w. dw is [G,K,N] (opt.Layout KN) or [G,N,K] (NK, then dw[g] = dy_gᵀ·x_g). With
// opt.Accumulate the result is added to dw (in f32, then rounded to dw's dtype);
// otherwise dw is overwritten, and the gradient of an empty group is exactly zero.
// Rows of x and dy past sum(sizes) do not contribute. dtypes, devices, streams, the
// handling of invalid sizes and the padded copies of unaligned shapes are as for
// RaggedDot, the copies taking up to 2·M·K8 + 2·M·N8 + e·G·K8·N8 bytes (e: the size of
// dw's elements; dw's copy starts as dw, so Accumulate adds to it). dw must not overlap
// x, dy or sizes; x and dy may overlap each other.
func RaggedDotWeightGrad(s *device.Stream, dw, x, dy, sizes *device.Tensor, opt *Options) error {
	c, err := check(weightGrad, s, dw, x, dy, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

func (c *call) run(s *device.Stream) error { return onDevice(s, c.cpu, c.gpu) }

// onDevice runs gpu on a GPU stream s, else cpu.
func onDevice(s *device.Stream, cpu, gpu func(*device.Stream) error) error {
	if s.Device().IsCUDA() {
		return gpu(s)
	}
	return cpu(s)
}

// check validates the arguments of form f and returns the call.
// forward: out=y[M,N], a=x[M,K], b=w; inputGrad: out=dx[M,K], a=dy[M,N], b=w;
// weightGrad: out=dw, a=x[M,K], b=dy[M,N].
func check(f form, s *device.Stream, out, a, b, sizes *device.Tensor, opt *Options) (*call, error) {
	o, err := checkOptions(f, s, opt)
	if err != nil {
		return nil, err
	}
	names := f.argNames()
	for i, t := range []*device.Tensor{out, a, b, sizes} {
		name := "sizes"
		if i < 3 {
			name = names[i]
		}
		if err := t.Check(s, name); err != nil {
			return nil, fmt.Errorf("gemm: %v: %w", f, err)
		}
	}
	if o.Status != nil {
		if err := o.Status.Usable(s, "opt.Status"); err != nil {
			return nil, fmt.Errorf("gemm: %v: %w", f, err)
		}
	}
	if sizes.DType() != device.I32 || sizes.Rank() != 1 {
		return nil, fmt.Errorf("gemm: %v: sizes is %v, want i32[G]", f, sizes)
	}
	G := sizes.Dim(0)
	if a.DType() != b.DType() || (a.DType() != device.BF16 && a.DType() != device.F32) {
		return nil, fmt.Errorf("gemm: %v: %s is %v and %s is %v: want both bf16 or both f32", f, names[1], a, names[2], b)
	}
	if out.DType() != device.BF16 && out.DType() != device.F32 {
		return nil, fmt.Errorf("gemm: %v: %s is %v: want bf16 or f32", f, names[0], out)
	}
	if a.Rank() != 2 {
		return nil, fmt.Errorf("gemm: %v: %s is %v: want a matrix", f, names[1], a)
	}
	c := &call{f: f, layout: o.Layout, accum: o.Accumulate, status: o.Status, out: out, a: a, b: b, sizes: sizes, G: G}
	// w (forward, inputGrad) or dw (weightGrad) gives K and N; the matrices must agree.
	weights, wname := b, names[2]
	if f == weightGrad {
		weights, wname = out, names[0]
	}
	if weights.Rank() != 3 || weights.Dim(0) != G {
		return nil, fmt.Errorf("gemm: %v: %s is %v and sizes is %v: want %s[G=%d, %s] (layout %v)", f, wname, weights, sizes, wname, G, layoutDims(o.Layout), o.Layout)
	}
	c.K, c.N = weights.Dim(1), weights.Dim(2)
	if o.Layout == NK {
		c.K, c.N = c.N, c.K
	}
	// want returns the error of matrix name, t, whose shape is not [rows, cols], which
	// the tensor other implies.
	want := func(name string, t *device.Tensor, oname string, other *device.Tensor, rows, cols int) error {
		lay := ""
		if other == weights {
			lay = fmt.Sprintf(" (layout %v)", o.Layout)
		}
		return fmt.Errorf("gemm: %v: %s is %v and %s is %v%s: want %s[%d, %d]", f, name, t, oname, other, lay, name, rows, cols)
	}
	c.M = a.Dim(0)
	switch f {
	case forward, inputGrad:
		inner, outer := c.K, c.N // x's columns, y's columns
		if f == inputGrad {
			inner, outer = c.N, c.K // dy's columns, dx's columns
		}
		if a.Dim(1) != inner {
			return nil, want(names[1], a, wname, weights, c.M, inner)
		}
		if out.Rank() != 2 || out.Dim(0) != c.M {
			return nil, want(names[0], out, names[1], a, c.M, outer)
		}
		if out.Dim(1) != outer {
			return nil, want(names[0], out, wname, weights, c.M, outer)
		}
	case weightGrad:
		if b.Rank() != 2 || b.Dim(0) != c.M {
			return nil, fmt.Errorf("gemm: %v: dy is %v and x is %v: want dy[%d, N], the same M as x", f, b, a, c.M)
		}
		badK, badN := a.Dim(1) != c.K, b.Dim(1) != c.N
		switch {
		case badK && badN: // x and dy agree with each other, not with dw
			return nil, fmt.Errorf("gemm: %v: dw is %v, want %v (layout %v) for x %v and dy %v", f, out, wshape(o.Layout, G, a.Dim(1), b.Dim(1)), o.Layout, a, b)
		case badK:
			return nil, want("x", a, "dw", out, c.M, c.K)
		case badN:
			return nil, want("dy", b, "dw", out, c.M, c.N)
		}
	}
	// The kernels index with 32-bit integers. Each dimension is named by a matrix of it.
	type dim struct {
		name string
		v    int
		t    string
		of   *device.Tensor
	}
	dims := []dim{{"M", c.M, names[1], a}, {"K", c.K, names[1], a}, {"N", c.N, names[0], out}, {"G", G, "sizes", sizes}}
	switch f {
	case inputGrad: // dy[M,N], dx[M,K]
		dims[1], dims[2] = dim{"K", c.K, names[0], out}, dim{"N", c.N, names[1], a}
	case weightGrad: // x[M,K], dy[M,N]
		dims[2] = dim{"N", c.N, names[2], b}
	}
	for _, d := range dims {
		if d.v >= math.MaxInt32 {
			return nil, fmt.Errorf("gemm: %v: %s is %v: %s = %d, want less than 2^31-1", f, d.t, d.of, d.name, d.v)
		}
	}
	return c, nil
}

// checkOptions validates the stream and the options of a call of form f (all but
// opt.Status) and returns the options.
func checkOptions(f form, s *device.Stream, opt *Options) (Options, error) {
	var o Options
	if s == nil {
		return o, fmt.Errorf("gemm: %v: nil stream", f)
	}
	if opt != nil {
		o = *opt
	}
	if o.Layout != KN && o.Layout != NK {
		return o, fmt.Errorf("gemm: %v: opt.Layout is %v: want KN or NK", f, o.Layout)
	}
	if wg := f.weightGradForm(); o.Accumulate && f != wg {
		return o, fmt.Errorf("gemm: %v: opt.Accumulate applies to %v only", f, wg)
	}
	return o, nil
}

// wshape returns the shape of G weight matrices K×N stored in layout l.
func wshape(l WeightLayout, G, K, N int) []int {
	if l == NK {
		return []int{G, N, K}
	}
	return []int{G, K, N}
}

func layoutDims(l WeightLayout) string {
	if l == NK {
		return "N, K"
	}
	return "K, N"
}
