// Blockwise FP8 kernels of package quant: activations and gradients in 1x128 blocks
// (Row) and their transposed, token-blocked form (ColT) from one read of a bf16 or f32
// [M, K] source, grouped or not; weights in 128x128 blocks in both orientations from
// one read; and the inverses. Every kernel is bit-identical to the Go reference in
// quant/blockwise_cpu.go; quant/doc.go gives the rules and layouts.
//
// A kernel block of 256 threads works on a tile of 128 source rows by 128 columns.
// Thread (c, j) = (tid % 16, tid / 16) holds the 8x8 sub-tile of rows 8j..8j+7 and
// columns 8c..8c+7, loaded 16 bytes per row (a half-warp reads 256 contiguous bytes of
// bf16). Rowwise blocks are reduced across the 16 threads of a row with shuffles;
// columnwise ones through shared memory. Row-major outputs are stored 8 bytes per
// thread row, coalesced; transposed outputs go through a 128x128-byte shared tile
// (8-byte chunks XOR-swizzled, so that neither side conflicts) and leave 16 bytes per
// thread, each warp writing four full 128-byte rows.
//
// Activation tiles are the token blocks of ColT: tile t covers source rows
// [row0, row0 + n) (n <= 128; n == 0 for padding blocks), described by tiles[t] = {row0, n}
// when grouped, else computed (row0 = 128t).
#include "dl.cuh"

// DL_BW_HW_CVT selects the element conversion: 1 (the default) uses the instruction
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 of sm_89 and later, 0 dl_f32_to_e4m3 /
// dl_f32_to_e5m2 of dtype.cuh. Both round to nearest even, saturate to +-max (infinities
// included) and keep the sign of zero; their operand is the result of an arithmetic
// instruction, so a NaN is the canonical 0x7FFFFFFF, which both turn into 0x7F.
#ifndef DL_BW_HW_CVT
#define DL_BW_HW_CVT 1
#endif

#define DL_BW_E4M3 0
#define DL_BW_E5M2 1
#define DL_BW_THREADS 256

// The smallest float32 scale (2^-80) that takes the fused quotient of dl_bw_quo.
#define DL_BW_FUSED_MIN 0x17800000u

// dl_bw_pack2 returns the codes of a (bits 0-7) and b (bits 8-15).
template <int FMT>
__device__ __forceinline__ u32 dl_bw_pack2(float a, float b)
{
#if DL_BW_HW_CVT && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
    unsigned short h;
    // The first source operand lands in the upper byte.
    if (FMT == DL_BW_E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(b), "f"(a));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(b), "f"(a));
    }
    return (u32)h;
#else
    const u32 lo = FMT == DL_BW_E5M2 ? dl_f32_to_e5m2(a) : dl_f32_to_e4m3(a);
    const u32 hi = FMT == DL_BW_E5M2 ? dl_f32_to_e5m2(b) : dl_f32_to_e4m3(b);
    return lo | hi << 8;
#endif
}

// dl_bw_scale is blockScale: the scale of a block of largest magnitude amax (>= 0, NaN
// left out). amax == 0 gives 1, +Inf gives +Inf; else f = amax/fmax (rounded), and f
// itself (1 where it underflows to 0), or with pow2 the smallest power of two >= f,
// clamped to [2^-126, 2^127].
__device__ __forceinline__ float dl_bw_scale(float amax, float fmax, int pow2)
{
    if (amax == 0.f) {
        return 1.f;
    }
    if (__float_as_uint(amax) == 0x7f800000u) {
        return amax;
    }
    const float f = __fdiv_rn(amax, fmax);
    if (!pow2) {
        return f == 0.f ? 1.f : f;
    }
    const u32 b = __float_as_uint(f);
    u32 e = (b >> 23) + ((b & 0x7fffffu) != 0u ? 1u : 0u);
    e = e < 1u ? 1u : (e > 254u ? 254u : e);
    return __uint_as_float(e << 23);
}

// DlBwDiv is a block's divisor: its scale s, y = 1/s rounded to nearest, and how v/s is
// computed, always rounded to nearest even as one IEEE division:
//   0: v*y, exact as s is a power of two or +Inf (y exact: 2^-127 is a subnormal; 0);
//   1: v*y refined twice by q += (v - s*q)*y with fused multiply-adds (Markstein: from a
//      faithful q the refinement is the correctly rounded quotient), for float32 scales
//      in [2^-80, 2^120]: their y is normal and the residuals exact unless the quotient
//      is far below E5M2's smallest subnormal, where both encode to the same signed zero;
//   2: the IEEE division, for the rest (tiny float32 scales and +Inf).
struct DlBwDiv {
    float s, y;
    int how;
};

__device__ __forceinline__ DlBwDiv dl_bw_div(float s, float y, int pow2)
{
    DlBwDiv d;
    d.s = s;
    d.y = y;
    const u32 b = __float_as_uint(s);
    d.how = pow2 ? 0 : (b >= DL_BW_FUSED_MIN && b < 0x7f800000u ? 1 : 2);
    return d;
}

// dl_bw_enc8 returns the codes of f[0..7]/d.s, f[0] in the lowest byte.
template <int FMT>
__device__ __forceinline__ uint2 dl_bw_enc8(const float f[8], const DlBwDiv &d)
{
    float q[8];
    if (d.how == 0) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[e] = __fmul_rn(f[e], d.y);
        }
    } else if (d.how == 1) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float v = __fmul_rn(f[e], d.y);
            v = fmaf(-fmaf(d.s, v, -f[e]), d.y, v);
            q[e] = fmaf(-fmaf(d.s, v, -f[e]), d.y, v);
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[e] = __fdiv_rn(f[e], d.s);
        }
    }
    uint2 o;
    o.x = dl_bw_pack2<FMT>(q[0], q[1]) | dl_bw_pack2<FMT>(q[2], q[3]) << 16;
    o.y = dl_bw_pack2<FMT>(q[4], q[5]) | dl_bw_pack2<FMT>(q[6], q[7]) << 16;
    return o;
}

// DlBwSrc holds a thread's 8x8 source sub-tile: row i in w[i][0..W-1] (bf16: one uint4
// of 8 halves; f32: two uint4 of 4 floats), missing values as +0.
template <typename In>
struct DlBwSrc;

template <>
struct DlBwSrc<u16> {
    enum { W = 1 };
    uint4 w[8][1];
    __device__ __forceinline__ float at(int i, int e) const
    {
        const uint4 v = w[i][0];
        const u32 h = e < 2 ? v.x : (e < 4 ? v.y : (e < 6 ? v.z : v.w));
        return __uint_as_float((e & 1) ? (h & 0xffff0000u) : (h << 16));
    }
    // load sets row i from p: 8 values with vector loads, else the first n (< 8 or
    // unaligned) one by one.
    template <bool VEC>
    __device__ __forceinline__ void load(int i, const u16 *p, int n)
    {
        if (VEC && n >= 8) {
            w[i][0] = __ldcs((const uint4 *)p);
            return;
        }
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            h[e] = e < n ? (u32)p[e] : 0u;
        }
        w[i][0] = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
};

template <>
struct DlBwSrc<float> {
    enum { W = 2 };
    uint4 w[8][2];
    __device__ __forceinline__ float at(int i, int e) const
    {
        const uint4 v = w[i][e >> 2];
        const int k = e & 3;
        return __uint_as_float(k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w)));
    }
    template <bool VEC>
    __device__ __forceinline__ void load(int i, const float *p, int n)
    {
        if (VEC && n >= 8) {
            w[i][0] = __ldcs((const uint4 *)p);
            w[i][1] = __ldcs((const uint4 *)(p + 4));
            return;
        }
        u32 b[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            b[e] = e < n ? __float_as_uint(p[e]) : 0u;
        }
        w[i][0] = make_uint4(b[0], b[1], b[2], b[3]);
        w[i][1] = make_uint4(b[4], b[5], b[6], b[7]);
    }
};

// dl_bw_row / dl_bw_col gather row i or column e of a sub-tile.
template <typename In>
__device__ __forceinline__ void dl_bw_row(const DlBwSrc<In> &x, int i, float f[8])
{
#pragma unroll
    for (int e = 0; e < 8; e++) {
        f[e] = x.at(i, e);
    }
}
template <typename In>
__device__ __forceinline__ void dl_bw_col(const DlBwSrc<In> &x, int e, float f[8])
{
#pragma unroll
    for (int i = 0; i < 8; i++) {
        f[i] = x.at(i, e);
    }
}

__device__ __forceinline__ float dl_bw_amax8(const float f[8])
{
    float a = 0.f;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        a = fmaxf(a, fabsf(f[e])); // fmaxf leaves NaN out
    }
    return a;
}

// dl_bw_put8 stores the 8 codes of o at p, the first n of them (all with VEC and n >= 8,
// p 8-byte aligned).
template <bool VEC>
__device__ __forceinline__ void dl_bw_put8(u8 *p, uint2 o, int n)
{
    if (VEC && n >= 8) {
        __stcs((uint2 *)p, o);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        if (e < n) {
            p[e] = (u8)((e < 4 ? o.x : o.y) >> (8 * (e & 3)));
        }
    }
}

// The shared tile of transposed codes: row k holds 128 bytes, 8-byte chunk q of row k at
// chunk q ^ (k / 8). A thread (c, j) puts its column 8c+e (rows 8j..8j+7) at chunk
// j ^ c, so a half-warp hits 16 distinct chunks; 16-byte reads of chunks (2h, 2h+1) find
// them in the pair h ^ (k / 16), swapped when k / 8 is odd.
struct DlBwTr {
    __align__(16) u8 b[128][128];
    __device__ __forceinline__ void put(int k, int j, uint2 o) { *(uint2 *)&b[k][8 * (j ^ (k >> 3))] = o; }
    __device__ __forceinline__ uint2 get(int k, int j) const { return *(const uint2 *)&b[k][8 * (j ^ (k >> 3))]; }
    __device__ __forceinline__ uint4 get16(int k, int h) const
    {
        const uint4 v = *(const uint4 *)&b[k][16 * (h ^ (k >> 4))];
        return ((k >> 3) & 1) ? make_uint4(v.z, v.w, v.x, v.y) : v;
    }
    __device__ __forceinline__ void put16(int k, int h, uint4 v)
    {
        *(uint4 *)&b[k][16 * (h ^ (k >> 4))] = ((k >> 3) & 1) ? make_uint4(v.z, v.w, v.x, v.y) : v;
    }
};

// dl_bw_trans_store writes the shared tile to out, whose row k (k < nk) starts at
// out + k*ld: 16 bytes h (16h < nb) of each. With zero, it writes zeros instead.
__device__ __forceinline__ void dl_bw_trans_store(const DlBwTr &tr, u8 *out, u64 ld, int nk, int nb, bool zero)
{
#pragma unroll
    for (int rep = 0; rep < 4; rep++) {
        const int idx = (int)threadIdx.x + DL_BW_THREADS * rep;
        const int k = idx >> 3, h = idx & 7;
        if (k < nk && 16 * h < nb) {
            __stcs((uint4 *)(out + (u64)k * ld + 16 * h), zero ? make_uint4(0u, 0u, 0u, 0u) : tr.get16(k, h));
        }
    }
}

// The arguments of the activation kernels, quant's bwQuantArgs.
struct DlBwArgs {
    const void *x;
    u8 *row;
    float *rs;
    u8 *colt;
    float *cs;
    const int2 *tiles;
    int M, K, Mr, Mp, ntiles, ncolt;
    float fmax;
    int pow2;
};

// dl_bw_tile returns tile t's {row0, n}: tiles[t], or without tiles the ungrouped block
// t; a descriptor out of [0, M] counts as padding.
__device__ __forceinline__ int2 dl_bw_tile(const int2 *tiles, int t, int M)
{
    if (tiles == 0) {
        const int n = M - 128 * t;
        return make_int2(128 * t, n > 128 ? 128 : (n < 0 ? 0 : n));
    }
    const int2 d = tiles[t];
    if (d.x < 0 || d.y < 0 || d.y > 128 || d.x > M - d.y) {
        return make_int2(0, 0);
    }
    return d;
}

struct DlBwSmem {
    float part[16][128]; // column maxima of the 16 row groups
    float rsc[128];      // the tile's row scales
    float csc[128], cy[128]; // the column scales and their reciprocals
    DlBwTr tr;
};

// Quantization of an activation tile: Row, RowScale, ColT and ColTScale as ROW and COL
// say. VEC: K % 8 == 0 and x 16-byte aligned.
template <typename In, int FMT, bool ROW, bool COL, bool VEC>
__device__ __forceinline__ void dl_bw_quant(const DlBwArgs &a)
{
    __shared__ DlBwSmem sm;
    const int t = (int)(blockIdx.x / (u32)a.ncolt);
    const int ct = (int)blockIdx.x - t * a.ncolt;
    const int2 d = dl_bw_tile(a.tiles, t, a.M);
    const int row0 = d.x, n = d.y;
    const int tid = (int)threadIdx.x, c = tid & 15, j = tid >> 4;
    const int col0 = 128 * ct;
    const int col = col0 + 8 * c;
    const int nc = a.K - col;     // the thread's valid columns, if below 8
    const int nk = a.K - col0;    // the tile's valid columns, if below 128
    u8 *colt = a.colt + (u64)col0 * (u64)a.Mp + 128u * (u64)t;

    if (n == 0) { // a padding token block: zero columns and scales
        if (COL) {
            if (tid < 128 && tid < nk) {
                a.cs[(u64)t * (u64)a.K + (u64)(col0 + tid)] = 0.f;
            }
            dl_bw_trans_store(sm.tr, colt, (u64)a.Mp, nk, 128, true);
        }
        return;
    }

    DlBwSrc<In> x;
    const In *src = (const In *)a.x + (u64)row0 * (u64)a.K + (u64)col;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        x.template load<VEC>(i, src + (u64)r * (u64)a.K, r < n ? nc : 0);
    }

    if (ROW) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int r = 8 * j + i;
            float f[8];
            dl_bw_row(x, i, f);
            float m = dl_bw_amax8(f);
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) {
                m = fmaxf(m, __shfl_xor_sync(DL_FULL, m, o));
            }
            const float s = dl_bw_scale(m, a.fmax, a.pow2);
            const uint2 o = dl_bw_enc8<FMT>(f, dl_bw_div(s, __frcp_rn(s), a.pow2));
            if (r < n && nc > 0) {
                dl_bw_put8<VEC>(a.row + (u64)(row0 + r) * (u64)a.K + (u64)col, o, nc);
            }
            if (c == 0) {
                sm.rsc[r] = s;
            }
        }
    }
    if (COL) {
        float m[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float f[8];
            dl_bw_col(x, e, f);
            m[e] = dl_bw_amax8(f);
        }
        *(float4 *)&sm.part[j][8 * c] = make_float4(m[0], m[1], m[2], m[3]);
        *(float4 *)&sm.part[j][8 * c + 4] = make_float4(m[4], m[5], m[6], m[7]);
    }
    __syncthreads();
    if (ROW && tid < 132) {
        // The tile's row scales, and the padding rows [M, Mr) after the last row.
        const int r = tid;
        const u64 o = (u64)ct * (u64)a.Mr + (u64)(row0 + r);
        if (r < n) {
            a.rs[o] = sm.rsc[r];
        } else if (row0 + n == a.M && row0 + r < a.Mr) {
            a.rs[o] = 0.f;
        }
    }
    if (COL) {
        if (tid < 128) {
            float m = 0.f;
#pragma unroll
            for (int g = 0; g < 16; g++) {
                m = fmaxf(m, sm.part[g][tid]);
            }
            const float s = dl_bw_scale(m, a.fmax, a.pow2);
            sm.csc[tid] = s;
            sm.cy[tid] = __frcp_rn(s);
            if (tid < nk) {
                a.cs[(u64)t * (u64)a.K + (u64)(col0 + tid)] = s;
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int k = 8 * c + e;
            float f[8];
            dl_bw_col(x, e, f);
            sm.tr.put(k, j, dl_bw_enc8<FMT>(f, dl_bw_div(sm.csc[k], sm.cy[k], a.pow2)));
        }
        __syncthreads();
        dl_bw_trans_store(sm.tr, colt, (u64)a.Mp, nk, 128, false);
    }
}

// The arguments of the weight kernels, quant's bwWeightArgs: w is [G, R, C] (R = K, C = N
// for KN weights; R = N, C = K for NK), direct [G, R, C] and trans [G, C, R] the two
// orientations; the scale of tile (g, rt, ct) is at scales[g*nrt*nct + rt*srs + ct*scs].
struct DlBwWArgs {
    const void *w;
    u8 *direct;
    u8 *trans;
    float *scales;
    int R, C, nrt, nct, srs, scs;
    float fmax;
    int pow2;
};

// Quantization of a 128x128 weight block: one scale, both orientations. VEC: w 16-byte
// aligned (C % 16 == 0 always).
template <typename In, int FMT, bool VEC>
__device__ __forceinline__ void dl_bw_weights(const DlBwWArgs &a)
{
    __shared__ DlBwTr tr;
    __shared__ float red[DL_BW_THREADS / 32];
    const int ct = (int)(blockIdx.x % (u32)a.nct);
    const int gr = (int)(blockIdx.x / (u32)a.nct);
    const int rt = gr % a.nrt, g = gr / a.nrt;
    const int tid = (int)threadIdx.x, c = tid & 15, j = tid >> 4;
    const int col0 = 128 * ct, row0 = 128 * rt;
    const int col = col0 + 8 * c;
    const int nc = a.C - col, nr = a.R - row0;
    const u64 gbase = (u64)g * (u64)a.R * (u64)a.C;

    DlBwSrc<In> x;
    const In *src = (const In *)a.w + gbase + (u64)row0 * (u64)a.C + (u64)col;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        x.template load<VEC>(i, src + (u64)r * (u64)a.C, r < nr ? nc : 0);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float f[8];
        dl_bw_row(x, i, f);
        m = fmaxf(m, dl_bw_amax8(f));
    }
    m = dl_warp_max(m);
    if ((tid & 31) == 0) {
        red[tid >> 5] = m;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < DL_BW_THREADS / 32; w++) {
        m = fmaxf(m, red[w]);
    }
    const float s = dl_bw_scale(m, a.fmax, a.pow2);
    const DlBwDiv dv = dl_bw_div(s, __frcp_rn(s), a.pow2);
    if (tid == 0) {
        a.scales[(u64)g * (u64)a.nrt * (u64)a.nct + (u64)rt * (u64)a.srs + (u64)ct * (u64)a.scs] = s;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        float f[8];
        dl_bw_row(x, i, f);
        const uint2 o = dl_bw_enc8<FMT>(f, dv);
        if (r < nr && nc > 0) {
            dl_bw_put8<VEC>(a.direct + gbase + (u64)(row0 + r) * (u64)a.C + (u64)col, o, nc);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float f[8];
        dl_bw_col(x, e, f);
        tr.put(8 * c + e, j, dl_bw_enc8<FMT>(f, dv));
    }
    __syncthreads();
    dl_bw_trans_store(tr, a.trans + gbase + (u64)col0 * (u64)a.R + (u64)row0, (u64)a.R, a.C - col0, nr, false);
}

// Dequantization: decode(q)*s, NaN as DL_NAN_F32, then rounded to the output dtype.
template <int FMT>
__device__ __forceinline__ float dl_bw_dec(u32 code, float s)
{
    const float v = __fmul_rn(FMT == DL_BW_E5M2 ? dl_e5m2_to_f32((u8)code) : dl_e4m3_to_f32((u8)code), s);
    return v != v ? __uint_as_float(DL_NAN_F32) : v;
}

// dl_bw_out8 stores 8 values at p, the first n of them (16-byte stores with vec).
__device__ __forceinline__ void dl_bw_out8(u16 *p, const float v[8], int n, int vec)
{
    if (vec && n >= 8) {
        u32 h[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            h[e] = (u32)dl_f32_to_bf16(v[2 * e]) | (u32)dl_f32_to_bf16(v[2 * e + 1]) << 16;
        }
        *(uint4 *)p = make_uint4(h[0], h[1], h[2], h[3]);
        return;
    }
    for (int e = 0; e < 8 && e < n; e++) {
        p[e] = dl_f32_to_bf16(v[e]);
    }
}
__device__ __forceinline__ void dl_bw_out8(float *p, const float v[8], int n, int vec)
{
    if (vec && n >= 8) {
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    for (int e = 0; e < 8 && e < n; e++) {
        p[e] = v[e];
    }
}

// dl_bw_codes8 loads the 8 codes at p, the first n of them (one 8-byte load with vec).
__device__ __forceinline__ uint2 dl_bw_codes8(const u8 *p, int n, int vec)
{
    if (vec && n >= 8) {
        return *(const uint2 *)p;
    }
    uint2 o = make_uint2(0u, 0u);
    for (int e = 0; e < 8 && e < n; e++) {
        if (e < 4) {
            o.x |= (u32)p[e] << (8 * e);
        } else {
            o.y |= (u32)p[e] << (8 * (e - 4));
        }
    }
    return o;
}

__device__ __forceinline__ u32 dl_bw_byte(uint2 o, int e) { return ((e < 4 ? o.x : o.y) >> (8 * (e & 3))) & 0xffu; }

// The arguments of the activation dequantization, quant's bwDequantArgs: from Row (col 0)
// or ColT (col 1); vec: K % 8 == 0 and y 16-byte aligned.
struct DlBwDqArgs {
    void *y;
    const u8 *q;
    const float *sc;
    const int2 *tiles;
    int M, K, Mr, Mp, ncolt, col, vec;
};

template <typename Out, int FMT>
__device__ __forceinline__ void dl_bw_dequant(const DlBwDqArgs &a)
{
    __shared__ DlBwTr tr;
    const int t = (int)(blockIdx.x / (u32)a.ncolt);
    const int ct = (int)blockIdx.x - t * a.ncolt;
    const int2 d = dl_bw_tile(a.tiles, t, a.M);
    const int row0 = d.x, n = d.y;
    if (n == 0) {
        return;
    }
    const int tid = (int)threadIdx.x, c = tid & 15, j = tid >> 4;
    const int col0 = 128 * ct, col = col0 + 8 * c;
    const int nc = a.K - col, nk = a.K - col0;
    Out *y = (Out *)a.y + (u64)row0 * (u64)a.K + (u64)col;
    if (!a.col) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int r = 8 * j + i;
            if (r < n && nc > 0) {
                const uint2 o = dl_bw_codes8(a.q + (u64)(row0 + r) * (u64)a.K + (u64)col, nc, a.vec);
                const float s = a.sc[(u64)ct * (u64)a.Mr + (u64)(row0 + r)];
                float v[8];
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    v[e] = dl_bw_dec<FMT>(dl_bw_byte(o, e), s);
                }
                dl_bw_out8(y + (u64)r * (u64)a.K, v, nc, a.vec);
            }
        }
        return;
    }
    const u8 *q = a.q + (u64)col0 * (u64)a.Mp + 128u * (u64)t;
#pragma unroll
    for (int rep = 0; rep < 4; rep++) {
        const int idx = tid + DL_BW_THREADS * rep;
        const int k = idx >> 3, h = idx & 7;
        if (k < nk) {
            tr.put16(k, h, __ldcs((const uint4 *)(q + (u64)k * (u64)a.Mp + 16 * h)));
        }
    }
    __syncthreads();
    if (nc <= 0) {
        return;
    }
    uint2 o[8];
    float s[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        o[e] = tr.get(8 * c + e, j);
        s[e] = e < nc ? a.sc[(u64)t * (u64)a.K + (u64)(col + e)] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        if (r < n) {
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                v[e] = dl_bw_dec<FMT>(dl_bw_byte(o[e], i), s[e]);
            }
            dl_bw_out8(y + (u64)r * (u64)a.K, v, nc, a.vec);
        }
    }
}

// The arguments of the weight dequantization, quant's bwWeightDequantArgs: y [G, K, N]
// from NMajor q [G, K, N] and scales [G, nkt, nnt]; vec: y 16-byte aligned.
struct DlBwWDqArgs {
    void *y;
    const u8 *q;
    const float *scales;
    int K, N, nkt, nnt, vec;
};

template <typename Out, int FMT>
__device__ __forceinline__ void dl_bw_dequant_weights(const DlBwWDqArgs &a)
{
    const int nt = (int)(blockIdx.x % (u32)a.nnt);
    const int gk = (int)(blockIdx.x / (u32)a.nnt);
    const int kt = gk % a.nkt, g = gk / a.nkt;
    const int tid = (int)threadIdx.x, c = tid & 15, j = tid >> 4;
    const int col = 128 * nt + 8 * c, nc = a.N - col;
    if (nc <= 0) {
        return;
    }
    const float s = a.scales[(u64)g * (u64)a.nkt * (u64)a.nnt + (u64)kt * (u64)a.nnt + (u64)nt];
    const u64 base = (u64)g * (u64)a.K * (u64)a.N + (u64)(128 * kt) * (u64)a.N + (u64)col;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        if (128 * kt + r < a.K) {
            const uint2 o = dl_bw_codes8(a.q + base + (u64)r * (u64)a.N, nc, 1);
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                v[e] = dl_bw_dec<FMT>(dl_bw_byte(o, e), s);
            }
            dl_bw_out8((Out *)a.y + base + (u64)r * (u64)a.N, v, nc, a.vec);
        }
    }
}

// The status record of invalid group sizes: quant's domain (quant/status.go), the op of
// the call (quant/blockwise_layout.go), code 1 with (g, sizes[g]) for the first negative
// size, or code 2 with (the sum, M).
#define DL_BW_STATUS_DOMAIN 2

// dl_bw_scan returns the inclusive prefix sum of v over the block (blockDim.x a multiple
// of 32, at most 1024), through red (32 entries of shared memory).
__device__ __forceinline__ long long dl_bw_scan(long long v, long long *red)
{
    const int lane = (int)(threadIdx.x & 31u), w = (int)(threadIdx.x >> 5);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const long long u = __shfl_up_sync(DL_FULL, v, o);
        v += lane >= o ? u : 0;
    }
    __syncthreads();
    if (lane == 31) {
        red[w] = v;
    }
    __syncthreads();
    long long before = 0;
    for (int i = 0; i < w; i++) {
        before += red[i];
    }
    return v + before;
}

// Token-block descriptors of a grouped layout from the G group sizes, on one block of
// 1024 threads: group g owns tiles [P_g, P_g + ceil(M_g/128)), P_g = sum over h < g of
// ceil(M_h/128), the rows of its block b being [O_g + 128b, O_g + min(128b + 128, M_g))
// with O_g its first row; tiles after the last group are padding {M, 0}. Invalid sizes
// (a negative one, or a sum other than M) are recorded in status (null for none) and give
// the ungrouped descriptors {128t, min(M - 128t, 128)}, padding from ceil(M/128) on.
// gtab (2G + 2 ints) holds P_0..P_G and O_0..O_G for the search of each tile's group.
extern "C" __global__ void __launch_bounds__(1024) dl_bw_groups(const int *__restrict__ sizes, int G, int M, int ntiles,
                                                                int op, int *gtab, int2 *tiles, i64 *status)
{
    __shared__ long long red[32];
    __shared__ int firstNeg;
    const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
    const int per = (G + nt - 1) / nt;
    const int g0 = min(tid * per, G), g1 = min(g0 + per, G);
    if (tid == 0) {
        firstNeg = G;
    }
    long long rows = 0, blocks = 0;
    int neg = G;
    for (int g = g0; g < g1; g++) {
        const int s = sizes[g];
        if (s < 0) {
            neg = min(neg, g);
        } else {
            rows += s;
            blocks += (s + 127) / 128;
        }
    }
    __syncthreads();
    if (neg < G) {
        atomicMin(&firstNeg, neg);
    }
    const long long rowEnd = dl_bw_scan(rows, red);
    const long long blockEnd = dl_bw_scan(blocks, red);
    __syncthreads();
    const int bad = firstNeg;
    __shared__ long long total;
    if (tid == nt - 1) {
        total = rowEnd;
    }
    __syncthreads();
    if (bad < G || total != (long long)M) {
        if (tid == 0) {
            if (bad < G) {
                dl_status_set(status, DL_STATUS_CODE(DL_BW_STATUS_DOMAIN, op, 1), bad, sizes[bad], 0);
            } else {
                dl_status_set(status, DL_STATUS_CODE(DL_BW_STATUS_DOMAIN, op, 2), total, M, 0);
            }
        }
        for (int t = tid; t < ntiles; t += nt) {
            const long long r0 = 128ll * t;
            const int n = (int)max(0ll, min((long long)M - r0, 128ll));
            tiles[t] = make_int2(n > 0 ? (int)r0 : M, n);
        }
        return;
    }
    long long ro = rowEnd - rows, bo = blockEnd - blocks;
    for (int g = g0; g < g1; g++) {
        const int s = sizes[g];
        gtab[g] = (int)bo;
        gtab[G + 1 + g] = (int)ro;
        ro += s;
        bo += (s + 127) / 128;
    }
    if (tid == nt - 1) {
        gtab[G] = (int)blockEnd;
        gtab[2 * G + 1] = M;
    }
    __syncthreads();
    for (int t = tid; t < ntiles; t += nt) {
        // The largest g in [0, G] with P_g <= t (P_0 = 0): t's group (empty groups share
        // the start of the next), or G for the padding after the last group; found by
        // steps of decreasing powers of two.
        int lo = 0;
        for (int step = G > 0 ? 1 << (31 - __clz(G)) : 0; step > 0; step >>= 1) {
            if (lo + step <= G && gtab[lo + step] <= t) {
                lo += step;
            }
        }
        if (lo == G) {
            tiles[t] = make_int2(M, 0);
        } else {
            const int b = t - gtab[lo];
            const int n = sizes[lo] - 128 * b;
            tiles[t] = make_int2(gtab[G + 1 + lo] + 128 * b, n > 128 ? 128 : n);
        }
    }
}

#define DL_BW_QUANT_KERNEL(NAME, IN, FMT, ROW, COL, VEC, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS, MINB) NAME(DlBwArgs a)                                \
    {                                                                                                                  \
        dl_bw_quant<IN, FMT, ROW, COL, VEC>(a);                                                                        \
    }

#define DL_BW_QUANT_DIRS(IN, INAME, FMT, FNAME, VEC, SUFFIX, MINB)                                                    \
    DL_BW_QUANT_KERNEL(dl_bwq_##INAME##_##FNAME##_row##SUFFIX, IN, FMT, true, false, VEC, MINB)                       \
    DL_BW_QUANT_KERNEL(dl_bwq_##INAME##_##FNAME##_col##SUFFIX, IN, FMT, false, true, VEC, MINB)                       \
    DL_BW_QUANT_KERNEL(dl_bwq_##INAME##_##FNAME##_both##SUFFIX, IN, FMT, true, true, VEC, MINB)                       \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS, 2) dl_bww_##INAME##_##FNAME##SUFFIX(DlBwWArgs a)     \
    {                                                                                                                  \
        dl_bw_weights<IN, FMT, VEC>(a);                                                                                \
    }

#define DL_BW_QUANT_ALL(IN, INAME, MINB)                                                                              \
    DL_BW_QUANT_DIRS(IN, INAME, DL_BW_E4M3, e4m3, true, , MINB)                                                      \
    DL_BW_QUANT_DIRS(IN, INAME, DL_BW_E5M2, e5m2, true, , MINB)                                                      \
    DL_BW_QUANT_DIRS(IN, INAME, DL_BW_E4M3, e4m3, false, _scalar, MINB)                                              \
    DL_BW_QUANT_DIRS(IN, INAME, DL_BW_E5M2, e5m2, false, _scalar, MINB)

DL_BW_QUANT_ALL(u16, bf16, 3)
DL_BW_QUANT_ALL(float, f32, 2)

#define DL_BW_DEQUANT_KERNELS(OUT, ONAME, FMT, FNAME)                                                                 \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS) dl_bwdq_##ONAME##_##FNAME(DlBwDqArgs a)               \
    {                                                                                                                  \
        dl_bw_dequant<OUT, FMT>(a);                                                                                    \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS) dl_bwdqw_##ONAME##_##FNAME(DlBwWDqArgs a)             \
    {                                                                                                                  \
        dl_bw_dequant_weights<OUT, FMT>(a);                                                                            \
    }

DL_BW_DEQUANT_KERNELS(u16, bf16, DL_BW_E4M3, e4m3)
DL_BW_DEQUANT_KERNELS(u16, bf16, DL_BW_E5M2, e5m2)
DL_BW_DEQUANT_KERNELS(float, f32, DL_BW_E4M3, e4m3)
DL_BW_DEQUANT_KERNELS(float, f32, DL_BW_E5M2, e5m2)
