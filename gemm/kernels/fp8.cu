#include "dl.cuh"

// Dequantization of blockwise FP8 operands to bf16, for the portable GPU path of the
// RaggedDotBlockwise forms (then the bf16 ragged_dot runs on them): value =
// decode(q)·s in f32 (as package quant's dequantization), rounded to bf16. Layouts are
// package quant's (quant/blockwise.go). Element loops are grid-stride; nothing here is
// tuned: the Hopper kernels are the fast path.

__device__ __forceinline__ float dl_fp8_value(u8 q, int e5m2) { return e5m2 ? dl_e5m2_to_f32(q) : dl_e4m3_to_f32(q); }

// Rowwise form: out[m][k] = q[m][k]·scale[k/128][m], q [M, K], scale [ceil(K/128), mr].
extern "C" __global__ void dl_fp8_dequant_rows(const u8 *__restrict__ q, const float *__restrict__ scale, u16 *__restrict__ out, i64 M,
                                               i64 K, i64 mr, int e5m2) {
    const i64 n = M * K;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 m = i / K, k = i - m * K;
        out[i] = dl_f32_to_bf16(dl_fp8_value(q[i], e5m2) * scale[(k / 128) * mr + m]);
    }
}

// Weights: out[g][r][c] = q[g][r][c]·scales[g][kb][nb] with scales [G, sk, sn] and, for
// the [G, N, K] orientation (kmajor), kb = c/128 and nb = r/128, else kb = r/128 and
// nb = c/128.
extern "C" __global__ void dl_fp8_dequant_weights(const u8 *__restrict__ q, const float *__restrict__ scales, u16 *__restrict__ out, i64 G,
                                                  i64 R, i64 C, i64 sk, i64 sn, int kmajor, int e5m2) {
    const i64 n = G * R * C;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i % C, r = (i / C) % R, g = i / (R * C);
        const i64 kb = kmajor ? c / 128 : r / 128, nb = kmajor ? r / 128 : c / 128;
        out[i] = dl_f32_to_bf16(dl_fp8_value(q[i], e5m2) * scales[(g * sk + kb) * sn + nb]);
    }
}

// Columnwise form of rows in groups, back to rows: colt [K, mp] and scale [mp/128, K] give
// out [M, K], row off[g]+i from token column 128·tp[g] + i (i < size of g), where plan is
// the gemm plan of the sizes with 128-row tiles and one column tile (plan[0] valid,
// off[0..G] at plan[4], tp[0..G] at plan[5+G]). Rows no group owns are left as they are.
// Block (32, 8) handles a tile of 32 token columns × 32 features through shared memory, so
// that both the reads and the writes are coalesced; grid (mp/32, ceil(K/32)).
extern "C" __global__ void dl_fp8_dequant_colt(const u8 *__restrict__ colt, const float *__restrict__ scale, u16 *__restrict__ out,
                                               const int *__restrict__ plan, int G, i64 K, i64 mp, int e5m2) {
    __shared__ float tile[32][33];
    if (!plan[0]) return;
    const int *off = plan + 4, *tp = plan + 5 + G;
    const i64 p0 = (i64)blockIdx.x * 32, k0 = (i64)blockIdx.y * 32;
    const int t = (int)(p0 / 128);
    if (t >= tp[G]) return;
    // The group owning token block t: the largest g with tp[g] <= t (it has blocks, as
    // tp[g+1] > t).
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tp[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int g = lo, size = off[g + 1] - off[g];
    const i64 i0 = p0 - (i64)tp[g] * 128; // the tile's first token within its group
    for (int j = threadIdx.y; j < 32; j += 8) {
        const i64 k = k0 + j, p = p0 + threadIdx.x;
        tile[j][threadIdx.x] = k < K ? dl_fp8_value(colt[k * mp + p], e5m2) * scale[(p / 128) * K + k] : 0.f;
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const i64 i = i0 + j, k = k0 + threadIdx.x;
        if (i < size && k < K) out[((i64)off[g] + i) * K + k] = dl_f32_to_bf16(tile[threadIdx.x][j]);
    }
}
