// The blockwise FP8 quantization kernels of package quant, templated on their source
// (see quant_source.cuh): activations and gradients in 1x128 blocks (Row) and their
// transposed, token-blocked form (ColT) from one read of a bf16 or f32 [M, K] source,
// grouped or not. quant's kernels/blockwise.cu instantiates them for tensors (and holds
// the weights' kernels and the inverses); the program of a quant.Source includes this
// header as quant_blockwise.cuh and instantiates them for its loader with
// DL_BW_SOURCE_KERNELS. Every kernel is bit-identical to the Go reference in
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

#ifndef DROPLESS_QUANT_BLOCKWISE_CUH
#define DROPLESS_QUANT_BLOCKWISE_CUH

#include "quant_source.cuh"

// DL_BW_HW_CVT selects the element conversion: 1 (the default) uses the instruction
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 where the GPU has it (DL_FP8_CVT), 0 dl_f32_to_e4m3 /
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
#if DL_BW_HW_CVT && DL_FP8_CVT
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
// of 8 halves; f32: two uint4 of 4 floats), missing values as +0. load reads row i from
// memory; set sets it from eight values, rounded to In (dl_q_round).
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
    __device__ __forceinline__ void set(int i, const float f[8])
    {
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            h[e] = (u32)dl_f32_to_bf16(f[e]);
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
    __device__ __forceinline__ void set(int i, const float f[8])
    {
        w[i][0] = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
        w[i][1] = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7]));
    }
};

// DlBwLoad<Src>::load sets row i of a sub-tile from the source of loader Src: the values
// of row r, columns [c, c + n) (n below 8 for the last columns of a row; 0 or less for
// none), zeros past them; with VEC (16-byte loads apply) and n >= 8 by 16-byte loads. A
// value source's values are rounded to its T; a tensor's are read as they are.
template <typename Src>
struct DlBwLoad {
    template <bool VEC>
    static __device__ __forceinline__ void load(const Src &s, DlBwSrc<typename Src::T> &x, int i, u64 r, u64 c, int n)
    {
        float f[8];
        if (VEC && n >= 8) {
            s.template load8<true>(r, c, 8, f);
        } else {
            s.template load8<false>(r, c, n, f);
        }
        x.set(i, f);
    }
};

template <typename In>
struct DlBwLoad<DlQTensor<In>> {
    template <bool VEC>
    static __device__ __forceinline__ void load(const DlQTensor<In> &s, DlBwSrc<In> &x, int i, u64 r, u64 c, int n)
    {
        x.template load<VEC>(i, s.x + r * s.K + c, n);
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

// The arguments of the activation kernels but their source, quant's bwQuantArgs.
struct DlBwArgs {
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

// Quantization of an activation tile of the source of loader Src: Row, RowScale, ColT and
// ColTScale as ROW and COL say. VEC: K % 8 == 0 and 16-byte loads of the source (a
// tensor 16-byte aligned, or a value source whose loads apply).
template <typename Src, int FMT, bool ROW, bool COL, bool VEC>
__device__ __forceinline__ void dl_bw_quant(const DlBwArgs &a, const Src &src)
{
    typedef typename Src::T In;
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
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = 8 * j + i;
        DlBwLoad<Src>::template load<VEC>(src, x, i, (u64)(row0 + r), (u64)col, r < n ? nc : 0);
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

// The kernels of loader SRC, named PREFIX: PREFIX_e4m3_row, _col and _both (Row,
// ColT, both) with 16-byte loads, the same with the suffix _scalar with loads element by
// element, and the same for e5m2, with __launch_bounds__(DL_BW_THREADS, MINB). Each takes
// quant's arguments (quant/blockwise_cuda.go), then the loader by value.
#define DL_BW_SOURCE_KERNEL(NAME, SRC, FMT, ROW, COL, VEC, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS, MINB) NAME(DlBwArgs a, SRC x)                         \
    {                                                                                                                  \
        dl_bw_quant<SRC, FMT, ROW, COL, VEC>(a, x);                                                                    \
    }

#define DL_BW_SOURCE_DIRS(PREFIX, SRC, FMT, FNAME, VEC, SUFFIX, MINB)                                                 \
    DL_BW_SOURCE_KERNEL(PREFIX##_##FNAME##_row##SUFFIX, SRC, FMT, true, false, VEC, MINB)                             \
    DL_BW_SOURCE_KERNEL(PREFIX##_##FNAME##_col##SUFFIX, SRC, FMT, false, true, VEC, MINB)                             \
    DL_BW_SOURCE_KERNEL(PREFIX##_##FNAME##_both##SUFFIX, SRC, FMT, true, true, VEC, MINB)

#define DL_BW_SOURCE_KERNELS(PREFIX, SRC, MINB)                                                                       \
    DL_BW_SOURCE_DIRS(PREFIX, SRC, DL_BW_E4M3, e4m3, true, , MINB)                                                   \
    DL_BW_SOURCE_DIRS(PREFIX, SRC, DL_BW_E5M2, e5m2, true, , MINB)                                                   \
    DL_BW_SOURCE_DIRS(PREFIX, SRC, DL_BW_E4M3, e4m3, false, _scalar, MINB)                                           \
    DL_BW_SOURCE_DIRS(PREFIX, SRC, DL_BW_E5M2, e5m2, false, _scalar, MINB)

#endif
