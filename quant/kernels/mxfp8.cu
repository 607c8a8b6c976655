// MXFP8 kernels of package quant: the quantizations of bf16 and f32 tensors (the
// kernels of quant_mxfp8.cuh, instantiated for DlQTensor), the group sizes' tile
// descriptors, expert weights in both orientations from one read, and the inverses.
// Every kernel is bit-identical to the Go reference in quant/cpu.go and
// quant/mxweights_cpu.go; quant/doc.go gives the rules and layouts.
#include "quant_mxfp8.cuh"

template <int FMT>
__device__ __forceinline__ float dl_mx_dec(u8 c)
{
    return FMT == DL_MX_E5M2 ? dl_e5m2_to_f32(c) : dl_e4m3_to_f32(c);
}

__device__ __forceinline__ void dl_mx_st(u16 *y, u64 i, float v) { y[i] = dl_f32_to_bf16(v); }
__device__ __forceinline__ void dl_mx_st(float *y, u64 i, float v) { y[i] = v; }

// Dequantization: 256 threads, one column each, the rows of one tile; with tr (col
// only) q is ColT [K, 32*ntiles], the tile's codes of column gj at ColT[gj][32t + r].
template <typename Out, int FMT>
__device__ __forceinline__ void dl_mx_dequant(Out *__restrict__ y, const u8 *__restrict__ q, const u8 *__restrict__ sc,
                                              const int4 *__restrict__ tiles, int M, int K, int ntiles, int ncolt,
                                              int cp, int kp, int swz, int col, int tr)
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
        const u8 e = tr ? q[(u64)gj * 32u * (u64)ntiles + 32u * (u64)t + (u64)r] : q[i];
        float v = dl_mx_dec<FMT>(e) * s;
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

// The quantization kernels of tensors: dl_mxq_bf16_e4m3_row ... dl_mxq_f32_gen_e5m2 (see
// DL_MX_SOURCE_KERNELS).
DL_MX_SOURCE_KERNELS(dl_mxq_bf16, DlQTensor<u16>, 6)
DL_MX_SOURCE_KERNELS(dl_mxq_f32, DlQTensor<float>, 4)

#define DL_MX_DEQUANT_KERNEL(OUT, ONAME, FMT, FNAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                                  \
        dl_mxdq_##ONAME##_##FNAME(OUT *y, const u8 *q, const u8 *sc, const int4 *tiles, int M, int K, int ntiles,     \
                                  int ncolt, int cp, int kp, int swz, int col, int tr)                                 \
    {                                                                                                                  \
        dl_mx_dequant<OUT, FMT>(y, q, sc, tiles, M, K, ntiles, ncolt, cp, kp, swz, col, tr);                           \
    }

DL_MX_DEQUANT_KERNEL(u16, bf16, DL_MX_E4M3, e4m3)
DL_MX_DEQUANT_KERNEL(u16, bf16, DL_MX_E5M2, e5m2)
DL_MX_DEQUANT_KERNEL(float, f32, DL_MX_E4M3, e4m3)
DL_MX_DEQUANT_KERNEL(float, f32, DL_MX_E5M2, e5m2)

// Expert weights in both orientations (quant/mxweights.go): w_g is R x C in memory (R = K,
// C = N for [G, K, N] weights; R = N, C = K for [G, N, K]), R and C multiples of 16.
// direct [G, R, C] holds 1x32 blocks along C, their scale of block b of row r at
// ds[g][b / 4][r][b % 4] ([G, ceil(C/128), R, 4]); trans [G, C, R] holds w_g transposed,
// 1x32 blocks along R, the scale of block b of column c at ts[g][b / 4][c][b % 4]
// ([G, ceil(R/128), C, 4]). Scale slots past the last block of a 128 are 0. Quant's
// mxwArgs mirrors DlMxWArgs.
struct DlMxWArgs {
    const void *w;
    u8 *direct, *ds, *trans, *ts;
    int R, C, nrt, nct, rb, cb;
    float rcp;
    int emax, floor_mode;
};

// One 32x256 tile of w_g (blockIdx.x = (g * nrt + rt) * nct + ct), 128 threads holding
// rows dl_mx_trow<true>: rowwise blocks as the fast kernel's (direct, row-major, 8 bytes
// per thread and row; their scales gathered in shared memory and stored as the 4-byte
// slots of two 128-byte runs), columnwise ones by dl_mx_colscales (one scale byte per
// column) and the transposed tile through shared memory into trans, 32 (or, for a last
// tile of 16 rows, 16) bytes per column. VEC: w 16-byte aligned; else element loads.
template <typename In, int FMT, bool VEC>
__device__ __forceinline__ void dl_mx_weights(const DlMxWArgs &a)
{
    typedef DlMxIn<In> L;
    __shared__ u32 dsc[2][32];
    __shared__ DlMxTr tr;
    const int ct = (int)(blockIdx.x % (u32)a.nct);
    const int gr = (int)(blockIdx.x / (u32)a.nct);
    const int rt = gr % a.nrt, g = gr / a.nrt;
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    const int col = ct * 256 + lane * 8;
    const bool cv = col < a.C;
    const int nr = min(32, a.R - 32 * rt);
    const u64 base = (u64)g * (u64)a.R * (u64)a.C;
    const In *w = (const In *)a.w + base + (u64)(32 * rt) * (u64)a.C;

    typename L::V v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = dl_mx_trow<true>(warp, i);
        if (cv && r < nr) {
            if (VEC) {
                L::load(v[i], w, (u64)r * (u64)a.C + (u64)col);
            } else {
                L::load_scalar(v[i], w, (u64)r * (u64)a.C + (u64)col);
            }
        } else {
            L::zero(v[i]);
        }
    }

#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = dl_mx_trow<true>(warp, i);
        float f[8];
        L::unpack(v[i], f);
        u32 c;
        const uint2 o = dl_mx_rowblock<FMT>(f, a.rcp, a.emax, a.floor_mode, c);
        if (r < nr && cv) {
            __stcs((uint2 *)(a.direct + base + (u64)(32 * rt + r) * (u64)a.C + (u64)col), o);
        }
        if ((lane & 3) == 0) { // block 8ct + lane/4: slot (lane/4) % 4 of run lane/16
            ((u8 *)dsc)[128 * (lane >> 4) + 4 * r + ((lane >> 2) & 3)] = (u8)(r < nr && cv ? c : 0u);
        }
    }

    float sv[8];
    dl_mx_colscales<In>(v, sv, a.rcp, a.emax, a.floor_mode, [&](int j, u32 c) {
        const int cc = ct * 256 + j;
        if (cc < a.C) {
            u8 *p = a.ts + (((u64)g * (u64)a.rb + (u64)(rt >> 2)) * (u64)a.C + (u64)cc) * 4u;
            p[rt & 3] = (u8)c;
            if (rt == a.nrt - 1) { // the slots of blocks past R in the last 128 rows
                for (int s = (rt & 3) + 1; s < 4; s++) {
                    p[s] = 0u;
                }
            }
        }
    });
    // dl_mx_colscales' barriers made dsc complete.
    if (threadIdx.x < 64) {
        const int h = (int)(threadIdx.x >> 5), r = (int)(threadIdx.x & 31u);
        if (2 * ct + h < a.cb && r < nr) {
            ((u32 *)a.ds)[((u64)g * (u64)a.cb + (u64)(2 * ct + h)) * (u64)a.R + (u64)(32 * rt + r)] = dsc[h][r];
        }
    }
    dl_mx_tr_put<In, FMT>(tr, v, sv);
    __syncthreads();
    dl_mx_tr_store(&tr, a.trans + base + (u64)(ct * 256) * (u64)a.R + (u64)(32 * rt), (u64)a.R, a.C - ct * 256, nr > 16 ? 32 : 16,
                   false, 0u);
}

// The arguments of the weights' dequantization, quant's mxwDequantArgs: y [G, K, N] from
// q and its scales sc, KMajor [G, N, K] and KScale [G, ceil(K/128), N, 4] (kmajor) or
// NMajor [G, K, N] and NScale [G, ceil(N/128), K, 4].
struct DlMxWDqArgs {
    void *y;
    const u8 *q, *sc;
    int K, N, nkt, nnt, kmajor;
};

// Dequantization of a 32x32 tile of y_g (blockIdx.x = (g * nkt + kt) * nnt + nt), 256
// threads: the codes staged in shared memory in q's orientation (rows of 32 bytes), then
// written along N.
template <typename Out, int FMT>
__device__ __forceinline__ void dl_mx_dequant_weights(const DlMxWDqArgs &a)
{
    __shared__ u8 sh[32][33];
    const int nt = (int)(blockIdx.x % (u32)a.nnt);
    const int gk = (int)(blockIdx.x / (u32)a.nnt);
    const int kt = gk % a.nkt, g = gk / a.nkt;
    const int tx = (int)(threadIdx.x & 31u), ty = (int)(threadIdx.x >> 5);
    const int k0 = 32 * kt, n0 = 32 * nt;
    const u64 base = (u64)g * (u64)a.K * (u64)a.N;
    // q's rows: n (kmajor, rows of K codes) or k (rows of N codes).
    const int r0 = a.kmajor ? n0 : k0, c0 = a.kmajor ? k0 : n0;
    const int nrow = a.kmajor ? a.N : a.K, ncol = a.kmajor ? a.K : a.N;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = ty + 8 * j;
        if (r0 + r < nrow && c0 + tx < ncol) {
            sh[r][tx] = a.q[base + (u64)(r0 + r) * (u64)ncol + (u64)(c0 + tx)];
        }
    }
    __syncthreads();
    const int n = n0 + tx;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int k = k0 + ty + 8 * j;
        if (k < a.K && n < a.N) {
            u8 e, c;
            if (a.kmajor) {
                e = sh[tx][ty + 8 * j];
                c = a.sc[(((u64)g * (u64)((a.K + 127) / 128) + (u64)(k >> 7)) * (u64)a.N + (u64)n) * 4u + ((k >> 5) & 3)];
            } else {
                e = sh[ty + 8 * j][tx];
                c = a.sc[(((u64)g * (u64)((a.N + 127) / 128) + (u64)(n >> 7)) * (u64)a.K + (u64)k) * 4u + ((n >> 5) & 3)];
            }
            float v = dl_mx_dec<FMT>(e) * dl_e8m0_to_f32(c);
            if (v != v) {
                v = __uint_as_float(DL_NAN_F32);
            }
            dl_mx_st((Out *)a.y, base + (u64)k * (u64)a.N + (u64)n, v);
        }
    }
}

#define DL_MX_WEIGHT_KERNELS(IN, INAME, FMT, FNAME, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(DL_MX_FAST_THREADS, MINB) dl_mxw_##INAME##_##FNAME(DlMxWArgs a)     \
    {                                                                                                                  \
        dl_mx_weights<IN, FMT, true>(a);                                                                               \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(DL_MX_FAST_THREADS, MINB)                                             \
        dl_mxw_##INAME##_##FNAME##_scalar(DlMxWArgs a)                                                                 \
    {                                                                                                                  \
        dl_mx_weights<IN, FMT, false>(a);                                                                              \
    }

DL_MX_WEIGHT_KERNELS(u16, bf16, DL_MX_E4M3, e4m3, 6)
DL_MX_WEIGHT_KERNELS(u16, bf16, DL_MX_E5M2, e5m2, 6)
DL_MX_WEIGHT_KERNELS(float, f32, DL_MX_E4M3, e4m3, 4)
DL_MX_WEIGHT_KERNELS(float, f32, DL_MX_E5M2, e5m2, 4)

#define DL_MX_WEIGHT_DEQUANT_KERNEL(OUT, ONAME, FMT, FNAME)                                                           \
    extern "C" __global__ void __launch_bounds__(256) dl_mxdqw_##ONAME##_##FNAME(DlMxWDqArgs a)                       \
    {                                                                                                                  \
        dl_mx_dequant_weights<OUT, FMT>(a);                                                                            \
    }

DL_MX_WEIGHT_DEQUANT_KERNEL(u16, bf16, DL_MX_E4M3, e4m3)
DL_MX_WEIGHT_DEQUANT_KERNEL(u16, bf16, DL_MX_E5M2, e5m2)
DL_MX_WEIGHT_DEQUANT_KERNEL(float, f32, DL_MX_E4M3, e4m3)
DL_MX_WEIGHT_DEQUANT_KERNEL(float, f32, DL_MX_E5M2, e5m2)
