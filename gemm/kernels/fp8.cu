#include "dl.cuh"

// Dequantization of FP8 operands to bf16, for the portable GPU path of the FP8 forms
// (RaggedDotBlockwise and RaggedDotMXFP8; then the bf16 ragged_dot runs on them): value =
// decode(q)·s in f32 (as package quant's dequantizations: one f32 product with a blockwise
// f32 scale, exact with an MXFP8 E8M0 scale), rounded to bf16. Layouts are package quant's
// (quant/blockwise.go, quant/mxfp8.go). Element loops are grid-stride; nothing here is
// tuned: the Hopper kernels are the fast path.

__device__ __forceinline__ float dl_fp8_value(u8 q, int e5m2) { return e5m2 ? dl_e5m2_to_f32(q) : dl_e4m3_to_f32(q); }

// Scale i of scales that are f32 (blockwise) or E8M0 codes (MXFP8: code e is 2^(e−127),
// 0 is 2^−127, 255 NaN).
__device__ __forceinline__ float dl_fp8_scale(const void *__restrict__ scale, i64 i, int e8m0) {
    return e8m0 ? dl_e8m0_to_f32(((const u8 *)scale)[i]) : ((const float *)scale)[i];
}

// The largest i in [0, n) with a[i] <= v, a non-decreasing and a[0] <= v.
__device__ __forceinline__ int dl_fp8_last_le(const int *a, int n, i64 v) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (a[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// dl_fp8_colt_group finds, for the token columns from p0 (within one 128-token tile) of a
// columnwise form, the group g that owns their tile, its size and i0, the first column's
// token within g; false when the plan is not valid or the columns are past every group's
// tiles. g is the largest group with tp[g] <= p0/128 (it has tiles, as tp[g+1] > p0/128).
__device__ __forceinline__ bool dl_fp8_colt_group(const int *plan, int G, i64 p0, int *g, int *size, i64 *i0) {
    if (!plan[0]) return false;
    const int *off = plan + 4, *tp = plan + 5 + G;
    const int t = (int)(p0 / 128);
    if (t >= tp[G]) return false;
    *g = dl_fp8_last_le(tp, G, t);
    *size = off[*g + 1] - off[*g];
    *i0 = p0 - (i64)tp[*g] * 128;
    return true;
}

// Plans, where a kernel takes one, are the gemm plan of the sizes with 128-row tiles and
// one column tile (kernels/gemm.cu): plan[0] valid, the groups' row offsets off[0..G] at
// plan[4] and their first 128-row tiles tp[0..G] at plan[5+G].

// Rowwise form: out[m][k] = q[m][k]·scale[(k/blk)·ks + row(m)·ms], q [M, K] (blockwise:
// blk 128, scales [ceil(K/128), ks], ms 1; MXFP8: blk 32, ks 1, scales [rows, ms]). Without
// a plan row(m) = m; with one (MXFP8 quantized in groups, whose scale rows are in the tile
// layout) row(m) = 128·tp[g] + m − off[g] for the group g that owns m, and rows that no
// group owns, or all rows when the plan is not valid, are left as they are.
extern "C" __global__ void dl_fp8_dequant_rows(const u8 *__restrict__ q, const void *__restrict__ scale, u16 *__restrict__ out, i64 M,
                                               i64 K, int blk, i64 ks, i64 ms, const int *__restrict__ plan, int G, int e8m0,
                                               int e5m2) {
    if (plan && !plan[0]) return;
    const int *off = plan ? plan + 4 : nullptr, *tp = plan ? plan + 5 + G : nullptr;
    const i64 n = M * K;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 m = i / K, k = i - m * K;
        i64 row = m;
        if (plan) {
            if (m >= off[G]) continue;
            const int g = dl_fp8_last_le(off, G, m); // the group owning m: off[g] <= m < off[g+1]
            row = 128 * (i64)tp[g] + m - off[g];
        }
        out[i] = dl_f32_to_bf16(dl_fp8_value(q[i], e5m2) * dl_fp8_scale(scale, (k / blk) * ks + row * ms, e8m0));
    }
}

// Blockwise weights: out[g][r][c] = q[g][r][c]·scales[g][kb][nb] with scales [G, sk, sn]
// and, for the [G, N, K] orientation (kmajor), kb = c/128 and nb = r/128, else kb = r/128
// and nb = c/128.
extern "C" __global__ void dl_fp8_dequant_weights(const u8 *__restrict__ q, const float *__restrict__ scales, u16 *__restrict__ out, i64 G,
                                                  i64 R, i64 C, i64 sk, i64 sn, int kmajor, int e5m2) {
    const i64 n = G * R * C;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i % C, r = (i / C) % R, g = i / (R * C);
        const i64 kb = kmajor ? c / 128 : r / 128, nb = kmajor ? r / 128 : c / 128;
        out[i] = dl_f32_to_bf16(dl_fp8_value(q[i], e5m2) * scales[(g * sk + kb) * sn + nb]);
    }
}

// MXFP8 weights, one orientation: q [G, R, C] with 1×32 blocks along C (the contraction:
// KMajor [G, N, K], NMajor [G, K, N]) and E8M0 scales [G, ceil(C/128), R, 4], the scale of
// element (g, r, c) at (g, c/128, r, (c/32)%4): out[g][r][c] = q[g][r][c]·2^(scale−127).
extern "C" __global__ void dl_mx_dequant_weights(const u8 *__restrict__ q, const u8 *__restrict__ scales, u16 *__restrict__ out, i64 G,
                                                 i64 R, i64 C, int e5m2) {
    const i64 n = G * R * C, cb = (C + 127) / 128;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i % C, r = (i / C) % R, g = i / (R * C);
        out[i] = dl_f32_to_bf16(dl_fp8_value(q[i], e5m2) * dl_e8m0_to_f32(scales[((g * cb + c / 128) * R + r) * 4 + (c / 32) % 4]));
    }
}

// Columnwise form of rows in groups, back to rows: colt [K, mp], with the scale of token
// column p, feature k at (p/blk)·ld + k (blockwise: blk 128, scales [mp/128, K], ld K;
// MXFP8: blk 32, scales [mp/32, ld]), gives out [M, K], row off[g]+i from token column
// 128·tp[g] + i (i < size of g). Rows no group owns are left as they are. Block (32, 8)
// handles a tile of 32 token columns × 32 features through shared memory, so that both
// the reads and the writes are coalesced; grid (mp/32, ceil(K/32)).
extern "C" __global__ void dl_fp8_dequant_colt(const u8 *__restrict__ colt, const void *__restrict__ scale, u16 *__restrict__ out,
                                               const int *__restrict__ plan, int G, i64 K, i64 mp, int blk, i64 ld, int e8m0,
                                               int e5m2) {
    __shared__ float tile[32][33];
    const i64 p0 = (i64)blockIdx.x * 32, k0 = (i64)blockIdx.y * 32;
    int g, size;
    i64 i0;
    if (!dl_fp8_colt_group(plan, G, p0, &g, &size, &i0)) return;
    const int *off = plan + 4;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const i64 k = k0 + j, p = p0 + threadIdx.x;
        tile[j][threadIdx.x] = k < K ? dl_fp8_value(colt[k * mp + p], e5m2) * dl_fp8_scale(scale, (p / blk) * ld + k, e8m0) : 0.f;
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const i64 i = i0 + j, k = k0 + threadIdx.x;
        if (i < size && k < K) out[((i64)off[g] + i) * K + k] = dl_f32_to_bf16(tile[threadIdx.x][j]);
    }
}

// The vector kernels below dequantize MXFP8 operands whose rows are multiples of 16 codes
// with 16-byte aligned codes and outputs (the shapes the Hopper kernels take): a thread
// decodes 16 codes of one 32-element block, which share one scale, from one 16-byte load
// into two 16-byte stores. Where the GPU has it (DL_FP8_CVT) cvt converts the codes two at
// a time (exact: every E4M3 and E5M2 value is an f16) and rounds the products to bf16 two
// at a time (exact but at the ends of bf16's range, as in the element kernels above,
// whose results they are bit for bit).

// dl_mx_dec2 returns codes c (two, in the low 16 bits) times s as two bf16 in one word,
// the first code in the low half.
__device__ __forceinline__ unsigned dl_mx_dec2(unsigned c, float s, int e5m2) {
#if DL_FP8_CVT
    unsigned h;
    const unsigned short c2 = (unsigned short)c;
    if (e5m2) asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(c2));
    else asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(c2));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h >> 16)));
    return dl_f32x2_to_bf16x2(lo * s, hi * s);
#else
    return (unsigned)dl_f32_to_bf16(dl_fp8_value((u8)c, e5m2) * s) |
           ((unsigned)dl_f32_to_bf16(dl_fp8_value((u8)(c >> 8), e5m2) * s) << 16);
#endif
}

// dl_mx_dec16 decodes the 16 codes of v times s into o[0..1] (8 bf16 each), in order.
__device__ __forceinline__ void dl_mx_dec16(uint4 v, float s, int e5m2, uint4 *o) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    unsigned r[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        r[2 * i] = dl_mx_dec2(w[i] & 0xffffu, s, e5m2);
        r[2 * i + 1] = dl_mx_dec2(w[i] >> 16, s, e5m2);
    }
    o[0] = make_uint4(r[0], r[1], r[2], r[3]);
    o[1] = make_uint4(r[4], r[5], r[6], r[7]);
}

// Rows of C codes (C a multiple of 16), rows [nrows, C], into out (BF16, the same shape),
// one row a block in a grid-stride loop. The scale of row i's 32-element block b is at
// base(i) + (b/4)·s4 + b%4: for activations (R = nrows, gstride 0, rstride the scales'
// row length, s4 4) base(i) = row(i)·rstride with row(i) as for dl_fp8_dequant_rows
// (with a plan, rows that no group owns are left as they are); for MXFP8 weights
// ([G, R, C] with scales [G, ceil(C/128), R, 4]: gstride ceil(C/128)·R·4, rstride 4,
// s4 4·R) base(i) = g·gstride + r·rstride for i = g·R + r.
extern "C" __global__ void dl_mx_dequant_rows16(const u8 *__restrict__ q, const u8 *__restrict__ scale, u16 *__restrict__ out, i64 nrows,
                                                i64 C, i64 R, i64 gstride, i64 rstride, i64 s4, const int *__restrict__ plan, int G,
                                                int e5m2) {
    if (plan && !plan[0]) return;
    const int *off = plan ? plan + 4 : nullptr, *tp = plan ? plan + 5 + G : nullptr;
    const i64 chunks = C / 16;
    for (i64 i = blockIdx.x; i < nrows; i += gridDim.x) {
        i64 base;
        if (plan) {
            if (i >= off[G]) return; // rows past the groups: this row and every later one
            const int g = dl_fp8_last_le(off, G, i);
            base = (128 * (i64)tp[g] + i - off[g]) * rstride;
        } else {
            const i64 g = i / R;
            base = g * gstride + (i - g * R) * rstride;
        }
        const uint4 *src = (const uint4 *)(q + i * C);
        uint4 *dst = (uint4 *)(out + i * C);
        for (i64 j = threadIdx.x; j < chunks; j += blockDim.x) {
            const i64 b = j >> 1;
            uint4 o[2];
            dl_mx_dec16(src[j], dl_e8m0_to_f32(scale[base + (b >> 2) * s4 + (b & 3)]), e5m2, o);
            dst[2 * j] = o[0];
            dst[2 * j + 1] = o[1];
        }
    }
}

// The transposed columnwise form colt [K, mp] (mp a multiple of 32, K of 16; the scale
// of token column p, feature k at (p/32)·ld + k) back to rows, as dl_fp8_dequant_colt:
// out [M, K] row off[g]+i from token column 128·tp[g] + i (i < size of g). A block of 256
// threads handles 64 token columns × 64 features: each thread decodes 16 token columns of
// one feature (one 16-byte load, one scale) into a shared tile, then writes 8 features of
// two token rows (16-byte stores). Grid (ceil(mp/64), ceil(K/64)).
extern "C" __global__ void __launch_bounds__(256) dl_mx_dequant_colt16(const u8 *__restrict__ colt, const u8 *__restrict__ scale,
                                                                       u16 *__restrict__ out, const int *__restrict__ plan, int G,
                                                                       i64 K, i64 mp, i64 ld, int e5m2) {
    __shared__ __align__(16) u16 tile[64][72]; // [token][feature], rows of 144 bytes
    const i64 p0 = (i64)blockIdx.x * 64, k0 = (i64)blockIdx.y * 64;
    int g, size;
    i64 i0;
    if (!dl_fp8_colt_group(plan, G, p0, &g, &size, &i0) || i0 >= size) return;
    const int *off = plan + 4;
    {
        const int kr = threadIdx.x >> 2, c = threadIdx.x & 3;
        const i64 k = k0 + kr, p = p0 + 16 * c;
        if (k < K && p < mp) {
            uint4 o[2];
            dl_mx_dec16(*(const uint4 *)(colt + k * mp + p), dl_e8m0_to_f32(scale[(p / 32) * ld + k]), e5m2, o);
            const u16 *v = (const u16 *)o;
#pragma unroll
            for (int j = 0; j < 16; j++) tile[16 * c + j][kr] = v[j];
        }
    }
    __syncthreads();
    for (int it = threadIdx.x; it < 512; it += 256) {
        const int r = it >> 3, cc = it & 7;
        const i64 i = i0 + r, k = k0 + 8 * cc;
        if (i < size && k < K) *(uint4 *)(out + ((i64)off[g] + i) * K + k) = *(const uint4 *)&tile[r][8 * cc];
    }
}

// Rows off[G] to M of out [M, C] (C a multiple of 8, 16-byte aligned) set to zero: the
// rows that no group owns, which the columnwise kernels leave as they are.
extern "C" __global__ void dl_mx_zero_tail(u16 *__restrict__ out, const int *__restrict__ plan, int G, i64 M, i64 C) {
    if (!plan[0]) return;
    const i64 start = (i64)plan[4 + G] * C / 8, n = M * C / 8;
    uint4 *o = (uint4 *)out;
    for (i64 e = start + (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) o[e] = make_uint4(0, 0, 0, 0);
}
