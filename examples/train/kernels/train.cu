// Kernels of the training example: the dense parts of the model around the MoE layers.
// All tensors are f32, row-major; token ids are int32. Sums have a fixed order, so results
// do not change from run to run.

#include "dl.cuh"

// Sum of v over the block, returned to every thread, in a fixed order. blockDim.x is a
// multiple of 32, at most 1024; every thread of the block calls it.
__device__ float tr_block_sum(float v) {
    __shared__ float red[32];
    v = dl_warp_sum(v);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    float r = 0.f;
    for (int i = 0; i < nw; i++) r += red[i];
    return r;
}

// Maximum of v over the block, as tr_block_sum.
__device__ float tr_block_max(float v) {
    __shared__ float red[32];
    v = dl_warp_max(v);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < nw; i++) r = fmaxf(r, red[i]);
    return r;
}

// h[b, :] = sum over w < W of emb[w*V + tok[b*ld + w], :], for h [B, H], emb [W*V, H] and
// tok [B, ld] (ld > W). Ids outside [0, V) add nothing. One block per row b.
extern "C" __global__ void tr_embed_fwd(float *__restrict__ h, const float *__restrict__ emb,
                                        const int *__restrict__ tok, int B, int W, int ld, int V, int H) {
    int b = blockIdx.x;
    if (b >= B) return;
    const int *tb = tok + (i64)b * ld;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < W; w++) {
            int v = tb[w];
            if (v >= 0 && v < V) acc += emb[((i64)w * V + v) * H + j];
        }
        h[(i64)b * H + j] = acc;
    }
}

// demb[w*V + v, :] = sum over rows b with tok[b*ld + w] == v of dh[b, :], in order of b,
// for demb [W*V, H], dh [B, H]. Grid (V, W): one block of 256 threads per embedding row;
// the block stages the ids of column w in shared memory, 256 rows at a time.
extern "C" __global__ void __launch_bounds__(256) tr_embed_bwd(float *__restrict__ demb, const float *__restrict__ dh,
                                        const int *__restrict__ tok, int B, int W, int ld, int V, int H) {
    __shared__ int ids[256];
    int v = blockIdx.x, w = blockIdx.y;
    if (v >= V || w >= W || blockDim.x != 256) return;
    float *out = demb + ((i64)w * V + v) * H;
    for (int j0 = 0; j0 < H; j0 += 256) {
        int j = j0 + threadIdx.x;
        float acc = 0.f;
        for (int b0 = 0; b0 < B; b0 += 256) {
            int n = min(B - b0, 256);
            __syncthreads();
            if (threadIdx.x < n) ids[threadIdx.x] = tok[(i64)(b0 + threadIdx.x) * ld + w];
            __syncthreads();
            if (j < H)
                for (int i = 0; i < n; i++)
                    if (ids[i] == v) acc += dh[(i64)(b0 + i) * H + j];
        }
        if (j < H) out[j] = acc;
    }
}

// RMS normalization without a scale: xn[b, :] = x[b, :]·rstd[b], rstd[b] =
// 1/sqrt(mean(x[b, :]²) + eps), for x, xn [B, H]. One block per row.
extern "C" __global__ void tr_rms_fwd(float *__restrict__ xn, float *__restrict__ rstd,
                                      const float *__restrict__ x, int B, int H, float eps) {
    int b = blockIdx.x;
    if (b >= B) return;
    const float *xr = x + (i64)b * H;
    float ss = 0.f;
    for (int j = threadIdx.x; j < H; j += blockDim.x) ss += xr[j] * xr[j];
    ss = tr_block_sum(ss);
    float r = rsqrtf(ss / (float)H + eps);
    for (int j = threadIdx.x; j < H; j += blockDim.x) xn[(i64)b * H + j] = xr[j] * r;
    if (threadIdx.x == 0) rstd[b] = r;
}

// Gradient of tr_rms_fwd: dx[b, :] (+)= rstd[b]·(dxn[b, :] − xn[b, :]·mean(dxn[b, :]·xn[b, :])),
// added to dx when accumulate is nonzero. One block per row.
extern "C" __global__ void tr_rms_bwd(float *__restrict__ dx, const float *__restrict__ dxn,
                                      const float *__restrict__ xn, const float *__restrict__ rstd,
                                      int B, int H, int accumulate) {
    int b = blockIdx.x;
    if (b >= B) return;
    const float *g = dxn + (i64)b * H, *y = xn + (i64)b * H;
    float dot = 0.f;
    for (int j = threadIdx.x; j < H; j += blockDim.x) dot += g[j] * y[j];
    float mean = tr_block_sum(dot) / (float)H;
    float r = rstd[b];
    float *o = dx + (i64)b * H;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float v = r * (g[j] - y[j] * mean);
        o[j] = accumulate ? o[j] + v : v;
    }
}

// out[i] = a[i] + b[i] for i < n (out may be a or b).
extern "C" __global__ void tr_add(float *out, const float *a, const float *b, i64 n) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = a[i] + b[i];
}

// Softmax cross-entropy of logits [B, V] against targets tok[b*ld + col]:
// loss[b] += log Σ exp(logits[b, :]) − logits[b, target]; when dlogits is not null,
// dlogits[b, :] = (softmax(logits[b, :]) − onehot(target))·scale. A target outside
// [0, V) adds nothing and gets a zero gradient. One block per row.
extern "C" __global__ void tr_softmax_ce(float *__restrict__ loss, float *__restrict__ dlogits,
                                         const float *__restrict__ logits, const int *__restrict__ tok,
                                         int B, int V, int ld, int col, float scale) {
    int b = blockIdx.x;
    if (b >= B) return;
    const float *z = logits + (i64)b * V;
    int t = tok[(i64)b * ld + col];
    bool valid = t >= 0 && t < V;
    float m = __uint_as_float(0xff800000u); // -inf
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, z[j]);
    m = tr_block_max(m);
    float se = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) se += expf(z[j] - m);
    se = tr_block_sum(se);
    if (threadIdx.x == 0 && valid) loss[b] += logf(se) + m - z[t];
    if (dlogits != 0) {
        float inv = 1.f / se;
        float *d = dlogits + (i64)b * V;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float p = valid ? expf(z[j] - m) * inv : 0.f;
            d[j] = (p - (j == t ? 1.f : 0.f)) * scale;
        }
    }
}

// One AdamW step on n parameters: m = b1·m + (1−b1)·g, v = b2·v + (1−b2)·g²,
// p = p·decay − lr·(m·c1)/(sqrt(v·c2) + eps), where decay = 1 − lr·weight_decay and
// c1 = 1/(1 − b1^t), c2 = 1/(1 − b2^t) are the bias corrections of step t.
extern "C" __global__ void tr_adamw(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m,
                                    float *__restrict__ v, i64 n, float lr, float b1, float b2, float eps,
                                    float decay, float c1, float c2) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float gi = g[i];
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - lr * (mi * c1) / (sqrtf(vi * c2) + eps);
    }
}
