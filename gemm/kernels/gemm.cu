// Grouped GEMM (ragged_dot) kernels of package gemm.
//
// Every call is two launches on one stream:
//   1. dl_gemm_plan (one block) reads the group sizes, checks them, and writes the plan:
//      row offsets, per-group tile counts and their prefix sums, the number of tiles.
//      Invalid sizes (negative, or summing past M) set the status and a plan of no
//      tiles, so that the next kernel writes nothing.
//   2. a persistent GEMM kernel: each block walks tiles blockIdx.x, +gridDim.x, ...
//      and finds its group from the plan. No host ever sees the sizes.
//
// The GEMM is C = A·B with one of two raggednesses:
//   ragged M (forward, input gradient): rows of A and C are split into groups; group g
//     multiplies by B_g = b + g·strideB. A is row-major [M][Kc]; B_g is [Kc][Nc]
//     (BT) or [Nc][Kc] (!BT). Rows past the last group are written as zeros.
//   ragged K (weight gradient): the contraction runs over the rows of group g:
//     C_g = c + g·strideC, [Mc][Nc], C_g = A_gᵀ·B_g with A stored [rows][Mc] and B
//     stored [rows][Nc] (AT, BT). An empty group gives zeros (or, accumulating, is skipped).
//
// bf16 operands run on tensor cores (mma.sync m16n8k16, fp32 accumulators) fed by
// ldmatrix from a cp.async multi-stage shared-memory ring; f32 operands run an exact
// fp32 FMA kernel. Output is bf16 (round to nearest even, as the Go conversion) or f32.
// Accumulation order is fixed: results are deterministic.
#include "dl.cuh"

#define DL_INT_MAX 2147483647

// Plan layout (int32): [0] valid, [1] tiles in all (GEMM tiles then zero tiles),
// [2] GEMM tiles, [3] sum of sizes, [4, 4+G] row offsets off[0..G],
// [5+G, 5+2G] tile prefix tp[0..G] (tiles of groups before g).
#define DL_PLAN_OFF 4

// Status records (a device.Status, see dl_status_set): word 0 is
// DL_STATUS_CODE(DL_GEMM_DOMAIN, op, code) with op the call's form (1 RaggedDot,
// 2 RaggedDotInputGrad, 3 RaggedDotWeightGrad) and code 1 for a negative size (values:
// the group, its size, M) or 2 for sizes summing past M (values: G, the sum, M). The
// Go decoder is in status.go. The first error is kept until reset.
#define DL_GEMM_DOMAIN 1

// The module's own status, for calls that pass none.
__device__ i64 dl_gemm_status[4];

// Copies the module's own status into out[4].
extern "C" __global__ void dl_gemm_status_read(i64 *out) {
    if (threadIdx.x < 4) out[threadIdx.x] = dl_gemm_status[threadIdx.x];
}

// Clears the module's own status.
extern "C" __global__ void dl_gemm_status_reset() {
    if (threadIdx.x < 4) dl_gemm_status[threadIdx.x] = 0;
}

// dl_gemm_plan: one block, blockDim.x a multiple of 32 (at most 1024). sizes[G] int32;
// bm > 0 makes the tile prefix for tiles of bm rows and nt column tiles, bm == 0 skips
// it (ragged K). status == 0 means the module's own status.
extern "C" __global__ void __launch_bounds__(1024) dl_gemm_plan(const int *__restrict__ sizes, int G, i64 M, int bm, int nt,
                                                                int *__restrict__ plan, i64 *status, int op) {
    __shared__ i64 wr[32], wt[32];
    __shared__ int neg;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    int *off = plan + DL_PLAN_OFF;
    int *tp = plan + DL_PLAN_OFF + 1 + G;
    if (tid == 0) {
        neg = DL_INT_MAX;
        off[0] = 0;
        tp[0] = 0;
    }
    __syncthreads();
    i64 carryR = 0, carryT = 0;
    for (int base = 0; base < G; base += blockDim.x) {
        const int i = base + tid;
        i64 r = 0, t = 0;
        if (i < G) {
            const int sz = sizes[i];
            if (sz < 0) {
                atomicMin(&neg, i);
            } else {
                r = sz;
                if (bm > 0) t = ((i64)sz + bm - 1) / bm * nt;
            }
        }
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const i64 yr = __shfl_up_sync(DL_FULL, r, d);
            const i64 yt = __shfl_up_sync(DL_FULL, t, d);
            if (lane >= d) {
                r += yr;
                t += yt;
            }
        }
        if (lane == 31) {
            wr[warp] = r;
            wt[warp] = t;
        }
        __syncthreads();
        if (warp == 0) {
            i64 vr = lane < nw ? wr[lane] : 0, vt = lane < nw ? wt[lane] : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const i64 yr = __shfl_up_sync(DL_FULL, vr, d);
                const i64 yt = __shfl_up_sync(DL_FULL, vt, d);
                if (lane >= d) {
                    vr += yr;
                    vt += yt;
                }
            }
            wr[lane] = vr;
            wt[lane] = vt;
        }
        __syncthreads();
        const i64 pr = warp > 0 ? wr[warp - 1] : 0, pt = warp > 0 ? wt[warp - 1] : 0;
        if (i < G) {
            const i64 ir = carryR + pr + r, it = carryT + pt + t;
            off[i + 1] = (int)(ir < DL_INT_MAX ? ir : DL_INT_MAX);
            tp[i + 1] = (int)(it < DL_INT_MAX ? it : DL_INT_MAX);
        }
        carryR += wr[nw - 1];
        carryT += wt[nw - 1];
        __syncthreads();
    }
    if (tid == 0) {
        const bool isNeg = neg != DL_INT_MAX;
        const bool over = !isNeg && carryR > M;
        i64 zt = 0;
        if (!isNeg && !over && bm > 0) zt = (M - carryR + bm - 1) / bm * nt;
        const bool valid = !isNeg && !over && carryT + zt <= DL_INT_MAX;
        plan[0] = valid ? 1 : 0;
        plan[1] = valid ? (int)(carryT + zt) : 0;
        plan[2] = valid ? (int)carryT : 0;
        plan[3] = valid ? (int)carryR : 0;
        if (isNeg || over) {
            dl_status_set(status ? status : dl_gemm_status, DL_STATUS_CODE(DL_GEMM_DOMAIN, op, isNeg ? 1 : 2),
                          isNeg ? (i64)neg : (i64)G, isNeg ? (i64)sizes[neg] : carryR, M);
        }
    }
}

// GemmArgs is the by-value parameter of the GEMM kernels. All fields are 8 bytes; the
// Go struct gemmArgs of gpu.go mirrors it field for field.
struct GemmArgs {
    const void *a;   // A operand
    const void *b;   // B operand
    void *c;         // output
    const int *plan; // written by dl_gemm_plan
    i64 m, n, k;     // ragged M: rows M, Nc, Kc. ragged K: Mc, Nc, rows M
    i64 lda, ldb, ldc;
    i64 strideB;     // ragged M: elements from B_g to B_g+1
    i64 strideC;     // ragged K: elements from C_g to C_g+1
    i64 G;
    i64 flags;       // bit 0: f32 output (else bf16); bit 1: accumulate into C (ragged K)
    i64 tilesM;      // ragged K: row tiles of C_g, ceil(Mc/BM)
    i64 tilesN;      // column tiles, ceil(Nc/BN)
};

#define DL_F32_OUT 1
#define DL_ACCUMULATE 2

// Tile prefixes of up to this many groups (G+1 entries) are cached in shared memory.
#define DL_SCHED_MAX 4096

// find_group returns the group g of tile t: the largest g with tp[g] <= t, where
// tp[0] = 0 <= t < tp[G]. Empty groups (tp[g] == tp[g+1]) are never returned.
__device__ __forceinline__ int find_group(const int *tp, int G, int t) {
    int lo = 0, hi = G;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tp[mid] <= t) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Stores two adjacent outputs (col, col+1) of row-major C; pair says both exist and
// the pair may be stored as one aligned vector.
__device__ __forceinline__ void store2(void *c, i64 idx, float v0, float v1, bool f32, bool acc, bool pair, bool second) {
    if (f32) {
        float *p = (float *)c + idx;
        if (pair) {
            if (acc) {
                const float2 o = *(const float2 *)p;
                v0 += o.x;
                v1 += o.y;
            }
            *(float2 *)p = make_float2(v0, v1);
        } else {
            if (acc) v0 += p[0];
            p[0] = v0;
            if (second) {
                if (acc) v1 += p[1];
                p[1] = v1;
            }
        }
    } else {
        u16 *p = (u16 *)c + idx;
        if (pair) {
            if (acc) {
                const u32 o = *(const u32 *)p;
                v0 += dl_bf16_to_f32((u16)(o & 0xffffu));
                v1 += dl_bf16_to_f32((u16)(o >> 16));
            }
            *(u32 *)p = (u32)dl_f32_to_bf16(v0) | ((u32)dl_f32_to_bf16(v1) << 16);
        } else {
            if (acc) v0 += dl_bf16_to_f32(p[0]);
            p[0] = dl_f32_to_bf16(v0);
            if (second) {
                if (acc) v1 += dl_bf16_to_f32(p[1]);
                p[1] = dl_f32_to_bf16(v1);
            }
        }
    }
}

// zero_tile writes zeros to rows [r0, rlim) x cols [c0, min(c0+BN, n)) of row-major C,
// at most BM rows.
template <int BM, int BN, int THREADS>
__device__ __forceinline__ void zero_tile(void *c, i64 ldc, i64 r0, i64 rlim, i64 c0, i64 n, bool f32) {
    for (int q = threadIdx.x; q < BM * BN; q += THREADS) {
        const i64 r = r0 + q / BN, col = c0 + q % BN;
        if (r < rlim && col < n) {
            if (f32) {
                ((float *)c)[r * ldc + col] = 0.0f;
            } else {
                ((u16 *)c)[r * ldc + col] = 0;
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// bf16 tensor-core kernel.

__device__ __forceinline__ u32 smem_u32(const void *p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Copies 16 bytes global -> shared asynchronously; when !ok it writes 16 zero bytes
// and reads nothing.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// d += a·b for one m16n8k16 bf16 tile with fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory tiles hold R rows by C columns of bf16 (C a multiple of 64), as C/64
// panels of R rows of 64 elements (128 bytes); the 16-byte chunk j of row r sits at
// chunk j ^ (r & 7), so that ldmatrix and the 16-byte stores hit distinct banks.
template <int R>
__device__ __forceinline__ int swz(int r, int c) {
    return (((c >> 6) * R + r) << 6) + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// load_tile copies rows [r0, r0+R) and columns [c0, c0+C) of the row-major matrix g
// (leading dimension ld) into the swizzled tile s; elements at rows >= rlim or columns
// >= clim are zeros. VEC: 16-byte cp.async, which needs clim, ld, c0 multiples of 8
// and g 16-byte aligned. Otherwise element loads and 16-byte shared stores.
template <int R, int C, int THREADS, bool VEC>
__device__ __forceinline__ void load_tile(u16 *s, const u16 *g, i64 ld, i64 r0, i64 rlim, i64 c0, i64 clim) {
    constexpr int CH = C / 8;            // 16-byte chunks per row
    constexpr int RSTEP = THREADS / CH;  // rows between a thread's chunks
    static_assert(THREADS % CH == 0 && R % RSTEP == 0, "tile chunks must divide among the threads");
    static_assert(RSTEP % 8 == 0, "a thread's chunks must share their swizzle");
    const int rb = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
    const i64 gc = c0 + c;
    const bool cok = gc < clim;
    const u16 *src = g + (r0 + rb) * ld + gc;
    u16 *dst = s + swz<R>(rb, c);
#pragma unroll
    for (int it = 0; it < R / RSTEP; ++it) {
        const i64 gr = r0 + rb + it * RSTEP;
        const bool rok = gr < rlim;
        if (VEC) {
            const bool ok = cok && rok;
            cp_async16(dst + it * RSTEP * 64, ok ? (const void *)(src + it * RSTEP * ld) : (const void *)g, ok);
        } else {
            u32 w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                u32 lo = 0, hi = 0;
                if (rok) {
                    const u16 *row = src + it * RSTEP * ld;
                    if (gc + 2 * e < clim) lo = row[2 * e];
                    if (gc + 2 * e + 1 < clim) hi = row[2 * e + 1];
                }
                w[e] = lo | (hi << 16);
            }
            *(uint4 *)(dst + it * RSTEP * 64) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// Tile is where one output tile of a block lies: its group, first row and column of C
// (rows relative to C_g for ragged K), the row limit of A's m dimension (group end for
// ragged M, Mc for ragged K), the contraction range [kbase, klim), and nk, the number
// of BK blocks (0 for a tile to skip).
struct Tile {
    int g, m0, n0, mlim, kbase, klim, nk;
};

// tile_at returns tile t of the GEMM tiles (t < the plan's GEMM tiles).
template <int BM, int BN, int BK, bool RAGGED_K>
__device__ __forceinline__ Tile tile_at(const GemmArgs &p, const int *off, const int *tp, int t) {
    Tile T;
    if (RAGGED_K) {
        const int per = (int)(p.tilesM * p.tilesN);
        T.g = t / per;
        const int local = t - T.g * per;
        T.m0 = (local % (int)p.tilesM) * BM;
        T.n0 = (local / (int)p.tilesM) * BN;
        T.mlim = (int)p.m;
        T.kbase = off[T.g];
        T.klim = off[T.g + 1];
        T.nk = (T.klim - T.kbase + BK - 1) / BK;
    } else {
        T.g = find_group(tp, (int)p.G, t);
        const int rs = off[T.g], re = off[T.g + 1];
        const int mt = (re - rs + BM - 1) / BM;
        const int local = t - tp[T.g];
        T.m0 = rs + (local % mt) * BM;
        T.n0 = (local / mt) * BN;
        T.mlim = re;
        T.kbase = 0;
        T.klim = (int)p.k;
        T.nk = ((int)p.k + BK - 1) / BK;
    }
    return T;
}

// mma_gemm: the persistent tensor-core GEMM. BM x BN block tiles, BK = 64, WARPS_M x
// WARPS_N warps each computing (BM/WARPS_M) x (BN/WARPS_N), a STAGES-deep cp.async
// ring. AT: A stored [contraction][m] (ragged K) instead of [m][contraction]. BT: B
// stored [contraction][n] instead of [n][contraction]. RAGGED_K selects the weight-
// gradient form. Dynamic shared memory: STAGES*(BM+BN)*BK*2 bytes, plus 4*(G+1) bytes
// for the tile prefix when ragged M and G+1 <= DL_SCHED_MAX.
//
// A block's tiles are t = blockIdx.x, +gridDim.x, ...; their k-blocks form one stream
// that the ring runs through without draining between tiles, so the next tile's first
// blocks load during the last blocks and the epilogue of the current one. Then the
// block writes its share of the zero tiles (rows past the last group).
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool AT, bool BT, bool VEC, bool RAGGED_K>
__device__ __forceinline__ void mma_gemm(const GemmArgs &p) {
    constexpr int BK = 64;
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MI = WM / 16, NI = WN / 8;
    static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must be whole m16 x n16 tiles");
    static_assert(BM % 64 == 0 || !AT, "A stored [k][m] needs BM a multiple of 64");
    static_assert(BN % 64 == 0 || !BT, "B stored [k][n] needs BN a multiple of 64");
    constexpr int A_ELEMS = BM * BK, B_ELEMS = BN * BK;

    extern __shared__ __align__(128) unsigned char dl_smem[];
    u16 *sA = (u16 *)dl_smem;
    u16 *sB = sA + STAGES * A_ELEMS;
    int *sTP = (int *)(sB + STAGES * B_ELEMS);

    const int *plan = p.plan;
    if (plan[0] == 0) return; // invalid sizes: write nothing
    const int G = (int)p.G;
    const int *off = plan + DL_PLAN_OFF;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp % WARPS_M) * WM, wn0 = (warp / WARPS_M) * WN;
    const bool f32 = (p.flags & DL_F32_OUT) != 0, accum = (p.flags & DL_ACCUMULATE) != 0;
    const u16 *A = (const u16 *)p.a;
    const u16 *Bbase = (const u16 *)p.b;

    int gemmTiles;
    const int *tp = plan + DL_PLAN_OFF + 1 + G;
    if (RAGGED_K) {
        gemmTiles = G * (int)p.tilesM * (int)p.tilesN;
    } else {
        gemmTiles = plan[2];
        if (G + 1 <= DL_SCHED_MAX) {
            for (int i = tid; i <= G; i += THREADS) sTP[i] = tp[i];
            __syncthreads();
            tp = sTP;
        }
    }
    // An empty group's tile is skipped when accumulating (dw stays as it is); otherwise
    // it runs no k-blocks and writes zeros.
    auto tile = [&](int t) {
        Tile T = tile_at<BM, BN, BK, RAGGED_K>(p, off, tp, t);
        if (RAGGED_K && accum && T.klim == T.kbase) T.nk = -1;
        return T;
    };

    // The loader's cursor: tile lt, its next k-block lkb.
    int lt = blockIdx.x, lkb = 0;
    Tile L = {0, 0, 0, 0, 0, 0, 0};
    if (lt < gemmTiles) L = tile(lt);
    // Issues the loads of the stream's next k-block into ring slot `slot` (if any is
    // left) and commits a group either way, so that groups and stream steps match.
    auto load_next = [&](int slot) {
        while (lt < gemmTiles && lkb >= L.nk) {
            lt += gridDim.x;
            lkb = 0;
            if (lt < gemmTiles) L = tile(lt);
        }
        if (lt < gemmTiles) {
            const int k0 = L.kbase + lkb * BK;
            u16 *a = sA + slot * A_ELEMS;
            u16 *b = sB + slot * B_ELEMS;
            const u16 *B = RAGGED_K ? Bbase : Bbase + (i64)L.g * p.strideB;
            if (AT) {
                load_tile<BK, BM, THREADS, VEC>(a, A, p.lda, k0, L.klim, L.m0, L.mlim);
            } else {
                load_tile<BM, BK, THREADS, VEC>(a, A, p.lda, L.m0, L.mlim, k0, L.klim);
            }
            if (BT) {
                load_tile<BK, BN, THREADS, VEC>(b, B, p.ldb, k0, L.klim, L.n0, p.n);
            } else {
                load_tile<BN, BK, THREADS, VEC>(b, B, p.ldb, L.n0, p.n, k0, L.klim);
            }
            ++lkb;
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load_next(s);

    int step = 0; // the consumer's position in the stream
    for (int t = blockIdx.x; t < gemmTiles; t += gridDim.x) {
        const Tile T0 = tile(t);
        const int nk = T0.nk;
        if (nk < 0) continue;
        // Rows of this warp's slice that hold output: m16 tiles past them (the end of a
        // small group, or of C) skip their ldmatrix and mma. Warp-uniform.
        const int wrows = T0.mlim - T0.m0 - wm0;

        float acc[MI][NI][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        for (int kb = 0; kb < nk; ++kb, ++step) {
            cp_async_wait<STAGES - 2>(); // this thread's copies of block `step` have landed
            __syncthreads();             // everyone's have; everyone is done with step-1's slot
            load_next((step + STAGES - 1) % STAGES);
            const u16 *a = sA + (step % STAGES) * A_ELEMS;
            const u16 *b = sB + (step % STAGES) * B_ELEMS;
            if (wrows <= 0) continue;
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                u32 af[MI][4];
                u32 bf[NI][2];
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    if (i * 16 >= wrows) break;
                    if (AT) {
                        const int r = kk * 16 + (lane & 7) + ((lane >> 4) << 3);
                        const int c = wm0 + i * 16 + ((lane >> 3) & 1) * 8;
                        ldsm_x4_t(af[i], a + swz<BK>(r, c));
                    } else {
                        const int r = wm0 + i * 16 + (lane & 15);
                        const int c = kk * 16 + (lane >> 4) * 8;
                        ldsm_x4(af[i], a + swz<BM>(r, c));
                    }
                }
#pragma unroll
                for (int j = 0; j < NI / 2; ++j) {
                    u32 q[4];
                    if (BT) {
                        const int r = kk * 16 + (lane & 15);
                        const int c = wn0 + j * 16 + (lane >> 4) * 8;
                        ldsm_x4_t(q, b + swz<BK>(r, c));
                    } else {
                        const int r = wn0 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
                        const int c = kk * 16 + ((lane >> 3) & 1) * 8;
                        ldsm_x4(q, b + swz<BN>(r, c));
                    }
                    bf[2 * j][0] = q[0];
                    bf[2 * j][1] = q[1];
                    bf[2 * j + 1][0] = q[2];
                    bf[2 * j + 1][1] = q[3];
                }
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    if (i * 16 >= wrows) break;
#pragma unroll
                    for (int j = 0; j < NI; ++j) mma_bf16(acc[i][j], af[i], bf[j][0], bf[j][1]);
                }
            }
        }

        // Epilogue: fragment (i, j) holds rows +lane/4 and +8, columns +2*(lane%4), +1.
        // The ring is not touched: the loads of the next tile go on meanwhile.
        const Tile &T = T0;
        const int clim = T.mlim;
        void *C = RAGGED_K ? (void *)((char *)p.c + (f32 ? 4 : 2) * (i64)T.g * p.strideC) : p.c;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = T.m0 + wm0 + i * 16 + (lane >> 2) + h * 8;
                if (row >= clim) continue;
#pragma unroll
                for (int j = 0; j < NI; ++j) {
                    const int col = T.n0 + wn0 + j * 8 + (lane & 3) * 2;
                    if (col >= p.n) continue;
                    const bool second = col + 1 < p.n;
                    // VEC implies n and ldc even and C 16-byte aligned: pairs are aligned.
                    store2(C, (i64)row * p.ldc + col, acc[i][j][2 * h], acc[i][j][2 * h + 1], f32, accum, VEC && second,
                           second);
                }
            }
        }
    }
    cp_async_wait<0>();

    if (!RAGGED_K) { // rows past the last group: zeros
        const int zeroTiles = plan[1] - gemmTiles, sumRows = plan[3];
        for (int z = blockIdx.x; z < zeroTiles; z += gridDim.x) {
            const i64 zr = sumRows + (i64)(z / (int)p.tilesN) * BM;
            zero_tile<BM, BN, THREADS>(p.c, p.ldc, zr, p.m, (i64)(z % (int)p.tilesN) * BN, p.n, f32);
        }
    }
}

// Kernel names: dl_mma_{m|k}_{big|small}_{layout}_{vec|any}.
//   m: ragged M (forward, input gradient); k: ragged K (weight gradient).
//   layout for ragged M: kn = B stored [Kc][Nc], nk = B stored [Nc][Kc].
#define DL_MMA(name, BM, BN, WMS, WNS, ST, AT, BT, VEC, RK, MINB)                                                 \
    extern "C" __global__ void __launch_bounds__(WMS *WNS * 32, MINB) name(const GemmArgs p) {                   \
        mma_gemm<BM, BN, WMS, WNS, ST, AT, BT, VEC, RK>(p);                                                       \
    }

// Big tiles: 128 x 256, 8 warps of 64 x 64, 4 stages (192 KiB ring), one block per SM.
DL_MMA(dl_mma_m_big_kn_vec, 128, 256, 2, 4, 4, false, true, true, false, 1)
DL_MMA(dl_mma_m_big_nk_vec, 128, 256, 2, 4, 4, false, false, true, false, 1)
// Small tiles for few rows per group: 32 x 128, 4 warps of 32 x 32, 4 stages (80 KiB).
DL_MMA(dl_mma_m_small_kn_vec, 32, 128, 1, 4, 4, false, true, true, false, 2)
DL_MMA(dl_mma_m_small_nk_vec, 32, 128, 1, 4, 4, false, false, true, false, 2)
DL_MMA(dl_mma_m_small_kn_any, 32, 128, 1, 4, 4, false, true, false, false, 2)
DL_MMA(dl_mma_m_small_nk_any, 32, 128, 1, 4, 4, false, false, false, false, 2)
// Weight gradient: 128 x 256 tiles of C_g.
DL_MMA(dl_mma_k_big_vec, 128, 256, 2, 4, 4, true, true, true, true, 1)
DL_MMA(dl_mma_k_big_any, 128, 256, 2, 4, 4, true, true, false, true, 1)

// ---------------------------------------------------------------------------------
// f32 FMA kernel: exact fp32 products and sums in a fixed order. 64 x 64 tiles,
// BK = 16, 256 threads of 4 x 4 outputs. Same plan and tile order as above.

#define FMA_BM 64
#define FMA_BN 64
#define FMA_BK 16

template <bool AT, bool BT, bool RAGGED_K>
__device__ __forceinline__ void fma_gemm(const GemmArgs &p) {
    constexpr int THREADS = 256;
    __shared__ float sa[FMA_BK][FMA_BM + 4];
    __shared__ float sb[FMA_BK][FMA_BN + 4];
    __shared__ int sTP[1024];

    const int *plan = p.plan;
    if (plan[0] == 0) return;
    const int G = (int)p.G;
    const int *off = plan + DL_PLAN_OFF;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const bool f32 = (p.flags & DL_F32_OUT) != 0, accum = (p.flags & DL_ACCUMULATE) != 0;
    const float *A = (const float *)p.a;
    const float *Bbase = (const float *)p.b;

    int total, gemmTiles = 0, sumRows = 0;
    const int *tp = plan + DL_PLAN_OFF + 1 + G;
    if (RAGGED_K) {
        total = G * (int)p.tilesM * (int)p.tilesN;
    } else {
        total = plan[1];
        gemmTiles = plan[2];
        sumRows = plan[3];
        if (G + 1 <= 1024) {
            for (int i = tid; i <= G; i += THREADS) sTP[i] = tp[i];
            __syncthreads();
            tp = sTP;
        }
    }

    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g;
        i64 m0, n0, mlim, kbase, klim, clim;
        const float *B;
        void *C = p.c;
        if (RAGGED_K) {
            const int per = (int)(p.tilesM * p.tilesN);
            g = t / per;
            const int local = t - g * per;
            const int mi = local % (int)p.tilesM, ni = local / (int)p.tilesM;
            m0 = (i64)mi * FMA_BM;
            n0 = (i64)ni * FMA_BN;
            mlim = p.m;
            kbase = off[g];
            klim = off[g + 1];
            if (accum && klim == kbase) continue;
            B = Bbase;
            C = (void *)((char *)p.c + (f32 ? 4 : 2) * (i64)g * p.strideC);
            clim = p.m;
        } else {
            if (t >= gemmTiles) {
                const int z = t - gemmTiles;
                const i64 zr = sumRows + (i64)(z / (int)p.tilesN) * FMA_BM;
                zero_tile<FMA_BM, FMA_BN, THREADS>(p.c, p.ldc, zr, p.m, (i64)(z % (int)p.tilesN) * FMA_BN, p.n, f32);
                continue;
            }
            g = find_group(tp, G, t);
            const int rs = off[g], re = off[g + 1];
            const int mt = (re - rs + FMA_BM - 1) / FMA_BM;
            const int local = t - tp[g];
            const int mi = local % mt, ni = local / mt;
            m0 = rs + (i64)mi * FMA_BM;
            n0 = (i64)ni * FMA_BN;
            mlim = re;
            kbase = 0;
            klim = p.k;
            B = Bbase + (i64)g * p.strideB;
            clim = re;
        }

        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

        for (i64 k0 = kbase; k0 < klim; k0 += FMA_BK) {
#pragma unroll
            for (int it = 0; it < FMA_BM * FMA_BK / THREADS; ++it) {
                const int q = tid + it * THREADS;
                int mm, kk;
                if (AT) { // contiguous along m
                    kk = q / FMA_BM;
                    mm = q % FMA_BM;
                } else { // contiguous along k
                    mm = q / FMA_BK;
                    kk = q % FMA_BK;
                }
                const i64 gm = m0 + mm, gk = k0 + kk;
                float v = 0.0f;
                if (gm < mlim && gk < klim) v = AT ? A[gk * p.lda + gm] : A[gm * p.lda + gk];
                sa[kk][mm] = v;
            }
#pragma unroll
            for (int it = 0; it < FMA_BN * FMA_BK / THREADS; ++it) {
                const int q = tid + it * THREADS;
                int nn, kk;
                if (BT) { // contiguous along n
                    kk = q / FMA_BN;
                    nn = q % FMA_BN;
                } else { // contiguous along k
                    nn = q / FMA_BK;
                    kk = q % FMA_BK;
                }
                const i64 gn = n0 + nn, gk = k0 + kk;
                float v = 0.0f;
                if (gn < p.n && gk < klim) v = BT ? B[gk * p.ldb + gn] : B[gn * p.ldb + gk];
                sb[kk][nn] = v;
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < FMA_BK; ++kk) {
                float av[4], bv[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) av[i] = sa[kk][ty + 16 * i];
#pragma unroll
                for (int j = 0; j < 4; ++j) bv[j] = sb[kk][tx + 16 * j];
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
            __syncthreads();
        }

#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 row = m0 + ty + 16 * i;
            if (row >= clim) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const i64 col = n0 + tx + 16 * j;
                if (col >= p.n) continue;
                store2(C, row * p.ldc + col, acc[i][j], 0.0f, f32, accum, false, false);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) dl_fma_m_kn(const GemmArgs p) { fma_gemm<false, true, false>(p); }
extern "C" __global__ void __launch_bounds__(256) dl_fma_m_nk(const GemmArgs p) { fma_gemm<false, false, false>(p); }
extern "C" __global__ void __launch_bounds__(256) dl_fma_k(const GemmArgs p) { fma_gemm<true, true, true>(p); }
