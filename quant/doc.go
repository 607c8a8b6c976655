// Package quant quantizes tensors to MXFP8 (OCP microscaling: 32-element blocks sharing
// an E8M0 scale, E4M3 or E5M2 elements), rowwise and columnwise in one pass, aware of
// expert groups, and dequantizes them back, on the CPU and on CUDA GPUs.
//
// The CPU path is the reference; the GPU kernels are bit-identical to it.
//
// # Rules
//
// A block holds 32 values V_i and is stored as a scale code c (2^(c−127), c in 0..254)
// and elements P_i = V_i·2^(127−c), computed exactly in float32 and rounded to nearest,
// ties to even, saturating to ±Max (448 for E4M3, 57344 for E5M2). The scale follows
// from the block's largest magnitude amax:
//
//   - RCEIL (default, Transformer Engine and cuBLAS): c is the E8M0 code of
//     amax·fp32(1/Max) rounded up to a power of two, saturating to 0..254. Then
//     amax/2^(c−127) lies in (Max/2, Max] and nothing clips.
//   - FLOOR (OCP MX v1.0): c = floor(log2 amax) + 127 − emax (emax 8 for E4M3, 15 for
//     E5M2), at least 0; elements above Max saturate (480 → 448).
//
// An all-zero block has code 0 and zero elements, the sign of −0 kept.
//
// Dequantizing multiplies back exactly in float32. Quantizing the result again gives
// the same values, and the same codes except in RCEIL blocks whose largest element is
// exactly Max/2 (±224 in E4M3): fp32(1/448)·224 rounds to exactly 1/2, so those come
// back one scale lower with doubled elements. A finite block whose largest magnitude
// is within a rounding step of float32's maximum may dequantize to ±Inf.
//
// # NaN and infinity
//
// NaN elements are left out of amax (as Transformer Engine does) and become the NaN
// code 0x7F, so they dequantize to NaN; the rest of their block is quantized as usual.
// An infinite amax gives code 254 under both rules: ±Inf elements saturate to ±Max and
// dequantize to ±Inf again (Max·2^127 overflows float32), while the finite elements of
// that block, scaled by 2^-127, mostly flush to zero. Quantize never writes the NaN
// scale 0xFF, and padding scales are 0, except that a quantization whose group sizes
// were invalid sets every element to 0x7F and every scale to 0xFF (see Options.Status).
//
// # Layouts
//
// Row holds the rowwise elements [M, K]; RowScale is [32·T, roundup(ceil(K/32), 4)]
// with the scale of row r, block b (columns [32b, 32b+32)) at (r, b). Col holds the
// columnwise elements in the source's order, [M, K] (not transposed); ColScale is
// [T, roundup(K, 128)] with the scale of rows [32i, 32i+32) of column j at (i, j).
// Without groups T = 4·ceil(M/128), so RowScale is [roundup(M, 128), roundup(K/32, 4)]
// and ColScale [roundup(M/32, 4), roundup(K, 128)]. Columnwise quantization of X is
// rowwise quantization of Xᵀ transposed: Col(X)ᵀ = Row(Xᵀ), ColScale(X)ᵀ = RowScale(Xᵀ).
//
// A K that is not a multiple of 32 ends each row with a short block, and an M that is
// not a multiple of 32 ends each column with one; missing values count as zeros in the
// scale and are not stored. Padding entries of the scale tensors are 0.
//
// With Options.Swizzle the scale tensors keep their shapes but their bytes follow the
// layout of block-scaled tensor cores: a matrix of R×C scales (R a multiple of 128, C of
// 4) is cut into 128×4 tiles of 512 bytes stored row-major by (r/128, c/4), and inside a
// tile scale (r, c) is at (r%32)·16 + ((r%128)/32)·4 + c%4. RowScale is that layout of
// its own matrix. ColScale is that layout of its transpose, the [roundup(K, 128),
// T] matrix of a [K, M] operand, so that swizzled ColScale(X) equals swizzled
// RowScale(Xᵀ).
//
// # Groups
//
// With Options.GroupSizes the M rows are G consecutive groups (the tokens of G experts)
// of sizes M_g, read on the device. Every output is the concatenation of what Quantize
// gives on each group alone: columnwise blocks restart at each group's first row (a
// group's last block may be short), group g's rowwise scales are RowScale rows
// [128·P_g, 128·P_g + roundup(M_g, 128)) and its columnwise scales ColScale rows
// [4·P_g, 4·P_g + roundup(ceil(M_g/32), 4)), swizzled as a tensor of their own, where
// P_g = Σ_{h<g} ceil(M_h/128). So that shapes do not depend on the sizes, T is the
// bound 4·(floor(M/128) + min(G, M)); scale rows after the last group are padding.
// Group sizes are checked on the device and invalid ones recorded in a device.Status:
// Options.Status, or the MXFP8's own Status.
//
// # Performance
//
// On a GPU one kernel reads the source once for both directions: a block of 128 threads
// loads a 32×256 tile with 16-byte loads, reduces rowwise blocks with warp shuffles and
// columnwise blocks through shared memory, and stores elements 8 bytes per thread. K a
// multiple of 32 and a 16-byte aligned source take that path; others take a general
// kernel. Grouped quantization adds a one-block kernel that turns the group sizes into
// tile descriptors; nothing waits for the host.
package quant
