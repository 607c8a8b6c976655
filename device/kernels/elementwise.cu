// Elementwise kernels of package device: fill, copy and cast between the dtypes.
// Conversions come from dtype.cuh and are bit-identical to the Go code in dtype.go.
#include "dl.cuh"

// Fills nbytes at p with a pattern that repeats every 16 bytes, phased so that
// pattern byte i lands on addresses congruent to i mod 16.
extern "C" __global__ void dl_fill(u8 *p, u64 nbytes, u32 a, u32 b, u32 c, u32 d) {
    const uint4 pat = make_uint4(a, b, c, d);
    const u8 *pb = (const u8 *)&pat;
    u64 head = (16 - ((u64)p & 15)) & 15;
    if (head > nbytes) head = nbytes;
    u64 nvec = (nbytes - head) / 16;
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    uint4 *v = (uint4 *)(p + head);
    for (u64 i = tid; i < nvec; i += stride) v[i] = pat;
    u64 tail0 = head + nvec * 16;
    for (u64 i = tid; i < head; i += stride) p[i] = pb[((u64)p + i) & 15];
    for (u64 i = tail0 + tid; i < nbytes; i += stride) p[i] = pb[((u64)p + i) & 15];
}

#define DL_COPY_UNROLL 4

// Copies n16 16-byte words: each thread moves DL_COPY_UNROLL words, all loads issued
// before the stores, with streaming cache hints. Both pointers 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) dl_copy16(uint4 *__restrict__ dst, const uint4 *__restrict__ src, u64 n16) {
    u64 base = ((u64)blockIdx.x * blockDim.x * DL_COPY_UNROLL) + threadIdx.x;
    uint4 r[DL_COPY_UNROLL];
#pragma unroll
    for (int k = 0; k < DL_COPY_UNROLL; k++) {
        u64 i = base + (u64)k * blockDim.x;
        if (i < n16) r[k] = __ldcs(&src[i]);
    }
#pragma unroll
    for (int k = 0; k < DL_COPY_UNROLL; k++) {
        u64 i = base + (u64)k * blockDim.x;
        if (i < n16) __stcs(&dst[i], r[k]);
    }
}

// Copies nbytes with no alignment requirement.
extern "C" __global__ void dl_copy1(u8 *__restrict__ dst, const u8 *__restrict__ src, u64 nbytes) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes; i += stride) dst[i] = src[i];
}

// Loads element i of each dtype as float (integers round to nearest even).
__device__ __forceinline__ float dl_ld_f32(const float *p, u64 i) { return p[i]; }
__device__ __forceinline__ float dl_ld_f16(const u16 *p, u64 i) { return dl_f16_to_f32(p[i]); }
__device__ __forceinline__ float dl_ld_bf16(const u16 *p, u64 i) { return dl_bf16_to_f32(p[i]); }
__device__ __forceinline__ float dl_ld_e4m3(const u8 *p, u64 i) { return dl_e4m3_to_f32(p[i]); }
__device__ __forceinline__ float dl_ld_e5m2(const u8 *p, u64 i) { return dl_e5m2_to_f32(p[i]); }
__device__ __forceinline__ float dl_ld_e8m0(const u8 *p, u64 i) { return dl_e8m0_to_f32(p[i]); }
__device__ __forceinline__ float dl_ld_i32(const int *p, u64 i) { return __int2float_rn(p[i]); }
__device__ __forceinline__ float dl_ld_i64(const i64 *p, u64 i) { return __ll2float_rn(p[i]); }

__device__ __forceinline__ float dl_cv_f32(float x) { return x; }
__device__ __forceinline__ u16 dl_cv_f16(float x) { return dl_f32_to_f16(x); }
__device__ __forceinline__ u16 dl_cv_bf16(float x) { return dl_f32_to_bf16(x); }
__device__ __forceinline__ u8 dl_cv_e4m3(float x) { return dl_f32_to_e4m3(x); }
__device__ __forceinline__ u8 dl_cv_e5m2(float x) { return dl_f32_to_e5m2(x); }
__device__ __forceinline__ u8 dl_cv_e8m0(float x) { return dl_f32_to_e8m0(x); }
__device__ __forceinline__ int dl_cv_i32(float x) { return dl_f32_to_i32(x); }
__device__ __forceinline__ i64 dl_cv_i64(float x) { return dl_f32_to_i64(x); }

// dl_cast_S_D converts n elements of dtype S at src to dtype D at dst through float32.
#define DL_CAST(S, ST, D, DT)                                                              \
    extern "C" __global__ void dl_cast_##S##_##D(DT *__restrict__ dst, const ST *__restrict__ src, u64 n) { \
        u64 stride = (u64)gridDim.x * blockDim.x;                                           \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)       \
            dst[i] = dl_cv_##D(dl_ld_##S(src, i));                                           \
    }
#define DL_CAST_FROM(S, ST)                                                                \
    DL_CAST(S, ST, f32, float) DL_CAST(S, ST, f16, u16) DL_CAST(S, ST, bf16, u16)          \
    DL_CAST(S, ST, e4m3, u8) DL_CAST(S, ST, e5m2, u8) DL_CAST(S, ST, e8m0, u8)

DL_CAST_FROM(f32, float)
DL_CAST_FROM(f16, u16)
DL_CAST_FROM(bf16, u16)
DL_CAST_FROM(e4m3, u8)
DL_CAST_FROM(e5m2, u8)
DL_CAST_FROM(e8m0, u8)
DL_CAST_FROM(i32, int)
DL_CAST_FROM(i64, i64)
DL_CAST(f32, float, i32, int) DL_CAST(f16, u16, i32, int) DL_CAST(bf16, u16, i32, int)
DL_CAST(e4m3, u8, i32, int) DL_CAST(e5m2, u8, i32, int) DL_CAST(e8m0, u8, i32, int)
DL_CAST(f32, float, i64, i64) DL_CAST(f16, u16, i64, i64) DL_CAST(bf16, u16, i64, i64)
DL_CAST(e4m3, u8, i64, i64) DL_CAST(e5m2, u8, i64, i64) DL_CAST(e8m0, u8, i64, i64)

// Integer to integer casts convert directly; i64 to i32 saturates.
extern "C" __global__ void dl_cast_i32_i64(i64 *__restrict__ dst, const int *__restrict__ src, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
extern "C" __global__ void dl_cast_i64_i32(int *__restrict__ dst, const i64 *__restrict__ src, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 v = src[i];
        dst[i] = v > 2147483647LL ? 2147483647 : (v < -2147483648LL ? (int)0x80000000 : (int)v);
    }
}
