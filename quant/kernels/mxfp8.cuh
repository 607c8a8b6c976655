// The MXFP8 quantization kernels of package quant, templated on their source (see
// quant_source.cuh): rowwise (1x32) and columnwise (32x1) blocks from one read of a bf16
// or f32 [M, K] source, grouped or not, the columnwise data row-major (Col) or
// transposed (ColT [K, 32*ntiles]). quant's kernels/mxfp8.cu instantiates them for
// tensors (and holds the weights' kernels and the inverses); the program of a
// quant.Source includes this header as quant_mxfp8.cuh and instantiates them for its
// loader with DL_MX_SOURCE_KERNELS. Every kernel is bit-identical to the Go reference in
// quant/cpu.go; quant/doc.go gives the rules and layouts, quant/layout.go the tiles these
// kernels walk.
//
// Work is cut into tiles of 32 rows (tile t: rowwise scale rows [32t, 32t+32) and
// columnwise scale row t) by 256 columns; one kernel block per (tile, column tile),
// blockIdx.x = t * ncolt + column tile. A tile descriptor {row0, nrows, p4, cg} says
// which source rows the tile holds (nrows 0: padding; -1: invalid group sizes, when the
// tile's rows [row0, row0 + 32) get NaN codes 0x7F and its scales 0xFF) and
// where its group's tiles start (p4) and how many there are (cg); without groups the
// descriptors are computed (tiles == 0).

#ifndef DROPLESS_QUANT_MXFP8_CUH
#define DROPLESS_QUANT_MXFP8_CUH

#include "quant_source.cuh"

// DL_MX_HW_CVT selects the element conversion: 1 (the default) uses the instruction
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 where the GPU has it (DL_FP8_CVT), 0 the branch-free software
// conversion below, bit-identical to dl_f32_to_e4m3 / dl_f32_to_e5m2 of dtype.cuh (and
// so to Go's device.E4M3FromFloat32 / E5M2FromFloat32). Both round to nearest even,
// saturate finite and infinite values to +-max and keep the sign of zero. The operand
// is always the result of a multiplication, which turns any NaN into the canonical
// 0x7FFFFFFF; both conversions give 0x7F for it.
#ifndef DL_MX_HW_CVT
#define DL_MX_HW_CVT 1
#endif

#define DL_MX_E4M3 0
#define DL_MX_E5M2 1

// dl_mx_sw_e4m3 is dl_f32_to_e4m3 without branches. Codes from 2^-6 up round the
// float32 bits at bit 20; below, float32 addition to 2^14 (whose ulp is 2^-9, the unit
// of the subnormals) rounds |x| to nearest even, and the bits past 2^14's count units.
__device__ __forceinline__ u32 dl_mx_sw_e4m3(float x)
{
    const u32 b = __float_as_uint(x);
    const u32 a = b & 0x7fffffffu;
    u32 n = a - (120u << 23);
    n = (n + 0x7ffffu + ((n >> 20) & 1u)) >> 20;
    const u32 s = __float_as_uint(__uint_as_float(a) + 16384.0f) - 0x46800000u;
    u32 c = a >= 0x3c800000u ? n : s;
    c = a >= 0x43e00000u ? 0x7eu : c;
    c |= (b >> 24) & 0x80u;
    return a > 0x7f800000u ? 0x7fu : c;
}

// dl_mx_sw_e5m2 is dl_f32_to_e5m2 without branches: bits rounded at bit 21 from 2^-14
// up; below, addition to 2^7 (ulp 2^-16).
__device__ __forceinline__ u32 dl_mx_sw_e5m2(float x)
{
    const u32 b = __float_as_uint(x);
    const u32 a = b & 0x7fffffffu;
    u32 n = a - (112u << 23);
    n = (n + 0xfffffu + ((n >> 21) & 1u)) >> 21;
    const u32 s = __float_as_uint(__uint_as_float(a) + 128.0f) - 0x43000000u;
    u32 c = a >= 0x38800000u ? n : s;
    c = a >= 0x47600000u ? 0x7bu : c;
    c |= (b >> 24) & 0x80u;
    return a > 0x7f800000u ? 0x7fu : c;
}

// dl_mx_cvt2 returns the element codes of lo (bits 0-7) and hi (bits 8-15).
template <int FMT>
__device__ __forceinline__ u32 dl_mx_cvt2(float lo, float hi)
{
#if DL_MX_HW_CVT && DL_FP8_CVT
    unsigned short r;
    // cvt d, a, b puts a in the upper byte of d and b in the lower.
    if (FMT == DL_MX_E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    }
    return (u32)r;
#else
    if (FMT == DL_MX_E5M2) {
        return dl_mx_sw_e5m2(lo) | (dl_mx_sw_e5m2(hi) << 8);
    }
    return dl_mx_sw_e4m3(lo) | (dl_mx_sw_e4m3(hi) << 8);
#endif
}

// dl_mx_cvt8 converts f[0..7]*s[0..7] into 8 codes, f[0] in the lowest byte.
template <int FMT>
__device__ __forceinline__ uint2 dl_mx_cvt8(const float f[8], const float s[8])
{
    uint2 o;
    o.x = dl_mx_cvt2<FMT>(f[0] * s[0], f[1] * s[1]) | (dl_mx_cvt2<FMT>(f[2] * s[2], f[3] * s[3]) << 16);
    o.y = dl_mx_cvt2<FMT>(f[4] * s[4], f[5] * s[5]) | (dl_mx_cvt2<FMT>(f[6] * s[6], f[7] * s[7]) << 16);
    return o;
}

// dl_mx_code is scaleCode: the E8M0 code of a block of largest magnitude amax (>= 0,
// not NaN). RCEIL: amax*rcp rounded up to a power of two; FLOOR: 2^(floor(log2 amax) -
// emax). Both saturate to 0..254; an infinite amax gives 254.
__device__ __forceinline__ u32 dl_mx_code(float amax, float rcp, int emax, int floor_mode)
{
    if (floor_mode) {
        const int e = (int)(__float_as_uint(amax) >> 23);
        if (e >= 255) {
            return 254u;
        }
        return e - emax < 0 ? 0u : (u32)(e - emax);
    }
    const u32 b = __float_as_uint(amax * rcp);
    u32 e = b >> 23;
    const u32 m = b & 0x7fffffu;
    if (e >= 255u) {
        return 254u;
    }
    if (e == 0u) {
        return m > 0x400000u ? 1u : 0u;
    }
    if (m != 0u && e < 254u) {
        e += 1u;
    }
    return e;
}

// dl_mx_inv is invScale: 2^(127-c) exactly (2^-127 is a subnormal).
__device__ __forceinline__ float dl_mx_inv(u32 c)
{
    return __uint_as_float(c == 254u ? 0x00400000u : (254u - c) << 23);
}

// dl_mx_swz is swizzle: offset of scale (r, c) in 128x4 tiles of a matrix of cols columns.
__device__ __forceinline__ u64 dl_mx_swz(u64 r, u64 c, u64 cols)
{
    return ((r / 128u) * (cols / 4u) + c / 4u) * 512u + (r % 32u) * 16u + ((r % 128u) / 32u) * 4u + c % 4u;
}

struct DlMxTile {
    int row0, nrows, p4, cg;
};

__device__ __forceinline__ DlMxTile dl_mx_tile(const int4 *tiles, int t, int M, int ntiles)
{
    DlMxTile d;
    if (tiles != 0) {
        const int4 v = tiles[t];
        d.row0 = v.x;
        d.nrows = v.y;
        d.p4 = v.z;
        d.cg = v.w;
    } else {
        const int n = M - 32 * t;
        d.row0 = 32 * t;
        d.nrows = n < 0 ? 0 : (n > 32 ? 32 : n);
        d.p4 = 0;
        d.cg = ntiles;
    }
    return d;
}

// Offsets of rowwise scale (row sr, block blk) and columnwise scale (tile t, column gj).
__device__ __forceinline__ u64 dl_mx_rs_off(int swz, u64 sr, u64 blk, u64 cp)
{
    return swz ? dl_mx_swz(sr, blk, cp) : sr * cp + blk;
}
__device__ __forceinline__ u64 dl_mx_cs_off(int swz, const DlMxTile &d, int t, u64 gj, u64 kp)
{
    return swz ? (u64)d.p4 * kp + dl_mx_swz(gj, (u64)(t - d.p4), (u64)d.cg) : (u64)t * kp + gj;
}

// Eight consecutive source elements of one row: loads (16-byte, or element by element
// for sources that are not 16-byte aligned), widening to float, element e of them, and
// pack, which sets them from eight values rounded to In (dl_q_round).
template <typename In>
struct DlMxIn;

template <>
struct DlMxIn<u16> {
    struct V {
        uint4 a;
    };
    static __device__ __forceinline__ void load(V &v, const u16 *x, u64 off)
    {
        v.a = __ldcs((const uint4 *)(x + off));
    }
    static __device__ __forceinline__ void load_scalar(V &v, const u16 *x, u64 off)
    {
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            h[e] = (u32)x[off + e];
        }
        v.a = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
    static __device__ __forceinline__ void zero(V &v) { v.a = make_uint4(0u, 0u, 0u, 0u); }
    static __device__ __forceinline__ void pack(V &v, const float f[8])
    {
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            h[e] = (u32)dl_f32_to_bf16(f[e]);
        }
        v.a = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
    static __device__ __forceinline__ float at(const V &v, int e)
    {
        const u32 h = e < 2 ? v.a.x : (e < 4 ? v.a.y : (e < 6 ? v.a.z : v.a.w));
        return __uint_as_float((e & 1) ? (h & 0xffff0000u) : (h << 16));
    }
    static __device__ __forceinline__ void unpack(const V &v, float f[8])
    {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            f[e] = at(v, e);
        }
    }
};

template <>
struct DlMxIn<float> {
    struct V {
        float4 a, b;
    };
    static __device__ __forceinline__ void load(V &v, const float *x, u64 off)
    {
        v.a = __ldcs((const float4 *)(x + off));
        v.b = __ldcs((const float4 *)(x + off + 4));
    }
    static __device__ __forceinline__ void load_scalar(V &v, const float *x, u64 off)
    {
        v.a = make_float4(x[off], x[off + 1], x[off + 2], x[off + 3]);
        v.b = make_float4(x[off + 4], x[off + 5], x[off + 6], x[off + 7]);
    }
    static __device__ __forceinline__ void zero(V &v)
    {
        v.a = make_float4(0.f, 0.f, 0.f, 0.f);
        v.b = v.a;
    }
    static __device__ __forceinline__ void pack(V &v, const float f[8])
    {
        v.a = make_float4(f[0], f[1], f[2], f[3]);
        v.b = make_float4(f[4], f[5], f[6], f[7]);
    }
    static __device__ __forceinline__ float at(const V &v, int e)
    {
        const float4 q = e < 4 ? v.a : v.b;
        const int k = e & 3;
        return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
    }
    static __device__ __forceinline__ void unpack(const V &v, float f[8])
    {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            f[e] = at(v, e);
        }
    }
};

__device__ __forceinline__ float dl_mx_ld(const u16 *x, u64 i) { return dl_bf16_to_f32(x[i]); }
__device__ __forceinline__ float dl_mx_ld(const float *x, u64 i) { return x[i]; }

// DlMxLoad<Src> reads the source of loader Src: load sets v to the eight values of row r
// from column c (the fast kernel's, 16-byte loads), at returns one value (the general
// kernel's). A value source's values are rounded to its T; a tensor's are read as they
// are.
template <typename Src>
struct DlMxLoad {
    typedef typename Src::T In;
    static __device__ __forceinline__ void load(const Src &s, typename DlMxIn<In>::V &v, u64 r, u64 c)
    {
        float f[8];
        s.template load8<true>(r, c, 8, f);
        DlMxIn<In>::pack(v, f);
    }
    static __device__ __forceinline__ float at(const Src &s, u64 r, u64 c) { return dl_q_round<In>(s.at(r, c)); }
};

template <typename In>
struct DlMxLoad<DlQTensor<In>> {
    static __device__ __forceinline__ void load(const DlQTensor<In> &s, typename DlMxIn<In>::V &v, u64 r, u64 c)
    {
        DlMxIn<In>::load(v, s.x, r * s.K + c);
    }
    static __device__ __forceinline__ float at(const DlQTensor<In> &s, u64 r, u64 c) { return dl_mx_ld(s.x, r * s.K + c); }
};

#define DL_MX_FAST_THREADS 128

// The pieces of the 32x256 tile kernels (the fast quantization and the weights): 128
// threads, warp w and lane l holding columns [8l, 8l + 8) of the tile's rows
// dl_mx_trow(w, i), i = 0..7, as DlMxIn values.

// dl_mx_trow is the tile row of a thread's i-th row: w + 4i (row-major outputs only), or
// with TR 8w + i, so that a warp's rows are contiguous in the transposed outputs.
template <bool TR>
__device__ __forceinline__ int dl_mx_trow(int warp, int i)
{
    return TR ? 8 * warp + i : warp + 4 * i;
}

// dl_mx_rowblock returns the codes of f[0..7], eight consecutive values of a rowwise
// block that four consecutive lanes hold, and sets code to the block's scale code: the
// largest magnitude meets in two shuffles. Every lane of the warp calls it.
template <int FMT>
__device__ __forceinline__ uint2 dl_mx_rowblock(const float f[8], float rcp, int emax, int floor_mode, u32 &code)
{
    float a = 0.f;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        a = fmaxf(a, fabsf(f[e]));
    }
    a = fmaxf(a, __shfl_xor_sync(DL_FULL, a, 1));
    a = fmaxf(a, __shfl_xor_sync(DL_FULL, a, 2));
    code = dl_mx_code(a, rcp, emax, floor_mode);
    const float s = dl_mx_inv(code);
    const float sv[8] = {s, s, s, s, s, s, s, s};
    return dl_mx_cvt8<FMT>(f, sv);
}

// dl_mx_colscales finishes the 256 columnwise blocks of a tile whose rows the threads
// hold in v (missing values as zeros): per-warp maxima over 8 rows meet in shared
// memory, where thread j finishes columns j and j + 128 and calls put(column, code).
// After a barrier sv[e] is the inverse scale of the thread's column 8l + e.
template <typename In, typename Put>
__device__ __forceinline__ void dl_mx_colscales(const typename DlMxIn<In>::V v[8], float sv[8], float rcp, int emax,
                                                int floor_mode, Put put)
{
    typedef DlMxIn<In> L;
    __shared__ __align__(16) float part[4][256];
    __shared__ __align__(16) float inv[256];
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    float m[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        m[e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float f[8];
        L::unpack(v[i], f);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            m[e] = fmaxf(m[e], fabsf(f[e]));
        }
    }
    *(float4 *)&part[warp][lane * 8] = make_float4(m[0], m[1], m[2], m[3]);
    *(float4 *)&part[warp][lane * 8 + 4] = make_float4(m[4], m[5], m[6], m[7]);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = (int)threadIdx.x + 128 * h;
        const float a = fmaxf(fmaxf(part[0][j], part[1][j]), fmaxf(part[2][j], part[3][j]));
        const u32 c = dl_mx_code(a, rcp, emax, floor_mode);
        inv[j] = dl_mx_inv(c);
        put(j, c);
    }
    __syncthreads();
    const float4 s0 = *(const float4 *)&inv[lane * 8];
    const float4 s1 = *(const float4 *)&inv[lane * 8 + 4];
    sv[0] = s0.x;
    sv[1] = s0.y;
    sv[2] = s0.z;
    sv[3] = s0.w;
    sv[4] = s1.x;
    sv[5] = s1.y;
    sv[6] = s1.z;
    sv[7] = s1.w;
}

// DlMxTr is a 32x256 tile of codes transposed, 256 rows (the tile's columns) of 32 bytes
// (its rows), staged in shared memory so that the transposed outputs leave in whole
// 32-byte rows. Four rows share a 128-byte line; 8-byte chunk c of row k sits at chunk
// (4(k % 4) + c) ^ ((k / 8) % 16) of the line, so that a warp's puts (rows 8l + e, chunk
// w) hit 16 distinct chunks, and 16-byte gets of chunks (2h, 2h + 1) find them in the
// pair (2(k % 4) + h) ^ ((k / 16) % 8), swapped when k / 8 is odd.
struct DlMxTr {
    __align__(16) u8 b[64][128];
    __device__ __forceinline__ void put(int k, int c, uint2 o)
    {
        *(uint2 *)&b[k >> 2][8 * ((4 * (k & 3) + c) ^ ((k >> 3) & 15))] = o;
    }
    __device__ __forceinline__ uint4 get16(int k, int h) const
    {
        const uint4 v = *(const uint4 *)&b[k >> 2][16 * ((2 * (k & 3) + h) ^ ((k >> 4) & 7))];
        return ((k >> 3) & 1) ? make_uint4(v.z, v.w, v.x, v.y) : v;
    }
};

// dl_mx_tr_put puts the transposed codes of the thread's columns into tr: column 8l + e,
// rows 8w..8w + 7, the elements f*sv[e] (the thread's rows must be dl_mx_trow<true>).
template <typename In, int FMT>
__device__ __forceinline__ void dl_mx_tr_put(DlMxTr &tr, const typename DlMxIn<In>::V v[8], const float sv[8])
{
    typedef DlMxIn<In> L;
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            f[i] = L::at(v[i], e);
        }
        const float s[8] = {sv[e], sv[e], sv[e], sv[e], sv[e], sv[e], sv[e], sv[e]};
        tr.put(8 * lane + e, warp, dl_mx_cvt8<FMT>(f, s));
    }
}

// dl_mx_tr_store writes the tile's transposed rows k < nk to out + k*ld, their first nb
// bytes (16 or 32; out and ld multiples of 16): from tr, or, with fill, the 32-bit word
// fill repeated. Each thread stores four 16-byte pieces, so a warp writes 16 whole rows.
__device__ __forceinline__ void dl_mx_tr_store(const DlMxTr *tr, u8 *out, u64 ld, int nk, int nb, bool fill, u32 word)
{
#pragma unroll
    for (int rep = 0; rep < 4; rep++) {
        const int idx = (int)threadIdx.x + DL_MX_FAST_THREADS * rep;
        const int k = idx >> 1, h = idx & 1;
        if (k < nk && 16 * h < nb) {
            __stcs((uint4 *)(out + (u64)k * ld + 16u * (u64)h), fill ? make_uint4(word, word, word, word) : tr->get16(k, h));
        }
    }
}

// The fast kernel: K % 32 == 0, 16-byte loads of the source (a tensor 16-byte aligned,
// or a value source whose loads apply), rq and cq 8-byte aligned (with TR,
// cq is ColT [K, 32*ntiles], 16-byte aligned). 128 threads; warp w, lane l holds columns
// [c0 + 8l, c0 + 8l + 8) of tile rows dl_mx_trow<TR>(w, i), i = 0..7, all loaded (16
// bytes per row) before any use. Rowwise: a 32-column block is 4 lanes, reduced with two
// shuffles. Columnwise: dl_mx_colscales, then the elements leave row-major (8 bytes per
// thread and row) or, with TR, transposed through shared memory into ColT's 32-byte
// pieces [32t, 32t + 32) of rows c0..c0 + 255.
template <typename Src, int FMT, bool ROW, bool COL, bool TR>
__device__ __forceinline__ void dl_mx_fast(const Src &x, u8 *__restrict__ rq, u8 *__restrict__ rs,
                                           u8 *__restrict__ cq, u8 *__restrict__ cs, const int4 *__restrict__ tiles,
                                           int M, int K, int ntiles, int ncolt, int cp, int kp, float rcp, int emax,
                                           int floor_mode, int swz)
{
    typedef typename Src::T In;
    typedef DlMxIn<In> L;
    const int t = (int)(blockIdx.x / (u32)ncolt);
    const int ct = (int)blockIdx.x - t * ncolt;
    const DlMxTile d = dl_mx_tile(tiles, t, M, ntiles);
    const u64 ldt = 32u * (u64)ntiles;
    u8 *colt = TR ? cq + (u64)(ct * 256) * ldt + 32u * (u64)t : cq;
    if (tiles != 0 && d.nrows == 0) {
        // A padding tile of a grouped layout: its scales were zeroed before the launch,
        // its ColT columns are zeroed here.
        if (TR) {
            dl_mx_tr_store(0, colt, ldt, K - ct * 256, 32, true, 0u);
        }
        return;
    }
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    const int col = ct * 256 + lane * 8;
    const bool cv = col < K;

    typename L::V v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = dl_mx_trow<TR>(warp, i);
        if (cv && r < d.nrows) {
            DlMxLoad<Src>::load(x, v[i], (u64)(d.row0 + r), (u64)col);
        } else {
            L::zero(v[i]);
        }
    }

    if constexpr (ROW) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int r = dl_mx_trow<TR>(warp, i);
            float f[8];
            L::unpack(v[i], f);
            u32 c;
            const uint2 o = dl_mx_rowblock<FMT>(f, rcp, emax, floor_mode, c);
            const bool rv = r < d.nrows;
            if (rv && cv) {
                __stcs((uint2 *)(rq + (u64)(d.row0 + r) * (u64)K + (u64)col), o);
            } else if (d.nrows < 0 && cv && d.row0 + r < M) {
                *(uint2 *)(rq + (u64)(d.row0 + r) * (u64)K + (u64)col) = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
            }
            if ((lane & 3) == 0) {
                const int blk = col >> 5;
                if (blk < cp) {
                    const u64 off = dl_mx_rs_off(swz, (u64)(32 * t + r), (u64)blk, (u64)cp);
                    rs[off] = (u8)(d.nrows < 0 ? 0xffu : (rv && cv ? c : 0u));
                }
            }
        }
    }

    if constexpr (COL) {
        float sv[8];
        dl_mx_colscales<In>(v, sv, rcp, emax, floor_mode, [&](int j, u32 c) {
            const int gj = ct * 256 + j;
            if (gj < kp) {
                cs[dl_mx_cs_off(swz, d, t, (u64)gj, (u64)kp)] = (u8)(d.nrows < 0 ? 0xffu : (gj < K && d.nrows > 0 ? c : 0u));
            }
        });
        if constexpr (TR) {
            __shared__ DlMxTr tr;
            if (d.nrows >= 0) { // d.nrows is the block's: the barrier is reached by all or none
                dl_mx_tr_put<In, FMT>(tr, v, sv);
                __syncthreads();
            }
            dl_mx_tr_store(&tr, colt, ldt, K - ct * 256, 32, d.nrows < 0, 0x7f7f7f7fu);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int r = dl_mx_trow<TR>(warp, i);
                if (r < d.nrows && cv) {
                    float f[8];
                    L::unpack(v[i], f);
                    __stcs((uint2 *)(cq + (u64)(d.row0 + r) * (u64)K + (u64)col), dl_mx_cvt8<FMT>(f, sv));
                } else if (d.nrows < 0 && cv && d.row0 + r < M) {
                    *(uint2 *)(cq + (u64)(d.row0 + r) * (u64)K + (u64)col) = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
                }
            }
        }
    }
}

// dl_mx_put32 stores the 32 codes w[0..7] (code i in byte i % 4 of w[i / 4]) at p: two
// 16-byte stores where p is 16-byte aligned, else byte by byte.
__device__ __forceinline__ void dl_mx_put32(u8 *p, const u32 w[8])
{
    if (((unsigned long long)p & 15u) == 0u) {
        __stcs((uint4 *)p, make_uint4(w[0], w[1], w[2], w[3]));
        __stcs((uint4 *)(p + 16), make_uint4(w[4], w[5], w[6], w[7]));
        return;
    }
    for (int i = 0; i < 32; i++) {
        p[i] = (u8)(w[i >> 2] >> (8 * (i & 3)));
    }
}

// The general kernel: any K and alignment. 256 threads, one column each, the tile's
// rows staged in shared memory; a rowwise block is one warp (column tiles start at
// multiples of 256). With tr, cq is ColT [K, 32*ntiles] and each thread writes its
// column's 32 codes of the tile at once, ColT[gj][32t .. 32t + 32).
template <typename Src, int FMT>
__device__ __forceinline__ void dl_mx_general(const Src &x, u8 *__restrict__ rq, u8 *__restrict__ rs,
                                              u8 *__restrict__ cq, u8 *__restrict__ cs, const int4 *__restrict__ tiles,
                                              int M, int K, int ntiles, int ncolt, int cp, int kp, float rcp, int emax,
                                              int floor_mode, int swz, int dorow, int docol, int tr)
{
    __shared__ float v[32][256];
    const int t = (int)(blockIdx.x / (u32)ncolt);
    const int ct = (int)blockIdx.x - t * ncolt;
    const DlMxTile d = dl_mx_tile(tiles, t, M, ntiles);
    const int j = (int)threadIdx.x;
    const int lane = j & 31;
    const int gj = ct * 256 + j;
    const bool cv = gj < K;
    u8 *colt = cq + (u64)gj * 32u * (u64)ntiles + 32u * (u64)t;
    if (tiles != 0 && d.nrows == 0) {
        // A padding tile of a grouped layout: its scales were zeroed before the launch,
        // its ColT columns are zeroed here.
        if (docol && tr && cv) {
            const u32 z[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
            dl_mx_put32(colt, z);
        }
        return;
    }
    for (int r = 0; r < 32; r++) {
        v[r][j] = (cv && r < d.nrows) ? DlMxLoad<Src>::at(x, (u64)(d.row0 + r), (u64)gj) : 0.f;
    }
    if (dorow) {
        const int nbk = (K + 31) >> 5;
        const int blk = gj >> 5;
        for (int r = 0; r < 32; r++) {
            const float a = dl_warp_max(fmaxf(0.f, fabsf(v[r][j]))); // NaN leaves amax alone, as in the fast kernel
            const u32 c = dl_mx_code(a, rcp, emax, floor_mode);
            const bool rv = r < d.nrows;
            if (rv && cv) {
                rq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = (u8)dl_mx_cvt2<FMT>(v[r][j] * dl_mx_inv(c), 0.f);
            } else if (d.nrows < 0 && cv && d.row0 + r < M) {
                rq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = 0x7fu;
            }
            if (lane == 0 && blk < cp) {
                rs[dl_mx_rs_off(swz, (u64)(32 * t + r), (u64)blk, (u64)cp)] = (u8)(d.nrows < 0 ? 0xffu : (rv && blk < nbk ? c : 0u));
            }
        }
    }
    if (docol) {
        float a = 0.f;
        for (int r = 0; r < 32; r++) {
            a = fmaxf(a, fabsf(v[r][j]));
        }
        const u32 c = dl_mx_code(a, rcp, emax, floor_mode);
        const float s = dl_mx_inv(c);
        if (gj < kp) {
            cs[dl_mx_cs_off(swz, d, t, (u64)gj, (u64)kp)] = (u8)(d.nrows < 0 ? 0xffu : (cv && d.nrows > 0 ? c : 0u));
        }
        if (tr) {
            if (cv) { // rows past d.nrows hold zeros: code 0
                u32 w[8];
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    w[q] = d.nrows < 0 ? 0x7f7f7f7fu
                                       : dl_mx_cvt2<FMT>(v[4 * q][j] * s, v[4 * q + 1][j] * s) |
                                             dl_mx_cvt2<FMT>(v[4 * q + 2][j] * s, v[4 * q + 3][j] * s) << 16;
                }
                dl_mx_put32(colt, w);
            }
            return;
        }
        for (int r = 0; r < 32; r++) {
            if (cv && r < d.nrows) {
                cq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = (u8)dl_mx_cvt2<FMT>(v[r][j] * s, 0.f);
            } else if (d.nrows < 0 && cv && d.row0 + r < M) {
                cq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = 0x7fu;
            }
        }
    }
}

// The kernels of loader SRC, named PREFIX: the fast ones (PREFIX_e4m3_row, _col, _both,
// _colt and _botht, and the same for e5m2: rowwise, columnwise as Col, both, the
// columnwise data transposed as ColT alone or with the rowwise) with __launch_bounds__
// (DL_MX_FAST_THREADS, MINB), and the general ones, PREFIX_gen_e4m3 and PREFIX_gen_e5m2.
// Each takes the loader by value, then quant's arguments (quant/cuda.go).
#define DL_MX_FAST_KERNEL(NAME, SRC, FMT, ROW, COL, TR, MINB)                                                         \
    extern "C" __global__ void __launch_bounds__(DL_MX_FAST_THREADS, MINB)                                             \
        NAME(SRC x, u8 *rq, u8 *rs, u8 *cq, u8 *cs, const int4 *tiles, int M, int K, int ntiles, int ncolt, int cp,   \
             int kp, float rcp, int emax, int floor_mode, int swz)                                                     \
    {                                                                                                                  \
        dl_mx_fast<SRC, FMT, ROW, COL, TR>(x, rq, rs, cq, cs, tiles, M, K, ntiles, ncolt, cp, kp, rcp, emax,          \
                                           floor_mode, swz);                                                           \
    }

#define DL_MX_GENERAL_KERNEL(NAME, SRC, FMT)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                                  \
        NAME(SRC x, u8 *rq, u8 *rs, u8 *cq, u8 *cs, const int4 *tiles, int M, int K, int ntiles, int ncolt, int cp,   \
             int kp, float rcp, int emax, int floor_mode, int swz, int dorow, int docol, int tr)                      \
    {                                                                                                                  \
        dl_mx_general<SRC, FMT>(x, rq, rs, cq, cs, tiles, M, K, ntiles, ncolt, cp, kp, rcp, emax, floor_mode, swz,    \
                                dorow, docol, tr);                                                                     \
    }

#define DL_MX_SOURCE_FORMAT(PREFIX, SRC, FMT, FNAME, MINB)                                                            \
    DL_MX_FAST_KERNEL(PREFIX##_##FNAME##_row, SRC, FMT, true, false, false, MINB)                                     \
    DL_MX_FAST_KERNEL(PREFIX##_##FNAME##_col, SRC, FMT, false, true, false, MINB)                                     \
    DL_MX_FAST_KERNEL(PREFIX##_##FNAME##_both, SRC, FMT, true, true, false, MINB)                                     \
    DL_MX_FAST_KERNEL(PREFIX##_##FNAME##_colt, SRC, FMT, false, true, true, MINB)                                     \
    DL_MX_FAST_KERNEL(PREFIX##_##FNAME##_botht, SRC, FMT, true, true, true, MINB)                                     \
    DL_MX_GENERAL_KERNEL(PREFIX##_gen_##FNAME, SRC, FMT)

#define DL_MX_SOURCE_KERNELS(PREFIX, SRC, MINB)                                                                       \
    DL_MX_SOURCE_FORMAT(PREFIX, SRC, DL_MX_E4M3, e4m3, MINB)                                                          \
    DL_MX_SOURCE_FORMAT(PREFIX, SRC, DL_MX_E5M2, e5m2, MINB)

#endif
