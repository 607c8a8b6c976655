// MXFP8 quantization kernels of package quant: rowwise (1x32) and columnwise (32x1)
// blocks from one read of a bf16 or f32 [M, K] source, grouped or not, and the inverse.
// Every kernel is bit-identical to the Go reference in quant/cpu.go; quant/doc.go gives
// the rules and layouts, quant/layout.go the tiles these kernels walk.
//
// Work is cut into tiles of 32 rows (tile t: rowwise scale rows [32t, 32t+32) and
// columnwise scale row t) by 256 columns; one kernel block per (tile, column tile),
// blockIdx.x = t * ncolt + column tile. A tile descriptor {row0, nrows, p4, cg} says
// which source rows the tile holds (nrows 0: padding; -1: invalid group sizes, when the
// tile's rows [row0, row0 + 32) get NaN codes 0x7F and its scales 0xFF) and
// where its group's tiles start (p4) and how many there are (cg); without groups the
// descriptors are computed (tiles == 0).
#include "dl.cuh"

// DL_MX_HW_CVT selects the element conversion: 1 (the default) uses the instruction
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 of sm_89 and later, 0 the branch-free software
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
#if DL_MX_HW_CVT && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
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

// Eight consecutive source elements of one row: loads and widening to float.
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
    static __device__ __forceinline__ void zero(V &v) { v.a = make_uint4(0u, 0u, 0u, 0u); }
    static __device__ __forceinline__ void unpack(const V &v, float f[8])
    {
        f[0] = __uint_as_float(v.a.x << 16);
        f[1] = __uint_as_float(v.a.x & 0xffff0000u);
        f[2] = __uint_as_float(v.a.y << 16);
        f[3] = __uint_as_float(v.a.y & 0xffff0000u);
        f[4] = __uint_as_float(v.a.z << 16);
        f[5] = __uint_as_float(v.a.z & 0xffff0000u);
        f[6] = __uint_as_float(v.a.w << 16);
        f[7] = __uint_as_float(v.a.w & 0xffff0000u);
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
    static __device__ __forceinline__ void zero(V &v)
    {
        v.a = make_float4(0.f, 0.f, 0.f, 0.f);
        v.b = v.a;
    }
    static __device__ __forceinline__ void unpack(const V &v, float f[8])
    {
        f[0] = v.a.x;
        f[1] = v.a.y;
        f[2] = v.a.z;
        f[3] = v.a.w;
        f[4] = v.b.x;
        f[5] = v.b.y;
        f[6] = v.b.z;
        f[7] = v.b.w;
    }
};

__device__ __forceinline__ float dl_mx_ld(const u16 *x, u64 i) { return dl_bf16_to_f32(x[i]); }
__device__ __forceinline__ float dl_mx_ld(const float *x, u64 i) { return x[i]; }

#define DL_MX_FAST_THREADS 128

// The fast kernel: K % 32 == 0, x 16-byte aligned, rq and cq 8-byte aligned. 128
// threads; warp w, lane l holds columns [c0 + 8l, c0 + 8l + 8) of tile rows w + 4i,
// i = 0..7, all loaded (16 bytes per row) before any use. Rowwise: a 32-column block is
// 4 lanes, reduced with two shuffles. Columnwise: per-warp maxima over 8 rows meet in
// shared memory, where each thread finishes two columns.
template <typename In, int FMT, bool ROW, bool COL>
__device__ __forceinline__ void dl_mx_fast(const In *__restrict__ x, u8 *__restrict__ rq, u8 *__restrict__ rs,
                                           u8 *__restrict__ cq, u8 *__restrict__ cs, const int4 *__restrict__ tiles,
                                           int M, int K, int ntiles, int ncolt, int cp, int kp, float rcp, int emax,
                                           int floor_mode, int swz)
{
    typedef DlMxIn<In> L;
    const int t = (int)(blockIdx.x / (u32)ncolt);
    const int ct = (int)blockIdx.x - t * ncolt;
    const DlMxTile d = dl_mx_tile(tiles, t, M, ntiles);
    if (tiles != 0 && d.nrows == 0) {
        return; // a padding tile of a grouped layout: its scales were zeroed before the launch
    }
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    const int col = ct * 256 + lane * 8;
    const bool cv = col < K;

    typename L::V v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = warp + 4 * i;
        if (cv && r < d.nrows) {
            L::load(v[i], x, (u64)(d.row0 + r) * (u64)K + (u64)col);
        } else {
            L::zero(v[i]);
        }
    }

    if constexpr (ROW) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int r = warp + 4 * i;
            float f[8];
            L::unpack(v[i], f);
            float a = 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                a = fmaxf(a, fabsf(f[e]));
            }
            a = fmaxf(a, __shfl_xor_sync(DL_FULL, a, 1));
            a = fmaxf(a, __shfl_xor_sync(DL_FULL, a, 2));
            const u32 c = dl_mx_code(a, rcp, emax, floor_mode);
            const bool rv = r < d.nrows;
            if (rv && cv) {
                const float s = dl_mx_inv(c);
                const float sv[8] = {s, s, s, s, s, s, s, s};
                __stcs((uint2 *)(rq + (u64)(d.row0 + r) * (u64)K + (u64)col), dl_mx_cvt8<FMT>(f, sv));
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
        __shared__ __align__(16) float part[4][256];
        __shared__ __align__(16) float inv[256];
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
            const int gj = ct * 256 + j;
            if (gj < kp) {
                cs[dl_mx_cs_off(swz, d, t, (u64)gj, (u64)kp)] = (u8)(d.nrows < 0 ? 0xffu : (gj < K && d.nrows > 0 ? c : 0u));
            }
        }
        __syncthreads();
        const float4 s0 = *(const float4 *)&inv[lane * 8];
        const float4 s1 = *(const float4 *)&inv[lane * 8 + 4];
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int r = warp + 4 * i;
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

// The general kernel: any K and alignment. 256 threads, one column each, the tile's
// rows staged in shared memory; a rowwise block is one warp (column tiles start at
// multiples of 256).
template <typename In, int FMT>
__device__ __forceinline__ void dl_mx_general(const In *__restrict__ x, u8 *__restrict__ rq, u8 *__restrict__ rs,
                                              u8 *__restrict__ cq, u8 *__restrict__ cs, const int4 *__restrict__ tiles,
                                              int M, int K, int ntiles, int ncolt, int cp, int kp, float rcp, int emax,
                                              int floor_mode, int swz, int dorow, int docol)
{
    __shared__ float v[32][256];
    const int t = (int)(blockIdx.x / (u32)ncolt);
    const int ct = (int)blockIdx.x - t * ncolt;
    const DlMxTile d = dl_mx_tile(tiles, t, M, ntiles);
    if (tiles != 0 && d.nrows == 0) {
        return; // a padding tile of a grouped layout: its scales were zeroed before the launch
    }
    const int j = (int)threadIdx.x;
    const int lane = j & 31;
    const int gj = ct * 256 + j;
    const bool cv = gj < K;
    for (int r = 0; r < 32; r++) {
        v[r][j] = (cv && r < d.nrows) ? dl_mx_ld(x, (u64)(d.row0 + r) * (u64)K + (u64)gj) : 0.f;
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
        for (int r = 0; r < 32; r++) {
            if (cv && r < d.nrows) {
                cq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = (u8)dl_mx_cvt2<FMT>(v[r][j] * s, 0.f);
            } else if (d.nrows < 0 && cv && d.row0 + r < M) {
                cq[(u64)(d.row0 + r) * (u64)K + (u64)gj] = 0x7fu;
            }
        }
    }
}

template <int FMT>
__device__ __forceinline__ float dl_mx_dec(u8 c)
{
    return FMT == DL_MX_E5M2 ? dl_e5m2_to_f32(c) : dl_e4m3_to_f32(c);
}

__device__ __forceinline__ void dl_mx_st(u16 *y, u64 i, float v) { y[i] = dl_f32_to_bf16(v); }
__device__ __forceinline__ void dl_mx_st(float *y, u64 i, float v) { y[i] = v; }

// Dequantization: 256 threads, one column each, the rows of one tile.
template <typename Out, int FMT>
__device__ __forceinline__ void dl_mx_dequant(Out *__restrict__ y, const u8 *__restrict__ q, const u8 *__restrict__ sc,
                                              const int4 *__restrict__ tiles, int M, int K, int ntiles, int ncolt,
                                              int cp, int kp, int swz, int col)
{
    const int t = (int)(blockIdx.x / (u32)ncolt);
    const int ct = (int)blockIdx.x - t * ncolt;
    const DlMxTile d = dl_mx_tile(tiles, t, M, ntiles);
    const int gj = ct * 256 + (int)threadIdx.x;
    if (gj >= K) {
        return;
    }
    if (d.nrows < 0) {
        for (int r = 0; r < 32 && d.row0 + r < M; r++) {
            dl_mx_st(y, (u64)(d.row0 + r) * (u64)K + (u64)gj, __uint_as_float(DL_NAN_F32));
        }
        return;
    }
    float cscale = 0.f;
    if (col && d.nrows > 0) {
        cscale = dl_e8m0_to_f32(sc[dl_mx_cs_off(swz, d, t, (u64)gj, (u64)kp)]);
    }
    for (int r = 0; r < d.nrows; r++) {
        const u64 i = (u64)(d.row0 + r) * (u64)K + (u64)gj;
        const float s = col ? cscale : dl_e8m0_to_f32(sc[dl_mx_rs_off(swz, (u64)(32 * t + r), (u64)(gj >> 5), (u64)cp)]);
        float v = dl_mx_dec<FMT>(q[i]) * s;
        if (v != v) {
            v = __uint_as_float(DL_NAN_F32);
        }
        dl_mx_st(y, i, v);
    }
}

// The status record of invalid group sizes: quant's domain and op (quant/status.go),
// the code 1 (a negative size) or 2 (sizes not summing to M), and M.
#define DL_MX_STATUS_DOMAIN 2
#define DL_MX_STATUS_OP 1

// Tile descriptors of a grouped layout from the group sizes, on one block of 1024
// threads: a scan of the sizes and of ceil(size/128), a check that no size is negative
// and that they sum to M (else recorded in status, null for none, and descriptors
// {32t, -1, 0, ntiles}), per-group tile starts and row offsets in gtab
// ([0, G]: 4*P_g, [G+1, 2G+1]: row offsets), then a binary search per tile.
extern "C" __global__ void __launch_bounds__(1024) dl_mx_groups(const int *__restrict__ sizes, int G, int M,
                                                                int ntiles, int *gtab, int4 *tiles, i64 *status)
{
    __shared__ long long srows[1024];
    __shared__ long long squads[1024];
    const int tid = (int)threadIdx.x;
    const int nt = (int)blockDim.x;
    const long long per = ((long long)G + nt - 1) / nt;
    const long long g0 = min((long long)tid * per, (long long)G);
    const long long g1 = min(g0 + per, (long long)G);
    long long rows = 0, quads = 0;
    int bad = 0;
    for (long long g = g0; g < g1; g++) {
        const long long s = sizes[g];
        if (s < 0) {
            bad = 1;
        } else {
            rows += s;
            quads += (s + 127) / 128;
        }
    }
    srows[tid] = rows;
    squads[tid] = quads;
    __syncthreads();
    for (int o = 1; o < nt; o <<= 1) {
        long long a = 0, b = 0;
        if (tid >= o) {
            a = srows[tid - o];
            b = squads[tid - o];
        }
        __syncthreads();
        srows[tid] += a;
        squads[tid] += b;
        __syncthreads();
    }
    bad = __syncthreads_or(bad);
    const long long totRows = srows[nt - 1], totQuads = squads[nt - 1];
    const int st = bad ? 1 : (totRows != (long long)M ? 2 : 0);
    if (st != 0) {
        if (tid == 0) {
            dl_status_set(status, DL_STATUS_CODE(DL_MX_STATUS_DOMAIN, DL_MX_STATUS_OP, st), M, 0, 0);
        }
        for (int t = tid; t < ntiles; t += nt) {
            tiles[t] = make_int4(32 * t, -1, 0, ntiles);
        }
        return;
    }
    long long ro = srows[tid] - rows, qo = squads[tid] - quads;
    for (long long g = g0; g < g1; g++) {
        const int s = sizes[g];
        gtab[g] = (int)(4 * qo);
        gtab[G + 1 + g] = (int)ro;
        ro += s;
        qo += (s + 127) / 128;
    }
    if (tid == 0) {
        gtab[G] = (int)(4 * totQuads);
        gtab[2 * G + 1] = M;
    }
    __syncthreads();
    for (int t = tid; t < ntiles; t += nt) {
        // The largest g in [0, G] with gtab[g] <= t: t's group, or G for the padding
        // after the last group. Empty groups share the start of the next one.
        int lo = 0, hi = G;
        while (lo < hi) {
            const int mid = lo + (hi - lo + 1) / 2;
            if (gtab[mid] <= t) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        int4 d;
        if (lo == G) {
            d = make_int4(M, 0, gtab[G], ntiles - gtab[G]);
        } else {
            const int p4 = gtab[lo];
            const int b = t - p4;
            const int n = sizes[lo] - 32 * b;
            d = make_int4(min(gtab[G + 1 + lo] + 32 * b, M), n < 0 ? 0 : (n > 32 ? 32 : n), p4, gtab[lo + 1] - p4);
        }
        tiles[t] = d;
    }
}

#define DL_MX_FAST_KERNEL(NAME, IN, FMT, ROW, COL, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(DL_MX_FAST_THREADS, MINB)                                             \
        NAME(const IN *x, u8 *rq, u8 *rs, u8 *cq, u8 *cs, const int4 *tiles, int M, int K, int ntiles, int ncolt,     \
             int cp, int kp, float rcp, int emax, int floor_mode, int swz)                                             \
    {                                                                                                                  \
        dl_mx_fast<IN, FMT, ROW, COL>(x, rq, rs, cq, cs, tiles, M, K, ntiles, ncolt, cp, kp, rcp, emax, floor_mode,   \
                                      swz);                                                                            \
    }

#define DL_MX_FAST_DIRS(IN, INAME, FMT, FNAME, MINB)                                                                  \
    DL_MX_FAST_KERNEL(dl_mxq_##INAME##_##FNAME##_row, IN, FMT, true, false, MINB)                                     \
    DL_MX_FAST_KERNEL(dl_mxq_##INAME##_##FNAME##_col, IN, FMT, false, true, MINB)                                     \
    DL_MX_FAST_KERNEL(dl_mxq_##INAME##_##FNAME##_both, IN, FMT, true, true, MINB)

DL_MX_FAST_DIRS(u16, bf16, DL_MX_E4M3, e4m3, 6)
DL_MX_FAST_DIRS(u16, bf16, DL_MX_E5M2, e5m2, 6)
DL_MX_FAST_DIRS(float, f32, DL_MX_E4M3, e4m3, 4)
DL_MX_FAST_DIRS(float, f32, DL_MX_E5M2, e5m2, 4)

#define DL_MX_GENERAL_KERNEL(IN, INAME, FMT, FNAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                                  \
        dl_mxq_gen_##INAME##_##FNAME(const IN *x, u8 *rq, u8 *rs, u8 *cq, u8 *cs, const int4 *tiles, int M, int K,    \
                                     int ntiles, int ncolt, int cp, int kp, float rcp, int emax, int floor_mode,      \
                                     int swz, int dorow, int docol)                                                   \
    {                                                                                                                  \
        dl_mx_general<IN, FMT>(x, rq, rs, cq, cs, tiles, M, K, ntiles, ncolt, cp, kp, rcp, emax, floor_mode, swz,     \
                               dorow, docol);                                                                          \
    }

DL_MX_GENERAL_KERNEL(u16, bf16, DL_MX_E4M3, e4m3)
DL_MX_GENERAL_KERNEL(u16, bf16, DL_MX_E5M2, e5m2)
DL_MX_GENERAL_KERNEL(float, f32, DL_MX_E4M3, e4m3)
DL_MX_GENERAL_KERNEL(float, f32, DL_MX_E5M2, e5m2)

#define DL_MX_DEQUANT_KERNEL(OUT, ONAME, FMT, FNAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                                  \
        dl_mxdq_##ONAME##_##FNAME(OUT *y, const u8 *q, const u8 *sc, const int4 *tiles, int M, int K, int ntiles,     \
                                  int ncolt, int cp, int kp, int swz, int col)                                         \
    {                                                                                                                  \
        dl_mx_dequant<OUT, FMT>(y, q, sc, tiles, M, K, ntiles, ncolt, cp, kp, swz, col);                               \
    }

DL_MX_DEQUANT_KERNEL(u16, bf16, DL_MX_E4M3, e4m3)
DL_MX_DEQUANT_KERNEL(u16, bf16, DL_MX_E5M2, e5m2)
DL_MX_DEQUANT_KERNEL(float, f32, DL_MX_E4M3, e4m3)
DL_MX_DEQUANT_KERNEL(float, f32, DL_MX_E5M2, e5m2)
