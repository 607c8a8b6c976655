// Hopper (sm_90a) blockwise FP8 ragged_dot: the products of package gemm's
// RaggedDotBlockwise forms, FP8 operands (E4M3 or E5M2, each operand its own) with one f32
// scale per 128-element block of the contracted dimension, f32 accumulation, bf16 or f32
// output.
//
// The bf16 kernels' source is included for its helpers: barriers, TMA, descriptors, the
// group scan and the tile schedule (hb_setup, hb_pick) and the tail kernel.
#include "hopper_grouped.cuh"

// Tiles: 128×128 outputs, one 128-deep block of the contraction per pipeline stage, which
// is exactly one scale block: the stage's partial sum is promoted into the total with the
// two blocks' scales, total += partial · s_a · s_b, on CUDA cores in f32 (DeepSeek-V3's
// recipe; Hopper's FP8 tensor cores keep fewer bits than f32 over long sums).
//
// CTA: 384 threads. Warpgroup 0 is the producer (thread 0 issues every TMA); warpgroups 1
// and 2 are the consumers, each owning 64 of the tile's 128 rows and running
// wgmma.m64n128k32 on them. The stages form a ring of HF_STAGES buffers with a full and an
// empty mbarrier each (hb_setup initializes them: full counts the producer's one arrival
// plus the TMA bytes, empty one arrival per consumer warp of each CTA of the cluster).
//
// Shared memory, from the first 1024-byte aligned byte (the 128-byte swizzle needs it):
//   [0, S·32 KB)          stage s: A 128 rows × 128 B at s·32 KB, B 128 rows × 128 B at s·32 KB + 16 KB
//   [S·32 KB, +S·512)     A scales: 128 floats a stage (the tile's rows, or the dw tile's rows)
//   [.., +S·512)          B scales: 128 floats a stage (weight gradient only: dw tile's columns)
//   [.., +4·HF_MXT·4)     MXFP8: each consumer's two tables of decoded column scales (hf_mx_decode)
//   [.., +2·S·8)          full[S], empty[S]
//   [.., +3·(G+1)·4)      tstart, rstart, lstart: hb_setup's group tables (HB_MAXG + 1 each)
//   [.., +(G+1)·4)        pstart: the groups' first 128-row blocks (the MXFP8 forms' scale rows)
// HF_SMEM is that sum plus 1024 bytes of alignment slack; hopper/fp8.go's fp8Smem mirrors it.
//
// Shared-memory matrix descriptors (hb_desc, 128-byte swizzle, both operands K-major).
// TMA writes a box {128 contraction elements, R rows} of FP8 as R rows of 128 bytes, the
// 16-byte chunk j of row i at chunk j ^ (i % 8): 8-row atoms of 1024 bytes, the canonical
// K-major SW128 layout of wgmma. Per descriptor:
//   - start address: the operand's first row (A: stage + c·8192 for consumer c's 64 rows,
//     8192 = 64 rows × 128 B; B: stage + 16 KB), plus 32 bytes per k32 step: one
//     m64n128k32 step reads 32 FP8 = 32 bytes of each row, and the hardware applies the
//     swizzle to the address it forms, so stepping the start address inside the 128-byte
//     row is how consecutive k steps are addressed (base offset 0: every operand base is
//     1024-byte aligned);
//   - leading-dimension byte offset: unused for swizzled K-major operands whose k step (32
//     bytes) lies within the 128-byte swizzle row: 0;
//   - stride-dimension byte offset: from one 8-row core-matrix group to the next along M
//     or N: 8 rows × 128 B = 1024.
// In bytes these are the bf16 kernels' values (their 64-element bf16 rows are also 128
// bytes and their k16 step also 32 bytes); in elements a row is 128 FP8 and a step 32.
//
// Accumulator fragment of m64nNk32 with f32 D (the layout of every wgmma f32 D): thread t
// of the warpgroup, warp w = t/32, lane l, holds for each 8-column group j (0..N/8-1)
//   d[4j+0], d[4j+1] = D[16w + l/4    ][8j + 2(l%4) + {0, 1}]
//   d[4j+2], d[4j+3] = D[16w + l/4 + 8][8j + 2(l%4) + {0, 1}]
// so each thread promotes two rows (two A scales) and, in the weight gradient, 32 columns
// (32 B scales: the pairs 8j + 2(l%4), j = 0..15).

#define HF_BM 128
#define HF_BN 128
#define HF_BK 128
#define HF_STAGES 6
#define HF_A_BYTES (HF_BM * HF_BK)
#define HF_B_BYTES (HF_BN * HF_BK)
#define HF_STAGE_BYTES (HF_A_BYTES + HF_B_BYTES)
#define HF_MXT 640 // floats of one decoded column-scale table: 4 blocks × 4 lane quads × 40
#define HF_SMEM (HF_STAGES * (HF_STAGE_BYTES + (HF_BM + HF_BN) * 4) + 4 * HF_MXT * 4 + 2 * HF_STAGES * 8 + 4 * (HB_MAXG + 1) * 4 + 1024)
// The _m192 kernels (blockwise forward and weight gradient): three consumer warpgroups,
// tiles of 192 rows × 128 columns, HF_STAGES3 stages of 40 KB, no MXFP8 tables; HF_SMEM3
// is their shared memory (hopper/fp8.go's fp8Smem3 mirrors it).
#define HF_STAGES3 5
#define HF_SMEM3 (HF_STAGES3 * (192 * HF_BK + HF_B_BYTES + (192 + HF_BN) * 4) + 2 * HF_STAGES3 * 8 + 4 * (HB_MAXG + 1) * 4 + 1024)

// The kernels' output modes (their argument out): bf16 stored from the accumulator layout,
// f32, or bf16 through the staged epilogue (hb_store_staged; the blockwise kernels of one
// CTA a cluster, out 16-byte aligned, not accumulating; the others store bf16 from the
// accumulator layout in that mode too).
#define HF_OUT_BF16 0
#define HF_OUT_F32 1
#define HF_OUT_STAGED 2

// hf_cfg is the tile and shared-memory layout of a kernel with NC consumer warpgroups of 64
// rows each: NC = 2 for every recipe and form (HF_SMEM), NC = 3 for the _m192 kernels
// (HF_SMEM3). With one more consumer the tensor cores run two consumers' MMAs while the
// third promotes, and each CTA-stage's 40 KB from L2 feed 1.5 times the MMAs of 32 KB.
// The register budget of 64K per SM is split between the producer warpgroup (PREG) and the
// consumers (CREG each): 40 + 2·232 or 24 + 3·160 per thread, in units of 128 threads.
template <int NC> struct hf_cfg {
    static constexpr int BM = 64 * NC;
    static constexpr int S = NC == 2 ? HF_STAGES : HF_STAGES3;
    static constexpr int A_BYTES = BM * HF_BK;
    static constexpr int STAGE = A_BYTES + HF_B_BYTES;
    static constexpr int MXT = NC == 2 ? 4 * HF_MXT : 0; // floats of the MXFP8 tables
    static constexpr int PREG = NC == 2 ? 40 : 24, CREG = NC == 2 ? 232 : 160;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// wgmma m64n128k32, FP8 operands from shared memory (both K-major: FP8 has no transposed
// forms), f32 accumulators in d[64]. scale_d == 0 zeroes the accumulators first.
// Operands: d %0-%63, the descriptors %64 and %65, scale_d %66.
#define HF_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define HF_WGMMA(NAME, TYPES)                                                                                                     \
    __device__ __forceinline__ void NAME(float *d, u64 da, u64 db, int scale_d) {                                                \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                 \
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES " "                                                     \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "      \
                     "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
                     "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                     "%64, %65, p, 1, 1;\n}\n"                                                                                    \
                     : HF_D8(0), HF_D8(8), HF_D8(16), HF_D8(24), HF_D8(32), HF_D8(40), HF_D8(48), HF_D8(56)                       \
                     : "l"(da), "l"(db), "r"(scale_d));                                                                           \
    }
// m64n64k32 likewise, d[32] (operands %0-%31, descriptors %32 and %33; always accumulating
// into zeroed or live d as scale_d %34 says).
#define HF_WGMMA64(NAME, TYPES)                                                                                                  \
    __device__ __forceinline__ void NAME(float *d, u64 da, u64 db, int scale_d) {                                                \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                 \
                     "wgmma.mma_async.sync.aligned.m64n64k32.f32." TYPES " "                                                      \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "      \
                     "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                                         \
                     "%32, %33, p, 1, 1;\n}\n"                                                                                    \
                     : HF_D8(0), HF_D8(8), HF_D8(16), HF_D8(24)                                                                   \
                     : "l"(da), "l"(db), "r"(scale_d));                                                                           \
    }
HF_WGMMA(hf_wgmma_e4m3_e4m3, "e4m3.e4m3")
HF_WGMMA(hf_wgmma_e4m3_e5m2, "e4m3.e5m2")
HF_WGMMA(hf_wgmma_e5m2_e4m3, "e5m2.e4m3")
HF_WGMMA(hf_wgmma_e5m2_e5m2, "e5m2.e5m2")
HF_WGMMA64(hf_wgmma64_e4m3_e4m3, "e4m3.e4m3")
HF_WGMMA64(hf_wgmma64_e4m3_e5m2, "e4m3.e5m2")
HF_WGMMA64(hf_wgmma64_e5m2_e4m3, "e5m2.e4m3")
HF_WGMMA64(hf_wgmma64_e5m2_e5m2, "e5m2.e5m2")

// hf_mma: the wgmma m64nNk32 (N = 128, or 64: hf_wgmma64) of element types TA (A) and TB
// (B): 0 E4M3, 1 E5M2.
#define HF_PICK(P)                                                                                                               \
    if constexpr (TA == 0 && TB == 0) P##_e4m3_e4m3(d, da, db, scale_d);                                                          \
    else if constexpr (TA == 0) P##_e4m3_e5m2(d, da, db, scale_d);                                                                \
    else if constexpr (TB == 0) P##_e5m2_e4m3(d, da, db, scale_d);                                                                \
    else P##_e5m2_e5m2(d, da, db, scale_d);
template <int TA, int TB, int N = 128>
__device__ __forceinline__ void hf_mma(float *d, u64 da, u64 db, int scale_d) {
    if constexpr (N == 64) {
        HF_PICK(hf_wgmma64)
    } else {
        HF_PICK(hf_wgmma)
    }
}

// hf_fence keeps the compiler from moving accesses of the accumulators across the wgmma
// fences and waits around it (the registers are written asynchronously).
__device__ __forceinline__ void hf_fence(float *d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// hf_fence32 is hf_fence for half of the accumulators (one m64n64 fragment).
__device__ __forceinline__ void hf_fence32(float *d) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Clusters: with CL = 2 the two CTAs of a cluster compute tiles that share their A tile
// (the same rows, or in the weight gradient the same dw rows) and neighbouring column
// tiles; each CTA loads half of the A tile and multicasts it to both, halving the A
// traffic from L2. A stage is refilled only when the consumers of both CTAs have read it,
// so each consumer warp hands a stage back to both CTAs' producers (hf_release).

__device__ __forceinline__ u32 hf_cta_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// hf_cluster_sync: every thread of both CTAs arrives and waits (release/acquire at cluster
// scope).
__device__ __forceinline__ void hf_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// hf_arrive_peer arrives on the barrier at bar's offset in the shared memory of cluster CTA
// peer. The arrival keeps the default release at CTA scope: what it orders is this warp's
// reads of a stage by its (completed) MMAs before the peer's next copy into it, and a
// release at cluster scope would make every consumer warp wait at a memory barrier for
// its outstanding global loads and stores once a stage (measured: half the rate).
__device__ __forceinline__ void hf_arrive_peer(u64 *bar, u32 peer) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(hb_smem(bar)), "r"(peer));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(a) : "memory");
}

// hf_tma2d_mc is hb_tma2d multicast: the box lands at dst's offset in every CTA of mask,
// each completing the transaction on its barrier at bar's offset.
__device__ __forceinline__ void hf_tma2d_mc(void *dst, const dl_tmap *tm, int c0, int c1, u64 *bar, unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4}], "
                 "[%2], %5;" ::"r"(hb_smem(dst)),
                 "l"((u64)tm), "r"(hb_smem(bar)), "r"(c0), "r"(c1), "h"(mask)
                 : "memory");
}

// hf_bulk copies bytes (a multiple of 16; 16-byte aligned addresses) from global memory to
// shared memory, completing the transaction on bar.
__device__ __forceinline__ void hf_bulk(void *dst, const void *src, u32 bytes, u64 *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(hb_smem(dst)),
                 "l"((u64)src), "r"(bytes), "r"(hb_smem(bar))
                 : "memory");
}

// hf_cp4 copies the 4 bytes at src (global) to dst (shared) asynchronously and has bar's
// current phase wait for the copy: the arrival it adds on completion balances the pending
// count it raises at once, so the phase's expected arrivals stay as they are.
__device__ __forceinline__ void hf_cp4(void *dst, const void *src, u64 *bar) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                 "cp.async.mbarrier.arrive.shared::cta.b64 [%2];" ::"r"(hb_smem(dst)),
                 "l"((u64)src), "r"(hb_smem(bar))
                 : "memory");
}

// hf_wait_empty is the producer's wait for a stage to be handed back (with CL = 2 by the
// consumers of both CTAs; the acquire at CTA scope pairs with hf_arrive_peer's release).
__device__ __forceinline__ void hf_wait_empty(u64 *bar, u32 parity) { hb_mbar_wait(bar, parity); }

// hf_release hands a stage back, once per consumer warp (the empty barriers count CL·8
// arrivals): lane 0 arrives on its own CTA's barrier and, with CL = 2, lane 1 on the peer's.
template <int CL>
__device__ __forceinline__ void hf_release(u64 *bar, int lane, u32 crank) {
    if (lane == 0) hb_mbar_arrive(bar);
    if (CL > 1 && lane == 1) hf_arrive_peer(bar, crank ^ 1);
}

// hf_block runs one stage for a consumer warpgroup: d = A·Bᵀ over the stage's 128-deep
// block (four k32 steps, the first zeroing d), then waits for it. a and b are the
// operands' first rows in shared memory.
template <int TA, int TB>
__device__ __forceinline__ void hf_block(float *d, const unsigned char *a, const unsigned char *b) {
    hf_fence(d);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < HF_BK / 32; kk++) hf_mma<TA, TB>(d, hb_desc(a + kk * 32, 0, 1024), hb_desc(b + kk * 32, 0, 1024), kk);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    hf_fence(d);
}

// hf_store2 writes the pair (v0, v1) at element at = row·n + col of the row-major out of n
// columns (col even), f32 or bf16, adding what is there when acc is set; a pair past the
// last column writes its first element only (n odd) or nothing.
__device__ __forceinline__ void hf_store2(void *out, u64 at, int col, int n, float v0, float v1, int f32, int acc) {
    if (f32) {
        float *p = (float *)out + at;
        if (col + 1 < n) {
            if (acc) {
                const float2 o = *(const float2 *)p;
                v0 += o.x, v1 += o.y;
            }
            *(float2 *)p = make_float2(v0, v1);
        } else if (col < n) {
            p[0] = acc ? p[0] + v0 : v0;
        }
    } else {
        unsigned short *p = (unsigned short *)out + at;
        if (col + 1 < n) {
            if (acc) {
                const u32 o = *(const u32 *)p;
                v0 += dl_bf16_to_f32((unsigned short)o), v1 += dl_bf16_to_f32((unsigned short)(o >> 16));
            }
            *(u32 *)p = dl_f32x2_to_bf16x2(v0, v1);
        } else if (col < n) {
            p[0] = dl_f32_to_bf16(acc ? dl_bf16_to_f32(p[0]) + v0 : v0);
        }
    }
}

// hf_epilogue writes a consumer's 64×128 share of a tile, t in the fragment layout above,
// into rows row0 + [0, rows) (rows may be ≤ 0: nothing) and columns n0 + [0, 128) ∩ [0, n)
// of out.
__device__ __forceinline__ void hf_epilogue(const float *t, void *out, u64 row0, int rows, int n0, int n, int w, int lane, int f32,
                                            int acc) {
    const int r = w * 16 + lane / 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (r + 8 * h >= rows) continue;
        const u64 rowoff = (row0 + r + 8 * h) * (u64)n;
#pragma unroll
        for (int j = 0; j < HF_BN / 8; j++) {
            const int col = n0 + 8 * j + 2 * (lane % 4);
            hf_store2(out, rowoff + col, col, n, t[4 * j + 2 * h], t[4 * j + 2 * h + 1], f32, acc);
        }
    }
}

// The shared-memory regions of the layout above.
struct hf_smem {
    unsigned char *stages;
    float *sa, *sb, *mx;
    u64 *full, *empty;
    int *tstart, *rstart, *lstart, *pstart;
};

template <int NC>
__device__ __forceinline__ hf_smem hf_carve(unsigned char *raw) {
    using L = hf_cfg<NC>;
    hf_smem m;
    m.stages = hb_align(raw);
    m.sa = (float *)(m.stages + L::S * L::STAGE);
    m.sb = m.sa + L::S * L::BM;
    m.mx = m.sb + L::S * HF_BN;
    m.full = (u64 *)(m.mx + L::MXT);
    m.empty = m.full + L::S;
    m.tstart = (int *)(m.empty + L::S);
    m.rstart = m.tstart + (HB_MAXG + 1);
    m.lstart = m.rstart + (HB_MAXG + 1);
    m.pstart = m.lstart + (HB_MAXG + 1);
    return m;
}

// hf_pstarts, run by warp 0 after hb_setup: pstart[g] = Σ_{h<g} ceil(M_h/128) for g ≤ G,
// the first 128-row block of each group in package quant's grouped MXFP8 layout.
__device__ __forceinline__ void hf_pstarts(const int *rstart, int G, int *pstart) {
    const int lane = threadIdx.x & 31;
    int p = 0;
    for (int base = 0; base < G; base += 32) {
        const int g = base + lane;
        const int nb = g < G ? (rstart[g + 1] - rstart[g] + HF_BM - 1) / HF_BM : 0;
        int in = nb;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(DL_FULL, in, o);
            if (lane >= o) in += v;
        }
        if (g < G) pstart[g] = p + in - nb;
        p += __shfl_sync(DL_FULL, in, 31);
    }
    if (lane == 0) pstart[G] = p;
}

// hf_begin runs warp 0's setup (hb_setup with ntc column tiles per 128-row block, and the
// MXFP8 forms' pstart when pstarts is set), then synchronizes the CTA and, with CL = 2, the
// cluster (so that the peer's barriers are initialized before anything reaches them). It
// returns false for invalid sizes, alike in both CTAs of a cluster.
template <int CL, int NC, int BR>
__device__ __forceinline__ bool hf_begin(const hf_smem &m, hb_sched *sc, const int *sizes, int G, int M, int ntc, int light,
                                         int band, i64 *status, int op, bool pstarts) {
    __shared__ int bad;
    if (threadIdx.x < 32) {
        const int e =
            hb_setup<BR>(sizes, G, M, ntc, light, band, m.tstart, m.lstart, sc, m.rstart, status, op, m.full, m.empty, hf_cfg<NC>::S, CL * 4 * NC);
        if (!e && pstarts) hf_pstarts(m.rstart, G, m.pstart);
        if (threadIdx.x == 0) bad = e;
    }
    __syncthreads();
    if (bad) return false;
    if (CL > 1) hf_cluster_sync();
    return true;
}

// hf_load_a issues a stage's A tile (rows row0.., contraction from c0): with CL = 2 this
// CTA's half, multicast to both CTAs of the cluster; else the whole box.
template <int CL, int NC>
__device__ __forceinline__ void hf_load_a(unsigned char *stg, const dl_tmap *tmA, int c0, int row0, u32 crank, u64 *bar) {
    if constexpr (CL > 1)
        hf_tma2d_mc(stg + crank * (hf_cfg<NC>::A_BYTES / CL), tmA, c0, row0 + crank * (hf_cfg<NC>::BM / CL), bar, (1 << CL) - 1);
    else
        hb_tma2d(stg, tmA, c0, row0, bar);
}

// hf_ftile is the place of a forward (or input-gradient) tile: group g of sz rows, its row
// tile mt (rows row0 + [0, rows) of the group's) and column tile nt (columns from n0).
struct hf_ftile {
    int g, sz, mt, nt, row0, n0, rows;
};

// hf_fwd_tile returns the place of schedule position tile for this CTA of a cluster of CL.
template <int CL, int BM>
__device__ __forceinline__ hf_ftile hf_fwd_tile(const hb_sched *sc, const hf_smem &m, int G, int tile, u32 crank) {
    hf_ftile t;
    int local;
    t.g = hb_pick(sc, m.tstart, m.lstart, G, tile, &local);
    t.sz = m.rstart[t.g + 1] - m.rstart[t.g];
    const int mtiles = (t.sz + BM - 1) / BM;
    int nu;
    hb_place(sc, local, mtiles, &t.mt, &nu);
    t.nt = nu * CL + crank;
    t.row0 = m.rstart[t.g] + t.mt * BM, t.n0 = t.nt * HF_BN;
    t.rows = min(BM, t.sz - t.mt * BM);
    return t;
}

// hf_wtile is the place of a weight-gradient tile: group g, dw rows from m0 and columns from
// n0, the group's token blocks [p0, p0 + nkb).
struct hf_wtile {
    int g, m0, n0, p0, nkb;
};

// hf_wg_tile returns the place of tile (of G·tm·tnc) for this CTA of a cluster of CL.
template <int CL, int BM>
__device__ __forceinline__ hf_wtile hf_wg_tile(const hf_smem &m, int tile, int tm, int tnc, u32 crank) {
    hf_wtile t;
    t.g = tile / (tm * tnc);
    const int local = tile % (tm * tnc);
    t.m0 = (local % tm) * BM, t.n0 = ((local / tm) * CL + crank) * HF_BN;
    t.p0 = m.tstart[t.g], t.nkb = m.tstart[t.g + 1] - t.p0;
    return t;
}

// MXFP8 (1×32 blocks, E8M0 scales): the same tiles, stages and clusters, but each 128-deep
// stage holds four scale blocks, so every 32 of the contraction is promoted on its own:
// total += partial · s_a · s_b with the block's scales, 2^(e − 127) for code e (code 0 is
// 2^−127; code 255, NaN, only marks blocks whose codes are NaN). The promotions are as
// much CUDA-core work as the MMAs are tensor-core work, so each block runs as two
// m64n64k32 halves whose promotions overlap the other half's MMA (hf_mx_stage), with the
// column scales decoded to f32 once per stage (hf_mx_decode).

// hf_e8m0 is the scale of E8M0 code e (0..255).
__device__ __forceinline__ float hf_e8m0(u32 e) { return e ? __int_as_float(e << 23) : 5.877471754111438e-39f; }

// The column scales of a stage (128 columns × 4 blocks) are decoded once per stage by the
// consumer warpgroup into f32 in shared memory, in the order hf_mx_stage reads them: the
// thread of lane l promotes columns 8j + 2(l%4) + {0, 1}, j = 0..15, so the table holds, for
// block s and lane quad q = l%4, those 32 scales contiguous at tab[160s + 40q + 2j + e]
// (rows of 40 floats: the 4 quads' stores fall in distinct banks; 16-byte reads).
// Each consumer has two tables, used by alternate stages, so that a thread may fill the
// next stage's while another still reads the last one's (the named barrier between
// them orders each table's writes after the reads of two stages before).

// hf_mx_decode decodes the 512 codes of a stage, code(col, s) = codes[col·cs + s·ss], into
// tab, one column per thread t of the consumer warpgroup, then synchronizes the warpgroup
// (named barrier bar).
__device__ __forceinline__ void hf_mx_decode(float *tab, const unsigned char *codes, int cs, int ss, int t, int bar) {
    float *d = tab + 40 * ((t % 8) / 2) + 2 * (t / 8) + t % 2;
#pragma unroll
    for (int s = 0; s < 4; s++) d[160 * s] = hf_e8m0(codes[t * cs + s * ss]);
    asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
}

// hf_mx_half adds half h (columns 64h..64h+63, accumulators 32h..32h+31) of block s's
// partial sums scaled by (sa0, sa1) for the thread's two rows and tq's column scales
// (tq: the thread's quad row of the table).
__device__ __forceinline__ void hf_mx_half(float *tot, const float *part, float sa0, float sa1, const float *tq, int s, int h) {
#pragma unroll
    for (int i = 4 * h; i < 4 * h + 4; i++) {
        const float4 v = *(const float4 *)(tq + 160 * s + 4 * i);
        tot[8 * i + 0] = fmaf(part[8 * i + 0], sa0 * v.x, tot[8 * i + 0]);
        tot[8 * i + 1] = fmaf(part[8 * i + 1], sa0 * v.y, tot[8 * i + 1]);
        tot[8 * i + 2] = fmaf(part[8 * i + 2], sa1 * v.x, tot[8 * i + 2]);
        tot[8 * i + 3] = fmaf(part[8 * i + 3], sa1 * v.y, tot[8 * i + 3]);
        tot[8 * i + 4] = fmaf(part[8 * i + 4], sa0 * v.z, tot[8 * i + 4]);
        tot[8 * i + 5] = fmaf(part[8 * i + 5], sa0 * v.w, tot[8 * i + 5]);
        tot[8 * i + 6] = fmaf(part[8 * i + 6], sa1 * v.z, tot[8 * i + 6]);
        tot[8 * i + 7] = fmaf(part[8 * i + 7], sa1 * v.w, tot[8 * i + 7]);
    }
}

// hf_mx_issue issues half h of block s: part's half = A·Bᵀ over the block's 32 elements and
// the tile's columns 64h..64h+63 (B rows 64h.. of the stage: 8 core-matrix groups of 1024
// bytes each), as one wgmma group.
template <int TA, int TB>
__device__ __forceinline__ void hf_mx_issue(float *part, const unsigned char *a, const unsigned char *b, int s, int h) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    hf_fence32(part + 32 * h);
    hf_mma<TA, TB, 64>(part + 32 * h, hb_desc(a + s * 32, 0, 1024), hb_desc(b + h * 8192 + s * 32, 0, 1024), 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// hf_mx_stage runs a stage's four scale blocks for a consumer warpgroup as a pipeline of
// half-width MMAs: each half's promotion runs while the other half's MMA of the same or
// the next block is in flight, so the warpgroup's promotions overlap its own tensor-core
// work (and the other consumer's). w0 and w1 hold the four codes of the thread's two rows
// (byte s: block s); the stage is handed back once its last MMA has completed.
template <int TA, int TB, int CL>
__device__ __forceinline__ void hf_mx_stage(float *tot, float *part, const unsigned char *a, const unsigned char *b, u32 w0, u32 w1,
                                            const float *tq, u64 *empty, int lane, u32 crank) {
    hf_mx_issue<TA, TB>(part, a, b, 0, 0);
    hf_mx_issue<TA, TB>(part, a, b, 0, 1);
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const float sa0 = hf_e8m0((w0 >> (8 * s)) & 255), sa1 = hf_e8m0((w1 >> (8 * s)) & 255);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        hf_fence32(part);
        hf_mx_half(tot, part, sa0, sa1, tq, s, 0);
        if (s < 3) {
            hf_mx_issue<TA, TB>(part, a, b, s + 1, 0);
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        } else {
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            hf_release<CL>(empty, lane, crank);
        }
        hf_fence32(part + 32);
        hf_mx_half(tot, part, sa0, sa1, tq, s, 1);
        if (s < 3) hf_mx_issue<TA, TB>(part, a, b, s + 1, 1);
    }
}

// Forward and input gradient: y[M, N] = A[M, Kc] · B_gᵀ for the rows of each group g, for
// the two recipes (MX = 0: blockwise, MX = 1: MXFP8).
//   A: the rowwise activations or gradients, FP8 [M, Kc] (tmA, box {128, 128/CL}: with CL = 2
//      each CTA loads its half of the tile's rows and multicasts it). Its scales, which
//      the consumers read from global memory a stage ahead (each thread needs its two
//      rows'):
//        blockwise: RowScale F32 [ceil(Kc/128), Mr] (sa, ss = Mr = roundup(M, 4));
//        MXFP8: RowScale E8M0 [Sr, cp] (sa, bytes, ss = cp = roundup(ceil(Kc/32), 4), so
//        that one 32-bit word holds a row's four codes of a stage): row r of group g has
//        scale row r when grouped is 0, else 128·P_g + (r − start_g) (package quant's
//        grouped layout).
//   B: the K-major weights, FP8 [G, N, Kc] (tmB, box {128, 128, 1}), with scales
//        blockwise: sb[g·gs + kb·ks + nb·ns] for contraction block kb and output block nb
//        (forward: w.Scales [G, Kc/128, N/128], ks = N/128, ns = 1; input gradient:
//        [G, N/128, Kc/128], ks = 1, ns = Kc/128): the producer copies each stage's one
//        scale into the stage's B scale slot with the data (hf_cp4);
//        MXFP8: E8M0 [G, ceil(Kc/128), N, 4] (sb): a stage's codes for the tile's columns
//        are 512 contiguous bytes (N is a multiple of 16), which the producer copies into
//        the stage's B scale slot with the data.
// Tiles are dealt as the bf16 forward deals them (hb_pick: each group's row tiles, short
// groups' tiles spread among the others), round-robin over the persistent grid's clusters;
// a cluster's CL CTAs take the same rows and CL neighbouring column tiles (a column tile
// past N loads no B and computes nothing). Every tile runs ceil(Kc/128) stages. A consumer
// whose 64 rows all lie past its group's end keeps the barrier protocol but issues no
// wgmma and writes nothing. Rows past the group's end in a tile belong to the next group
// and are computed but not written; rows past M, columns past N and contraction past Kc
// read TMA's zeros. Rows past sum(sizes) are zeroed by the tail kernel, launched first.
template <int TA, int TB, int CL, int MX, int NC>
__device__ __forceinline__ void hf_gemm(const dl_tmap *tmA, const dl_tmap *tmB, const void *sav, int ss, int grouped, void *y,
                                        const void *sbv, const int *sizes, int G, int M, int N, int Kc, i64 ks, i64 ns, i64 gs,
                                        i64 *status, int op, int light, int band, int out) {
    using L = hf_cfg<NC>;
    extern __shared__ unsigned char hf_raw[];
    const hf_smem m = hf_carve<NC>(hf_raw);
    __shared__ hb_sched sc;
    const int tid = threadIdx.x;
    const u32 crank = CL > 1 ? hf_cta_rank() : 0;
    const int ntn = (N + HF_BN - 1) / HF_BN, ntc = (ntn + CL - 1) / CL; // column tiles, per CTA of a cluster
    if (!hf_begin<CL, NC, L::BM>(m, &sc, sizes, G, M, ntc, light, band, status, op, MX)) return;
    const int total = m.tstart[G] + m.lstart[G];
    const int nkb = (Kc + HF_BK - 1) / HF_BK;
    const int first = blockIdx.x / CL, step = gridDim.x / CL;
    unsigned char *sbs = (unsigned char *)m.sb; // MXFP8: the B scale slots, 512 bytes a stage
    // Uniform over the warp (see hb_grouped): the branches on it must not look divergent.
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::PREG));
        if (tid == 0) {
            int it = 0;
            for (int tile = first; tile < total; tile += step) {
                const hf_ftile t = hf_fwd_tile<CL, L::BM>(&sc, m, G, tile, crank);
                const bool hasB = t.n0 < N;
                const u32 sbytes = MX && hasB ? 4 * min(HF_BN, N - t.n0) : 0;
                for (int kb = 0; kb < nkb; kb++, it++) {
                    const int st = it % L::S;
                    const u32 ph = (it / L::S) & 1;
                    hf_wait_empty(&m.empty[st], ph ^ 1);
                    unsigned char *stg = m.stages + st * L::STAGE;
                    // Blockwise: the stage's B scale into its slot, for the consumers to
                    // read after the stage's barrier (not a load of their own a stage
                    // ahead, whose value the compiler may move into a uniform register
                    // at once, waiting for the load there).
                    if (!MX && hasB) hf_cp4(m.sb + st * HF_BN, (const float *)sbv + (i64)t.g * gs + (i64)kb * ks + (i64)t.nt * ns, &m.full[st]);
                    hb_mbar_expect_tx(&m.full[st], L::A_BYTES + (hasB ? HF_B_BYTES : 0) + sbytes);
                    hf_load_a<CL, NC>(stg, tmA, kb * HF_BK, t.row0, crank, &m.full[st]);
                    if (hasB) hb_tma3d(stg + L::A_BYTES, tmB, kb * HF_BK, t.n0, t.g, &m.full[st]);
                    if (sbytes)
                        hf_bulk(sbs + st * 512, (const unsigned char *)sbv + (((i64)t.g * nkb + kb) * N + t.n0) * 4, sbytes, &m.full[st]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::CREG));
        const int c = wg - 1;
        const int w = (tid % 128) / 32, lane = tid % 32;
        const int r = w * 16 + lane / 4;
        float part[64], tot[64];
#pragma unroll
        for (int i = 0; i < 64; i++) part[i] = 0.f;
        int it = 0;
        int dec = 0; // MXFP8: stages decoded, whose parity picks the table
        (void)dec;
        // bf16 output through the staged epilogue (blockwise, one CTA a cluster).
        const bool staged = !MX && CL == 1 && out == HF_OUT_STAGED;
        int held = 0; // the stage the staged epilogue stores through
        for (int tile = first; tile < total; tile += step) {
            const hf_ftile t = hf_fwd_tile<CL, L::BM>(&sc, m, G, tile, crank);
            const bool active = c * 64 < t.rows && t.nt < ntn;
            // The scales of the thread's two rows, loaded a stage ahead: *n for the next
            // stage (blockwise rows past Mr and MXFP8 rows past the group's end read
            // nothing); blockwise, the tile's column scale comes with each stage.
            float a0n = 0.f, a1n = 0.f;
            u32 w0n = 0, w1n = 0;
            const float *sa = (const float *)sav;
            const u32 *w0p = nullptr, *w1p = nullptr;
            const int ra0 = t.row0 + c * 64 + r, ra1 = ra0 + 8;
            if constexpr (MX) {
                const int i0 = t.mt * L::BM + c * 64 + r, i1 = i0 + 8;
                const i64 srow = grouped ? (i64)m.pstart[t.g] * HF_BM - m.rstart[t.g] : 0; // scale row − row
                const unsigned char *sab = (const unsigned char *)sav;
                if (i0 < t.sz) w0p = (const u32 *)(sab + (srow + ra0) * ss);
                if (i1 < t.sz) w1p = (const u32 *)(sab + (srow + ra1) * ss);
                w0n = w0p ? __ldg(w0p) : 0u, w1n = w1p ? __ldg(w1p) : 0u;
            } else {
                a0n = ra0 < ss ? __ldg(sa + ra0) : 0.f, a1n = ra1 < ss ? __ldg(sa + ra1) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] = 0.f;
            for (int kb = 0; kb < nkb; kb++, it++) {
                const int st = it % L::S;
                const u32 ph = (it / L::S) & 1;
                const float a0 = a0n, a1 = a1n;
                const u32 w0 = w0n, w1 = w1n;
                if (kb + 1 < nkb) {
                    if constexpr (MX) {
                        w0n = w0p ? __ldg(w0p + kb + 1) : 0u;
                        w1n = w1p ? __ldg(w1p + kb + 1) : 0u;
                    } else {
                        const float *san = sa + (i64)(kb + 1) * ss;
                        a0n = ra0 < ss ? __ldg(san + ra0) : 0.f;
                        a1n = ra1 < ss ? __ldg(san + ra1) : 0.f;
                    }
                }
                hb_mbar_wait(&m.full[st], ph);
                if (!active) {
                    hf_release<CL>(&m.empty[st], lane, crank);
                    continue;
                }
                const unsigned char *stg = m.stages + st * L::STAGE;
                if constexpr (MX) {
                    float *tab = m.mx + (2 * c + (dec++ & 1)) * HF_MXT;
                    hf_mx_decode(tab, sbs + st * 512, 4, 1, tid % 128, 1 + c);
                    hf_mx_stage<TA, TB, CL>(tot, part, stg + c * (64 * HF_BK), stg + L::A_BYTES, w0, w1, tab + 40 * (lane % 4),
                                            &m.empty[st], lane, crank);
                } else {
                    const float sbk = m.sb[st * HF_BN]; // read before the stage is handed back
                    hf_block<TA, TB>(part, stg + c * (64 * HF_BK), stg + L::A_BYTES);
                    // The stage's data is read: hand it back before promoting, but for the
                    // tile's last stage in the staged epilogue, which stores through it.
                    if (!staged || kb + 1 < nkb) hf_release<CL>(&m.empty[st], lane, crank);
                    else held = st;
                    const float s0 = a0 * sbk, s1 = a1 * sbk;
#pragma unroll
                    for (int j = 0; j < HF_BN / 8; j++) {
                        tot[4 * j + 0] = fmaf(part[4 * j + 0], s0, tot[4 * j + 0]);
                        tot[4 * j + 1] = fmaf(part[4 * j + 1], s0, tot[4 * j + 1]);
                        tot[4 * j + 2] = fmaf(part[4 * j + 2], s1, tot[4 * j + 2]);
                        tot[4 * j + 3] = fmaf(part[4 * j + 3], s1, tot[4 * j + 3]);
                    }
                }
            }
            if (active && staged && nkb > 0) {
                // Each warp's rows pass through its 2 KB of the consumer's A rows in the
                // tile's last stage (see hb_store_staged), handed back afterwards.
                unsigned char *wb = m.stages + held * L::STAGE + c * (64 * HF_BK) + w * 2048;
                hb_store_staged<2>(tot, wb, (unsigned short *)y, (u64)(t.row0 + c * 64 + w * 16), t.rows - c * 64 - w * 16, t.n0, N,
                                   lane);
                hf_release<CL>(&m.empty[held], lane, crank);
            } else if (active) {
                hf_epilogue(tot, y, (u64)(t.row0 + c * 64), t.rows - c * 64, t.n0, N, w, lane, out == HF_OUT_F32, 0);
            }
        }
    }
    if (CL > 1) hf_cluster_sync(); // no CTA leaves while its peer may still signal it
}

// Weight gradient: dw[g] (R×C) = A_g · B_gᵀ, contracting over the tokens of group g, for the
// two recipes (MX = 0: blockwise, MX = 1: MXFP8).
//   A: FP8 [R, Mp] (tmA, box {128 tokens, 128/CL rows}, multicast in a cluster as in the
//      forward), the columnwise (ColT) form of x (dw [G, K, N]) or dy ([G, N, K]);
//   B: FP8 [C, Mp] (tmB) likewise, the other operand.
// Their scales, which the producer copies into the stage's scale slots with the data (the
// consumers read their two rows' and 32 columns' there before handing the stage back):
//   blockwise: F32 [Mp/128, R] (sa) and [Mp/128, C] (sb), the scale of row i's block t at
//   (t, i): a stage's 128 are contiguous (R and C are multiples of 16, so the copies are
//   16-byte aligned);
//   MXFP8: E8M0 [Mp/32, sra] (sa) and [Mp/32, srb] (sb), sra = roundup(R, 128) and
//   srb = roundup(C, 128): a stage's codes are four runs of 128 bytes, one per 32-token
//   block.
// Group g's tokens are the 128-token blocks [P_g, P_g + ceil(M_g/128)), P_g =
// Σ_{h<g} ceil(M_h/128) (hb_setup's tile offsets with one column tile and no light
// groups); the quantization zeroed the padding tokens of each group's last block, so no
// masking is needed. Promotion scales element (i, j) by s_a[i]·s_b[j]. Tiles (g, m-tile,
// n-tile) are dealt round-robin over the clusters, whose CTAs take the same m-tile and CL
// neighbouring n-tiles; an empty group's tile writes zeros (accum: nothing). accum adds
// the result to dw. Scale slots past R or C hold stale values, which only rows and columns
// that are not written use.
template <int TA, int TB, int CL, int MX, int NC>
__device__ __forceinline__ void hf_wgrad(const dl_tmap *tmA, const dl_tmap *tmB, const void *sa, int sra, const void *sb, int srb,
                                         void *dw, const int *sizes, int G, int M, int R, int C, i64 *status, int op, int out,
                                         int accum) {
    using L = hf_cfg<NC>;
    extern __shared__ unsigned char hf_raw[];
    const hf_smem m = hf_carve<NC>(hf_raw);
    __shared__ hb_sched sc;
    const int tid = threadIdx.x;
    const u32 crank = CL > 1 ? hf_cta_rank() : 0;
    if (!hf_begin<CL, NC, HF_BK>(m, &sc, sizes, G, M, 1, 0, 0, status, op, false)) return;
    const int tm = (R + L::BM - 1) / L::BM, tn = (C + HF_BN - 1) / HF_BN, tnc = (tn + CL - 1) / CL;
    const int total = G * tm * tnc;
    const int first = blockIdx.x / CL, step = gridDim.x / CL;
    unsigned char *sas = (unsigned char *)m.sa, *sbs = (unsigned char *)m.sb; // 4·BM and 512 bytes a stage
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::PREG));
        if (tid == 0) {
            int it = 0;
            for (int tile = first; tile < total; tile += step) {
                const hf_wtile t = hf_wg_tile<CL, L::BM>(m, tile, tm, tnc, crank);
                // Scale bytes per run: MXFP8 one code per row (four runs), blockwise one f32.
                const u32 ab = (MX ? 1 : 4) * min(L::BM, R - t.m0), bb = t.n0 < C ? (MX ? 1 : 4) * min(HF_BN, C - t.n0) : 0;
                const u32 runs = MX ? 4 : 1;
                for (int kb = 0; kb < t.nkb; kb++, it++) {
                    const int st = it % L::S;
                    const u32 ph = (it / L::S) & 1;
                    hf_wait_empty(&m.empty[st], ph ^ 1);
                    unsigned char *stg = m.stages + st * L::STAGE;
                    // A column tile past C (the odd one of a cluster) loads no B.
                    hb_mbar_expect_tx(&m.full[st], L::A_BYTES + runs * ab + (bb ? HF_B_BYTES + runs * bb : 0));
                    const int p = (t.p0 + kb) * HF_BK;
                    hf_load_a<CL, NC>(stg, tmA, p, t.m0, crank, &m.full[st]);
                    if (bb) hb_tma2d(stg + L::A_BYTES, tmB, p, t.n0, &m.full[st]);
                    for (u32 q = 0; q < runs; q++) {
                        // The run's first scale: token block (t.p0 + kb)·runs + q of the operand's.
                        const i64 blk = (i64)(t.p0 + kb) * runs + q;
                        hf_bulk(sas + st * (4 * L::BM) + q * 128, (const unsigned char *)sa + (blk * sra + t.m0) * (MX ? 1 : 4), ab, &m.full[st]);
                        if (bb)
                            hf_bulk(sbs + st * 512 + q * 128, (const unsigned char *)sb + (blk * srb + t.n0) * (MX ? 1 : 4), bb, &m.full[st]);
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::CREG));
        const int c = wg - 1;
        const int w = (tid % 128) / 32, lane = tid % 32;
        const int r = w * 16 + lane / 4;
        float part[64], tot[64];
#pragma unroll
        for (int i = 0; i < 64; i++) part[i] = 0.f;
        int it = 0;
        int dec = 0; // MXFP8: stages decoded, whose parity picks the table
        (void)dec;
        // bf16 output through the staged epilogue (blockwise, one CTA a cluster, not
        // accumulating).
        const bool staged = !MX && CL == 1 && out == HF_OUT_STAGED;
        int held = 0; // the stage the staged epilogue stores through
        for (int tile = first; tile < total; tile += step) {
            const hf_wtile t = hf_wg_tile<CL, L::BM>(m, tile, tm, tnc, crank);
            if (t.nkb == 0 && accum) continue;
            const bool active = t.m0 + c * 64 < R && t.n0 < C;
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] = 0.f;
            for (int kb = 0; kb < t.nkb; kb++, it++) {
                const int st = it % L::S;
                const u32 ph = (it / L::S) & 1;
                hb_mbar_wait(&m.full[st], ph);
                if (!active) {
                    hf_release<CL>(&m.empty[st], lane, crank);
                    continue;
                }
                const unsigned char *stg = m.stages + st * L::STAGE;
                if constexpr (MX) {
                    // The codes of the thread's two rows (byte q: block q); the columns'
                    // decoded into the table.
                    const unsigned char *ssa = sas + st * (4 * L::BM) + c * 64 + r;
                    u32 w0 = 0, w1 = 0;
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        w0 |= (u32)ssa[q * 128] << (8 * q);
                        w1 |= (u32)ssa[q * 128 + 8] << (8 * q);
                    }
                    float *tab = m.mx + (2 * c + (dec++ & 1)) * HF_MXT;
                    hf_mx_decode(tab, sbs + st * 512, 1, 128, tid % 128, 1 + c);
                    hf_mx_stage<TA, TB, CL>(tot, part, stg + c * (64 * HF_BK), stg + L::A_BYTES, w0, w1, tab + 40 * (lane % 4),
                                            &m.empty[st], lane, crank);
                } else {
                    const float *ssa = (const float *)m.sa + st * L::BM + c * 64 + r,
                                *ssb = (const float *)m.sb + st * HF_BN + 2 * (lane % 4);
                    const float sa0 = ssa[0], sa1 = ssa[8];
                    if constexpr (NC == 2) {
                        // The column scales in registers during the MMA; the stage handed back
                        // before promoting.
                        float2 sbf[HF_BN / 8];
#pragma unroll
                        for (int j = 0; j < HF_BN / 8; j++) sbf[j] = *(const float2 *)(ssb + 8 * j);
                        hf_block<TA, TB>(part, stg + c * (64 * HF_BK), stg + L::A_BYTES);
                        if (!staged || kb + 1 < t.nkb) hf_release<CL>(&m.empty[st], lane, crank);
                        else held = st;
#pragma unroll
                        for (int j = 0; j < HF_BN / 8; j++) {
                            tot[4 * j + 0] = fmaf(part[4 * j + 0], sa0 * sbf[j].x, tot[4 * j + 0]);
                            tot[4 * j + 1] = fmaf(part[4 * j + 1], sa0 * sbf[j].y, tot[4 * j + 1]);
                            tot[4 * j + 2] = fmaf(part[4 * j + 2], sa1 * sbf[j].x, tot[4 * j + 2]);
                            tot[4 * j + 3] = fmaf(part[4 * j + 3], sa1 * sbf[j].y, tot[4 * j + 3]);
                        }
                    } else {
                        // 160 registers hold the accumulators but not 32 column scales beside
                        // them: each pair is read from the stage's slot as it is used, and the
                        // stage handed back after the promotion (the other two consumers keep
                        // the tensor cores busy meanwhile).
                        hf_block<TA, TB>(part, stg + c * (64 * HF_BK), stg + L::A_BYTES);
#pragma unroll
                        for (int j = 0; j < HF_BN / 8; j++) {
                            const float2 sb = *(const float2 *)(ssb + 8 * j);
                            tot[4 * j + 0] = fmaf(part[4 * j + 0], sa0 * sb.x, tot[4 * j + 0]);
                            tot[4 * j + 1] = fmaf(part[4 * j + 1], sa0 * sb.y, tot[4 * j + 1]);
                            tot[4 * j + 2] = fmaf(part[4 * j + 2], sa1 * sb.x, tot[4 * j + 2]);
                            tot[4 * j + 3] = fmaf(part[4 * j + 3], sa1 * sb.y, tot[4 * j + 3]);
                        }
                        if (!staged || kb + 1 < t.nkb) hf_release<CL>(&m.empty[st], lane, crank);
                        else held = st;
                    }
                }
            }
            if (active && staged && t.nkb > 0) {
                // As in the forward: through the consumer's A rows of the tile's last stage.
                unsigned char *wb = m.stages + held * L::STAGE + c * (64 * HF_BK) + w * 2048;
                hb_store_staged<2>(tot, wb, (unsigned short *)dw, (u64)t.g * R + t.m0 + c * 64 + w * 16, R - t.m0 - c * 64 - w * 16,
                                   t.n0, C, lane);
                hf_release<CL>(&m.empty[held], lane, crank);
            } else if (active) {
                hf_epilogue(tot, dw, (u64)t.g * R + t.m0 + c * 64, R - t.m0 - c * 64, t.n0, C, w, lane, out == HF_OUT_F32, accum);
            }
        }
    }
    if (CL > 1) hf_cluster_sync(); // no CTA leaves while its peer may still signal it
}

#define HF_BODY(TA, TB, CL, NC) hf_gemm<TA, TB, CL, 0, NC>(&tmA, &tmB, sa, Mr, 0, y, sb, sizes, G, M, N, Kc, ks, ns, gs, status, op, light, band, out);
#define HF_WBODY(TA, TB, CL, NC) hf_wgrad<TA, TB, CL, 0, NC>(&tmA, &tmB, sa, R, sb, C, dw, sizes, G, M, R, C, status, op, out, acc);
#define HF_MXBODY(TA, TB, CL) hf_gemm<TA, TB, CL, 1, 2>(&tmA, &tmB, sa, cp, grouped, y, sb, sizes, G, M, N, Kc, 0, 0, 0, status, op, light, band, out);
#define HF_MXWBODY(TA, TB, CL) hf_wgrad<TA, TB, CL, 1, 2>(&tmA, &tmB, sa, ka, sb, kbs, dw, sizes, G, M, R, C, status, op, out, acc);
#else
#define HF_BODY(TA, TB, CL, NC)
#define HF_WBODY(TA, TB, CL, NC)
#define HF_MXBODY(TA, TB, CL)
#define HF_MXWBODY(TA, TB, CL)
#endif

// Forward and input gradient, A of element type TA and B of TB (0 E4M3, 1 E5M2); out is
// an HF_OUT_ mode. The _x2 kernels run in clusters of two CTAs (CL = 2); the
// grid must then be even and its clusters must all fit on the device at once (the grid is
// persistent). NC consumer warpgroups: 128·(NC + 1) threads a CTA (see hf_cfg).
#define HF_KERNEL(NAME, TA, TB, CL, ATTR, NC)                                                                                    \
    extern "C" __global__ void ATTR __launch_bounds__(128 * (NC + 1), 1)                                                        \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const float *sa, int Mr, void *y,         \
             const float *sb, const int *sizes, int G, int M, int N, int Kc, i64 ks, i64 ns, i64 gs, i64 *status, int op,         \
             int light, int band, int out) {                                                                                     \
        HF_BODY(TA, TB, CL, NC)                                                                                                  \
    }

// Weight gradient, A of element type TA and B of TB; out an HF_OUT_ mode; acc adds.
#define HF_WKERNEL(NAME, TA, TB, CL, ATTR, NC)                                                                                   \
    extern "C" __global__ void ATTR __launch_bounds__(128 * (NC + 1), 1)                                                        \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const float *sa, const float *sb,         \
             void *dw, const int *sizes, int G, int M, int R, int C, i64 *status, int op, int out, int acc) {                     \
        HF_WBODY(TA, TB, CL, NC)                                                                                                 \
    }

// MXFP8 forward and input gradient, and weight gradient (E8M0 scales as bytes).
#define HF_MXKERNEL(NAME, TA, TB, CL, ATTR)                                                                                      \
    extern "C" __global__ void ATTR __launch_bounds__(384, 1)                                                                   \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const unsigned char *sa, int cp,          \
             int grouped, void *y, const unsigned char *sb, const int *sizes, int G, int M, int N, int Kc, i64 *status, int op,   \
             int light, int band, int out) {                                                                                     \
        HF_MXBODY(TA, TB, CL)                                                                                                    \
    }
#define HF_MXWKERNEL(NAME, TA, TB, CL, ATTR)                                                                                     \
    extern "C" __global__ void ATTR __launch_bounds__(384, 1)                                                                   \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const unsigned char *sa, int ka,          \
             const unsigned char *sb, int kbs, void *dw, const int *sizes, int G, int M, int R, int C, i64 *status, int op,       \
             int out, int acc) {                                                                                                 \
        HF_MXWBODY(TA, TB, CL)                                                                                                   \
    }

#define HF_ONE
#define HF_TWO __cluster_dims__(2, 1, 1)
#define HF_KERNELS(A, B, TA, TB)                                                                                                  \
    HF_KERNEL(dl_hopper_fp8_##A##_##B, TA, TB, 1, HF_ONE, 2)                                                                      \
    HF_KERNEL(dl_hopper_fp8_x2_##A##_##B, TA, TB, 2, HF_TWO, 2)                                                                   \
    HF_KERNEL(dl_hopper_fp8_m192_##A##_##B, TA, TB, 1, HF_ONE, 3)                                                                 \
    HF_KERNEL(dl_hopper_fp8_x2_m192_##A##_##B, TA, TB, 2, HF_TWO, 3)                                                              \
    HF_WKERNEL(dl_hopper_fp8_wgrad_##A##_##B, TA, TB, 1, HF_ONE, 2)                                                               \
    HF_WKERNEL(dl_hopper_fp8_wgrad_x2_##A##_##B, TA, TB, 2, HF_TWO, 2)                                                           \
    HF_WKERNEL(dl_hopper_fp8_wgrad_m192_##A##_##B, TA, TB, 1, HF_ONE, 3)                                                         \
    HF_WKERNEL(dl_hopper_fp8_wgrad_x2_m192_##A##_##B, TA, TB, 2, HF_TWO, 3)                                                      \
    HF_MXKERNEL(dl_hopper_mx_##A##_##B, TA, TB, 1, HF_ONE)                                                                        \
    HF_MXKERNEL(dl_hopper_mx_x2_##A##_##B, TA, TB, 2, HF_TWO)                                                                     \
    HF_MXWKERNEL(dl_hopper_mx_wgrad_##A##_##B, TA, TB, 1, HF_ONE)                                                                 \
    HF_MXWKERNEL(dl_hopper_mx_wgrad_x2_##A##_##B, TA, TB, 2, HF_TWO)

HF_KERNELS(e4m3, e4m3, 0, 0)
HF_KERNELS(e4m3, e5m2, 0, 1)
HF_KERNELS(e5m2, e4m3, 1, 0)
HF_KERNELS(e5m2, e5m2, 1, 1)
