package gemm

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// RaggedDotBlockwise computes y[M,N] = x[M,K]·w[g] for the rows of each group g, as
// RaggedDot does, from blockwise FP8 operands (DeepSeek-V3's recipe, see package quant):
// x quantized in 1×128 blocks along K (x.Row and x.RowScale are needed: Dir Rowwise or
// Both) and w in 128×128 blocks (w.KMajor and w.Scales are needed). Each output element
// is Σ_b s_x·s_w·Σ_{k in b} q_x·q_w over the 128-element blocks b of K, summed in f32. x
// and w may be E4M3 or E5M2, each its own; y is BF16 or F32 [x.M, w.N]. sizes is an
// I32[w.G] tensor; rows past sum(sizes) are written as zeros. All tensors are on s's
// device and the work is enqueued on s; sizes, invalid sizes and the Status are handled as
// by RaggedDot. opt.Layout is not used (w holds both orientations); opt.Accumulate must
// be false. y must not overlap x's, w's or sizes' tensors.
func RaggedDotBlockwise(s *device.Stream, y *device.Tensor, x *quant.Blockwise, w *quant.BlockwiseWeights, sizes *device.Tensor, opt *Options) error {
	c, err := checkBlockwise(blockForward, s, y, x, nil, w, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

// RaggedDotBlockwiseInputGrad computes dx[M,K] = dy[M,N]·w[g]ᵀ for the rows of each group
// g, as RaggedDotInputGrad does, from blockwise FP8 operands: dy quantized in 1×128 blocks
// along N (dy.Row and dy.RowScale are needed) and w in 128×128 blocks (w.NMajor and
// w.Scales are needed). dx is BF16 or F32 [dy.M, w.K]; the rest is as for
// RaggedDotBlockwise. dx must not overlap dy's, w's or sizes' tensors.
func RaggedDotBlockwiseInputGrad(s *device.Stream, dx *device.Tensor, dy *quant.Blockwise, w *quant.BlockwiseWeights, sizes *device.Tensor, opt *Options) error {
	c, err := checkBlockwise(blockInputGrad, s, dx, dy, nil, w, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

// RaggedDotBlockwiseWeightGrad computes dw[g] = x_gᵀ·dy_g for each group g, as
// RaggedDotWeightGrad does, from the columnwise blockwise FP8 forms of x [M,K] and dy
// [M,N] (x.ColT, x.ColTScale, dy.ColT and dy.ColTScale are needed: Dir Columnwise or
// Both), whose 128-token blocks restart at each group's first token: both must have been
// quantized with BlockOptions.GroupSizes holding the values of sizes (Groups = G). Each
// element is Σ_t s_x·s_dy·Σ_{p in t} q_x·q_dy over the group's token blocks t, summed in
// f32. dw is BF16 or F32 [G,K,N] (opt.Layout KN) or [G,N,K] (NK); with opt.Accumulate the
// result is added to dw, otherwise the gradient of an empty group is exactly zero. The rest
// is as for RaggedDotBlockwise. dw must not overlap x's, dy's or sizes' tensors.
func RaggedDotBlockwiseWeightGrad(s *device.Stream, dw *device.Tensor, x, dy *quant.Blockwise, sizes *device.Tensor, opt *Options) error {
	c, err := checkBlockwise(blockWeightGrad, s, dw, x, dy, nil, sizes, opt)
	if err != nil {
		return err
	}
	return c.run(s)
}

// blockCall is a checked blockwise call: the bf16 or f32 form it runs as once its
// operands are dequantized (c: f, layout, out, sizes, dimensions, status; op is the
// blockwise form) and its quantized operands.
type blockCall struct {
	c    *call
	a, b *quant.Blockwise        // forward: x; input gradient: dy; weight gradient: x and dy
	w    *quant.BlockwiseWeights // forward and input gradient
}

func (bc *blockCall) run(s *device.Stream) error {
	if s.Device().IsCUDA() {
		return bc.gpu(s)
	}
	return bc.cpu(s)
}

// tokens returns Mp, the token columns of the columnwise form of M rows in G groups (0:
// without groups), as package quant lays it out.
func tokens(M, G int) int {
	if G == 0 {
		return quant.BlockSize * ceilDiv(M, quant.BlockSize)
	}
	return quant.BlockSize * (M/quant.BlockSize + min(G, M))
}

// checkBlockwise validates the arguments of the blockwise form f and returns the call.
// forward: out = y, a = x, w; input gradient: out = dx, a = dy, w; weight gradient:
// out = dw, a = x, b = dy.
func checkBlockwise(f form, s *device.Stream, out *device.Tensor, a, b *quant.Blockwise, w *quant.BlockwiseWeights, sizes *device.Tensor, opt *Options) (*blockCall, error) {
	o, err := checkOptions(f, s, opt)
	if err != nil {
		return nil, err
	}
	names := map[form][3]string{
		blockForward:    {"y", "x", "w"},
		blockInputGrad:  {"dx", "dy", "w"},
		blockWeightGrad: {"dw", "x", "dy"},
	}[f]
	fail := func(format string, v ...any) error {
		return fmt.Errorf("gemm: %v: "+format, append([]any{f}, v...)...)
	}
	wrap := func(err error) error { return fmt.Errorf("gemm: %v: %w", f, err) }
	if err := out.Check(s, names[0]); err != nil {
		return nil, wrap(err)
	}
	if err := sizes.CheckShape(s, "sizes", device.I32, -1); err != nil {
		return nil, wrap(err)
	}
	if o.Status != nil {
		if err := o.Status.Usable(s, "opt.Status"); err != nil {
			return nil, wrap(err)
		}
	}
	if out.DType() != device.BF16 && out.DType() != device.F32 {
		return nil, fail("%s is %v: want bf16 or f32", names[0], out)
	}
	G := sizes.Dim(0)
	c := &call{op: f, layout: o.Layout, accum: o.Accumulate, status: o.Status, out: out, sizes: sizes, G: G}
	bc := &blockCall{c: c, a: a, b: b, w: w}
	var want []int // out's shape
	switch f {
	case blockForward, blockInputGrad:
		c.f, c.layout = forward, NK // y = x·w_g with w_g stored [N][K]: w.KMajor
		if f == blockInputGrad {
			c.f, c.layout = inputGrad, KN // dx = dy·w_gᵀ with w_g stored [K][N]: w.NMajor
		}
		if err := checkRows(s, names[1], a); err != nil {
			return nil, wrap(err)
		}
		if err := checkWeights(s, w, f == blockForward, G); err != nil {
			return nil, wrap(err)
		}
		c.M, c.K, c.N = a.M, w.K, w.N
		inner, outer := w.K, w.N
		if f == blockInputGrad {
			inner, outer = w.N, w.K
		}
		if a.K != inner {
			return nil, fail("%s is quantized [%d %d] and w [G=%d K=%d N=%d]: want %s [M %d]", names[1], a.M, a.K, w.G, w.K, w.N, names[1], inner)
		}
		want = []int{a.M, outer}
	default:
		c.f = weightGrad
		for i, q := range []*quant.Blockwise{a, b} {
			if err := checkColT(s, names[1+i], q); err != nil {
				return nil, wrap(err)
			}
		}
		switch {
		case a.M != b.M:
			return nil, fail("x is quantized [%d %d] and dy [%d %d]: want the same M", a.M, a.K, b.M, b.K)
		case a.Groups != b.Groups:
			return nil, fail("x was quantized in %d groups and dy in %d: want both quantized with the group sizes of sizes", a.Groups, b.Groups)
		case a.Groups != G:
			return nil, fail("x and dy were quantized in %d groups and sizes is %v: want G=%d groups (BlockOptions.GroupSizes as sizes)", a.Groups, sizes, G)
		}
		c.M, c.K, c.N = a.M, a.K, b.K
		want = wshape(o.Layout, G, c.K, c.N)
	}
	if !out.HasShape(device.Invalid, want...) {
		return nil, fail("%s is %v, want %s", names[0], out, device.ShapeString(device.Invalid, want...))
	}
	for _, d := range []struct {
		name string
		v    int
	}{{"M", c.M}, {"K", c.K}, {"N", c.N}, {"G", G}} {
		if d.v >= math.MaxInt32 {
			return nil, fail("%s = %d: want less than 2^31-1", d.name, d.v)
		}
	}
	return bc, nil
}

// checkFormat returns an error unless q's element format is E4M3 or E5M2.
func checkFormat(name string, f quant.Format) error {
	if f != quant.E4M3 && f != quant.E5M2 {
		return fmt.Errorf("%s.Format is %v: want e4m3 or e5m2", name, f)
	}
	return nil
}

// checkForm checks that q, named name, is not nil, is E4M3 or E5M2 and holds the form
// a call reads: the rowwise one (Row, RowScale) when rowwise, else the columnwise one
// (ColT, ColTScale). Its shapes are left to checkRows and checkColT.
func checkForm(name string, q *quant.Blockwise, rowwise bool) error {
	if q == nil {
		return fmt.Errorf("%s is nil", name)
	}
	if err := checkFormat(name, q.Format); err != nil {
		return err
	}
	form, data, scale, dir := "rowwise", "Row", "RowScale", "Rowwise"
	has := q.Row != nil && q.RowScale != nil
	if !rowwise {
		form, data, scale, dir = "columnwise", "ColT", "ColTScale", "Columnwise"
		has = q.ColT != nil && q.ColTScale != nil
	}
	if !has {
		return fmt.Errorf("%s has no %s form (%s.%s, %s.%s): quantize it with Dir %s or Both", name, form, name, data, name, scale, dir)
	}
	return nil
}

// checkRows checks the rowwise form of q, named name: Row Format [M, K] and RowScale F32
// [ceil(K/128), roundup(M, 4)] on s's device.
func checkRows(s *device.Stream, name string, q *quant.Blockwise) error {
	if err := checkForm(name, q, true); err != nil {
		return err
	}
	if q.M < 0 || q.K < 0 {
		return fmt.Errorf("%s is quantized [%d %d]: want non-negative dimensions", name, q.M, q.K)
	}
	if err := q.Row.CheckShape(s, name+".Row", q.Format.DType(), q.M, q.K); err != nil {
		return err
	}
	return q.RowScale.CheckShape(s, name+".RowScale", device.F32, ceilDiv(q.K, quant.BlockSize), 4*ceilDiv(q.M, 4))
}

// checkColT checks the columnwise form of q, named name: ColT Format [K, Mp] and ColTScale
// F32 [Mp/128, K] on s's device.
func checkColT(s *device.Stream, name string, q *quant.Blockwise) error {
	if err := checkForm(name, q, false); err != nil {
		return err
	}
	if q.M < 0 || q.K < 0 || q.Groups < 0 {
		return fmt.Errorf("%s is quantized [%d %d] in %d groups: want non-negative dimensions", name, q.M, q.K, q.Groups)
	}
	mp := tokens(q.M, q.Groups)
	if err := q.ColT.CheckShape(s, name+".ColT", q.Format.DType(), q.K, mp); err != nil {
		return err
	}
	return q.ColTScale.CheckShape(s, name+".ColTScale", device.F32, mp/quant.BlockSize, q.K)
}

// checkWeights checks w and the orientation the call reads (KMajor [G, N, K] when kMajor,
// else NMajor [G, K, N]) with its Scales F32 [G, ceil(K/128), ceil(N/128)] on s's device,
// for sizes of G groups.
func checkWeights(s *device.Stream, w *quant.BlockwiseWeights, kMajor bool, G int) error {
	if w == nil {
		return fmt.Errorf("w is nil")
	}
	if err := checkFormat("w", w.Format); err != nil {
		return err
	}
	t, name, shape := w.KMajor, "w.KMajor", []int{w.G, w.N, w.K}
	if !kMajor {
		t, name, shape = w.NMajor, "w.NMajor", []int{w.G, w.K, w.N}
	}
	if t == nil || w.Scales == nil {
		return fmt.Errorf("w has no %s or no w.Scales: quantize it with QuantizeWeights", name)
	}
	if w.G != G {
		return fmt.Errorf("w holds %d groups and sizes has %d: want the same G", w.G, G)
	}
	if w.K < 0 || w.N < 0 {
		return fmt.Errorf("w is quantized [G=%d K=%d N=%d]: want non-negative dimensions", w.G, w.K, w.N)
	}
	if err := t.CheckShape(s, name, w.Format.DType(), shape...); err != nil {
		return err
	}
	return w.Scales.CheckShape(s, "w.Scales", device.F32, G, ceilDiv(w.K, quant.BlockSize), ceilDiv(w.N, quant.BlockSize))
}
