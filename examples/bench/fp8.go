package main

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/dropless/dropless/quant"
)

// fp8 times the FP8 forms of ragged_dot on case c, forward, input gradient and weight
// gradient, in both recipes (blockwise and MXFP8): E4M3 operands quantized once before
// the timing from random bf16 data, bf16 outputs, 2·M·K·N flops per call as in gemm.
// Beside them it times each recipe's quantization of each kind of operand, counting the
// bytes of the bf16 it reads: activations rowwise (x [M,K]; dy [M,N] likewise for the
// input gradient), weights in both orientations (w [G,K,N]) and activations columnwise
// in the case's groups, transposed (x; dy likewise for the weight gradient).
func (b *bench) fp8(c baseline.Case) ([]row, error) {
	g, err := b.newGemmCase(c)
	if err != nil {
		return nil, err
	}
	defer g.Free()
	s := b.s
	o := &fp8Case{gemmCase: g}
	// The grouped quantizations record invalid group sizes here, checked once at the end.
	if o.status, err = device.NewStatus(s); err != nil {
		return nil, err
	}
	defer o.status.Free()
	var rows []row
	for _, r := range []func(*bench, *fp8Case) ([]row, error){blockwiseRecipe.time, mxfp8Recipe.time} {
		rs, err := r(b, o)
		rows = append(rows, rs...)
		if err != nil {
			return rows, err
		}
	}
	if err := o.status.Check(s); err != nil {
		return rows, err
	}
	return rows, gemm.CheckStatus(s)
}

// fp8Case is a case of fp8: its bf16 data and the outputs of the forms.
type fp8Case struct {
	*gemmCase
	status *device.Status
}

// fp8Recipe is an FP8 recipe of ragged_dot: the quantization of its activations and
// gradients (Q, with options O) and of its weights (W), and its three forms.
type fp8Recipe[Q interface{ Free() error }, W interface{ Free() error }, O any] struct {
	name       string
	alloc      func(*device.Stream, int, int, O) (Q, error)
	into       func(*device.Stream, Q, *device.Tensor, O) error
	weights    func(*device.Stream, *device.Tensor, O) (W, error)
	rows, wopt O
	cols       func(sizes *device.Tensor, st *device.Status) O
	fwd, dgrad func(*device.Stream, *device.Tensor, Q, W, *device.Tensor, *gemm.Options) error
	wgrad      func(*device.Stream, *device.Tensor, Q, Q, *device.Tensor, *gemm.Options) error
}

// The recipes, as gemm's benchmarks quantize their operands: E4M3 elements, blockwise
// in 1×128 blocks (weights 128×128) with float32 scales, MXFP8 in 1×32 blocks with E8M0
// scales chosen by RCEIL, the weight gradient's operands columnwise in the groups
// (MXFP8: transposed, as the blockwise ones always are).
var (
	blockwiseRecipe = fp8Recipe[*quant.Blockwise, *quant.BlockwiseWeights, quant.BlockOptions]{
		name: "blockwise", alloc: quant.AllocBlockwise, into: quant.QuantizeBlockwiseInto, weights: quant.QuantizeWeights,
		rows: quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32, Dir: quant.Rowwise},
		wopt: quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32},
		cols: func(sizes *device.Tensor, st *device.Status) quant.BlockOptions {
			return quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32, Dir: quant.Columnwise, GroupSizes: sizes, Status: st}
		},
		fwd: gemm.RaggedDotBlockwise, dgrad: gemm.RaggedDotBlockwiseInputGrad, wgrad: gemm.RaggedDotBlockwiseWeightGrad,
	}
	mxfp8Recipe = fp8Recipe[*quant.MXFP8, *quant.MXFP8Weights, quant.Options]{
		name: "mxfp8", alloc: quant.Alloc, into: quant.QuantizeInto, weights: quant.QuantizeMXFP8Weights,
		rows: quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: quant.Rowwise},
		wopt: quant.Options{Format: quant.E4M3, Mode: quant.RCEIL},
		cols: func(sizes *device.Tensor, st *device.Status) quant.Options {
			return quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: quant.Columnwise, Transpose: true, GroupSizes: sizes, Status: st}
		},
		fwd: gemm.RaggedDotMXFP8, dgrad: gemm.RaggedDotMXFP8InputGrad, wgrad: gemm.RaggedDotMXFP8WeightGrad,
	}
)

// time quantizes the operands of r's three forms on o once, times the forms, then times
// r's quantization of each kind of operand: the activations into tensors allocated
// once, as the quant rows, the weights with the allocation and the Free of their
// result (there is no form into given tensors).
func (r fp8Recipe[Q, W, O]) time(b *bench, o *fp8Case) ([]row, error) {
	s := b.s
	var err error
	var frees []func() error
	defer func() {
		for _, f := range frees {
			f()
		}
	}()
	// quantize quantizes t [m, k] with opt into a new Q (after the first failure, none).
	quantize := func(t *device.Tensor, opt O) Q {
		var q Q
		if err != nil {
			return q
		}
		if q, err = r.alloc(s, t.Dim(0), t.Dim(1), opt); err == nil {
			frees = append(frees, q.Free)
			err = r.into(s, q, t, opt)
		}
		return q
	}
	cols := r.cols(o.sizes, o.status)
	qx, qdy, cx, cdy := quantize(o.x, r.rows), quantize(o.dy, r.rows), quantize(o.x, cols), quantize(o.dy, cols)
	if err != nil {
		return nil, err
	}
	qw, err := r.weights(s, o.w, r.wopt)
	if err != nil {
		return nil, err
	}
	frees = append(frees, qw.Free)
	var rows []row
	name := o.name + " " + r.name
	for _, f := range []struct {
		prim string
		fn   func() error
	}{
		{"fp8 forward", func() error { return r.fwd(s, o.y, qx, qw, o.sizes, nil) }},
		{"fp8 input grad", func() error { return r.dgrad(s, o.dx, qdy, qw, o.sizes, nil) }},
		{"fp8 weight grad", func() error { return r.wgrad(s, o.dw, cx, cdy, o.sizes, nil) }},
	} {
		t, err := b.time(f.fn)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row{f.prim, name, t, o.flops / t.Seconds() / 1e12, "TFLOP/s", ""})
	}
	for _, f := range []struct {
		prim, what string
		src        *device.Tensor
		fn         func() error
	}{
		{"fp8 quant rowwise", "x M×K rowwise", o.x, func() error { return r.into(s, qx, o.x, r.rows) }},
		{"fp8 quant weights", "w G×K×N both orientations", o.w, func() error {
			q, err := r.weights(s, o.w, r.wopt)
			if err != nil {
				return err
			}
			return q.Free()
		}},
		{"fp8 quant grouped", "x M×K grouped columnwise", o.x, func() error { return r.into(s, cx, o.x, cols) }},
	} {
		t, err := b.time(f.fn)
		if err != nil {
			return rows, err
		}
		name := fmt.Sprintf("%s %s, %s", o.c.Name, f.what, r.name)
		rows = append(rows, row{f.prim, name, t, float64(f.src.Bytes()) / t.Seconds() / 1e9, "GB/s (bf16 read)", ""})
	}
	return rows, nil
}

// fp8Check returns an error for a case that the FP8 forms cannot run: their weights
// need K and N multiples of 16 (FP8 rows of whole 16-byte units).
func fp8Check(cases []baseline.Case) error {
	for _, c := range cases {
		if c.K%16 != 0 || c.N%16 != 0 {
			return fmt.Errorf("fp8: case %s has K=%d, N=%d: FP8 weights need K and N multiples of 16 (leave fp8 out of -only for this case)", c.Name, c.K, c.N)
		}
	}
	return nil
}
