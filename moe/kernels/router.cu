// Router kernels: the router's small GEMMs (logits = x * wr^T and its weight
// gradient), top-k routing with softmax or sigmoid scores, its backward pass, and the
// score-correction bias update. All router arithmetic is f32.
#include "moe.cuh"

// ---------------------------------------------------------------------------------
// C[i][j] = sum over k in this block's k-range of A(k,i) * B(k,j), for a BI x BJ
// tile per block of 128 threads (4x4 per thread), k in steps of DL_BK through
// shared memory. A(k,i) is a[i*lda + k] when AK (contiguous along k), else
// a[k*lda + i]; likewise B. Out-of-range elements read as 0. blockIdx.z selects
// the k-range [z*kchunk, (z+1)*kchunk) and the output slice c + z*ni*nj (row-major
// ni x nj), so split-k partial sums are reduced in a fixed order afterwards.
#define DL_BK 32

template <typename TA, bool AK, typename TB, bool BK, int BI, int BJ>
__device__ __forceinline__ void atb_tile(float *__restrict__ c, const TA *__restrict__ a, i64 lda,
                                         const TB *__restrict__ b, i64 ldb, i64 ni, i64 nj, i64 nk, i64 kchunk) {
    __shared__ __align__(16) float As[DL_BK][BI + 4];
    __shared__ __align__(16) float Bs[DL_BK][BJ + 4];
    const int tid = threadIdx.x;
    const int tj = tid % (BJ / 4), ti = tid / (BJ / 4);
    const i64 i0 = (i64)blockIdx.x * BI, j0 = (i64)blockIdx.y * BJ;
    const i64 kb = (i64)blockIdx.z * kchunk;
    const i64 ke = kb + kchunk < nk ? kb + kchunk : nk;
    float acc[4][4];
#pragma unroll
    for (int p = 0; p < 4; p++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[p][q] = 0.f;
    for (i64 k0 = kb; k0 < ke; k0 += DL_BK) {
#pragma unroll 4
        for (int n = 0; n < DL_BK * BI / 128; n++) {
            int x = tid + n * 128;
            int kk = AK ? x % DL_BK : x / BI;
            int ii = AK ? x / DL_BK : x % BI;
            i64 gi = i0 + ii, gk = k0 + kk;
            float v = 0.f;
            if (gi < ni && gk < ke) v = dl_ld(AK ? a + gi * lda + gk : a + gk * lda + gi);
            As[kk][ii] = v;
        }
#pragma unroll 4
        for (int n = 0; n < DL_BK * BJ / 128; n++) {
            int x = tid + n * 128;
            int kk = BK ? x % DL_BK : x / BJ;
            int jj = BK ? x / DL_BK : x % BJ;
            i64 gj = j0 + jj, gk = k0 + kk;
            float v = 0.f;
            if (gj < nj && gk < ke) v = dl_ld(BK ? b + gj * ldb + gk : b + gk * ldb + gj);
            Bs[kk][jj] = v;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < DL_BK; kk++) {
            float4 av = *(const float4 *)&As[kk][ti * 4];
            float4 bv = *(const float4 *)&Bs[kk][tj * 4];
            float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[p][q] += ar[p] * br[q];
        }
        __syncthreads();
    }
    float *out = c + (i64)blockIdx.z * ni * nj;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        i64 gi = i0 + ti * 4 + p;
        if (gi >= ni) continue;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            i64 gj = j0 + tj * 4 + q;
            if (gj < nj) out[gi * nj + gj] = acc[p][q];
        }
    }
}

// Logits: out[z][t][e] = sum_h x[t,h] * wr[e,h] over the z-th h-range.
// Grid (ceil(T/64), ceil(E/32), splits), 128 threads.
#define DL_LOGITS(S, TX, TW)                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 4)                                                     \
        dl_moe_logits_##S(float *out, const TX *x, const TW *wr, i64 T, i64 E, i64 H, i64 kchunk) {       \
        atb_tile<TX, true, TW, true, 64, 32>(out, x, H, wr, H, T, E, H, kchunk);                          \
    }
DL_LOGITS(f32_f32, float, float)
DL_LOGITS(f32_bf16, float, u16)
DL_LOGITS(bf16_f32, u16, float)
DL_LOGITS(bf16_bf16, u16, u16)

// Router weight gradient: out[z][e][h] = sum_t dl[t,e] * x[t,h] over the z-th t-range.
// Grid (ceil(E/32), ceil(H/64), splits), 128 threads.
#define DL_RWGRAD(S, TX)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128, 4)                                                     \
        dl_moe_router_wgrad_##S(float *out, const float *dl, const TX *x, i64 T, i64 E, i64 H, i64 kchunk) { \
        atb_tile<float, false, TX, false, 32, 64>(out, dl, E, x, H, E, H, T, kchunk);                     \
    }
DL_RWGRAD(f32, float)
DL_RWGRAD(bf16, u16)

// out[i] = sum_z part[z*n + i] (+ out[i] when acc), z in order; grid-stride.
template <typename T>
__device__ __forceinline__ void reduce_splits(T *__restrict__ out, const float *__restrict__ part, i64 n, int splits,
                                              int acc) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int z = 0; z < splits; z++) s += part[(i64)z * n + i];
        if (acc) s += dl_ld(out + i);
        dl_st(out + i, s);
    }
}
extern "C" __global__ void dl_moe_reduce_f32(float *out, const float *part, i64 n, int splits, int acc) {
    reduce_splits<float>(out, part, n, splits, acc);
}
extern "C" __global__ void dl_moe_reduce_bf16(u16 *out, const float *part, i64 n, int splits, int acc) {
    reduce_splits<u16>(out, part, n, splits, acc);
}

// ---------------------------------------------------------------------------------
// Routing, one warp per token; lanes own experts e = lane + 32*j.
//   scores: softmax p = exp(z - max z) / sum (with +inf logits its limit: they share
//           the weight equally, the others get 0), or sigmoid s = 1 / (1 + exp(-z));
//   choice: the value top-k selects on: z (softmax without bias), p + bias, s + bias;
//           NaN choices count as -inf;
//   groups (G > 1): group score = sum of the group's two largest choices (the
//           largest if a group has one expert); the TG best groups stay, the rest
//           are masked out;
//   top-k:  K rounds of warp argmax, ties to the lower expert index;
//   weight: score of the chosen expert, divided by (sum of the K scores + 1e-20)
//           when renorm, times scale.
// Dynamic shared memory: nw*4*E floats (choice, score, group scores, aux sums per
// warp) + E ints (the block's expert counts). Block b handles tokens
// [b*tpw*nw, (b+1)*tpw*nw) and writes its expert counts to pcnt[b*E + e] and, when
// aux, its sums of p (softmax) or s / sum(s) (sigmoid) to psum[b*E + e].
struct dl_route_args {
    int T, E, K, sigmoid, G, TG, renorm, aux, tpw;
    float scale;
};

// dl_softmax_exp returns exp(z - m), the softmax term of logit z when the largest logit
// is m, or its limit when m = +inf: 1 for the +inf logits (not exp(inf - inf) = NaN)
// and 0 for the others, NaN ones included (as routeCPU).
__device__ __forceinline__ float dl_softmax_exp(float z, float m) {
    if (m == DL_POS_INF) return z == m ? 1.f : 0.f;
    return expf(z - m);
}

__device__ __forceinline__ void dl_argmax_merge(float &best, int &bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(DL_FULL, best, o);
        int oi = __shfl_xor_sync(DL_FULL, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
            best = ob;
            bi = oi;
        }
    }
}

extern "C" __global__ void dl_moe_route(const float *__restrict__ logits, const float *__restrict__ bias,
                                        dl_route_args p, int *__restrict__ idx, float *__restrict__ wt,
                                        float *__restrict__ scores, int *__restrict__ pcnt,
                                        float *__restrict__ psum) {
    extern __shared__ float sm[];
    const int E = p.E, K = p.K;
    const int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *choice = sm + (i64)w * 4 * E;
    float *score = choice + E;
    float *gsc = score + E;
    float *acc = gsc + E;
    int *cnt = (int *)(sm + (i64)nw * 4 * E);
    for (int e = lane; e < E; e += 32) acc[e] = 0.f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    const int gsz = p.G > 1 ? E / p.G : E;
    for (int it = 0; it < p.tpw; it++) {
        i64 t = ((i64)blockIdx.x * p.tpw + it) * nw + w;
        if (t >= p.T) break;
        const float *z = logits + t * E;
        if (!p.sigmoid) {
            float m = DL_NEG_INF;
            for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
            m = dl_warp_max(m);
            float sum = 0.f;
            for (int e = lane; e < E; e += 32) sum += dl_softmax_exp(z[e], m);
            sum = dl_warp_sum(sum);
            for (int e = lane; e < E; e += 32) {
                float pe = dl_softmax_exp(z[e], m) / sum;
                float c = bias ? pe + bias[e] : z[e];
                score[e] = pe;
                choice[e] = c != c ? DL_NEG_INF : c;
            }
        } else {
            for (int e = lane; e < E; e += 32) {
                float s = 1.f / (1.f + expf(-z[e]));
                float c = bias ? s + bias[e] : s;
                score[e] = s;
                choice[e] = c != c ? DL_NEG_INF : c;
            }
        }
        __syncwarp();
        if (p.G > 1) {
            for (int g = lane; g < p.G; g += 32) {
                float m1 = DL_NEG_INF, m2 = DL_NEG_INF;
                for (int j = 0; j < gsz; j++) {
                    float v = choice[g * gsz + j];
                    if (v > m1) {
                        m2 = m1;
                        m1 = v;
                    } else if (v > m2) {
                        m2 = v;
                    }
                }
                float gs = gsz > 1 ? m1 + m2 : m1;
                gsc[g] = gs != gs ? DL_NEG_INF : gs;
            }
            __syncwarp();
            for (int r = 0; r < p.TG; r++) {
                float best = DL_NEG_INF;
                int bi = 0x7fffffff;
                for (int g = lane; g < p.G; g += 32) {
                    float v = gsc[g];
                    if (v > best || (v == best && g < bi)) {
                        best = v;
                        bi = g;
                    }
                }
                dl_argmax_merge(best, bi);
                __syncwarp();
                if (lane == 0 && bi < p.G) gsc[bi] = DL_NAN; // taken
                __syncwarp();
            }
            for (int e = lane; e < E; e += 32) {
                float g = gsc[e / gsz];
                if (g == g) choice[e] = DL_NAN; // group not taken: masked
            }
            __syncwarp();
        }
        int mine = -1;
        for (int k = 0; k < K; k++) {
            float best = DL_NEG_INF;
            int bi = 0x7fffffff;
            for (int e = lane; e < E; e += 32) {
                float v = choice[e];
                if (v > best || (v == best && e < bi)) {
                    best = v;
                    bi = e;
                }
            }
            dl_argmax_merge(best, bi);
            bool ok = bi < E;
            __syncwarp();
            if (lane == 0 && ok) choice[bi] = DL_NAN; // taken
            if (lane == k) mine = ok ? bi : -1;
            __syncwarp();
        }
        float v = mine >= 0 ? score[mine] : 0.f;
        float vsum = dl_warp_sum(v);
        float wk = p.renorm ? v / (vsum + 1e-20f) * p.scale : v * p.scale;
        if (lane < K) {
            idx[t * K + lane] = mine;
            wt[t * K + lane] = mine >= 0 ? wk : 0.f;
            if (mine >= 0) atomicAdd(&cnt[mine], 1);
        }
        float ssum = 0.f;
        for (int e = lane; e < E; e += 32) {
            scores[t * E + e] = score[e];
            ssum += score[e];
        }
        if (p.aux) {
            if (p.sigmoid) {
                ssum = dl_warp_sum(ssum);
                for (int e = lane; e < E; e += 32) acc[e] += score[e] / ssum;
            } else {
                for (int e = lane; e < E; e += 32) acc[e] += score[e];
            }
        }
        __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        pcnt[(i64)blockIdx.x * E + e] = cnt[e];
        if (p.aux) {
            float s = 0.f;
            for (int v = 0; v < nw; v++) s += sm[(i64)v * 4 * E + 3 * E + e];
            psum[(i64)blockIdx.x * E + e] = s;
        }
    }
}

// The auxiliary loss from each thread's term load[e] * probsum[e] (0 past E), in one
// block: *auxloss = coef * E * sum_e term / (T*K*T), 0 without tokens.
__device__ __forceinline__ void dl_moe_aux_store(float term, int T, int E, int K, float coef,
                                                 float *__restrict__ auxloss) {
    __shared__ float red[32];
    float sum = dl_block_sum(term, red);
    if (threadIdx.x == 0) *auxloss = T > 0 ? (float)((double)coef * E * (double)sum / ((double)T * K * (double)T)) : 0.f;
}

// One block of blockDim.x >= E threads (multiple of 32, at most 1024): load[e] =
// sum over blocks of pcnt; when aux, probsum[e] = sum over blocks of psum and
// *auxloss = coef * E * sum_e f_e * P_e with f_e = load[e] / (T*K) and
// P_e = probsum[e] / T.
extern "C" __global__ void dl_moe_route_finalize(const int *__restrict__ pcnt, const float *__restrict__ psum,
                                                 int nb, int T, int E, int K, float coef, int aux,
                                                 int *__restrict__ load, float *__restrict__ auxloss,
                                                 float *__restrict__ probsum) {
    int e = threadIdx.x;
    float term = 0.f;
    if (e < E) {
        int c = 0;
        float s = 0.f;
        for (int b = 0; b < nb; b++) {
            c += pcnt[(i64)b * E + e];
            if (aux) s += psum[(i64)b * E + e];
        }
        load[e] = c;
        if (aux) probsum[e] = s;
        term = (float)c * s;
    }
    if (aux) dl_moe_aux_store(term, T, E, K, coef, auxloss);
}

// The share of a routing in the auxiliary loss over a batch of T tokens whose loads
// are load[E]: *auxloss = coef * E * sum_e load[e] * probsum[e] / (T*K*T), probsum
// being the routing's own sums of probabilities (dl_moe_route_finalize's). One block
// of blockDim.x >= E threads (multiple of 32, at most 1024).
extern "C" __global__ void dl_moe_aux_loss(const float *__restrict__ probsum, const int *__restrict__ load, int T,
                                           int E, int K, float coef, float *__restrict__ auxloss) {
    int e = threadIdx.x;
    dl_moe_aux_store(e < E ? (float)load[e] * probsum[e] : 0.f, T, E, K, coef, auxloss);
}

// Backward of dl_moe_route, one warp per token: dl[t,e] = d loss / d logits[t,e]
// from dwt (d loss / d weight, may be null) and, when auxc != 0, the auxiliary loss
// (auxc = coef * E / (T*K*T), so that d aux / d P-term of expert e is auxc * load[e]).
// Dynamic shared memory: nw*E floats.
extern "C" __global__ void dl_moe_route_bwd(const float *__restrict__ dwt, const int *__restrict__ idx,
                                            const float *__restrict__ scores, const int *__restrict__ load,
                                            dl_route_args p, float auxc, float *__restrict__ dl) {
    extern __shared__ float sm[];
    const int E = p.E, K = p.K;
    const int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *ds = sm + (i64)w * E;
    i64 t = (i64)blockIdx.x * nw + w;
    if (t >= p.T) return;
    const float *s = scores + t * E;
    if (auxc != 0.f) {
        if (p.sigmoid) {
            float S = 0.f, gs = 0.f;
            for (int e = lane; e < E; e += 32) {
                S += s[e];
                gs += auxc * (float)load[e] * s[e];
            }
            S = dl_warp_sum(S);
            gs = dl_warp_sum(gs) / S;
            for (int e = lane; e < E; e += 32) ds[e] = (auxc * (float)load[e] - gs) / S;
        } else {
            for (int e = lane; e < E; e += 32) ds[e] = auxc * (float)load[e];
        }
    } else {
        for (int e = lane; e < E; e += 32) ds[e] = 0.f;
    }
    int ek = lane < K ? idx[t * K + lane] : -1;
    float d = (lane < K && dwt) ? dwt[t * K + lane] : 0.f;
    float v = ek >= 0 ? s[ek] : 0.f;
    if (ek < 0) d = 0.f;
    float dv;
    if (p.renorm) {
        float S = dl_warp_sum(v) + 1e-20f;
        float c = dl_warp_sum(d * v);
        dv = p.scale * (d - c / S) / S;
    } else {
        dv = p.scale * d;
    }
    __syncwarp();
    if (ek >= 0) ds[ek] += dv;
    __syncwarp();
    if (!p.sigmoid) {
        float dot = 0.f;
        for (int e = lane; e < E; e += 32) dot += ds[e] * s[e];
        dot = dl_warp_sum(dot);
        for (int e = lane; e < E; e += 32) dl[t * E + e] = s[e] * (ds[e] - dot);
    } else {
        for (int e = lane; e < E; e += 32) dl[t * E + e] = ds[e] * s[e] * (1.f - s[e]);
    }
}

// bias[e] += gamma * sign(mean(load) - load[e]), the sign computed exactly in
// integers. One block of blockDim.x >= E threads (multiple of 32, at most 1024).
extern "C" __global__ void dl_moe_update_bias(float *__restrict__ bias, const int *__restrict__ load, int E,
                                              float gamma) {
    __shared__ unsigned long long total;
    int e = threadIdx.x;
    if (e == 0) total = 0ull;
    __syncthreads();
    long long c = e < E ? (long long)load[e] : 0;
    atomicAdd(&total, (unsigned long long)c);
    __syncthreads();
    if (e < E) {
        long long diff = (long long)total - c * (long long)E;
        float sg = diff > 0 ? 1.f : (diff < 0 ? -1.f : 0.f);
        bias[e] += gamma * sg;
    }
}
