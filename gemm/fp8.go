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

func (bc *blockCall) run(s *device.Stream) error { return onDevice(s, bc.cpu, bc.gpu) }

// tokens returns Mp, the token columns of the columnwise (transposed) form of M rows in
// G groups (0: without groups), as package quant lays it out in both recipes: 128-token
// tiles that restart at each group, within a bound that does not depend on the sizes.
// It is also the number of rowwise scale rows of an MXFP8 operand.
func tokens(M, G int) int {
	if G == 0 {
		return quant.BlockSize * ceilDiv(M, quant.BlockSize)
	}
	return quant.BlockSize * (M/quant.BlockSize + min(G, M))
}

// qdims are the dimensions of a quantized operand as the shared checks see them: an
// activation or gradient of M rows and K columns quantized in G groups (0: without
// groups), or weights of G groups of K×N.
type qdims struct{ M, K, N, G int }

// fp8Checks are one FP8 recipe's checks of its quantized operands, each returning the
// dimensions of the operand it checked on s: an activation or gradient read rowwise (the
// forward's x, the input gradient's dy), named name, for sizes of G groups; one read
// columnwise (the weight gradient's x and dy); the weights, in the orientation of the
// forward (kMajor) or of the input gradient.
type fp8Checks[Q, W any] struct {
	rows    func(s *device.Stream, name string, q Q, G int) (qdims, error)
	cols    func(s *device.Stream, name string, q Q) (qdims, error)
	weights func(s *device.Stream, w W, kMajor bool) (qdims, error)
}

// checkFP8 validates the arguments of the FP8 form f, whose operands are a and w
// (forward: x; input gradient: dy) or a and b (weight gradient: x and dy), checked by
// the recipe's checks, and returns the bf16 or f32 call it runs as once its operands are
// dequantized: c.f and c.layout say how (the forward as w_g stored [N][K], the input
// gradient as w_g stored [K][N]), c.op is f.
func checkFP8[Q, W any](f form, s *device.Stream, out *device.Tensor, a, b Q, w W, sizes *device.Tensor, opt *Options, rc fp8Checks[Q, W]) (*call, error) {
	o, err := checkOptions(f, s, opt)
	if err != nil {
		return nil, err
	}
	names := f.argNames()
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
	var want []int // out's shape
	switch f.base() {
	case forward, inputGrad:
		c.f, c.layout = forward, NK // y = x·w_g with w_g stored [N][K]: w.KMajor
		if f.base() == inputGrad {
			c.f, c.layout = inputGrad, KN // dx = dy·w_gᵀ with w_g stored [K][N]: w.NMajor
		}
		q, err := rc.rows(s, names[1], a, G)
		if err != nil {
			return nil, wrap(err)
		}
		wd, err := rc.weights(s, w, c.f == forward)
		if err != nil {
			return nil, wrap(err)
		}
		if wd.G != G {
			return nil, fail("w holds %d groups and sizes has %d: want the same G", wd.G, G)
		}
		c.M, c.K, c.N = q.M, wd.K, wd.N
		inner, outer := wd.K, wd.N
		if c.f == inputGrad {
			inner, outer = wd.N, wd.K
		}
		if q.K != inner {
			return nil, fail("%s is quantized [%d %d] and w [G=%d K=%d N=%d]: want %s [M %d]", names[1], q.M, q.K, wd.G, wd.K, wd.N, names[1], inner)
		}
		want = []int{q.M, outer}
	default:
		c.f = weightGrad
		var qs [2]qdims
		for i, q := range []Q{a, b} {
			if qs[i], err = rc.cols(s, names[1+i], q); err != nil {
				return nil, wrap(err)
			}
		}
		x, dy := qs[0], qs[1]
		switch {
		case x.M != dy.M:
			return nil, fail("x is quantized [%d %d] and dy [%d %d]: want the same M", x.M, x.K, dy.M, dy.K)
		case x.G != dy.G:
			return nil, fail("x was quantized in %d groups and dy in %d: want both quantized with the group sizes of sizes", x.G, dy.G)
		case x.G != G:
			return nil, fail("x and dy were quantized in %d groups and sizes is %v: want G=%d groups (GroupSizes holding the values of sizes)", x.G, sizes, G)
		}
		c.M, c.K, c.N = x.M, x.K, dy.K
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
	return c, nil
}

// blockChecks are the checks of the blockwise operands.
var blockChecks = fp8Checks[*quant.Blockwise, *quant.BlockwiseWeights]{rows: checkRows, cols: checkColT, weights: checkWeights}

// checkBlockwise validates the arguments of the blockwise form f and returns the call.
// forward: out = y, a = x, w; input gradient: out = dx, a = dy, w; weight gradient:
// out = dw, a = x, b = dy.
func checkBlockwise(f form, s *device.Stream, out *device.Tensor, a, b *quant.Blockwise, w *quant.BlockwiseWeights, sizes *device.Tensor, opt *Options) (*blockCall, error) {
	c, err := checkFP8(f, s, out, a, b, w, sizes, opt, blockChecks)
	if err != nil {
		return nil, err
	}
	return &blockCall{c: c, a: a, b: b, w: w}, nil
}

// checkFormat returns an error unless q's element format is E4M3 or E5M2.
func checkFormat(name string, f quant.Format) error {
	if f != quant.E4M3 && f != quant.E5M2 {
		return fmt.Errorf("%s.Format is %v: want e4m3 or e5m2", name, f)
	}
	return nil
}

// checkHolds checks that an operand named name, of element format f, is E4M3 or E5M2 and
// holds (has) the form a call reads: the tensors data and scale, which quantizing it as
// how says makes.
func checkHolds(name string, f quant.Format, has bool, form, data, scale, how string) error {
	if err := checkFormat(name, f); err != nil {
		return err
	}
	if !has {
		return fmt.Errorf("%s has no %s form (%s.%s, %s.%s): quantize it with %s", name, form, name, data, name, scale, how)
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
	if rowwise {
		return checkHolds(name, q.Format, q.Row != nil && q.RowScale != nil, "rowwise", "Row", "RowScale", "Dir Rowwise or Both")
	}
	return checkHolds(name, q.Format, q.ColT != nil && q.ColTScale != nil, "columnwise", "ColT", "ColTScale", "Dir Columnwise or Both")
}

// qpart is one tensor of a quantized operand as a call reads it: field names it within
// the operand, dt and shape are what the call wants.
type qpart struct {
	t     *device.Tensor
	field string
	dt    device.DType
	shape []int
}

// checkParts checks the operand named name, of dimensions d (not negative) and tensors
// parts (live on s's device, of their dtypes and shapes), and returns d.
func checkParts(s *device.Stream, name string, d qdims, parts ...qpart) (qdims, error) {
	if d.M < 0 || d.K < 0 || d.N < 0 || d.G < 0 {
		return d, fmt.Errorf("%s is quantized with M=%d K=%d N=%d G=%d: want non-negative dimensions", name, d.M, d.K, d.N, d.G)
	}
	for _, p := range parts {
		if err := p.t.CheckShape(s, name+"."+p.field, p.dt, p.shape...); err != nil {
			return d, err
		}
	}
	return d, nil
}

// checkRows checks the rowwise form of q, named name: Row Format [M, K] and RowScale F32
// [ceil(K/128), roundup(M, 4)] on s's device. Rowwise blocks do not depend on groups: any
// grouping of q will do.
func checkRows(s *device.Stream, name string, q *quant.Blockwise, _ int) (qdims, error) {
	if err := checkForm(name, q, true); err != nil {
		return qdims{}, err
	}
	return checkParts(s, name, qdims{M: q.M, K: q.K},
		qpart{q.Row, "Row", q.Format.DType(), []int{q.M, q.K}},
		qpart{q.RowScale, "RowScale", device.F32, []int{ceilDiv(q.K, quant.BlockSize), 4 * ceilDiv(q.M, 4)}})
}

// checkColT checks the columnwise form of q, named name: ColT Format [K, Mp] and ColTScale
// F32 [Mp/128, K] on s's device.
func checkColT(s *device.Stream, name string, q *quant.Blockwise) (qdims, error) {
	if err := checkForm(name, q, false); err != nil {
		return qdims{}, err
	}
	mp := tokens(q.M, q.Groups)
	return checkParts(s, name, qdims{M: q.M, K: q.K, G: q.Groups},
		qpart{q.ColT, "ColT", q.Format.DType(), []int{q.K, mp}},
		qpart{q.ColTScale, "ColTScale", device.F32, []int{mp / quant.BlockSize, q.K}})
}

// checkWeights checks w and the orientation the call reads (KMajor [G, N, K] when kMajor,
// else NMajor [G, K, N]) with its Scales F32 [G, ceil(K/128), ceil(N/128)] on s's device.
func checkWeights(s *device.Stream, w *quant.BlockwiseWeights, kMajor bool) (qdims, error) {
	if w == nil {
		return qdims{}, fmt.Errorf("w is nil")
	}
	if err := checkFormat("w", w.Format); err != nil {
		return qdims{}, err
	}
	t := qpart{w.KMajor, "KMajor", w.Format.DType(), []int{w.G, w.N, w.K}}
	if !kMajor {
		t = qpart{w.NMajor, "NMajor", w.Format.DType(), []int{w.G, w.K, w.N}}
	}
	if t.t == nil || w.Scales == nil {
		return qdims{}, fmt.Errorf("w has no w.%s or no w.Scales: quantize it with QuantizeWeights", t.field)
	}
	return checkParts(s, "w", qdims{K: w.K, N: w.N, G: w.G},
		t, qpart{w.Scales, "Scales", device.F32, []int{w.G, ceilDiv(w.K, quant.BlockSize), ceilDiv(w.N, quant.BlockSize)}})
}
