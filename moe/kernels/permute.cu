// Permute (tokens to expert-sorted rows) and unpermute (weighted sum back), with their
// gradients. Every kernel is token-major: the block of token t reads its K rows
// through row[t*K + k] (-1: no row), so each token row is read or written once, and
// sums run over k in order in f32: results do not depend on scheduling.
// V is the number of elements a thread moves at once (16 bytes when the host has
// checked alignment, else 1). K <= 32.
#include "moe.cuh"

// xp[row[t*K+k]] = x[t] for each k with a row, copying nw words of type W per row.
template <typename W>
__device__ __forceinline__ void gather(W *__restrict__ xp, const W *__restrict__ x, const int *__restrict__ row,
                                       int K, i64 nw) {
    __shared__ int rs[32];
    i64 t = blockIdx.x;
    if (threadIdx.x < K) rs[threadIdx.x] = row[t * K + threadIdx.x];
    __syncthreads();
    const W *src = x + t * nw;
    for (i64 i = threadIdx.x; i < nw; i += blockDim.x) {
        W v = src[i];
        for (int k = 0; k < K; k++) {
            int r = rs[k];
            if (r >= 0) xp[(i64)r * nw + i] = v;
        }
    }
}

// Zeroes words [total*nw, rows*nw) of p, total = *used (rows when used is null).
template <typename W>
__device__ __forceinline__ void zero_rows(W *__restrict__ p, const int *__restrict__ used, i64 rows, i64 nw) {
    i64 from = dl_total(used, rows) * nw, to = rows * nw;
    W z{};
    for (i64 i = from + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < to; i += (i64)gridDim.x * blockDim.x) p[i] = z;
}

#define DL_WORD_KERNELS(S, W)                                                                              \
    extern "C" __global__ void dl_moe_gather_##S(W *xp, const W *x, const int *row, int K, i64 nw) {      \
        gather<W>(xp, x, row, K, nw);                                                                      \
    }                                                                                                      \
    extern "C" __global__ void dl_moe_zero_rows_##S(W *p, const int *used, i64 rows, i64 nw) {             \
        zero_rows<W>(p, used, rows, nw);                                                                   \
    }
DL_WORD_KERNELS(w16, uint4)
DL_WORD_KERNELS(w4, u32)
DL_WORD_KERNELS(w2, u16)

// Rows loaded at once by the row-summing kernels.
#define DL_KG 4

// y[t] = sum_k wt[t*K+k] * yp[row[t*K+k]] (+ add[t] when add is not null). A null row
// means row[a] = a, a null wt weights of 1.
template <typename T, int V>
__device__ __forceinline__ void combine(T *__restrict__ y, const T *__restrict__ yp, const float *__restrict__ wt,
                                        const int *__restrict__ row, const T *__restrict__ add, int K, i64 H) {
    __shared__ int rs[32];
    __shared__ float ws[32];
    i64 t = blockIdx.x;
    if (threadIdx.x < K) {
        rs[threadIdx.x] = row ? row[t * K + threadIdx.x] : (int)(t * K + threadIdx.x);
        ws[threadIdx.x] = wt ? wt[t * K + threadIdx.x] : 1.f;
    }
    __syncthreads();
    for (i64 c = (i64)threadIdx.x * V; c < H; c += (i64)blockDim.x * V) {
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] = 0.f;
        // Rows in groups of DL_KG, loads first, so that several are in flight.
        for (int k0 = 0; k0 < K; k0 += DL_KG) {
            float v[DL_KG][V];
#pragma unroll
            for (int q = 0; q < DL_KG; q++) {
                int r = k0 + q < K ? rs[k0 + q] : -1;
                if (r >= 0) {
                    dl_vec<T, V>::load(yp + (i64)r * H + c, v[q]);
                } else {
#pragma unroll
                    for (int j = 0; j < V; j++) v[q][j] = 0.f;
                }
            }
#pragma unroll
            for (int q = 0; q < DL_KG; q++) {
                float g = k0 + q < K && rs[k0 + q] >= 0 ? ws[k0 + q] : 0.f;
#pragma unroll
                for (int j = 0; j < V; j++) acc[j] += g * v[q][j];
            }
        }
        if (add) {
            float v[V];
            dl_vec<T, V>::load(add + t * H + c, v);
#pragma unroll
            for (int j = 0; j < V; j++) acc[j] += v[j];
        }
        dl_vec<T, V>::store(y + t * H + c, acc);
    }
}

// For each k with a row r: dyp[r] = wt[t*K+k] * dy[t] (not when dyp is null) and
// dwt[t*K+k] = <dy[t], yp[r]> (0 without a row). blockDim.x is a multiple of 32.
template <typename T, int V>
__device__ __forceinline__ void combine_bwd(T *__restrict__ dyp, float *__restrict__ dwt, const T *__restrict__ dy,
                                            const T *__restrict__ yp, const float *__restrict__ wt,
                                            const int *__restrict__ row, int K, i64 H) {
    __shared__ int rs[32];
    __shared__ float ws[32];
    __shared__ float red[32];
    i64 t = blockIdx.x;
    if (threadIdx.x < K) {
        rs[threadIdx.x] = row[t * K + threadIdx.x];
        ws[threadIdx.x] = wt[t * K + threadIdx.x];
    }
    __syncthreads();
    for (int k = 0; k < K; k++) {
        int r = rs[k];
        if (r < 0) {
            if (threadIdx.x == 0) dwt[t * K + k] = 0.f;
            continue;
        }
        float g = ws[k], part = 0.f;
        for (i64 c = (i64)threadIdx.x * V; c < H; c += (i64)blockDim.x * V) {
            float d[V], u[V];
            dl_vec<T, V>::load(dy + t * H + c, d);
            dl_vec<T, V>::load(yp + (i64)r * H + c, u);
#pragma unroll
            for (int j = 0; j < V; j++) {
                part += d[j] * u[j];
                d[j] *= g;
            }
            if (dyp) dl_vec<T, V>::store(dyp + (i64)r * H + c, d);
        }
        float s = dl_block_sum(part, red);
        if (threadIdx.x == 0) dwt[t * K + k] = s;
    }
}

// Tokens per block of permute_bwd.
#define DL_TB 8

// dx[t] = sum_e dl[t,e] * wr[e] (when dl is not null) + sum_k dxp[row[t*K+k]]
//         (+ add[t] when add is not null),
// for the DL_TB tokens of the block; a null row means row[a] = a. Dynamic shared
// memory: DL_TB*E floats when dl is not null.
template <typename T, typename WT, int V>
__device__ __forceinline__ void permute_bwd(T *__restrict__ dx, const T *__restrict__ dxp, const int *__restrict__ row,
                                            const T *__restrict__ add, const float *__restrict__ dl,
                                            const WT *__restrict__ wr, i64 ntok, int K, int E, i64 H) {
    extern __shared__ float dls[];
    __shared__ int rs[DL_TB * 32];
    i64 t0 = (i64)blockIdx.x * DL_TB;
    int nt = ntok - t0 < DL_TB ? (int)(ntok - t0) : DL_TB;
    for (int i = threadIdx.x; i < DL_TB * K; i += blockDim.x)
        rs[i] = i < nt * K ? (row ? row[t0 * K + i] : (int)(t0 * K + i)) : -1;
    if (dl)
        for (int i = threadIdx.x; i < DL_TB * E; i += blockDim.x) dls[i] = i < nt * E ? dl[t0 * E + i] : 0.f;
    __syncthreads();
    for (i64 c = (i64)threadIdx.x * V; c < H; c += (i64)blockDim.x * V) {
        float acc[DL_TB][V], v[V];
#pragma unroll
        for (int i = 0; i < DL_TB; i++)
#pragma unroll
            for (int j = 0; j < V; j++) acc[i][j] = 0.f;
        if (dl) {
#pragma unroll 4
            for (int e = 0; e < E; e++) {
                dl_vec<WT, V>::load(wr + (i64)e * H + c, v);
#pragma unroll
                for (int i = 0; i < DL_TB; i++) {
                    float d = dls[i * E + e];
#pragma unroll
                    for (int j = 0; j < V; j++) acc[i][j] += d * v[j];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < DL_TB; i++) {
            if (i < nt) {
                for (int k0 = 0; k0 < K; k0 += DL_KG) {
                    float u[DL_KG][V];
#pragma unroll
                    for (int q = 0; q < DL_KG; q++) {
                        int r = k0 + q < K ? rs[i * K + k0 + q] : -1;
                        if (r >= 0) {
                            dl_vec<T, V>::load(dxp + (i64)r * H + c, u[q]);
                        } else {
#pragma unroll
                            for (int j = 0; j < V; j++) u[q][j] = 0.f;
                        }
                    }
#pragma unroll
                    for (int q = 0; q < DL_KG; q++)
#pragma unroll
                        for (int j = 0; j < V; j++) acc[i][j] += u[q][j];
                }
                if (add) {
                    dl_vec<T, V>::load(add + (t0 + i) * H + c, v);
#pragma unroll
                    for (int j = 0; j < V; j++) acc[i][j] += v[j];
                }
                dl_vec<T, V>::store(dx + (t0 + i) * H + c, acc[i]);
            }
        }
    }
}

#define DL_ROW_KERNELS(S, T, V)                                                                             \
    extern "C" __global__ void dl_moe_combine_##S(T *y, const T *yp, const float *wt, const int *row,      \
                                                  const T *add, int K, i64 H) {                             \
        combine<T, V>(y, yp, wt, row, add, K, H);                                                           \
    }                                                                                                       \
    extern "C" __global__ void dl_moe_combine_bwd_##S(T *dyp, float *dwt, const T *dy, const T *yp,        \
                                                      const float *wt, const int *row, int K, i64 H) {      \
        combine_bwd<T, V>(dyp, dwt, dy, yp, wt, row, K, H);                                                 \
    }                                                                                                       \
    extern "C" __global__ void dl_moe_permute_bwd_##S##_wf32(T *dx, const T *dxp, const int *row,          \
                                                            const T *add, const float *dl, const float *wr, \
                                                            i64 ntok, int K, int E, i64 H) {                \
        permute_bwd<T, float, V>(dx, dxp, row, add, dl, wr, ntok, K, E, H);                                 \
    }                                                                                                       \
    extern "C" __global__ void dl_moe_permute_bwd_##S##_wbf16(T *dx, const T *dxp, const int *row,         \
                                                             const T *add, const float *dl, const u16 *wr,  \
                                                             i64 ntok, int K, int E, i64 H) {               \
        permute_bwd<T, u16, V>(dx, dxp, row, add, dl, wr, ntok, K, E, H);                                   \
    }
DL_ROW_KERNELS(f32_v4, float, 4)
DL_ROW_KERNELS(f32_v1, float, 1)
DL_ROW_KERNELS(bf16_v8, u16, 8)
DL_ROW_KERNELS(bf16_v1, u16, 1)
