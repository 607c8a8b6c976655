// Shared definitions of package moe's kernels. Each program's source is this
// prelude followed by its own file (see kernels.go). Elements are f32 (float)
// or bf16 (unsigned short); arithmetic is f32.
#include "dtype.cuh"

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define DL_FULL 0xffffffffu
#define DL_NEG_INF __int_as_float(0xff800000)
#define DL_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float dl_ld(const float *p) { return *p; }
__device__ __forceinline__ float dl_ld(const u16 *p) { return dl_bf16_to_f32(*p); }
__device__ __forceinline__ void dl_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void dl_st(u16 *p, float v) { *p = dl_f32_to_bf16(v); }

// dl_vec moves V consecutive elements between memory and floats. V > 1 needs
// 16-byte aligned addresses (the host picks V).
template <typename T, int V> struct dl_vec {
    static __device__ __forceinline__ void load(const T *p, float *v) {
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = dl_ld(p + i);
    }
    static __device__ __forceinline__ void store(T *p, const float *v) {
#pragma unroll
        for (int i = 0; i < V; i++) dl_st(p + i, v[i]);
    }
};

template <> struct dl_vec<float, 4> {
    static __device__ __forceinline__ void load(const float *p, float *v) {
        float4 q = *(const float4 *)p;
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    }
    static __device__ __forceinline__ void store(float *p, const float *v) {
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    }
};

template <> struct dl_vec<u16, 8> {
    static __device__ __forceinline__ void load(const u16 *p, float *v) {
        uint4 q = *(const uint4 *)p;
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ void store(u16 *p, const float *v) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = (u32)dl_f32_to_bf16(v[2 * i]) | ((u32)dl_f32_to_bf16(v[2 * i + 1]) << 16);
        *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
    }
};

// dl_total returns the number of used rows: *total, or rows when total is null.
__device__ __forceinline__ i64 dl_total(const int *total, i64 rows) {
    if (total == 0) return rows;
    i64 t = *total;
    return t < 0 ? 0 : (t > rows ? rows : t);
}

__device__ __forceinline__ float dl_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DL_FULL, v, o);
    return v;
}

__device__ __forceinline__ float dl_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DL_FULL, v, o));
    return v;
}

// dl_block_sum returns the sum of v over the block to every thread, in a fixed
// order. red holds 32 floats of shared memory; blockDim.x is a multiple of 32.
__device__ __forceinline__ float dl_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = dl_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float s = lane < nw ? red[lane] : 0.f;
    return dl_warp_sum(s);
}
