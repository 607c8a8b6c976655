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

// Options modify a call. The zero value (or a nil *Options) means layout KN, overwrite,
// exact f32 products and the device's own Status.
type Options struct {
	Layout     WeightLayout // layout of w (RaggedDot, RaggedDotInputGrad) or of dw (RaggedDotWeightGrad)
	Accumulate bool         // RaggedDotWeightGrad: dw += x_gᵀ·dy_g instead of dw = ...
	TF32       bool         // allow tf32 tensor cores for f32 operands (default: exact f32 FMA; the current kernels are exact either way)
	Status     *Status      // optional status that records invalid sizes; nil: the device's own (see CheckStatus)
}

// form is one of the three ragged_dot forms.
type form int

const (
	forward    form = 1 // RaggedDot
	inputGrad  form = 2 // RaggedDotInputGrad
	weightGrad form = 3 // RaggedDotWeightGrad
)

func (f form) String() string {
	switch f {
	case forward:
		return "RaggedDot"
	case inputGrad:
		return "RaggedDotInputGrad"
	case weightGrad:
		return "RaggedDotWeightGrad"
	}
	return "gemm"
}

// call is one checked call: the GEMM C = A·B of the form, in the terms of the kernels.
type call struct {
	f      form
	layout WeightLayout
	accum  bool
	status *Status

	out, a, b, sizes *device.Tensor
	// M: rows of x (and of y, dx, dy); K, N: the weight matrix's dimensions; G: groups.
	M, K, N, G int
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
// devices, streams and the handling of invalid sizes are as for RaggedDot.
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
// Rows of x and dy past sum(sizes) do not contribute. dtypes, devices, streams and the
// handling of invalid sizes are as for RaggedDot.
func RaggedDotWeightGrad(s *device.Stream, dw, x, dy, sizes *device.Tensor, opt *Options) error {
	c, err := check(weightGrad, s, dw, x, dy, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

func (c *call) run(s *device.Stream) error {
	if s.Device().IsCUDA() {
		return c.gpu(s)
	}
	return c.cpu(s)
}

// check validates the arguments of form f and returns the call.
// forward: out=y[M,N], a=x[M,K], b=w; inputGrad: out=dx[M,K], a=dy[M,N], b=w;
// weightGrad: out=dw, a=x[M,K], b=dy[M,N].
func check(f form, s *device.Stream, out, a, b, sizes *device.Tensor, opt *Options) (*call, error) {
	if s == nil {
		return nil, fmt.Errorf("gemm: %v: nil stream", f)
	}
	var o Options
	if opt != nil {
		o = *opt
	}
	if o.Layout != KN && o.Layout != NK {
		return nil, fmt.Errorf("gemm: %v: invalid layout %v: want KN or NK", f, o.Layout)
	}
	if o.Accumulate && f != weightGrad {
		return nil, fmt.Errorf("gemm: %v: Accumulate applies to RaggedDotWeightGrad only", f)
	}
	names := map[form][3]string{
		forward:    {"y", "x", "w"},
		inputGrad:  {"dx", "dy", "w"},
		weightGrad: {"dw", "x", "dy"},
	}[f]
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
		if err := o.Status.usable(s); err != nil {
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
	wshape := func(K, N int) []int {
		if o.Layout == NK {
			return []int{G, N, K}
		}
		return []int{G, K, N}
	}
	switch f {
	case forward, inputGrad:
		// forward: a = x[M,K]; inputGrad: a = dy[M,N]. w gives the other dimension.
		if b.Rank() != 3 || b.Dim(0) != G {
			return nil, fmt.Errorf("gemm: %v: w is %v, want [G=%d, %s] with G = len(sizes)", f, b, G, layoutDims(o.Layout))
		}
		c.M = a.Dim(0)
		if o.Layout == KN {
			c.K, c.N = b.Dim(1), b.Dim(2)
		} else {
			c.N, c.K = b.Dim(1), b.Dim(2)
		}
		inner, outer := c.K, c.N // x's columns, y's columns
		if f == inputGrad {
			inner, outer = c.N, c.K // dy's columns, dx's columns
		}
		if a.Dim(1) != inner {
			return nil, fmt.Errorf("gemm: %v: %s is %v and w is %v (layout %v): want %s[%d, %d]", f, names[1], a, b, o.Layout, names[1], c.M, inner)
		}
		if out.Rank() != 2 || out.Dim(0) != c.M || out.Dim(1) != outer {
			return nil, fmt.Errorf("gemm: %v: %s is %v, want [%d, %d]", f, names[0], out, c.M, outer)
		}
	case weightGrad:
		if b.Rank() != 2 || b.Dim(0) != a.Dim(0) {
			return nil, fmt.Errorf("gemm: %v: x is %v and dy is %v: want x[M,K] and dy[M,N] with the same M", f, a, b)
		}
		c.M, c.K, c.N = a.Dim(0), a.Dim(1), b.Dim(1)
		want := wshape(c.K, c.N)
		if out.Rank() != 3 || out.Dim(0) != want[0] || out.Dim(1) != want[1] || out.Dim(2) != want[2] {
			return nil, fmt.Errorf("gemm: %v: dw is %v, want %v (layout %v)", f, out, want, o.Layout)
		}
	}
	for _, d := range []struct {
		name string
		v    int
	}{{"M", c.M}, {"K", c.K}, {"N", c.N}, {"G", G}} {
		if d.v >= math.MaxInt32 {
			return nil, fmt.Errorf("gemm: %v: %s = %d: want less than 2^31-1", f, d.name, d.v)
		}
	}
	return c, nil
}

func layoutDims(l WeightLayout) string {
	if l == NK {
		return "N, K"
	}
	return "K, N"
}
