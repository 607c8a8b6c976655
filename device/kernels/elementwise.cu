// Elementwise kernels of package device: fill, copy (dense, and of strided rectangles)
// and cast between the dtypes. Conversions come from dtype.cuh and are bit-identical to
// the Go code in dtype.go.
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

// A 16-byte chunk of a row, viewed as words of each width.
union dl_chunk {
    uint4 v;
    u64 d[2];
    u32 w[4];
    u16 h[8];
    u8 b[16];
};

// dl_ld_chunk loads the 16 bytes at p, W bytes at a time (p is W-byte aligned).
template <int W> __device__ __forceinline__ void dl_ld_chunk(dl_chunk &c, const u8 *p) {
    if (W == 16) {
        c.v = *(const uint4 *)p;
    } else if (W == 8) {
#pragma unroll
        for (int k = 0; k < 2; k++) c.d[k] = ((const u64 *)p)[k];
    } else if (W == 4) {
#pragma unroll
        for (int k = 0; k < 4; k++) c.w[k] = ((const u32 *)p)[k];
    } else if (W == 2) {
#pragma unroll
        for (int k = 0; k < 8; k++) c.h[k] = ((const u16 *)p)[k];
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) c.b[k] = p[k];
    }
}

// dl_st_chunk stores c at p, W bytes at a time (p is W-byte aligned).
template <int W> __device__ __forceinline__ void dl_st_chunk(u8 *p, const dl_chunk &c) {
    if (W == 16) {
        *(uint4 *)p = c.v;
    } else if (W == 8) {
#pragma unroll
        for (int k = 0; k < 2; k++) ((u64 *)p)[k] = c.d[k];
    } else if (W == 4) {
#pragma unroll
        for (int k = 0; k < 4; k++) ((u32 *)p)[k] = c.w[k];
    } else if (W == 2) {
#pragma unroll
        for (int k = 0; k < 8; k++) ((u16 *)p)[k] = c.h[k];
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) p[k] = c.b[k];
    }
}

// dl_copy_rect copies nrows rows of rowBytes bytes between two strided layouts: row r
// is row i = r mod rows of matrix b = r / rows, read at src + b·srcBatch + i·srcRow and
// written at dst + b·dstBatch + i·dstRow (strides in bytes). One block per row, striding
// over the rows when they outnumber the grid. Each thread moves 16-byte chunks of the
// row, loaded L and stored S bytes at a time (the alignments of the two sides' rows),
// then the last rowBytes mod 16 bytes one at a time.
template <int L, int S>
__device__ __forceinline__ void dl_copy_rect(u8 *__restrict__ dst, const u8 *__restrict__ src, u64 rows, u64 nrows, u64 rowBytes,
                                             u64 srcRow, u64 srcBatch, u64 dstRow, u64 dstBatch) {
    const u64 nchunks = rowBytes / 16;
    for (u64 r = blockIdx.x; r < nrows; r += gridDim.x) {
        const u64 b = r / rows, i = r - b * rows;
        const u8 *s = src + b * srcBatch + i * srcRow;
        u8 *d = dst + b * dstBatch + i * dstRow;
        for (u64 j = threadIdx.x; j < nchunks; j += blockDim.x) {
            dl_chunk c;
            dl_ld_chunk<L>(c, s + 16 * j);
            dl_st_chunk<S>(d + 16 * j, c);
        }
        for (u64 j = 16 * nchunks + threadIdx.x; j < rowBytes; j += blockDim.x) d[j] = s[j];
    }
}

// dl_copy_rect_L_S is dl_copy_rect with loads of L and stores of S bytes.
#define DL_COPY_RECT(L, S)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                                   \
        dl_copy_rect_##L##_##S(u8 *__restrict__ dst, const u8 *__restrict__ src, u64 rows, u64 nrows, u64 rowBytes,   \
                               u64 srcRow, u64 srcBatch, u64 dstRow, u64 dstBatch) {                                   \
        dl_copy_rect<L, S>(dst, src, rows, nrows, rowBytes, srcRow, srcBatch, dstRow, dstBatch);                      \
    }
#define DL_COPY_RECT_FROM(L)                                                                                            \
    DL_COPY_RECT(L, 1) DL_COPY_RECT(L, 2) DL_COPY_RECT(L, 4) DL_COPY_RECT(L, 8) DL_COPY_RECT(L, 16)

DL_COPY_RECT_FROM(1)
DL_COPY_RECT_FROM(2)
DL_COPY_RECT_FROM(4)
DL_COPY_RECT_FROM(8)
DL_COPY_RECT_FROM(16)
