package gemm

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// mxBlock is the MXFP8 scale block: 32 elements along the contracted dimension.
const mxBlock = 32

// RaggedDotMXFP8 computes y[M,N] = x[M,K]·w[g] for the rows of each group g, as RaggedDot
// does, from MXFP8 operands (OCP MX, see package quant): x quantized in 1×32 blocks along K
// (x.Row and x.RowScale are needed: Dir Rowwise or Both) and w in 1×32 blocks along K
// (w.KMajor and w.KScale are needed: QuantizeMXFP8Weights). Each output element is
// Σ_b s_x·s_w·Σ_{k in b} q_x·q_w over the 32-element blocks b of K, summed in f32. x and
// w may be E4M3 or E5M2, each its own; their scales must be unswizzled (quantized
// without Options.Swizzle). x may be quantized without groups or in the groups of sizes
// (Options.GroupSizes holding the values of sizes, which puts its scale rows in the tile
// layout). Only the count of a grouped x's groups is checked, x.Groups = G: the sizes it
// was quantized with are taken to be those of sizes. y is BF16 or F32 [x.M, w.N]. sizes
// is an I32[w.G] tensor; rows past sum(sizes) are written as zeros. All tensors are on
// s's device and the work is enqueued on s; sizes, invalid sizes and the Status are
// handled as by RaggedDot. opt.Layout is not used (w holds both orientations);
// opt.Accumulate must be false. y must not overlap x's, w's or sizes' tensors.
func RaggedDotMXFP8(s *device.Stream, y *device.Tensor, x *quant.MXFP8, w *quant.MXFP8Weights, sizes *device.Tensor, opt *Options) error {
	mc, err := checkMXFP8(mxForward, s, y, x, nil, w, sizes, opt)
	if err != nil {
		return err
	}
	return mc.run(s)
}

// RaggedDotMXFP8InputGrad computes dx[M,K] = dy[M,N]·w[g]ᵀ for the rows of each group g,
// as RaggedDotInputGrad does, from MXFP8 operands: dy quantized in 1×32 blocks along N
// (dy.Row and dy.RowScale are needed; without groups, or in the groups of sizes as x for
// RaggedDotMXFP8) and w in 1×32 blocks along N (w.NMajor and w.NScale are needed). dx is
// BF16 or F32 [dy.M, w.K]; the rest is as for RaggedDotMXFP8. dx must not overlap dy's,
// w's or sizes' tensors.
func RaggedDotMXFP8InputGrad(s *device.Stream, dx *device.Tensor, dy *quant.MXFP8, w *quant.MXFP8Weights, sizes *device.Tensor, opt *Options) error {
	mc, err := checkMXFP8(mxInputGrad, s, dx, dy, nil, w, sizes, opt)
	if err != nil {
		return err
	}
	return mc.run(s)
}

// RaggedDotMXFP8WeightGrad computes dw[g] = x_gᵀ·dy_g for each group g, as
// RaggedDotWeightGrad does, from the transposed columnwise MXFP8 forms of x [M,K] and dy
// [M,N] (x.ColT, x.ColScale, dy.ColT and dy.ColScale are needed: Dir Columnwise or Both,
// with Transpose), whose 32-token blocks restart at each group's first token: both must
// have been quantized with Options.GroupSizes holding the values of sizes (Groups = G).
// Each element is Σ_t s_x·s_dy·Σ_{p in t} q_x·q_dy over the group's 32-token blocks t,
// summed in f32. dw is BF16 or F32 [G,K,N] (opt.Layout KN) or [G,N,K] (NK); with
// opt.Accumulate the result is added to dw, otherwise the gradient of an empty group is
// exactly zero. The rest is as for RaggedDotMXFP8. dw must not overlap x's, dy's or
// sizes' tensors.
func RaggedDotMXFP8WeightGrad(s *device.Stream, dw *device.Tensor, x, dy *quant.MXFP8, sizes *device.Tensor, opt *Options) error {
	mc, err := checkMXFP8(mxWeightGrad, s, dw, x, dy, nil, sizes, opt)
	if err != nil {
		return err
	}
	return mc.run(s)
}

// mxCall is a checked MXFP8 call: the bf16 or f32 form it runs as once its operands are
// dequantized (c, as for blockCall; op is the MXFP8 form) and its quantized operands.
type mxCall struct {
	c    *call
	a, b *quant.MXFP8        // forward: x; input gradient: dy; weight gradient: x and dy
	w    *quant.MXFP8Weights // forward and input gradient
}

func (mc *mxCall) run(s *device.Stream) error { return onDevice(s, mc.cpu, mc.gpu) }

// mxChecks are the checks of the MXFP8 operands.
var mxChecks = fp8Checks[*quant.MXFP8, *quant.MXFP8Weights]{rows: checkMXRows, cols: checkMXColT, weights: checkMXWeights}

// checkMXFP8 validates the arguments of the MXFP8 form f and returns the call. forward:
// out = y, a = x, w; input gradient: out = dx, a = dy, w; weight gradient: out = dw,
// a = x, b = dy.
func checkMXFP8(f form, s *device.Stream, out *device.Tensor, a, b *quant.MXFP8, w *quant.MXFP8Weights, sizes *device.Tensor, opt *Options) (*mxCall, error) {
	c, err := checkFP8(f, s, out, a, b, w, sizes, opt, mxChecks)
	if err != nil {
		return nil, err
	}
	return &mxCall{c: c, a: a, b: b, w: w}, nil
}

// checkMXForm checks that q, named name, is not nil, is E4M3 or E5M2 with unswizzled
// scales and holds the form a call reads: the rowwise one (Row, RowScale) when rowwise,
// else the transposed columnwise one (ColT, ColScale). Its shapes are left to checkMXRows
// and checkMXColT.
func checkMXForm(name string, q *quant.MXFP8, rowwise bool) error {
	if q == nil {
		return fmt.Errorf("%s is nil", name)
	}
	var err error
	switch {
	case rowwise:
		err = checkHolds(name, q.Format, q.Row != nil && q.RowScale != nil, "rowwise", "Row", "RowScale", "Dir Rowwise or Both")
	case q.ColT == nil && q.Col != nil:
		return fmt.Errorf("%s holds its columnwise form untransposed (%s.Col): quantize it with Dir Columnwise or Both and Transpose", name, name)
	default:
		err = checkHolds(name, q.Format, q.ColT != nil && q.ColScale != nil, "transposed columnwise", "ColT", "ColScale", "Dir Columnwise or Both and Transpose")
	}
	if err == nil && q.Swizzled {
		err = fmt.Errorf("%s.Swizzled is set: the GEMM reads unswizzled scales (quantize it without Options.Swizzle)", name)
	}
	return err
}

// checkMXRows checks the rowwise form of q, named name, for sizes of G groups: Row Format
// [M, K] and RowScale E8M0 [32·T, roundup(ceil(K/32), 4)] on s's device, and q ungrouped
// or quantized in G groups.
func checkMXRows(s *device.Stream, name string, q *quant.MXFP8, G int) (qdims, error) {
	if err := checkMXForm(name, q, true); err != nil {
		return qdims{}, err
	}
	if q.Groups != 0 && q.Groups != G {
		return qdims{}, fmt.Errorf("%s was quantized in %d groups and sizes has %d: want %s quantized without groups or in the groups of sizes", name, q.Groups, G, name)
	}
	return checkParts(s, name, qdims{M: q.M, K: q.K, G: q.Groups},
		qpart{q.Row, "Row", q.Format.DType(), []int{q.M, q.K}},
		qpart{q.RowScale, "RowScale", device.E8M0, []int{tokens(q.M, q.Groups), 4 * ceilDiv(ceilDiv(q.K, mxBlock), 4)}})
}

// checkMXColT checks the transposed columnwise form of q, named name: ColT Format
// [K, 32·T] and ColScale E8M0 [T, roundup(K, 128)] on s's device.
func checkMXColT(s *device.Stream, name string, q *quant.MXFP8) (qdims, error) {
	if err := checkMXForm(name, q, false); err != nil {
		return qdims{}, err
	}
	mp := tokens(q.M, q.Groups)
	return checkParts(s, name, qdims{M: q.M, K: q.K, G: q.Groups},
		qpart{q.ColT, "ColT", q.Format.DType(), []int{q.K, mp}},
		qpart{q.ColScale, "ColScale", device.E8M0, []int{mp / mxBlock, 128 * ceilDiv(q.K, 128)}})
}

// checkMXWeights checks w and the orientation the call reads: KMajor [G, N, K] and KScale
// E8M0 [G, ceil(K/128), N, 4] when kMajor, else NMajor [G, K, N] and NScale E8M0
// [G, ceil(N/128), K, 4], on s's device.
func checkMXWeights(s *device.Stream, w *quant.MXFP8Weights, kMajor bool) (qdims, error) {
	if w == nil {
		return qdims{}, fmt.Errorf("w is nil")
	}
	if err := checkFormat("w", w.Format); err != nil {
		return qdims{}, err
	}
	t := qpart{w.KMajor, "KMajor", w.Format.DType(), []int{w.G, w.N, w.K}}
	sc := qpart{w.KScale, "KScale", device.E8M0, []int{w.G, ceilDiv(w.K, 128), w.N, 4}}
	if !kMajor {
		t = qpart{w.NMajor, "NMajor", w.Format.DType(), []int{w.G, w.K, w.N}}
		sc = qpart{w.NScale, "NScale", device.E8M0, []int{w.G, ceilDiv(w.N, 128), w.K, 4}}
	}
	if t.t == nil || sc.t == nil {
		return qdims{}, fmt.Errorf("w has no w.%s or no w.%s: quantize it with QuantizeMXFP8Weights", t.field, sc.field)
	}
	return checkParts(s, "w", qdims{K: w.K, N: w.N, G: w.G}, t, sc)
}
