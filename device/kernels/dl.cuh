// Shared definitions of the library's kernels: every .cu of every package includes
// this header (and through it dtype.cuh) instead of restating them.
//   - fixed-width integer names;
//   - the full-warp mask and warp and block reductions in a fixed order, so that
//     sums are deterministic;
//   - DL_FP8_CVT, whether the GPU converts FP8 codes in pairs with cvt;
//   - dl_status_set, the one way a kernel records an error found on the device in
//     a device.Status (Go: device/status.go).
//
// The file is compiled by NVRTC and includes only dtype.cuh.

#ifndef DROPLESS_DL_CUH
#define DROPLESS_DL_CUH

#include "dtype.cuh"

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define DL_FULL 0xffffffffu

// DL_FP8_CVT is 1 in device code for GPUs whose cvt converts pairs of f32 or f16 values
// to and from pairs of E4M3 or E5M2 codes: sm_90 and newer, and sm_89 with CUDA 12.1 or
// newer (older compilers reject those forms below sm_90); else 0, and kernels take the
// bit-exact software conversions of dtype.cuh.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900 || (__CUDA_ARCH__ >= 890 && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))))
#define DL_FP8_CVT 1
#else
#define DL_FP8_CVT 0
#endif

// dl_warp_sum returns the sum of v over the warp to every lane (butterfly order).
__device__ __forceinline__ float dl_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DL_FULL, v, o);
    return v;
}

// dl_warp_max returns the largest v over the warp to every lane.
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

// DL_STATUS_CODE builds word 0 of a status record: the package's domain, the op and
// the error code (1 to 255). See device.Status.
#define DL_STATUS_CODE(domain, op, code) \
    ((i64)(domain) << 16 | (i64)((op) & 0xff) << 8 | (i64)((code) & 0xff))

// dl_status_set records an error in status (a device.Status: I64[4], null for none):
// word 0 = code (nonzero, see DL_STATUS_CODE), words 1 to 3 = a, b and c. The first
// error recorded wins; later ones leave the record as it is.
__device__ __forceinline__ void dl_status_set(i64 *status, i64 code, i64 a, i64 b, i64 c) {
    if (status == 0) return;
    if (atomicCAS((u64 *)status, 0ull, (u64)code) == 0ull) {
        status[1] = a;
        status[2] = b;
        status[3] = c;
    }
}

#endif
