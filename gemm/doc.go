// Package gemm computes ragged_dot, the grouped matrix product of dropless MoE layers:
// rows of x sorted by group (expert) are multiplied by their group's weight matrix, with
// group sizes held in a tensor on the device. Forward, input-gradient and weight-gradient
// forms run on the CPU and on CUDA GPUs.
//
// # Forms
//
// With G groups, sizes an I32[G] tensor and rows of x sorted by group (group g owns
// sizes[g] rows after those of groups 0..g-1):
//
//	RaggedDot:           y[M,N]  = x_g[·,K] · w[g]     for each group's rows
//	RaggedDotInputGrad:  dx[M,K] = dy_g[·,N] · w[g]ᵀ
//	RaggedDotWeightGrad: dw[g]   = x_gᵀ · dy_g        (dw[G,K,N]; Options.Accumulate adds)
//
// w is [G,K,N] (layout KN) or [G,N,K] (layout NK, PyTorch's Linear): a flag, not a
// copy. Operands are BF16 or F32 (both the same), outputs BF16 or F32, and products are
// summed in f32. Rows past sum(sizes) are written as zeros and contribute nothing to
// weight gradients; the weight gradient of an empty group is exactly zero. Any M, K,
// N ≥ 0 work; K and N multiples of 8, with 16-byte aligned tensors, save the padded
// copies of unaligned shapes on the H100 and H200 (see Unaligned shapes).
//
// # Sizes stay on the device
//
// A GPU call enqueues its kernels on its stream and returns (its small workspace comes
// from the stream-ordered pool and is freed in stream order). First a one-block plan
// kernel reads the sizes, checks them and writes the group offsets and the tile
// schedule into the workspace; then one GEMM kernel finds each tile's group from them.
// The Hopper kernels of the forward and input-gradient forms put a third kernel
// between the two, which zeroes the rows past sum(sizes) and the tile counter of the
// GEMM's schedule: those calls enqueue three kernels, the others two (only the plan
// when the output is empty), plus the fills and copies of padded calls (see Unaligned
// shapes). Nothing is copied to the host and nothing waits, so a call can be captured
// in a Graph.
// Invalid sizes (a negative size, or a sum past M) cannot then be returned as errors:
// the kernels record them in a device.Status and write nothing. Pass Options.Status, or check
// the device's own status with CheckStatus (and clear it with ResetStatus). On the CPU
// a call returns the error at once; a CPU call replayed from a Graph records it like a
// GPU call.
//
// # Aliasing
//
// The output (y, dx or dw) must not overlap any input (x, w, dy or sizes): the result
// would be undefined. With Options.Accumulate dw is read as well as written. The inputs,
// which are only read, may overlap one another.
//
// # Kernels
//
// The GEMM kernel is, in order of preference:
//
//   - On the H100 and H200 (sm_90 with NVRTC that targets sm_90a), for bf16 operands
//     with K and N multiples of 8, at most 1024 groups and 16-byte aligned operands:
//     the Hopper kernels of gemm/internal/hopper, persistent and warp-specialized. One
//     producer warp loads the operands of 128×256 output tiles by TMA into a
//     shared-memory ring of 4 stages (3 in the weight gradient that stages its
//     stores), and two consumer warpgroups run wgmma m64n256k16 on them with f32
//     accumulators. The forward deals tile positions round-robin, spreading the tiles
//     of short groups among the others, and its CTAs claim the last rounds of tiles
//     from a per-call counter (every round when the largest group is more than twice
//     the mean); the tiles of a last, part-filled round are split along the
//     contraction, their f32 partial sums added in a fixed order, so that a call's
//     result is the same on every run. Where the output has 32 or more column tiles,
//     the forward's TMA loads carry L2 hints: the rows, read again for every round of
//     column tiles, evict last, and the weight tiles evict first. The weight gradient contracts over each group's rows
//     (ragged K). bf16 calls that fit them but for the alignment of their rows or
//     pointers run on them through padded copies (see Unaligned shapes).
//     DROPLESS_GEMM_KERNEL=mma, read when the package is initialized, turns them off.
//   - For the other bf16 calls (other GPUs, other shapes): mma.sync m16n8k16 with f32
//     accumulators, fed by ldmatrix from a 4-stage cp.async shared-memory ring, 128×256
//     block tiles of 8 warps (in the forward and input gradient, 32×128 tiles of 4
//     warps when groups average fewer than 96 rows, so that each weight byte is read
//     about once). Tiles of a group are ordered row-tile fastest, so that blocks
//     sharing a weight tile run together; each block runs its tiles through one
//     pipeline, loading the next tile while it finishes the last, and skips the
//     tensor-core work of rows past its group's end 16 rows at a time. Unaligned
//     shapes (K or N not a multiple of 8, or unaligned views) take element loads
//     instead of 16-byte copies: several times slower.
//   - For f32 operands: an exact f32 FMA kernel, 64×64 block tiles.
//
// Results are deterministic: each output element is summed in a fixed order, with no
// split-K atomics. The kernels need compute capability 8.0 or newer.
//
// On the CPU each group is one gonum Sgemm on f32 copies of the operands, groups in
// parallel. It is the reference the GPU path is tested against.
//
// # Unaligned shapes
//
// The Hopper kernels read their operands by TMA, whose rows must be multiples of 16
// bytes, from 16-byte aligned addresses. A bf16 call on the H100 or H200 with K or N not
// a multiple of 8, or with a tensor that is not 16-byte aligned (a view at an odd
// offset), and otherwise fit for them (1 to 1024 groups, M, K, N ≥ 1) runs them on
// padded copies: K and N are rounded up to multiples of 8, K8 and N8, and each operand
// that the kernels cannot read as it is (its rows longer once padded, or unaligned) is
// copied by device.CopyRects into a temporary of the padded shape, allocated in stream
// order on the call's stream and freed there after the call:
//
//	RaggedDot:           x8[M,K8], w8[G,K8,N8], y8[M,N8]
//	RaggedDotInputGrad:  dy8[M,N8], w8[G,K8,N8], dx8[M,K8]
//	RaggedDotWeightGrad: x8[M,K8], dy8[M,N8], dw8[G,K8,N8]
//
// (w8 and dw8 as [G,N8,K8] in layout NK; x needs its copy when K is not a multiple of 8
// or x is unaligned, w when K or N is not or w is, and so on). The copies take at most
// 2·M·K8 + 2·G·K8·N8 + e·M·N8 bytes for RaggedDot, 2·M·N8 + 2·G·K8·N8 + e·M·K8 for
// RaggedDotInputGrad and 2·M·K8 + 2·M·N8 + e·G·K8·N8 for RaggedDotWeightGrad, e being
// the output's element size (2 for bf16, 4 for f32). The padding of the contracted
// dimension (K in the forward, N in the input gradient) is zeroed, so it adds nothing to
// the products; the rest of the padding only makes output elements that are not copied
// back. The output's copy starts as a copy of the output (so that Options.Accumulate
// adds to dw, and invalid sizes still leave the output as it was); after the GEMM its
// real elements are copied back, rows past the groups as zeros. The copies cost memory
// traffic (each padded input read once and written once, or twice where its padding is
// zeroed first; the output read and written twice) and up to six more kernel launches;
// BenchmarkRaggedDotUnaligned measures them. When the copies' memory cannot be had
// (CUDA_ERROR_OUT_OF_MEMORY), the call runs the portable kernels instead, with no extra
// memory; other allocation errors are returned.
//
// # Blockwise FP8
//
// RaggedDotBlockwise, RaggedDotBlockwiseInputGrad and RaggedDotBlockwiseWeightGrad are
// the three forms on FP8 operands quantized by package quant in DeepSeek-V3's blockwise
// recipe: activations and gradients in 1×128 blocks along the contracted dimension
// (quant.Blockwise: Row for the forward's x and the input gradient's dy, ColT, whose
// 128-token blocks restart at each group, for the weight gradient's x and dy), weights in
// 128×128 blocks (quant.BlockwiseWeights, KMajor for the forward, NMajor for the input
// gradient, one set of scales). Elements are E4M3 or E5M2, each operand its own; each
// block's partial sum is scaled by its two blocks' f32 scales and summed in f32. Outputs,
// sizes, Status records (which name the blockwise form), graphs and determinism are as for
// the bf16 forms.
//
// On the CPU the operands are dequantized exactly as package quant documents (decode(q)·s,
// one f32 product) and the f32 CPU path runs on them: the reference of the GPU. On the H100
// and H200 (sm_90 with NVRTC that targets sm_90a), for K and N multiples of 16, 1 to 1024
// groups and 16-byte aligned tensors, the kernels of gemm/internal/hopper run: persistent
// and warp-specialized like the bf16 ones, one producer warp loading 128×128 FP8 tiles of
// both operands (K-major, 128-byte swizzle) and their scales by TMA into a 6-stage ring,
// one 128-deep scale block per stage, and two consumer warpgroups running wgmma
// m64n128k32 on 64 rows each into a partial accumulator that they promote, after each
// stage, into an f32 total with the blocks' scales (as DeepSeek-V3 does: Hopper's FP8
// tensor cores keep fewer bits than f32 over long sums). The forward and input gradient
// deal the groups' 128-row tiles as the bf16 forward does and zero the rows past the
// groups first; the weight gradient contracts over each group's token blocks. Elsewhere
// (other GPUs, other shapes, DROPLESS_GEMM_KERNEL=mma) a portable path dequantizes the
// operands into bf16 temporaries and runs the bf16 form on them: correct everywhere, but
// slow, and it needs the memory of the bf16 operands.
//
// # MXFP8
//
// RaggedDotMXFP8, RaggedDotMXFP8InputGrad and RaggedDotMXFP8WeightGrad are the three forms
// on MXFP8 operands (OCP MX, package quant: E4M3 or E5M2 elements with one E8M0 scale, a
// power of two, per 32 elements along the contracted dimension). Activations and gradients
// are a quant.MXFP8: its Row and RowScale for the forward's x and the input gradient's dy,
// quantized without groups or in the groups of the sizes (their scale rows then follow the
// groups' tile layout, and the operand's Groups must be G); its ColT and ColScale
// (Options.Transpose: the columnwise data transposed, 32-token blocks that restart at each
// group) for the weight gradient's x and dy, quantized in the groups of the sizes. So one
// quantization of x and one of dy, Dir Both with Transpose and the sizes as GroupSizes,
// serve all three forms. Weights are a quant.MXFP8Weights quantized along K for the forward
// (KMajor, KScale) and along N for the input gradient (NMajor, NScale): the transpose of a
// 1×32 block is not a block, so each orientation has its own scales. Scales must be
// unswizzled. Each 32-element block's partial sum is scaled by its two blocks' scales and
// summed in f32. Outputs, sizes, Status records (which name the MXFP8 form), graphs and
// determinism are as for the bf16 forms.
//
// On the CPU the operands are dequantized exactly (decode(q)·2^(e−127) is exact in f32) as
// package quant does and the f32 CPU path runs on them: the reference of the GPU. On an
// H100 or H200, where K and N are multiples of 16 and the tensors 16-byte aligned, a call
// runs one of two ways, chosen per call from its shape: the Hopper MXFP8 kernels (FP8
// tensor cores, each 32-element block's partial sums scaled and summed in f32 on the CUDA
// cores, which bounds them at about 350 TFLOP/s), or its operands dequantized into bf16
// temporaries and the Hopper bf16 kernels (about 600 TFLOP/s on the DeepSeek-V3 and
// Mixtral shapes, every weight gradient at 1.8–2.6× the MXFP8 kernels). Dequantizing is
// exact (E4M3 and E5M2 values times a power of two are bf16 numbers, but for values past
// bf16's normal range at the scales' extremes), so both ways sum the same exact products
// in f32. The choice estimates the dequantization's bytes against the product's FLOPs:
// calls bound by reading the weights (few rows a group) keep the MXFP8 kernels. The bf16
// way needs temporaries of the bf16 operands: 2·M·K + 2·G·K·N bytes for the forward (K
// and N swapped for the input gradient), 2·M·(K+N) for the weight gradient; where they do
// not fit in the device's memory the call runs on the MXFP8 kernels.
// DROPLESS_MXFP8_PATH=wgmma or bf16 forces one way, for comparisons. Other GPUs take the
// bf16 way with their bf16 kernels.
package gemm
