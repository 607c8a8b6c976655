// SwiGLU activation of rows h = [gate | up] (2F columns): a = silu(gate) * up
// (dl_swiglu of moe.cuh), in f32, with the limits of silu and silu' at -inf and +inf
// where the formulas give NaN (as moe/swiglu.go). Rows at or past *used (all rows when
// used is null) are written as zeros. One block per row, grid-stride over rows.
#include "moe.cuh"

template <typename T, int V>
__device__ __forceinline__ void swiglu(T *__restrict__ a, const T *__restrict__ h, const int *__restrict__ used,
                                       i64 rows, i64 F) {
    i64 n = dl_total(used, rows);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 c = (i64)threadIdx.x * V; c < F; c += (i64)blockDim.x * V) {
            float g[V], u[V];
            if (r < n) {
                dl_vec<T, V>::load(h + r * 2 * F + c, g);
                dl_vec<T, V>::load(h + r * 2 * F + F + c, u);
#pragma unroll
                for (int j = 0; j < V; j++) g[j] = dl_swiglu(g[j], u[j]);
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) g[j] = 0.f;
            }
            dl_vec<T, V>::store(a + r * F + c, g);
        }
    }
}

// dh = [da * up * silu'(gate) | da * silu(gate)], silu'(g) = s * (1 + g * (1 - s)),
// s = sigmoid(g).
template <typename T, int V>
__device__ __forceinline__ void swiglu_bwd(T *__restrict__ dh, const T *__restrict__ h, const T *__restrict__ da,
                                           const int *__restrict__ used, i64 rows, i64 F) {
    i64 n = dl_total(used, rows);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 c = (i64)threadIdx.x * V; c < F; c += (i64)blockDim.x * V) {
            float g[V], u[V], d[V];
            if (r < n) {
                dl_vec<T, V>::load(h + r * 2 * F + c, g);
                dl_vec<T, V>::load(h + r * 2 * F + F + c, u);
                dl_vec<T, V>::load(da + r * F + c, d);
#pragma unroll
                for (int j = 0; j < V; j++) dl_swiglu_bwd(g[j], u[j], d[j], g[j], u[j]);
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) g[j] = u[j] = 0.f;
            }
            dl_vec<T, V>::store(dh + r * 2 * F + c, g);
            dl_vec<T, V>::store(dh + r * 2 * F + F + c, u);
        }
    }
}

#define DL_SWIGLU(S, T, V)                                                                                  \
    extern "C" __global__ void dl_moe_swiglu_##S(T *a, const T *h, const int *used, i64 rows, i64 F) {     \
        swiglu<T, V>(a, h, used, rows, F);                                                                  \
    }                                                                                                       \
    extern "C" __global__ void dl_moe_swiglu_bwd_##S(T *dh, const T *h, const T *da, const int *used,      \
                                                     i64 rows, i64 F) {                                     \
        swiglu_bwd<T, V>(dh, h, da, used, rows, F);                                                         \
    }
DL_SWIGLU(f32_v4, float, 4)
DL_SWIGLU(f32_v1, float, 1)
DL_SWIGLU(bf16_v8, u16, 8)
DL_SWIGLU(bf16_v1, u16, 1)
