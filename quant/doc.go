// Package quant quantizes tensors to MXFP8 (OCP microscaling: 32-element blocks sharing
// an E8M0 scale, E4M3 or E5M2 elements), rowwise and columnwise in one pass, aware of
// expert groups, with the columnwise data optionally transposed, and expert weights in
// both orientations; and dequantizes them back, on the CPU and on CUDA GPUs.
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
// With Options.Transpose the columnwise data is stored transposed instead, as ColT
// [K, 32·T], the K-major operand that Hopper's FP8 GEMMs (wgmma reads both operands
// K-major) contract over tokens in the weight gradient: token column p = 32t + i is row
// i of tile t, so ColT[k][32t + i] = Col[row0_t + i][k], the element of column k in
// the block whose scale is ColScale (t, k), which does not change (plain or swizzled).
// Without groups row(p) = p. Columns of rows a tile lacks (past M, or past a group's
// last row) are code 0.
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
// Options.Status, or the MXFP8's own Status. In ColT group g's rows are the columns
// [128·P_g, 128·P_g + M_g), and its columns up to 128·P_g + roundup(M_g, 128) padding.
// Dequantize recovers rows from the tile descriptors of the last quantization.
//
// # MXFP8 weights
//
// QuantizeMXFP8Weights quantizes expert weights w [G, K, N] (or [G, N, K], PyTorch's
// Linear layout, with Options.NK) into both orientations the GEMMs read, from one read
// of w. A 1×32 block's transpose is not a block, so each orientation has scales of its
// own: KMajor, Format [G, N, K] in 1×32 blocks along K (the forward, y = x·w_g), with
// KScale, E8M0 [G, ceil(K/128), N, 4], the scale of w_g[k][n]'s block at
// (g, k/128, n, (k/32)%4); and NMajor, Format [G, K, N] in blocks along N (the input
// gradient, dx = dy·w_gᵀ), with NScale [G, ceil(N/128), K, 4], the scale at
// (g, n/128, k, (n/32)%4). The scales of a 128-deep step of 128 output columns are then
// 512 contiguous bytes. Every block follows the rules above, as a rowwise block of
// Quantize: KMajor holds Quantize's Row of the rows of w_gᵀ, NMajor that of the rows of
// w_g. K and N must be multiples of 16; a last block of 16 is short. Slots of blocks
// past K or N in the last 128 are 0, as every padding scale.
//
// # Performance
//
// On a GPU one kernel reads the source once for both directions: a block of 128 threads
// loads a 32×256 tile with 16-byte loads, reduces rowwise blocks with warp shuffles and
// columnwise blocks through shared memory, and stores elements 8 bytes per thread. With
// Transpose the columnwise elements go through a shared 256×32-byte tile (its 8-byte
// chunks XOR-swizzled so that neither side conflicts) and leave as ColT's 32-byte
// pieces, 16 bytes per thread, each warp writing 16 whole pieces. K a multiple of 32 and
// a 16-byte aligned source take that path; others take a general kernel (with
// Transpose, each thread writes its column's 32 codes at once). Grouped quantization
// adds a one-block kernel that turns the group sizes into tile descriptors; nothing
// waits for the host.
//
// The MXFP8 weights take one kernel of the same 32×256 tiles of w_g: the rowwise blocks
// of the tile make the orientation of w's own layout (row-major, 8 bytes per thread and
// row, the scales of a tile gathered in shared memory and stored as two 128-byte runs),
// its columnwise blocks the transposed one, through the shared tile.
//
// # Blockwise FP8
//
// QuantizeBlockwise and QuantizeWeights make the operands of DeepSeek-V3's recipe, which
// Hopper's FP8 GEMMs use (they apply the scales themselves): activations and gradients
// x [M, K] in 1×128 blocks along K, expert weights in 128×128 blocks, one float32 scale
// per block, E4M3 or E5M2 elements.
//
// A block's scale s follows from its largest magnitude amax (NaN left out; values outside
// the tensor count as 0), in float32 with IEEE divisions rounded to nearest even:
//
//   - ScaleF32 (the default): s = amax/Max.
//   - ScalePow2 (UE8M0, as DeepSeek-V3.1 and DeepGEMM): s is the smallest power of two
//     ≥ amax/Max (its bits with the mantissa cleared, the exponent raised by one when the
//     mantissa was not zero), clamped to [2^-126, 2^127].
//
// An all-zero block has s = 1, as has under ScaleF32 a block whose amax/Max underflows
// to 0 (amax ≤ Max·2^-150); an infinite amax gives s = +Inf. An element is
// encode(v/s): the float32 quotient, rounded to nearest even and saturated to ±Max, NaN
// to the NaN code 0x7F, the sign of −0 kept. Dequantizing gives decode(q)·s, one float32
// product, NaN as the quiet NaN. In a block of scale +Inf finite values become zeros and
// ±Inf the NaN code, and every element dequantizes to NaN: NaN and Inf stay within their
// block.
//
// A Blockwise holds, as BlockOptions.Dir says:
//
//   - Row, Format [M, K], blocks along each row (the last one of a row may be short), and
//     RowScale, F32 [ceil(K/128), roundup(M, 4)], the scale of row m, block b at (b, m):
//     the 128 scales of a tile of rows are contiguous. Padding entries are 0.
//   - ColT, Format [K, Mp], the transposed form that the weight gradient (contracting
//     over rows) reads: ColT[k][p] is x[row(p)][k] quantized in blocks of 128 along p,
//     and ColTScale, F32 [Mp/128, K], the scale of column k, block t at (t, k). Without
//     groups row(p) = p and Mp = roundup(M, 128).
//
// With BlockOptions.GroupSizes (G groups of sizes M_g, read on the device) the blocks of
// ColT restart at each group: group g's rows start at column 128·P_g,
// P_g = Σ_{h<g} ceil(M_h/128), so that ColT of a group is the Row of the group's rows
// transposed, and Mp = 128·(floor(M/128) + min(G, M)), a bound that does not depend on
// the sizes. Padding columns and the scales of padding blocks are 0. Row does not depend
// on the groups. Invalid sizes (a negative one, or a sum other than M) are recorded in
// BlockOptions.Status or the Blockwise's own Status ("quant: QuantizeBlockwise: sizes
// sum to 70 > M=64"); Row is then as always and ColT holds the ungrouped blocks.
//
// BlockwiseWeights, from w [G, K, N] (or [G, N, K], PyTorch's Linear layout, with
// BlockOptions.NK), hold both orientations of the GEMMs' operands from one read of w:
// KMajor, Format [G, N, K] (the forward, y = x·w_g), and NMajor, Format [G, K, N] (the
// input gradient, dx = dy·w_gᵀ), sharing Scales, F32 [G, ceil(K/128), ceil(N/128)]. K and
// N must be multiples of 16, so that FP8 rows are whole 16-byte units.
//
// On a GPU one kernel reads the source once for all outputs: a block of 256 threads loads
// a 128×128 tile with 16-byte loads (K a multiple of 8 and a 16-byte aligned source;
// others load element by element), reduces rowwise blocks with warp shuffles and
// columnwise (or whole weight) blocks through shared memory, stores row-major elements 8
// bytes per thread and transposed ones through a swizzled shared tile, 16 bytes per
// thread in whole 128-byte rows. Quotients by power-of-two scales are exact products;
// those by float32 scales are a reciprocal refined twice with fused multiply-adds, the
// correctly rounded quotient where it matters for the codes. Grouped quantization adds a
// one-block kernel that turns the sizes into token-block descriptors on the device;
// nothing waits for the host.
//
// # Sources
//
// QuantizeSource and QuantizeBlockwiseSource quantize a Source instead of a tensor: an
// M×K matrix whose values the quantization computes as it reads them, such as an
// elementwise function of other tensors, given as Go code for the CPU and as a loader
// type of the caller's CUDA program for GPUs. That program includes the package's
// Headers and instantiates the quantization kernels for its loader (the package's own
// tensor kernels are the same templates instantiated for tensors), so the source is
// read, computed, rounded to its dtype and quantized in one pass, and never written:
// bit for bit what quantizing the tensor that would hold its values gives. moe's
// SwiGLUBlockwise and SwiGLUMXFP8 quantize the SwiGLU of an MoE layer's projections so.
//
// # Gathers
//
// GatherBlockwise and GatherMXFP8 move rowwise-quantized rows, codes and scales, to the
// rows an index picks (copies of each source row numbered i·per + j; -1 gives a zero
// row), as a MoE layer moves each token's row to the rows of its experts: quantize the T
// tokens once, then gather, instead of quantizing the T·K moved rows. A rowwise block
// depends on its own row alone, so the result is bit for bit the quantization of the
// gathered source rows. Entries out of range give zero rows and are recorded in the
// Status passed. On a GPU one block of 128 threads copies each destination row, 16 bytes
// a thread and step when K is a multiple of 16.
package quant
