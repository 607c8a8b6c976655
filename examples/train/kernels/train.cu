// Kernels of the training example: the dense parts of the model around the MoE layers.
// Row-major tensors; the residual stream, norms' statistics, logits, weights and gradients
// are f32, AdamW's moments f32 or bf16; the inputs of the MoE layers and of the output
// projection, and the gradients that flow into them (the copy of the residual stream's
// gradient that the embedding's gradient also reads), are of the compute type T (f32 or
// bf16: kernels named _f32 and _bf16). Token ids are int32. Every sum has a fixed order (no
// atomics on floats), so results do not change from run to run.

#include "dl.cuh"

__device__ __forceinline__ float tr_ld(const float *p) { return *p; }
__device__ __forceinline__ float tr_ld(const u16 *p) { return dl_bf16_to_f32(*p); }
__device__ __forceinline__ void tr_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void tr_st(u16 *p, float v) { *p = dl_f32_to_bf16(v); }

// The bf16 copies of four elements, for one 8-byte store.
__device__ __forceinline__ uint2 tr_bf16x4(float4 p) {
    return make_uint2((u32)dl_f32_to_bf16(p.x) | ((u32)dl_f32_to_bf16(p.y) << 16),
                      (u32)dl_f32_to_bf16(p.z) | ((u32)dl_f32_to_bf16(p.w) << 16));
}

// Four consecutive elements, 16-byte aligned for f32 and 8-byte aligned for bf16: as loaded
// (tr_raw_ld4, of type tr_raw4<T>::t), widened to f32 (tr_wide4), or both (tr_ld4).
template <typename T>
struct tr_raw4;
template <>
struct tr_raw4<float> {
    typedef float4 t;
};
template <>
struct tr_raw4<u16> {
    typedef uint2 t;
};
__device__ __forceinline__ float4 tr_raw_ld4(const float *p) { return *reinterpret_cast<const float4 *>(p); }
__device__ __forceinline__ uint2 tr_raw_ld4(const u16 *p) { return *reinterpret_cast<const uint2 *>(p); }
__device__ __forceinline__ float4 tr_wide4(float4 r) { return r; }
__device__ __forceinline__ float4 tr_wide4(uint2 u) {
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}
template <typename T>
__device__ __forceinline__ float4 tr_ld4(const T *p) {
    return tr_wide4(tr_raw_ld4(p));
}
__device__ __forceinline__ void tr_st4(float *p, float4 v) { *reinterpret_cast<float4 *>(p) = v; }
__device__ __forceinline__ void tr_st4(u16 *p, float4 v) { *reinterpret_cast<uint2 *>(p) = tr_bf16x4(v); }
// The same, with the streaming cache hint (ld.global.cs, st.global.cs: evicted first from
// L1 and L2), for data that passes once, such as AdamW's, so that it does not push out of
// L2 what the kernels beside it reuse.
__device__ __forceinline__ float4 tr_raw_ld4_cs(const float *p) { return __ldcs(reinterpret_cast<const float4 *>(p)); }
__device__ __forceinline__ uint2 tr_raw_ld4_cs(const u16 *p) { return __ldcs(reinterpret_cast<const uint2 *>(p)); }
__device__ __forceinline__ void tr_st4_cs(float *p, float4 v) { __stcs(reinterpret_cast<float4 *>(p), v); }
__device__ __forceinline__ void tr_st4_cs(u16 *p, float4 v) { __stcs(reinterpret_cast<uint2 *>(p), tr_bf16x4(v)); }

__device__ __forceinline__ void tr_add4(float4 &a, float4 e) {
    a.x += e.x;
    a.y += e.y;
    a.z += e.z;
    a.w += e.w;
}

#define TR_EMB_VEC 4    // groups of 4 columns a thread of tr_embed_norm keeps with vec
#define TR_EMB_FLIGHT 8 // table rows whose loads tr_embed_norm issues before it adds them

// One block of 256 threads per row b: h[b, :] = sum over w < W of emb[w*V + tok[b*ld + w], :],
// added in increasing w (ids outside [0, V) add nothing), then its RMS norm without a scale:
// rstd[b] = 1/sqrt(mean(h[b, :]²) + eps) and xn[b, :] = T(h[b, :]·rstd[b]). Warp 0 lists the
// table rows of the row's valid ids once, in increasing w, in dynamic shared memory (W ints),
// so that the sums need no branch. With vec (H a multiple of 4 and at most
// 4·TR_EMB_VEC·blockDim.x; emb, h and xn 16-byte aligned, 8 for bf16; emb under 2 GiB, the
// list then holding the rows' byte offsets) a thread adds up to TR_EMB_VEC groups of 4 columns
// with 16-byte loads, TR_EMB_FLIGHT table rows in flight, and keeps them in registers for the
// norm; else one column at a time.
template <typename T>
__device__ void tr_embed_norm(float *__restrict__ h, T *__restrict__ xn, float *__restrict__ rstd,
                              const float *__restrict__ emb, const int *__restrict__ tok, int B, int W,
                              int ld, int V, int H, float eps, int vec) {
    extern __shared__ int tr_rows[];
    __shared__ float red[32];
    __shared__ int nrows;
    int b = blockIdx.x;
    if (b >= B) return;
    if (threadIdx.x < 32) {
        const int *tb = tok + (i64)b * ld;
        int lane = threadIdx.x, n = 0;
        for (int w0 = 0; w0 < W; w0 += 32) {
            int w = w0 + lane, v = w < W ? tb[w] : -1;
            bool ok = v >= 0 && v < V;
            unsigned m = __ballot_sync(DL_FULL, ok);
            if (ok) tr_rows[n + __popc(m & ((1u << lane) - 1u))] = (w * V + v) * (vec ? 4 * H : 1);
            n += __popc(m);
        }
        if (lane == 0) nrows = n;
    }
    __syncthreads();
    const int n = nrows;
    float *hr = h + (i64)b * H;
    float ss = 0.f;
    if (vec) {
        const int H4 = H >> 2;
        float4 acc[TR_EMB_VEC];
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j4 < H4) {
                const char *ej = reinterpret_cast<const char *>(emb + 4 * j4); // + a row's byte offset
                int i = 0;
                for (; i + TR_EMB_FLIGHT <= n; i += TR_EMB_FLIGHT) {
                    float4 e[TR_EMB_FLIGHT];
#pragma unroll
                    for (int u = 0; u < TR_EMB_FLIGHT; u++)
                        e[u] = tr_ld4(reinterpret_cast<const float *>(ej + tr_rows[i + u]));
#pragma unroll
                    for (int u = 0; u < TR_EMB_FLIGHT; u++) tr_add4(a, e[u]);
                }
                for (; i < n; i++) tr_add4(a, tr_ld4(reinterpret_cast<const float *>(ej + tr_rows[i])));
                tr_st4(hr + 4 * j4, a);
                ss += a.x * a.x;
                ss += a.y * a.y;
                ss += a.z * a.z;
                ss += a.w * a.w;
            }
            acc[q] = a;
        }
        ss = dl_block_sum(ss, red);
        float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            float4 a = acc[q];
            if (j4 < H4) tr_st4(xn + (i64)b * H + 4 * j4, make_float4(a.x * r, a.y * r, a.z * r, a.w * r));
        }
        if (threadIdx.x == 0) rstd[b] = r;
        return;
    }
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < n; i++) acc += emb[(i64)tr_rows[i] * H + j];
        hr[j] = acc;
        ss += acc * acc;
    }
    ss = dl_block_sum(ss, red);
    float r = 1.f / sqrtf(ss / (float)H + eps);
    for (int j = threadIdx.x; j < H; j += blockDim.x) tr_st(&xn[(i64)b * H + j], hr[j] * r);
    if (threadIdx.x == 0) rstd[b] = r;
}

// One block per row b: ho[b, :] = hi[b, :] + y[b, :], the residual add of a block, then
// its RMS norm as tr_embed_norm's. ho must not alias hi or y. (The two paths add the
// squares in different orders, so rstd may differ in its last bit between them: each
// path is deterministic.) With vec (as tr_embed_norm's:
// H a multiple of 4 and at most 4·TR_EMB_VEC·blockDim.x, the rows 16-byte aligned, 8 for
// bf16) a thread loads up to TR_EMB_VEC groups of 4 columns of hi and y at once and keeps
// the sums in registers for the norm; else one column at a time.
template <typename T>
__device__ void tr_add_norm(float *__restrict__ ho, T *__restrict__ xn, float *__restrict__ rstd,
                            const float *__restrict__ hi, const T *__restrict__ y, int B, int H, float eps,
                            int vec) {
    __shared__ float red[32];
    int b = blockIdx.x;
    if (b >= B) return;
    i64 o = (i64)b * H;
    float ss = 0.f;
    if (vec) {
        const int H4 = H >> 2;
        float4 a[TR_EMB_VEC];
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            a[q] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j4 < H4) {
                a[q] = tr_ld4(hi + o + 4 * j4);
                tr_add4(a[q], tr_ld4(y + o + 4 * j4));
            }
        }
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            if (j4 < H4) {
                tr_st4(ho + o + 4 * j4, a[q]);
                ss += a[q].x * a[q].x;
                ss += a[q].y * a[q].y;
                ss += a[q].z * a[q].z;
                ss += a[q].w * a[q].w;
            }
        }
        ss = dl_block_sum(ss, red);
        float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            if (j4 < H4) tr_st4(xn + o + 4 * j4, make_float4(a[q].x * r, a[q].y * r, a[q].z * r, a[q].w * r));
        }
        if (threadIdx.x == 0) rstd[b] = r;
        return;
    }
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float v = hi[o + j] + tr_ld(&y[o + j]);
        ho[o + j] = v;
        ss += v * v;
    }
    ss = dl_block_sum(ss, red);
    float r = 1.f / sqrtf(ss / (float)H + eps);
    for (int j = threadIdx.x; j < H; j += blockDim.x) tr_st(&xn[o + j], ho[o + j] * r);
    if (threadIdx.x == 0) rstd[b] = r;
}

// Gradient of the RMS norm of x (f32 [B, H]) with 1/rms rstd: with xn = x·rstd
// (recomputed as the forward computed it), v = rstd·(dxn − xn·mean(dxn·xn)); dx = v, or
// dx += v when accumulate; when dxc is not null it also receives T(dx), the copy the
// next MoE layer's backward reads. One block per row. With vec (as tr_add_norm's, dx and
// dxc aligned too) a thread loads up to TR_EMB_VEC groups of 4 columns of dxn, x and dx at
// once and keeps them in registers between the two passes; else one column at a time.
template <typename T>
__device__ void tr_norm_bwd(float *__restrict__ dx, T *__restrict__ dxc, const T *__restrict__ dxn,
                            const float *__restrict__ x, const float *__restrict__ rstd, int B, int H,
                            int accumulate, int vec, int copyonly) {
    __shared__ float red[32];
    int b = blockIdx.x;
    if (b >= B) return;
    i64 o = (i64)b * H;
    float r = rstd[b];
    float dot = 0.f;
    if (vec) {
        const int H4 = H >> 2;
        float4 g[TR_EMB_VEC], xr[TR_EMB_VEC], d0[TR_EMB_VEC];
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            g[q] = xr[q] = d0[q] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j4 < H4) {
                g[q] = tr_ld4(dxn + o + 4 * j4);
                xr[q] = tr_ld4(x + o + 4 * j4);
                if (accumulate) d0[q] = tr_ld4(dx + o + 4 * j4);
            }
        }
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            if (threadIdx.x + q * blockDim.x < H4) {
                dot += g[q].x * (xr[q].x * r);
                dot += g[q].y * (xr[q].y * r);
                dot += g[q].z * (xr[q].z * r);
                dot += g[q].w * (xr[q].w * r);
            }
        }
        float mean = dl_block_sum(dot, red) / (float)H;
#pragma unroll
        for (int q = 0; q < TR_EMB_VEC; q++) {
            int j4 = threadIdx.x + q * blockDim.x;
            if (j4 >= H4) continue;
            float4 d = make_float4(r * (g[q].x - (xr[q].x * r) * mean), r * (g[q].y - (xr[q].y * r) * mean),
                                   r * (g[q].z - (xr[q].z * r) * mean), r * (g[q].w - (xr[q].w * r) * mean));
            if (accumulate) {
                d.x = d0[q].x + d.x;
                d.y = d0[q].y + d.y;
                d.z = d0[q].z + d.z;
                d.w = d0[q].w + d.w;
            }
            if (!copyonly) tr_st4(dx + o + 4 * j4, d);
            if (dxc != 0) tr_st4(dxc + o + 4 * j4, d);
        }
        return;
    }
    for (int j = threadIdx.x; j < H; j += blockDim.x) dot += tr_ld(&dxn[o + j]) * (x[o + j] * r);
    float mean = dl_block_sum(dot, red) / (float)H;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float v = r * (tr_ld(&dxn[o + j]) - (x[o + j] * r) * mean);
        float d = accumulate ? dx[o + j] + v : v;
        if (!copyonly) dx[o + j] = d;
        if (dxc != 0) tr_st(&dxc[o + j], d);
    }
}

// Softmax cross-entropy of logits (f32 [B, V]) against targets tok[b*ld + col], one warp
// per row: loss[b] += log Σ exp(logits[b, :]) − logits[b, target]; when dlogits is not
// null, dlogits[b, :] = T((softmax(logits[b, :]) − onehot(target))·scale). A target
// outside [0, V) adds nothing and gets a zero gradient.
template <typename T>
__device__ void tr_softmax_ce(float *__restrict__ loss, T *__restrict__ dlogits, const float *__restrict__ logits,
                              const int *__restrict__ tok, int B, int V, int ld, int col, float scale) {
    int b = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (b >= B) return; // whole warps leave together
    const float *z = logits + (i64)b * V;
    int t = tok[(i64)b * ld + col];
    bool valid = t >= 0 && t < V;
    float m = __uint_as_float(0xff800000u); // -inf
    for (int j = lane; j < V; j += 32) m = fmaxf(m, z[j]);
    m = dl_warp_max(m);
    float se = 0.f;
    for (int j = lane; j < V; j += 32) se += expf(z[j] - m);
    se = dl_warp_sum(se);
    if (lane == 0 && valid) loss[b] += logf(se) + m - z[t];
    if (dlogits == 0) return;
    float inv = 1.f / se;
    T *d = dlogits + (i64)b * V;
    for (int j = lane; j < V; j += 32) {
        float p = valid ? expf(z[j] - m) * inv : 0.f;
        tr_st(&d[j], (p - (j == t ? 1.f : 0.f)) * scale);
    }
}

#define TR_TYPED(NAME, T)                                                                                      \
    extern "C" __global__ void tr_embed_norm_##NAME(float *h, T *xn, float *rstd, const float *emb,            \
                                                    const int *tok, int B, int W, int ld, int V, int H,        \
                                                    float eps, int vec) {                                      \
        tr_embed_norm<T>(h, xn, rstd, emb, tok, B, W, ld, V, H, eps, vec);                                     \
    }                                                                                                          \
    extern "C" __global__ void tr_add_norm_##NAME(float *ho, T *xn, float *rstd, const float *hi, const T *y, \
                                                  int B, int H, float eps, int vec) {                          \
        tr_add_norm<T>(ho, xn, rstd, hi, y, B, H, eps, vec);                                                   \
    }                                                                                                          \
    extern "C" __global__ void tr_norm_bwd_##NAME(float *dx, T *dxc, const T *dxn, const float *x,             \
                                                  const float *rstd, int B, int H, int accumulate, int vec,    \
                                                  int copyonly) {                                              \
        tr_norm_bwd<T>(dx, dxc, dxn, x, rstd, B, H, accumulate, vec, copyonly);                                \
    }                                                                                                          \
    extern "C" __global__ void tr_softmax_ce_##NAME(float *loss, T *dlogits, const float *logits,              \
                                                    const int *tok, int B, int V, int ld, int col,             \
                                                    float scale) {                                             \
        tr_softmax_ce<T>(loss, dlogits, logits, tok, B, V, ld, col, scale);                                    \
    }

TR_TYPED(f32, float)
TR_TYPED(bf16, u16)

// The rows of each embedding position, grouped by token: one block of 256 threads per
// position w. perm[w*B + i], i in [offs[w*(V+1) + v], offs[w*(V+1) + v + 1]), are the
// rows b with tok[b*ld + w] == v, in increasing b (a stable counting sort; ids outside
// [0, V) are left out). Dynamic shared memory: (9*V + 1) ints.
extern "C" __global__ void __launch_bounds__(256) tr_embed_sort(int *__restrict__ perm, int *__restrict__ offs,
                                                                const int *__restrict__ tok, int B, int ld, int V) {
    extern __shared__ int tr_sm[];
    int *base = tr_sm;         // [V+1]: next free place of each token's rows
    int *cnt = tr_sm + V + 1;  // [8][V]: a tile's rows of each token, per warp
    int w = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (blockDim.x != 256) return;
    for (int v = tid; v <= V; v += 256) base[v] = 0;
    __syncthreads();
    for (int b = tid; b < B; b += 256) {
        int v = tok[(i64)b * ld + w];
        if (v >= 0 && v < V) atomicAdd(&base[v], 1); // integer counts: any order gives the same
    }
    __syncthreads();
    // Exclusive scan of base[0, V) by warp 0: each lane scans a contiguous run.
    if (wid == 0) {
        int per = (V + 31) / 32, lo = min(lane * per, V), hi = min(lo + per, V);
        int run = 0;
        for (int v = lo; v < hi; v++) run += base[v];
        int incl = run;
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(DL_FULL, incl, o);
            if (lane >= o) incl += u;
        }
        int acc = incl - run;
        for (int v = lo; v < hi; v++) {
            int c = base[v];
            base[v] = acc;
            acc += c;
        }
        if (lane == 31) base[V] = incl;
    }
    __syncthreads();
    int *ow = offs + (i64)w * (V + 1);
    for (int v = tid; v <= V; v += 256) ow[v] = base[v];
    int *pw = perm + (i64)w * B;
    unsigned below = (1u << lane) - 1u;
    int next = tid < B ? tok[(i64)tid * ld + w] : -1; // the tile's token, loaded a tile ahead
    for (int b0 = 0; b0 < B; b0 += 256) {
        int v = next;
        if (b0 + 256 + tid < B) next = tok[(i64)(b0 + 256 + tid) * ld + w];
        for (int i = tid; i < 8 * V; i += 256) cnt[i] = 0;
        __syncthreads();
        int b = b0 + tid;
        bool valid = b < B && v >= 0 && v < V;
        unsigned m = __match_any_sync(DL_FULL, valid ? v : -1);
        int rank = __popc(m & below);
        if (valid && rank == 0) cnt[wid * V + v] = __popc(m);
        __syncthreads();
        if (valid) {
            int pos = base[v] + rank;
            for (int q = 0; q < wid; q++) pos += cnt[q * V + v];
            pw[pos] = b;
        }
        __syncthreads();
        for (int u = tid; u < V; u += 256) {
            int s = 0;
            for (int q = 0; q < 8; q++) s += cnt[q * V + u];
            base[u] += s;
        }
        __syncthreads();
    }
}

#define TR_EMB_PARTS 8  // warps of tr_embed_bwd: the parts each row's contributions are summed in
#define TR_EMB_COLS 128 // columns of tr_embed_bwd's block: 4 a lane, 32 apart
static_assert(TR_EMB_COLS == 4 * 32 && TR_EMB_COLS <= 32 * TR_EMB_PARTS, "tr_embed_bwd: 4 columns a lane, one block-wide sum");

// Gradient of the embedding table from tr_embed_sort's grouping: demb[w*V + v, j] = the sum
// of dh[b, j] (f32, or bf16 widened exactly: tr_embed_bwd_f32 and tr_embed_bwd_bf16) over
// the n rows b of (w, v) in increasing b, cut into TR_EMB_PARTS parts of
// q = ceil(n / TR_EMB_PARTS) rows (the last ones shorter or empty): each part added up in
// f32 in order from zero by one warp, the parts' sums then added in order,
// (((s0 + s1) + s2) + …), as embedBackward's CPU twin does. Grid (W*V, ceil(H / TR_EMB_COLS)),
// blocks of 32·TR_EMB_PARTS threads; every row of demb is written (zero for tokens absent at
// w). A lane keeps 4 columns of 4 rows in flight, so a row of 1,000 contributions (a
// frequent byte) is 32 rounds of loads, not 250 (one thread a column, four rows in flight).
template <typename T>
__device__ __forceinline__ void tr_embed_bwd(float *__restrict__ demb, const T *__restrict__ dh,
                                             const int *__restrict__ perm, const int *__restrict__ offs, int B,
                                             int V, int H) {
    __shared__ float part[TR_EMB_PARTS][TR_EMB_COLS];
    if (blockDim.x != 32 * TR_EMB_PARTS) return;
    int row = blockIdx.x, w = row / V, v = row - w * V;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, j0 = blockIdx.y * TR_EMB_COLS + lane;
    const int *pw = perm + (i64)w * B;
    int lo = offs[(i64)w * (V + 1) + v], hi = offs[(i64)w * (V + 1) + v + 1];
    int q = (hi - lo + TR_EMB_PARTS - 1) / TR_EMB_PARTS;
    int plo = min(lo + wid * q, hi), phi = min(plo + q, hi);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    bool in[4];
#pragma unroll
    for (int c = 0; c < 4; c++) in[c] = j0 + 32 * c < H;
    int i = plo;
    for (; i + 4 <= phi; i += 4) { // four rows of four columns in flight, added in order
        float a[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const T *src = dh + (i64)pw[i + r] * H + j0;
#pragma unroll
            for (int c = 0; c < 4; c++) a[r][c] = in[c] ? tr_ld(src + 32 * c) : 0.f;
        }
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[c] += a[r][c];
    }
    for (; i < phi; i++) {
        const T *src = dh + (i64)pw[i] * H + j0;
#pragma unroll
        for (int c = 0; c < 4; c++)
            if (in[c]) acc[c] += tr_ld(src + 32 * c);
    }
#pragma unroll
    for (int c = 0; c < 4; c++) part[wid][lane + 32 * c] = acc[c];
    __syncthreads();
    if (threadIdx.x < TR_EMB_COLS) {
        int j = blockIdx.y * TR_EMB_COLS + threadIdx.x;
        float sum = part[0][threadIdx.x];
#pragma unroll
        for (int p = 1; p < TR_EMB_PARTS; p++) sum += part[p][threadIdx.x];
        if (j < H) demb[(i64)row * H + j] = sum;
    }
}

#define TR_EMBED_BWD(NAME, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * TR_EMB_PARTS)                                            \
        tr_embed_bwd_##NAME(float *__restrict__ demb, const T *__restrict__ dh, const int *__restrict__ perm,  \
                            const int *__restrict__ offs, int B, int V, int H) {                               \
        tr_embed_bwd<T>(demb, dh, perm, offs, B, V, H);                                                        \
    }

TR_EMBED_BWD(f32, float)
TR_EMBED_BWD(bf16, u16)

// One parameter of the multi-tensor AdamW step: its tensors (the moments m and v of the step's
// moment type M and the gradient g of its gradient type G, float or u16 for bf16; c, the compute
// copy in bf16, may be null), its n elements, the first of its chunks, whether weight decay
// applies, and shift: with shift in [0, 4) every tensor's element 0 sits at position shift of a
// 16-byte group of f32 (8-byte group of bf16), so that the kernel moves 4 elements at a time, its
// groups starting at element -shift; -1: the tensors do not share an alignment and the kernel moves
// one element at a time.
template <typename M, typename G>
struct tr_adam_param {
    float *p;
    const G *g;
    M *m;
    M *v;
    u16 *c;
    i64 n;
    i64 chunk0;
    int decay;
    int shift;
};

// The step's hyperparameters: decay = 1 − lr·weight_decay, c1 = 1/(1 − b1^t) and
// c2 = 1/(1 − b2^t) the bias corrections of step t.
struct tr_adam_hyper {
    float lr, b1, b2, eps, decay, c1, c2;
};

#define TR_ADAM_THREADS 256 // the block size tr_adamw is written for
#define TR_ADAM_VEC 2       // groups of 4 elements each thread loads before it computes
#define TR_ADAM_CHUNK 2048  // elements of a chunk: TR_ADAM_THREADS × TR_ADAM_VEC groups of 4

// One element of the step, rounded as the CPU's twin (adamStep in adamw.go) rounds it:
// each product, sum, square root and quotient on its own, round to nearest, no fused
// multiply-add, so that the results are the CPU's bit for bit. ob1 = 1 − b1, ob2 = 1 − b2.
__device__ __forceinline__ float tr_adam1(float p, float g, float &m, float &v, float decay,
                                          const tr_adam_hyper &hp, float ob1, float ob2) {
    m = __fadd_rn(__fmul_rn(hp.b1, m), __fmul_rn(ob1, g));
    v = __fadd_rn(__fmul_rn(hp.b2, v), __fmul_rn(__fmul_rn(ob2, g), g));
    float den = __fadd_rn(__fsqrt_rn(__fmul_rn(v, hp.c2)), hp.eps);
    return __fsub_rn(__fmul_rn(p, decay), __fdiv_rn(__fmul_rn(hp.lr, __fmul_rn(m, hp.c1)), den));
}

// Four elements of the step: p, g, m, v as loaded; p, m, v updated.
__device__ __forceinline__ void tr_adam4(float4 &p, float4 g, float4 &m, float4 &v, float decay,
                                         const tr_adam_hyper &hp, float ob1, float ob2) {
    p.x = tr_adam1(p.x, g.x, m.x, v.x, decay, hp, ob1, ob2);
    p.y = tr_adam1(p.y, g.y, m.y, v.y, decay, hp, ob1, ob2);
    p.z = tr_adam1(p.z, g.z, m.z, v.z, decay, hp, ob1, ob2);
    p.w = tr_adam1(p.w, g.w, m.w, v.w, decay, hp, ob1, ob2);
}

// Elements [i, i+4) of q, 16-byte aligned (8 for bf16): loaded, stepped, stored (the moments
// rounded to M, computed in f32).
template <typename M, typename G>
__device__ __forceinline__ void tr_adam_group(const tr_adam_param<M, G> &q, i64 i, float decay,
                                              const tr_adam_hyper &hp, float ob1, float ob2) {
    float4 g = tr_ld4(q.g + i), m = tr_ld4(q.m + i), v = tr_ld4(q.v + i), p = tr_ld4(q.p + i);
    tr_adam4(p, g, m, v, decay, hp, ob1, ob2);
    tr_st4(q.m + i, m);
    tr_st4(q.v + i, v);
    tr_st4(q.p + i, p);
    if (q.c != 0) tr_st4(q.c + i, p);
}

// Element i of q: loaded, stepped, stored.
template <typename M, typename G>
__device__ __forceinline__ void tr_adam_elem(const tr_adam_param<M, G> &q, i64 i, float decay,
                                             const tr_adam_hyper &hp, float ob1, float ob2) {
    float m = tr_ld(&q.m[i]), v = tr_ld(&q.v[i]);
    float p = tr_adam1(q.p[i], tr_ld(&q.g[i]), m, v, decay, hp, ob1, ob2);
    tr_st(&q.m[i], m);
    tr_st(&q.v[i], v);
    q.p[i] = p;
    if (q.c != 0) q.c[i] = dl_f32_to_bf16(p);
}

// One AdamW step over every parameter of the table (np entries, nchunks chunks of TR_ADAM_CHUNK
// elements in all, each parameter's chunks after those of the entries before it): m = b1·m +
// (1−b1)·g, v = b2·v + (1−b2)·g·g, p = p·decay − lr·(m·c1)/(sqrt(v·c2) + eps), decay being 1 for
// parameters without weight decay, and c = bf16(p) where c is given; with bf16 moments
// (tr_adamw_bf16, tr_adamw_bf16_gbf16) m and v are widened exactly, the step is the same f32
// arithmetic, and the new m and v are rounded to bf16 (nearest even) as they are stored; a bf16
// gradient (the _gbf16 kernels) is widened exactly. Blocks of TR_ADAM_THREADS threads take chunks
// in a grid-stride loop (a grid of as many blocks as fit on the device at once, or one block a
// chunk). A chunk of a parameter with shift ≥ 0 is 512 groups of 4 elements, the first group of
// chunk k at element 2048·k − shift: each thread loads its TR_ADAM_VEC groups (16-byte loads of g,
// m, v and p, 128 bytes in flight; 8-byte ones of bf16 moments or gradients, 96 bytes with one of
// them bf16, 80 with both) before it computes and stores them (16-byte stores, 8-byte ones of
// bf16), all with the streaming cache hint (each byte passes once: the step beside other kernels
// leaves their data in L2); the groups that the parameter's ends cut, in its first and last chunk,
// go element by element. (Four groups a thread would keep more bytes in flight, but ptxas then
// spills around the calls of the division's slow path; with two, 58 registers (NVRTC 11.8, sm_90;
// 56 with bf16 moments, which stay packed until they are computed) let four blocks share a
// multiprocessor, 128 KB in flight on each.)
template <typename M, typename G>
__device__ __forceinline__ void tr_adamw_step(const tr_adam_param<M, G> *__restrict__ tab, int np, i64 nchunks,
                                              const tr_adam_hyper &hp) {
    const float ob1 = __fsub_rn(1.f, hp.b1), ob2 = __fsub_rn(1.f, hp.b2);
    int e = 0; // chunks only grow along the loop, so the entry search goes on from the last
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        while (e + 1 < np && tab[e + 1].chunk0 <= ch) e++;
        const tr_adam_param<M, G> q = tab[e];
        const float decay = q.decay ? hp.decay : 1.f;
        const i64 k = ch - q.chunk0;
        if (q.shift < 0) {
            i64 hi = min((k + 1) * TR_ADAM_CHUNK, q.n);
            for (i64 i = k * TR_ADAM_CHUNK + threadIdx.x; i < hi; i += TR_ADAM_THREADS) tr_adam_elem(q, i, decay, hp, ob1, ob2);
            continue;
        }
        const i64 lo = k * TR_ADAM_CHUNK - q.shift; // element of the chunk's first group
        const i64 t0 = lo + 4 * (i64)threadIdx.x;   // this thread's first group
        if (lo >= 0 && lo + TR_ADAM_CHUNK <= q.n) {
            float4 p[TR_ADAM_VEC];
            typename tr_raw4<G>::t g[TR_ADAM_VEC];
            typename tr_raw4<M>::t m[TR_ADAM_VEC], v[TR_ADAM_VEC]; // widened when computed
#pragma unroll
            for (int u = 0; u < TR_ADAM_VEC; u++) {
                i64 i = t0 + (i64)u * 4 * TR_ADAM_THREADS;
                g[u] = tr_raw_ld4_cs(q.g + i);
                m[u] = tr_raw_ld4_cs(q.m + i);
                v[u] = tr_raw_ld4_cs(q.v + i);
                p[u] = tr_wide4(tr_raw_ld4_cs(q.p + i));
            }
#pragma unroll
            for (int u = 0; u < TR_ADAM_VEC; u++) {
                i64 i = t0 + (i64)u * 4 * TR_ADAM_THREADS;
                float4 mu = tr_wide4(m[u]), vu = tr_wide4(v[u]);
                tr_adam4(p[u], tr_wide4(g[u]), mu, vu, decay, hp, ob1, ob2);
                tr_st4_cs(q.m + i, mu);
                tr_st4_cs(q.v + i, vu);
                tr_st4_cs(q.p + i, p[u]);
                if (q.c != 0) tr_st4_cs(q.c + i, p[u]);
            }
            continue;
        }
        // The parameter's first or last chunk: whole groups as above, cut ones by element.
        for (int u = 0; u < TR_ADAM_VEC; u++) {
            i64 i = t0 + (i64)u * 4 * TR_ADAM_THREADS;
            if (i >= 0 && i + 4 <= q.n) {
                tr_adam_group(q, i, decay, hp, ob1, ob2);
            } else {
                for (i64 j = max(i, (i64)0); j < min(i + 4, q.n); j++) tr_adam_elem(q, j, decay, hp, ob1, ob2);
            }
        }
    }
}

#define TR_ADAMW(NAME, M, G)                                                                                   \
    extern "C" __global__ void __launch_bounds__(TR_ADAM_THREADS)                                              \
        NAME(const tr_adam_param<M, G> *__restrict__ tab, int np, i64 nchunks, tr_adam_hyper hp) {            \
        tr_adamw_step(tab, np, nchunks, hp);                                                                   \
    }

TR_ADAMW(tr_adamw, float, float)
TR_ADAMW(tr_adamw_bf16, u16, float)
TR_ADAMW(tr_adamw_gbf16, float, u16)
TR_ADAMW(tr_adamw_bf16_gbf16, u16, u16)

// out[i] = Σ_r in[r*n + i] over the R ranks' gradients gathered side by side, in rank
// order, for i < n.
extern "C" __global__ void tr_rank_sum(float *__restrict__ out, const float *__restrict__ in, i64 n, int R) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = 0.f;
        for (int r = 0; r < R; r++) s += in[(i64)r * n + i];
        out[i] = s;
    }
}

// Routing statistics kept on the device between progress lines: acc[e] += load[e] for
// e < E, and acc[E] += dropped[0] when dropped is not null. One block.
extern "C" __global__ void tr_stats_add(i64 *__restrict__ acc, const int *__restrict__ load,
                                        const int *__restrict__ dropped, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) acc[e] += load[e];
    if (threadIdx.x == 0 && dropped != 0) acc[E] += dropped[0];
}
