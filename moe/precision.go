package moe

import "fmt"

// Precision is the arithmetic of the routed experts' six GEMMs (Config.Precision): the
// forwards of W1 and W2, their input gradients and their weight gradients.
//
// With an FP8 precision every operand of those GEMMs is quantized and the GEMM
// multiplies the FP8 codes with their scales, summing in f32: the permuted rows xp
// (without Config.EP quantized as x's T rows, then gathered to the expert rows) and the
// SwiGLU output a (quantized by the pass that computes it, both forms at once) rowwise
// (blocks along the hidden or intermediate width) for the forwards, the incoming
// gradients dyp and dh rowwise for the input gradients, and xp, a, dyp and dh
// columnwise in blocks of tokens that restart at each expert, transposed, for the
// weight gradients (dyp and dh in both forms from one pass over each). W1 and W2 are
// quantized in both orientations once and cached by the Layer (see
// Layer.InvalidateWeights). Elements are E4M3 throughout, gradients included, as
// fine-grained scales allow (DeepSeek-V3).
//
// Nothing else changes: the parameters, the master weights the optimizer updates, the
// gradients (Grads, written in their own dtypes) and the other activations the layer
// keeps (ActWi, ActWo) stay in the parameters' dtype, while ActSwiGLU is a's columnwise
// FP8 form, the operand of W2's weight gradient, instead of a, and ActPermuted, with
// Config.EP, the dispatched rows' rowwise FP8 form (without it the layer keeps none:
// Backward permutes x again); the FP8 GEMMs write their results, h,
// yp, da and dxp, in the activations' dtype (bf16, or f32 for an f32 layer) as the bf16
// GEMMs do, and the weight gradients in the dtypes of Grads.W1 and Grads.W2. The
// router, the combine and the shared expert (SharedFFN) run as with PrecisionBF16, the
// dispatch of Config.EP moves x's rows quantized rowwise, and SwiGLU computes the values
// it does there. FP8 precisions need
// Hidden and FFN multiples of 16 (the weights' FP8 rows are whole 16-byte units, as the
// FP8 GEMMs read them); the number of tokens is free, and widths that are not multiples
// of the scale blocks end in short blocks. On a GPU they need compute capability 8.0 or
// newer, as gemm's FP8 forms do (Hopper runs them on FP8 tensor cores, others
// dequantize to bf16 first).
type Precision int

const (
	// PrecisionBF16 (the zero value) runs the expert GEMMs in the parameters' dtype: bf16,
	// or f32 for an f32 layer, summing in f32.
	PrecisionBF16 Precision = iota
	// PrecisionBlockwise is DeepSeek-V3's blockwise FP8 recipe (package quant's
	// Blockwise forms, gemm.RaggedDotBlockwise and its gradients): E4M3 elements with one
	// float32 scale per 1×128 block of an activation or gradient (along the contracted
	// dimension) and per 128×128 block of a weight.
	PrecisionBlockwise
	// PrecisionMXFP8 is the OCP microscaling recipe (package quant's MXFP8 forms,
	// gemm.RaggedDotMXFP8 and its gradients): E4M3 elements with one E8M0 (power-of-two)
	// scale per 32 elements along the contracted dimension, activations, gradients and
	// weights alike, scales chosen by the RCEIL rule.
	PrecisionMXFP8
)

// String returns "bf16", "blockwise" or "mxfp8".
func (p Precision) String() string {
	switch p {
	case PrecisionBF16:
		return "bf16"
	case PrecisionBlockwise:
		return "blockwise"
	case PrecisionMXFP8:
		return "mxfp8"
	}
	return fmt.Sprintf("Precision(%d)", int(p))
}

func (p Precision) valid() bool { return p >= PrecisionBF16 && p <= PrecisionMXFP8 }

// fp8 reports whether p quantizes the expert GEMMs' operands.
func (p Precision) fp8() bool { return p == PrecisionBlockwise || p == PrecisionMXFP8 }

// fp8Align is what FP8 precisions need Hidden and FFN to be multiples of: the weights'
// FP8 rows are whole 16-byte units.
const fp8Align = 16
