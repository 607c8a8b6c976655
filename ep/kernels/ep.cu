// Kernels of package ep.
//
// Layout: a stable counting sort of routing entries by key (the destination rank of a
// token, or the local expert of a received entry) in four steps: count per block of
// rows, scan the counts per key over the blocks, offsets of the keys, and positions.
//
// Data: row gathers, replication of received rows into expert-major order, weighted
// sums for combine, the final sum of the partial rows each rank sends back, and the
// backward of combine. Row kernels give each row to one warp (blocks of up to EP_WARPS
// warps, looping over the rows). Sums run in float32 in a fixed order with __fadd_rn and __fmul_rn, so
// that nothing is contracted into an FMA and results are bit-identical to the Go code of
// the package (ep/cpu.go), which follows the same order.
#include "dl.cuh"

#define EP_MAX_ENTRIES 1024 // routing entries per block of the counting sort
#define EP_MAX_K 64         // the most routing entries per token
#define EP_WARPS 32         // the most warps per block of the row kernels (1024 threads)

// ---------------------------------------------------------------------------------
// Layout

// Marks the destination ranks of each token: keys[t*R + d] = d when one of token t's
// experts (idx[t*K + k], rank e / L) lives on rank d, else -1. Records the first bad
// entry (flat index t*K + k): bad[0] for an expert outside [-1, E), bad[1] for an expert
// repeated within a row. One thread per token.
extern "C" __global__ void ep_dest_keys(const int *__restrict__ idx, int T, int K, int E, int L, int R,
                                        int *__restrict__ keys, int *__restrict__ bad) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int *row = idx + (i64)t * K;
    int *out = keys + (i64)t * R;
    for (int d = 0; d < R; d++) out[d] = -1;
    for (int k = 0; k < K; k++) {
        int e = row[k];
        if (e == -1) continue;
        if (e < -1 || e >= E) {
            atomicMin(&bad[0], t * K + k);
            continue;
        }
        bool dup = false;
        for (int j = 0; j < k; j++) dup |= row[j] == e;
        if (dup) {
            atomicMin(&bad[1], t * K + k);
            continue;
        }
        out[e / L] = e / L;
    }
}

// Sort step 1: cnt[b*nkeys + key] = the entries of rows [b*cr, (b+1)*cr) holding key.
// Entry (row, w) is keys[row*stride + w], w < W; keys outside [0, nkeys) are skipped.
// One block per chunk of cr rows; dynamic shared memory of nkeys ints.
extern "C" __global__ void ep_sort_count(const int *__restrict__ keys, int n, int W, int stride, int nkeys, int cr,
                                         int *__restrict__ cnt) {
    extern __shared__ int sc[];
    for (int i = threadIdx.x; i < nkeys; i += blockDim.x) sc[i] = 0;
    __syncthreads();
    int r0 = blockIdx.x * cr;
    int m = min(cr, n - r0) * W;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        int key = keys[(i64)(r0 + i / W) * stride + i % W];
        if (key >= 0 && key < nkeys) atomicAdd(&sc[key], 1);
    }
    __syncthreads();
    int *out = cnt + (i64)blockIdx.x * nkeys;
    for (int i = threadIdx.x; i < nkeys; i += blockDim.x) out[i] = sc[i];
}

// Sort step 2: for key = blockIdx.x, replaces cnt[b*nkeys + key] by the count of that
// key in blocks before b, and writes the key's total. 256 threads per block.
extern "C" __global__ void __launch_bounds__(256) ep_sort_scan(int *__restrict__ cnt, int nb, int nkeys, int *__restrict__ total) {
    __shared__ int part[256];
    const int key = blockIdx.x;
    const int per = (nb + 255) / 256;
    const int b0 = min((int)threadIdx.x * per, nb), b1 = min(b0 + per, nb);
    int s = 0;
    for (int b = b0; b < b1; b++) s += cnt[(i64)b * nkeys + key];
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int i = 0; i < 256; i++) {
            int v = part[i];
            part[i] = run;
            run += v;
        }
        total[key] = run;
    }
    __syncthreads();
    int run = part[threadIdx.x];
    for (int b = b0; b < b1; b++) {
        i64 j = (i64)b * nkeys + key;
        int v = cnt[j];
        cnt[j] = run;
        run += v;
    }
}

// Sort step 3: off[key] = the entries of smaller keys; kept[key] (unless kept is null) =
// the entries of key whose position is below cap. One thread.
extern "C" __global__ void ep_sort_offsets(const int *__restrict__ total, int nkeys, int cap, int *__restrict__ off,
                                           int *__restrict__ kept) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 run = 0;
    for (int k = 0; k < nkeys; k++) {
        int c = total[k];
        off[k] = (int)run;
        if (kept) {
            i64 lo = run < cap ? run : cap, hi = run + c < cap ? run + c : cap;
            kept[k] = (int)(hi - lo);
        }
        run += c;
    }
}

// Sort step 4: pos[row*W + w] = off[key] + the rank of the entry among the entries of
// its key in (row, w) order, or -1 when the key is outside [0, nkeys) or the position is
// at or past cap. One block of 256 threads per chunk of cr rows (cr*W <= EP_MAX_ENTRIES);
// thread i walks the chunk's entries for keys i, i+256, ...
extern "C" __global__ void __launch_bounds__(256) ep_sort_assign(const int *__restrict__ keys, int n, int W, int stride,
                                                                 int nkeys, int cr, const int *__restrict__ cnt,
                                                                 const int *__restrict__ off, int cap, int *__restrict__ pos) {
    __shared__ int sk[EP_MAX_ENTRIES];
    const int r0 = blockIdx.x * cr;
    const int m = min(cr, n - r0) * W;
    if (m > EP_MAX_ENTRIES) return; // the host never asks for more
    int *out = pos + (i64)r0 * W;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        int key = keys[(i64)(r0 + i / W) * stride + i % W];
        sk[i] = key;
        if (key < 0 || key >= nkeys) out[i] = -1;
    }
    __syncthreads();
    for (int key = threadIdx.x; key < nkeys; key += blockDim.x) {
        int p = off[key] + cnt[(i64)blockIdx.x * nkeys + key];
        for (int i = 0; i < m; i++) {
            if (sk[i] == key) {
                out[i] = p < cap ? p : -1;
                p++;
            }
        }
    }
}

// Builds this rank's count rows, [R][4+L]: per rank d, T, bad[0], bad[1], tokens to d,
// then the entries of each of d's L experts.
extern "C" __global__ void ep_count_vec(const int *__restrict__ tok, const int *__restrict__ exp, const int *__restrict__ bad,
                                        int T, int R, int L, int *__restrict__ vec) {
    const int Wv = 4 + L;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < R * Wv; i += gridDim.x * blockDim.x) {
        int d = i / Wv, j = i % Wv, v;
        if (j == 0)
            v = T;
        else if (j == 1)
            v = bad[0];
        else if (j == 2)
            v = bad[1];
        else if (j == 3)
            v = tok[d];
        else
            v = exp[d * L + j - 4];
        vec[i] = v;
    }
}

// For each token t and rank d with row = sendRow[t*R + d] >= 0: sendTok[row] = t, and
// meta[row*(K+1) + k] = idx[t*K + k] - d*L when that expert lives on d, else -1;
// meta[row*(K+1) + K] = t. One thread per (t, d).
extern "C" __global__ void ep_pack_meta(const int *__restrict__ idx, const int *__restrict__ sendRow, int T, int K, int R,
                                        int L, int *__restrict__ sendTok, int *__restrict__ meta) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * R) return;
    const int t = (int)(i / R), d = (int)(i % R);
    const int row = sendRow[i];
    if (row < 0) return;
    sendTok[row] = t;
    int *m = meta + (i64)row * (K + 1);
    const int *e = idx + (i64)t * K;
    for (int k = 0; k < K; k++) {
        int x = e[k];
        m[k] = (x >= d * L && x < (d + 1) * L) ? x - d * L : -1;
    }
    m[K] = t;
}

// out[sl*3 .. sl*3+2] = (source rank, source token, k) for each kept slot sl =
// slot[j*K + k]; the source rank p of received row j is the one with recvOff[p] <= j <
// recvOff[p+1]. One thread per (j, k).
extern "C" __global__ void ep_origins(int *__restrict__ out, const int *__restrict__ slot, const int *__restrict__ meta,
                                      const int *__restrict__ recvOff, int R, i64 n, int K) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * K) return;
    const i64 j = i / K;
    const int k = (int)(i % K);
    const int sl = slot[i];
    if (sl < 0) return;
    int p = 0;
    while (p + 1 < R && recvOff[p + 1] <= j) p++;
    out[(i64)sl * 3] = p;
    out[(i64)sl * 3 + 1] = meta[j * (K + 1) + K];
    out[(i64)sl * 3 + 2] = k;
}

// ---------------------------------------------------------------------------------
// Rows

// The source row of row j: map[j], or j when map is null.
__device__ __forceinline__ i64 ep_row(const int *map, i64 j) { return map ? (i64)map[j] : j; }

// dst row j = src row ep_row(map, j), for j < n; rows of rowBytes bytes moved in units
// of V (rowBytes and both bases are multiples of sizeof(V)).
template <typename V>
__device__ __forceinline__ void ep_gather(u8 *__restrict__ dst, const u8 *__restrict__ src, const int *__restrict__ map,
                                          i64 n, i64 rowBytes) {
    const i64 nv = rowBytes / (i64)sizeof(V);
    const int lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < n; j += nw) {
        const V *s = (const V *)(src + ep_row(map, j) * rowBytes);
        V *d = (V *)(dst + j * rowBytes);
        for (i64 c = lane; c < nv; c += 128) {
            V v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (c + 32 * u < nv) v[u] = s[c + 32 * u];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (c + 32 * u < nv) d[c + 32 * u] = v[u];
        }
    }
}

#define EP_GATHER(N, V)                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) ep_gather_##N(u8 *__restrict__ dst, const u8 *__restrict__ src, \
                                                                    const int *__restrict__ map, i64 n, i64 rowBytes) { \
        ep_gather<V>(dst, src, map, n, rowBytes);                                                                  \
    }
EP_GATHER(v16, uint4)
EP_GATHER(v4, u32)
EP_GATHER(v1, u8)

// For each row j < n with source row r = ep_row(map, j) and each k with sl = slot[j*K +
// k] >= 0: X row sl = src row r, and Wout[sl] = srcW[r*K + k] unless Wout is null.
template <typename V>
__device__ __forceinline__ void ep_replicate(u8 *__restrict__ X, float *__restrict__ Wout, const u8 *__restrict__ src,
                                             const float *__restrict__ srcW, const int *__restrict__ map,
                                             const int *__restrict__ slot, i64 n, int K, i64 rowBytes) {
    __shared__ int ss[EP_WARPS][EP_MAX_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 nv = rowBytes / (i64)sizeof(V);
    const i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + warp; j < n; j += nw) {
        const i64 r = ep_row(map, j);
        __syncwarp();
        for (int k = lane; k < K; k += 32) {
            int sl = slot[j * K + k];
            ss[warp][k] = sl;
            if (Wout && sl >= 0) Wout[sl] = srcW[r * K + k];
        }
        __syncwarp();
        const V *s = (const V *)(src + r * rowBytes);
        for (i64 c = lane; c < nv; c += 128) {
            V v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (c + 32 * u < nv) v[u] = s[c + 32 * u];
            for (int k = 0; k < K; k++) {
                const int sl = ss[warp][k];
                if (sl < 0) continue;
                V *d = (V *)(X + (i64)sl * rowBytes);
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (c + 32 * u < nv) d[c + 32 * u] = v[u];
            }
        }
    }
}

#define EP_REPLICATE(N, V)                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                                \
        ep_replicate_##N(u8 *__restrict__ X, float *__restrict__ Wout, const u8 *__restrict__ src,                 \
                         const float *__restrict__ srcW, const int *__restrict__ map, const int *__restrict__ slot, \
                         i64 n, int K, i64 rowBytes) {                                                               \
        ep_replicate<V>(X, Wout, src, srcW, map, slot, n, K, rowBytes);                                              \
    }
EP_REPLICATE(v16, uint4)
EP_REPLICATE(v4, u32)
EP_REPLICATE(v1, u8)

// Element types of the arithmetic kernels: 0 f32, 1 bf16, 2 f16.
template <int DT> struct ep_ty;
template <> struct ep_ty<0> {
    typedef float T;
    static __device__ __forceinline__ float ld(float v) { return v; }
    static __device__ __forceinline__ float st(float v) { return v; }
};
template <> struct ep_ty<1> {
    typedef u16 T;
    static __device__ __forceinline__ float ld(u16 v) { return dl_bf16_to_f32(v); }
    static __device__ __forceinline__ u16 st(float v) { return dl_f32_to_bf16(v); }
};
template <> struct ep_ty<2> {
    typedef u16 T;
    static __device__ __forceinline__ float ld(u16 v) { return dl_f16_to_f32(v); }
    static __device__ __forceinline__ u16 st(float v) { return dl_f32_to_f16(v); }
};

// Loads elements [h, h+8) of the row at p (of H elements) as floats; past H they read
// as 0. vec: the 8 elements are in the row and 16-byte aligned.
template <int DT>
__device__ __forceinline__ void ep_ld8(const typename ep_ty<DT>::T *__restrict__ p, i64 h, i64 H, bool vec, float f[8]) {
    typedef ep_ty<DT> E;
    if (vec) {
        if constexpr (sizeof(typename E::T) == 4) {
            const uint4 a = *(const uint4 *)(p + h), b = *(const uint4 *)(p + h + 4);
            f[0] = __uint_as_float(a.x), f[1] = __uint_as_float(a.y), f[2] = __uint_as_float(a.z), f[3] = __uint_as_float(a.w);
            f[4] = __uint_as_float(b.x), f[5] = __uint_as_float(b.y), f[6] = __uint_as_float(b.z), f[7] = __uint_as_float(b.w);
        } else {
            const uint4 a = *(const uint4 *)(p + h);
            const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                f[2 * i] = E::ld((u16)(w[i] & 0xffffu));
                f[2 * i + 1] = E::ld((u16)(w[i] >> 16));
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = h + i < H ? E::ld(p[h + i]) : 0.f;
    }
}

// Stores f as elements [h, h+8) of the row at p, those below H.
template <int DT>
__device__ __forceinline__ void ep_st8(typename ep_ty<DT>::T *__restrict__ p, i64 h, i64 H, bool vec, const float f[8]) {
    typedef ep_ty<DT> E;
    if (vec) {
        if constexpr (sizeof(typename E::T) == 4) {
            *(uint4 *)(p + h) = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
            *(uint4 *)(p + h + 4) = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7]));
        } else {
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = (u32)E::st(f[2 * i]) | ((u32)E::st(f[2 * i + 1]) << 16);
            *(uint4 *)(p + h) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (h + i < H) p[h + i] = E::st(f[i]);
    }
}

// Eight elements as raw 16-byte words (two for f32), so that a lane can have several
// loads in flight before it converts any.
struct ep_pk {
    uint4 a, b;
};

// Loads elements [h, h+8) of the row at p, which lie in the row and are 16-byte aligned.
template <int DT>
__device__ __forceinline__ void ep_ldraw(const typename ep_ty<DT>::T *__restrict__ p, i64 h, ep_pk &k) {
    k.a = __ldg((const uint4 *)(p + h));
    if constexpr (sizeof(typename ep_ty<DT>::T) == 4) k.b = __ldg((const uint4 *)(p + h + 4));
}

// The floats of a pack of ep_ldraw.
template <int DT>
__device__ __forceinline__ void ep_unpack(const ep_pk &k, float f[8]) {
    typedef ep_ty<DT> E;
    if constexpr (sizeof(typename E::T) == 4) {
        f[0] = __uint_as_float(k.a.x), f[1] = __uint_as_float(k.a.y), f[2] = __uint_as_float(k.a.z), f[3] = __uint_as_float(k.a.w);
        f[4] = __uint_as_float(k.b.x), f[5] = __uint_as_float(k.b.y), f[6] = __uint_as_float(k.b.z), f[7] = __uint_as_float(k.b.w);
    } else {
        const u32 w[4] = {k.a.x, k.a.y, k.a.z, k.a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = E::ld((u16)(w[i] & 0xffffu));
            f[2 * i + 1] = E::ld((u16)(w[i] >> 16));
        }
    }
}

// A lane's share of a float32 sum of rows of H elements: U pieces of 8 elements, from
// element h0 on, 256 apart (with vec; without, one piece). add loads all its pieces
// before it adds any, so that U loads are in flight; U is smaller for f32, whose pieces
// take twice the registers. The sums run in a fixed order with __fadd_rn and __fmul_rn.
template <int DT> struct ep_rowsum {
    typedef typename ep_ty<DT>::T T;
    static constexpr int U = sizeof(T) == 4 ? 2 : 4;
    float acc[U][8];

    // The distance between a lane's successive h0.
    static __device__ __forceinline__ i64 step(int vec) { return vec ? 256 * U : 256; }

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[u][i] = 0.f;
    }

    // add adds w times the pieces of row p (MUL false: the pieces themselves).
    template <bool MUL> __device__ __forceinline__ void add(const T *__restrict__ p, i64 h0, i64 H, int vec, float w) {
        if (!vec) {
            float v[8];
            ep_ld8<DT>(p, h0, H, false, v);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[0][i] = __fadd_rn(acc[0][i], MUL ? __fmul_rn(w, v[i]) : v[i]);
            return;
        }
        ep_pk pk[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (h0 + 256 * u < H) ep_ldraw<DT>(p, h0 + 256 * u, pk[u]);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (h0 + 256 * u >= H) continue;
            float v[8];
            ep_unpack<DT>(pk[u], v);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[u][i] = __fadd_rn(acc[u][i], MUL ? __fmul_rn(w, v[i]) : v[i]);
        }
    }

    // store writes the pieces, rounded to the element type, into row p.
    __device__ __forceinline__ void store(T *__restrict__ p, i64 h0, i64 H, int vec) const {
#pragma unroll
        for (int u = 0; u < U; u++)
            if ((u == 0 || vec) && h0 + 256 * u < H) ep_st8<DT>(p, h0 + 256 * u, H, vec, acc[u]);
    }
};

// Loads a row's slots (and their weights: W[sl], or 1 when W is null) into shared memory
// for the warp.
__device__ __forceinline__ void ep_load_slots(int *ss, float *sw, const int *__restrict__ slot, const float *__restrict__ W,
                                              i64 j, int K, int lane) {
    __syncwarp();
    for (int k = lane; k < K; k += 32) {
        const int sl = slot[j * K + k];
        ss[k] = sl;
        sw[k] = (W && sl >= 0) ? W[sl] : 1.f;
    }
    __syncwarp();
}

// dst row j = sum over k with sl = slot[j*K + k] >= 0, in k order, of W[sl] * y row sl
// (W null: 1), in float32 from 0, rounded to the element type.
template <int DT>
__device__ __forceinline__ void ep_wsum(typename ep_ty<DT>::T *__restrict__ dst, const typename ep_ty<DT>::T *__restrict__ y,
                                        const float *__restrict__ W, const int *__restrict__ slot, i64 n, int K, i64 H, int vec) {
    __shared__ int ss[EP_WARPS][EP_MAX_K];
    __shared__ float sw[EP_WARPS][EP_MAX_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + warp; j < n; j += nw) {
        ep_load_slots(ss[warp], sw[warp], slot, W, j, K, lane);
        for (i64 h0 = (i64)lane * 8; h0 < H; h0 += ep_rowsum<DT>::step(vec)) {
            ep_rowsum<DT> sum;
            sum.zero();
            for (int k = 0; k < K; k++) {
                const int sl = ss[warp][k];
                if (sl >= 0) sum.template add<true>(y + (i64)sl * H, h0, H, vec, sw[warp][k]);
            }
            sum.store(dst + j * H, h0, H, vec);
        }
    }
}

// The start of chunk c of C of a segment of n rows: the end chunks weigh one unit, those
// between three (chunk and chunkStart in ep/ops.go).
__device__ __forceinline__ i64 ep_chunk_lo(i64 n, int c, int C) {
    const i64 units = C <= 1 ? 1 : 3 * C - 4;
    const i64 start = c <= 0 ? 0 : (c >= C ? units : 1 + 3 * (c - 1));
    return n * start / units;
}

// The chunk of C that row i of a segment of n rows lies in (chunkOf in ep/ops.go).
__device__ __forceinline__ int ep_chunk_of(i64 i, i64 n, int C) {
    for (int c = C - 1; c > 0; c--)
        if (i >= ep_chunk_lo(n, c, C)) return c;
    return 0;
}

// out row t = sum over d < R with r = sendRow[t*R + d] >= 0, in d order, of back row r,
// in float32 from 0, rounded to the element type. With sendOff (I32 [R+1], not null),
// only for the tokens whose last row from a rank other than rank lies in chunk c of C of
// that rank's segment (c = -1: tokens with none).
template <int DT>
__device__ __forceinline__ void ep_final_sum(typename ep_ty<DT>::T *__restrict__ out, const typename ep_ty<DT>::T *__restrict__ back,
                                             const int *__restrict__ sendRow, i64 T, int R, i64 H, int vec,
                                             const int *__restrict__ sendOff, int rank, int C, int c) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + warp; t < T; t += nw) {
        const int *rows = sendRow + t * R;
        if (sendOff) {
            int last = -1;
            for (int d = 0; d < R; d++) {
                const int q = __ldg(rows + d);
                if (d == rank || q < 0) continue;
                const int lo = __ldg(sendOff + d);
                last = max(last, ep_chunk_of(q - lo, __ldg(sendOff + d + 1) - lo, C));
            }
            if (last != c) continue;
        }
        for (i64 h0 = (i64)lane * 8; h0 < H; h0 += ep_rowsum<DT>::step(vec)) {
            ep_rowsum<DT> sum;
            sum.zero();
            for (int d = 0; d < R; d++) {
                const int r = __ldg(rows + d);
                if (r >= 0) sum.template add<false>(back + (i64)r * H, h0, H, vec, 1.f);
            }
            sum.store(out + t * H, h0, H, vec);
        }
    }
}

// Combine's backward: for row j < n with source row g = src row ep_row(map, j), and each
// k with sl = slot[j*K + k] >= 0: dy row sl = W[sl] * g (W null: 1), rounded to the
// element type; and, unless dw or y is null, dw[sl] = <y row sl, g>: lane l sums, from
// 0 and in order, the products of the elements of the 8-element groups l, l+32, ..., and
// a butterfly over lane distances 16, 8, 4, 2, 1 adds the lanes' sums.
template <int DT>
__device__ __forceinline__ void ep_rscale(typename ep_ty<DT>::T *__restrict__ dy, float *__restrict__ dw,
                                          const typename ep_ty<DT>::T *__restrict__ src, const int *__restrict__ map,
                                          const int *__restrict__ slot, const float *__restrict__ W,
                                          const typename ep_ty<DT>::T *__restrict__ y, i64 n, int K, i64 H, int vec) {
    __shared__ int ss[EP_WARPS][EP_MAX_K];
    __shared__ float sw[EP_WARPS][EP_MAX_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    const bool dot = dw != 0 && y != 0;
    for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + warp; j < n; j += nw) {
        ep_load_slots(ss[warp], sw[warp], slot, W, j, K, lane);
        const typename ep_ty<DT>::T *g = src + ep_row(map, j) * H;
        for (int k = 0; k < K; k++) {
            const int sl = ss[warp][k];
            if (sl < 0) continue;
            const float w = sw[warp][k];
            float part = 0.f;
            for (i64 h = (i64)lane * 8; h < H; h += 256) {
                float gv[8], o[8];
                ep_ld8<DT>(g, h, H, vec, gv);
#pragma unroll
                for (int i = 0; i < 8; i++) o[i] = __fmul_rn(w, gv[i]);
                ep_st8<DT>(dy + (i64)sl * H, h, H, vec, o);
                if (dot) {
                    float yv[8];
                    ep_ld8<DT>(y + (i64)sl * H, h, H, vec, yv);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (h + i < H) part = __fadd_rn(part, __fmul_rn(yv[i], gv[i]));
                }
            }
            if (dot) {
                part = dl_warp_sum(part);
                if (lane == 0) dw[sl] = part;
            }
        }
    }
}

#define EP_ARITH(N, DT)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(1024)                                                                     \
        ep_wsum_##N(ep_ty<DT>::T *__restrict__ dst, const ep_ty<DT>::T *__restrict__ y, const float *__restrict__ W,      \
                    const int *__restrict__ slot, i64 n, int K, i64 H, int vec) {                                         \
        ep_wsum<DT>(dst, y, W, slot, n, K, H, vec);                                                                       \
    }                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(1024)                                                                     \
        ep_final_sum_##N(ep_ty<DT>::T *__restrict__ out, const ep_ty<DT>::T *__restrict__ back,                           \
                         const int *__restrict__ sendRow, i64 T, int R, i64 H, int vec, const int *__restrict__ sendOff,  \
                         int rank, int C, int c) {                                                                        \
        ep_final_sum<DT>(out, back, sendRow, T, R, H, vec, sendOff, rank, C, c);                                          \
    }                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(1024)                                                                     \
        ep_rscale_##N(ep_ty<DT>::T *__restrict__ dy, float *__restrict__ dw, const ep_ty<DT>::T *__restrict__ src,        \
                      const int *__restrict__ map, const int *__restrict__ slot, const float *__restrict__ W,             \
                      const ep_ty<DT>::T *__restrict__ y, i64 n, int K, i64 H, int vec) {                                 \
        ep_rscale<DT>(dy, dw, src, map, slot, W, y, n, K, H, vec);                                                        \
    }
EP_ARITH(f32, 0)
EP_ARITH(bf16, 1)
EP_ARITH(f16, 2)

// Transpose of 4-byte elements: dst[j*ldd + i] = src[i*lds + j] for i < rows, j < cols
// (the blockwise FP8 scales between quant's layout, scale blocks outer and rows
// contiguous, and one row of scales per token, which the row kernels move). Tiles of
// 32×32 through shared memory, blocks of 32×8 threads, looping over the row tiles past
// gridDim.y.
extern "C" __global__ void __launch_bounds__(256) ep_transpose4(u32 *__restrict__ dst, const u32 *__restrict__ src, i64 rows,
                                                                i64 cols, i64 ldd, i64 lds) {
    __shared__ u32 t[32][33];
    const i64 j0 = (i64)blockIdx.x * 32;
    for (i64 i0 = (i64)blockIdx.y * 32; i0 < rows; i0 += (i64)gridDim.y * 32) {
        for (int y = threadIdx.y; y < 32; y += 8) {
            const i64 i = i0 + y, j = j0 + threadIdx.x;
            if (i < rows && j < cols) t[y][threadIdx.x] = src[i * lds + j];
        }
        __syncthreads();
        for (int y = threadIdx.y; y < 32; y += 8) {
            const i64 j = j0 + y, i = i0 + threadIdx.x;
            if (i < rows && j < cols) dst[j * ldd + i] = t[threadIdx.x][y];
        }
        __syncthreads();
    }
}

// dst[i] = dW[slot[i]], or 0 where slot[i] < 0, for i < nk.
extern "C" __global__ void ep_dw_pack(float *__restrict__ dst, const int *__restrict__ slot, const float *__restrict__ dW, i64 nk) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nk) return;
    const int sl = slot[i];
    dst[i] = sl >= 0 ? dW[sl] : 0.f;
}

// dweights[t*K + k] = back[sendRow[t*R + e/L]*K + k] for e = idx[t*K + k] >= 0, else 0.
extern "C" __global__ void ep_dw_unpack(float *__restrict__ dweights, const int *__restrict__ idx, const int *__restrict__ sendRow,
                                        const float *__restrict__ back, int T, int K, int R, int L) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * K) return;
    const int e = idx[i];
    float v = 0.f;
    if (e >= 0) {
        const int row = sendRow[(i / K) * R + e / L];
        if (row >= 0) v = back[(i64)row * K + i % K];
    }
    dweights[i] = v;
}

// ---------------------------------------------------------------------------------
// Direct transfers between GPUs

// Sets the 32-bit word at byte off of every other rank's window (bases[p], as this
// device addresses it) to v, after the writes this device made before: the kernels
// before it on the stream are done, and the fence orders what they wrote to the peers
// before the flag. Thread p writes rank p's word; rank me is skipped.
extern "C" __global__ void ep_signal(const u64 *__restrict__ bases, int R, int me, i64 off, u32 v) {
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= R || p == me) return;
    __threadfence_system();
    u32 *flag = (u32 *)(bases[p] + off);
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(v) : "memory");
}
