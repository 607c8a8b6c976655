// Blockwise FP8 kernels of package quant: the quantizations of bf16 and f32 activations
// and gradients (the kernels of quant_blockwise.cuh, instantiated for DlQTensor), the
// group sizes' token blocks, weights in 128x128 blocks in both orientations from one
// read, and the inverses. Every kernel is bit-identical to the Go reference in
// quant/blockwise_cpu.go; quant/doc.go gives the rules and layouts, quant_blockwise.cuh
// the kernels' tiles and threads.
#include "quant_blockwise.cuh"

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

// The activation kernels of tensors, dl_bwq_bf16_e4m3_row ... dl_bwq_f32_e5m2_both_scalar
// (see DL_BW_SOURCE_KERNELS), and the weights' dl_bww_bf16_e4m3 ... dl_bww_f32_e5m2_scalar.
DL_BW_SOURCE_KERNELS(dl_bwq_bf16, DlQTensor<u16>, 3)
DL_BW_SOURCE_KERNELS(dl_bwq_f32, DlQTensor<float>, 2)

#define DL_BW_WEIGHT_KERNEL(IN, INAME, FMT, FNAME, VEC, SUFFIX)                                                       \
    extern "C" __global__ void __launch_bounds__(DL_BW_THREADS, 2) dl_bww_##INAME##_##FNAME##SUFFIX(DlBwWArgs a)     \
    {                                                                                                                  \
        dl_bw_weights<IN, FMT, VEC>(a);                                                                                \
    }

#define DL_BW_WEIGHT_KERNELS(IN, INAME)                                                                               \
    DL_BW_WEIGHT_KERNEL(IN, INAME, DL_BW_E4M3, e4m3, true, )                                                         \
    DL_BW_WEIGHT_KERNEL(IN, INAME, DL_BW_E5M2, e5m2, true, )                                                         \
    DL_BW_WEIGHT_KERNEL(IN, INAME, DL_BW_E4M3, e4m3, false, _scalar)                                                 \
    DL_BW_WEIGHT_KERNEL(IN, INAME, DL_BW_E5M2, e5m2, false, _scalar)

DL_BW_WEIGHT_KERNELS(u16, bf16)
DL_BW_WEIGHT_KERNELS(float, f32)

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
