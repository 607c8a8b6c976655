// Package moe builds dropless Mixture-of-Experts layers from the primitives: the router,
// permute and unpermute, and the layer's forward and backward passes.
//
// # The layer
//
// For x[T,H] on one device, Layer.Forward runs
//
//	logits = x·Routerᵀ                       RouterLogits, f32 [T,E]
//	Index, Weight = top-k(logits)            Route (softmax or sigmoid, groups, bias)
//	Perm = stable counting sort of Index     Sort: rows grouped by expert, Counts[E]
//	xp = x[token of each row]                Permute            [R,H], R = T·K (dropless)
//	h  = ragged_dot(xp, W1[E,H,2F])          gemm.RaggedDot     [R,2F], gate | up
//	a  = silu(h[:, :F])·h[:, F:]             SwiGLU             [R,F]
//	yp = ragged_dot(a, W2[E,F,H])            gemm.RaggedDot     [R,H]
//	y[t] = Σ_k Weight[t,k]·yp[Row[t,k]] (+ shared expert)      Unpermute
//
// and Layer.Backward the same steps in reverse: UnpermuteGrad (the rows' gradients and
// the routing weights' ⟨dy, yp⟩), two ragged_dot input gradients and two weight
// gradients, SwiGLUGrad, RouteGrad (through the renormalization, the score function and
// the auxiliary loss) and, in one pass, PermuteGrad plus the router's input gradient
// dlogits·Router plus the shared expert's. The shared expert is a dense SwiGLU MLP run
// through gemm.RaggedDot with one group of T rows. Parameters and activations are f32
// or bf16; sums are f32; router math is f32 throughout.
//
// A capacity layer (Config.CapacityFactor > 0) is the same code with Sort keeping at
// most ⌈factor·T·K/E⌉ rows per expert, the first in token order; dropped assignments add
// nothing to y, get zero weight gradients, and are counted (Stats.Dropped).
//
// # Routing
//
// Selection uses the logits (softmax without bias) or score + bias; the bias
// (auxiliary-loss-free balancing, updated by UpdateBias: bias += γ·sign(mean load −
// load)) never enters the weights. With Groups > 1 only the TopKGroups groups of the
// largest top-2 sums are eligible (DeepSeek-V3). Weights are the chosen scores,
// renormalized to sum 1 if asked, times Scale. Ties go to the lower expert index and
// NaN choices count as −∞, on the CPU and the GPU alike. The optional load-balancing
// loss is α·E·Σ_e f_e·P_e (f_e: fraction of the T·K assignments routed to e, P_e: mean
// probability of e) and Backward includes its gradient. Routing.Load gives the tokens
// per expert of every step.
//
// With Config.EP the loss is that of the group's whole batch (every rank's tokens, T in
// all): f_e counts the assignments of all ranks (ep.Layout.GroupLoad, which comes with
// the count exchange that Layout makes anyway: no further communication or host
// synchronization), and P_e is the mean over all T tokens, to which each rank adds its
// own tokens' share (Routing.BalanceOver). Each rank's Stats.AuxLoss and gradients are
// its share: summed over the ranks (as the router's gradient is summed for data
// parallelism), they are the value and gradient of the one-device layer on the ranks'
// tokens together. Routing.Load stays the rank's own tokens' loads.
//
// # Permutation
//
// Sort is a stable counting sort on the device in three launches and no host
// synchronization: one warp per chunk of assignments counts them per expert; one
// block scans the counts into per-chunk ranks, per-expert sizes (capped by the
// capacity) and offsets; one warp per chunk walks its chunk in order and gives each
// assignment its row, __match_any_sync grouping the lanes of one expert so that ranks
// follow assignment order. Row (assignment → row) is the map back; Source is its
// inverse. Permute, Unpermute and their gradients are token-major: a token's row is
// read or written once, and sums run over k in a fixed order, so every result is
// deterministic (no floating-point atomics anywhere; split-k sums of the router GEMMs
// are reduced in a fixed order too).
//
// # Devices and streams
//
// Every op takes a *device.Stream and runs on its tensors' device: CUDA kernels
// (kernels/*.cu, compiled by NVRTC at first use) on a GPU, Go code on the CPU, which is
// also the tests' reference. Layer.Load compiles the programs a layer runs all at once,
// on every CPU core, before its first Forward. Nothing waits for the device except
// calls that say so: Stats, Permutation.DroppedCount, the Check of a Permutation's
// Status, and the count exchange of an expert-parallel Layout. Grads.W2Ready and
// W1Ready are events that Backward records on its stream as soon as it is done with
// each expert weight, so that an optimizer step of that weight on another stream can
// overlap the rest of the backward.
//
// # Expert parallelism and offloading
//
// Config.EP runs the experts over an ep.Group: ep's Layout, Dispatch and Combine
// replace Sort, Permute and Unpermute (their gradients CombineBackward and
// DispatchBackward), and each rank holds its E/R experts. Config.Offload hands the
// activations Backward needs (ActPermuted, ActWi, ActSwiGLU, ActWo and the shared
// expert's) to an offload.Offloader as soon as Forward is done with each; Backward
// prefetches them one ahead, and recomputes those the policy dropped. An FP8 layer's
// ActSwiGLU is two tensors under that name, its FP8 codes and their scales, and so is
// its ActPermuted with Config.EP (below).
//
// With Config.EP the layer runs work that does not need the rows in flight while ep
// moves them (ep's Overlap): the shared expert's forward, and in FP8 the quantization of
// W1 and W2, while x's rows are dispatched; the shared expert's backward while
// CombineBackward moves dy's rows; W1's weight gradient while DispatchBackward moves
// the rows of its input gradient back. Only the order of the work changes: the results
// are those of the layer run in the order of its data flow, bit for bit.
//
// # Precisions
//
// Config.Precision picks the arithmetic of the six routed-expert GEMMs. PrecisionBF16,
// the default, runs them in the parameters' dtype (bf16 or f32). The FP8 precisions,
// PrecisionBlockwise (DeepSeek-V3: E4M3 with an f32 scale per 1×128 block of an
// activation or gradient and per 128×128 block of a weight) and PrecisionMXFP8 (OCP MX:
// E4M3 with an E8M0 scale per 32 elements), quantize each operand with package quant
// right before its GEMM, which is gemm's FP8 form (RaggedDotBlockwise or RaggedDotMXFP8
// and their gradients), the incoming gradients dyp and dh once for their two GEMMs,
// rowwise and columnwise from one pass; SwiGLU writes its output a already quantized,
// in both forms from the pass that computes it (SwiGLUBlockwise, SwiGLUMXFP8), and the
// layer keeps the columnwise form for Backward instead of a:
//
//	h   = xp·W1     xp rowwise (x's rows quantized, then gathered or dispatched)
//	                                                W1 as KMajor (cached)
//	yp  = a·W2      a rowwise (from SwiGLU)         W2 as KMajor (cached)
//	da  = dyp·W2ᵀ   dyp rowwise                     W2 as NMajor (cached)
//	dW2 = aᵀ·dyp    a (kept from SwiGLU) and dyp columnwise, transposed, in token
//	                blocks that restart at each expert
//	dxp = dh·W1ᵀ    dh rowwise                      W1 as NMajor (cached)
//	dW1 = xpᵀ·dh    xp and dh columnwise, transposed, per expert
//
// The columnwise quantizations need group sizes that sum to the rows they cover: with
// Config.EP those are the kept rows; without, all rows, the unused rows of a capacity
// layer (zeros) counted in the last expert's group. The rowwise forms of a, dyp and dh
// cover the same rows (those of yp, da and dxp past the kept ones are zeros, as the
// GEMMs write them), with the same codes and scales as on their own. The fused SwiGLU
// computes a as SwiGLU does and rounds it to the activations' dtype before quantizing
// it, so the layer's results are bit for bit those of quantizing SwiGLU's output; the
// kept form, offloaded, or dropped and rebuilt from h by the same kernel, is too.
// Everything else is unchanged but for the permuted x (below): the router, the
// combine, the shared expert, the other activations kept for Backward
// (offloaded or recomputed as before; recomputation quantizes alike, so it rebuilds
// them bit for bit), and the parameters, gradients and optimizer in their own dtypes.
// The layer quantizes W1 and W2 once and reuses them while Params holds the same
// tensors: after changing them in place (each optimizer step) call
// Layer.InvalidateWeights, or the next steps silently use the old values. Against the
// bf16 layer on random data the outputs and gradients differ by about 6% (blockwise)
// and 7% (MXFP8) in relative Frobenius norm, the rounding of four to six E4M3 operands
// of about 2.6% each. Hidden and FFN must be multiples of 16.
//
// Without Config.EP an FP8 layer quantizes x's T rows and moves each token's codes and
// scales to its K expert rows for W1's GEMM (quant.GatherBlockwise, quant.GatherMXFP8),
// bit for bit the quantization of the permuted rows, instead of permuting x in bf16 and
// quantizing T·K rows; it keeps no permuted x, and Backward permutes x again for W1's
// weight gradient. With Config.EP it quantizes x's T rows likewise and dispatches the
// FP8 rows with their scales (ep's DispatchBlockwise or DispatchMXFP8, bit for bit the
// quantization of the rows a bf16 dispatch delivers, about half the bytes moved), and
// keeps them in FP8 as ActPermuted (redispatched when the policy drops them). W1's
// weight gradient then quantizes them columnwise from their dequantized values, as
// DeepSeek-V3 does: a second rounding to E4M3 that the one-device layer, which
// quantizes x, does not make. The blockwise recipe's gradient of W1 differs from the
// one-device layer's by about 4% in relative Frobenius norm on random data (within the
// recipe's error against bf16); MXFP8's power-of-two scales mostly requantize exactly.
//
// Activation bytes kept for Backward per token without offloading: K·(2H + 3F)
// elements of the parameters' dtype in bf16 (ActPermuted, ActWi, ActSwiGLU, ActWo).
// In FP8 without Config.EP, K·(H + 2F) elements (ActWi and ActWo, which Backward
// quantizes again; no ActPermuted) and K·33F/32 bytes: ActSwiGLU in FP8, one byte an
// element and F/32 bytes of scales a row (an f32 per 128 rows blockwise, an E8M0 per 32
// MXFP8), plus per step and expert at most one 128-row block of padding; with
// Config.EP also ActPermuted in FP8, K·33H/32 bytes (H bytes a row and its scales, an
// f32 per 128 columns blockwise or a byte per 32 MXFP8). Plus the shared expert's 3·Fs
// elements.
// With bf16 parameters at H=7168, F=2048, K=8 that is 320 KiB a token in bf16 and
// 192.5 KiB in FP8 (208 KiB with SwiGLU's output kept in bf16); offloading moves those
// bytes. Keeping ActWi and ActWo in FP8 too would about halve the FP8 figure again.
//
// # Cost
//
// Beside its six grouped GEMMs (6·T·K·H·F flops forward, twice that backward), a step
// makes five passes over an [T·K, H] tensor (Permute writes one, Unpermute reads one,
// UnpermuteGrad reads one and writes one, PermuteGrad reads one), moves 8·T·K·F
// elements in SwiGLU and its gradient, and runs the router's three T·H·E products on
// CUDA cores. At T=16384, H=7168, F=2048, E=32, K=8 in bf16 that is about 14 GB of
// traffic, some 4 ms on an H200, beside about 50 ms of expert GEMMs. An FP8 layer
// without Config.EP adds its quantizations, but writes neither Backward's dyp nor the
// permuted x its weight gradient reads: the quantizations compute them as they read dy
// and x (UnpermuteGrad's pass reads dy and the expert outputs alone, to the routing
// weights' gradient), which saves two [T·K, H] temporaries. BenchmarkLayer reports the
// time of each stage.
package moe
