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
// plus the TMA bytes, empty the 256 consumer threads).
//
// Shared memory, from the first 1024-byte aligned byte (the 128-byte swizzle needs it):
//   [0, S·32 KB)          stage s: A 128 rows × 128 B at s·32 KB, B 128 rows × 128 B at s·32 KB + 16 KB
//   [S·32 KB, +S·512)     A scales: 128 floats a stage (the tile's rows, or the dw tile's rows)
//   [.., +S·512)          B scales: 128 floats a stage (weight gradient only: dw tile's columns)
//   [.., +2·S·8)          full[S], empty[S]
//   [.., +3·(G+1)·4)      tstart, rstart, lstart: hb_setup's group tables (HB_MAXG + 1 each)
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
#define HF_SMEM (HF_STAGES * (HF_STAGE_BYTES + (HF_BM + HF_BN) * 4) + 2 * HF_STAGES * 8 + 3 * (HB_MAXG + 1) * 4 + 1024)

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
HF_WGMMA(hf_wgmma_e4m3_e4m3, "e4m3.e4m3")
HF_WGMMA(hf_wgmma_e4m3_e5m2, "e4m3.e5m2")
HF_WGMMA(hf_wgmma_e5m2_e4m3, "e5m2.e4m3")
HF_WGMMA(hf_wgmma_e5m2_e5m2, "e5m2.e5m2")

// hf_mma: the wgmma of element types TA (A) and TB (B): 0 E4M3, 1 E5M2.
template <int TA, int TB>
__device__ __forceinline__ void hf_mma(float *d, u64 da, u64 db, int scale_d) {
    if constexpr (TA == 0 && TB == 0) hf_wgmma_e4m3_e4m3(d, da, db, scale_d);
    else if constexpr (TA == 0) hf_wgmma_e4m3_e5m2(d, da, db, scale_d);
    else if constexpr (TB == 0) hf_wgmma_e5m2_e4m3(d, da, db, scale_d);
    else hf_wgmma_e5m2_e5m2(d, da, db, scale_d);
}

// hf_fence keeps the compiler from moving accesses of the accumulators across the wgmma
// fences and waits around it (the registers are written asynchronously).
__device__ __forceinline__ void hf_fence(float *d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
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
            *(u32 *)p = hb_bf16x2(v0, v1);
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
    float *sa, *sb;
    u64 *full, *empty;
    int *tstart, *rstart, *lstart;
};

__device__ __forceinline__ hf_smem hf_carve(unsigned char *raw) {
    hf_smem m;
    m.stages = hb_align(raw);
    m.sa = (float *)(m.stages + HF_STAGES * HF_STAGE_BYTES);
    m.sb = m.sa + HF_STAGES * HF_BM;
    m.full = (u64 *)(m.sb + HF_STAGES * HF_BN);
    m.empty = m.full + HF_STAGES;
    m.tstart = (int *)(m.empty + HF_STAGES);
    m.rstart = m.tstart + (HB_MAXG + 1);
    m.lstart = m.rstart + (HB_MAXG + 1);
    return m;
}

// Forward and input gradient: y[M, N] = A[M, Kc] · B_gᵀ for the rows of each group g.
//   A: the rowwise activations or gradients, FP8 [M, Kc] (tmA, box {128, 128}), with scales
//      RowScale F32 [ceil(Kc/128), Mr] (sa, read by the consumers from global memory a
//      stage ahead: each thread needs its two rows' scales), Mr = roundup(M, 4).
//   B: the K-major weights, FP8 [G, N, Kc] (tmB, box {128, 128, 1}), whose 128×128 blocks'
//      scales are sb[g·gs + kb·ks + nb·ns] for contraction block kb and output block nb
//      (forward: w.Scales [G, Kc/128, N/128], ks = N/128, ns = 1; input gradient:
//      [G, N/128, Kc/128], ks = 1, ns = Kc/128).
// Tiles are dealt as the bf16 forward deals them (hb_pick: each group's row tiles, short
// groups' tiles spread among the others), round-robin over the persistent grid; every tile
// runs ceil(Kc/128) stages. A consumer whose 64 rows all lie past its group's end keeps the
// barrier protocol but issues no wgmma and writes nothing. Rows past the group's end in a
// tile belong to the next group and are computed but not written; rows past M, columns
// past N and contraction past Kc read TMA's zeros. The B scale of the next stage is loaded
// from global memory one stage ahead. Rows past sum(sizes) are zeroed by the tail kernel,
// launched first.
template <int TA, int TB>
__device__ __forceinline__ void hf_gemm(const dl_tmap *tmA, const dl_tmap *tmB, const float *sa, int Mr, void *y, const float *sb,
                                        const int *sizes, int G, int M, int N, int Kc, i64 ks, i64 ns, i64 gs, i64 *status, int op,
                                        int light, int f32) {
    extern __shared__ unsigned char hf_raw[];
    const hf_smem m = hf_carve(hf_raw);
    __shared__ hb_sched sc;
    __shared__ int bad;
    const int tid = threadIdx.x;
    const int ntn = (N + HF_BN - 1) / HF_BN;
    if (tid < 32) {
        const int e = hb_setup(sizes, G, M, ntn, light, m.tstart, m.lstart, &sc, m.rstart, status, op, m.full, m.empty, HF_STAGES);
        if (tid == 0) bad = e;
    }
    __syncthreads();
    if (bad) return;
    const int total = m.tstart[G] + m.lstart[G];
    const int nkb = (Kc + HF_BK - 1) / HF_BK;
    // Uniform over the warp (see hb_grouped): the branches on it must not look divergent.
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
                int local;
                const int g = hb_pick(&sc, m.tstart, m.lstart, G, tile, &local);
                const int mtiles = (m.rstart[g + 1] - m.rstart[g] + HF_BM - 1) / HF_BM;
                const int row0 = m.rstart[g] + (local % mtiles) * HF_BM, n0 = (local / mtiles) * HF_BN;
                for (int kb = 0; kb < nkb; kb++, it++) {
                    const int st = it % HF_STAGES;
                    const u32 ph = (it / HF_STAGES) & 1;
                    hb_mbar_wait(&m.empty[st], ph ^ 1);
                    unsigned char *stg = m.stages + st * HF_STAGE_BYTES;
                    hb_mbar_expect_tx(&m.full[st], HF_STAGE_BYTES);
                    hb_tma2d(stg, tmA, kb * HF_BK, row0, &m.full[st]);
                    hb_tma3d(stg + HF_A_BYTES, tmB, kb * HF_BK, n0, g, &m.full[st]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1;
        const int w = (tid % 128) / 32, lane = tid % 32;
        const int r = w * 16 + lane / 4;
        float part[64], tot[64];
#pragma unroll
        for (int i = 0; i < 64; i++) part[i] = 0.f;
        int it = 0;
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            int local;
            const int g = hb_pick(&sc, m.tstart, m.lstart, G, tile, &local);
            const int sz = m.rstart[g + 1] - m.rstart[g];
            const int mtiles = (sz + HF_BM - 1) / HF_BM;
            const int mt = local % mtiles, nt = local / mtiles;
            const int row0 = m.rstart[g] + mt * HF_BM, n0 = nt * HF_BN;
            const int rows = min(HF_BM, sz - mt * HF_BM);
            const bool active = c * 64 < rows;
            const float *sbp = sb + (i64)g * gs + (i64)nt * ns;
            float sbn = __ldg(sbp);
            // The rows' A scales, loaded from global memory a stage ahead (rows past Mr: 0).
            const int ra0 = row0 + c * 64 + r, ra1 = ra0 + 8;
            float a0n = ra0 < Mr ? __ldg(sa + ra0) : 0.f, a1n = ra1 < Mr ? __ldg(sa + ra1) : 0.f;
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] = 0.f;
            for (int kb = 0; kb < nkb; kb++, it++) {
                const int st = it % HF_STAGES;
                const u32 ph = (it / HF_STAGES) & 1;
                const float sbk = sbn, a0 = a0n, a1 = a1n;
                if (kb + 1 < nkb) {
                    sbn = __ldg(sbp + (i64)(kb + 1) * ks);
                    const float *san = sa + (i64)(kb + 1) * Mr;
                    a0n = ra0 < Mr ? __ldg(san + ra0) : 0.f;
                    a1n = ra1 < Mr ? __ldg(san + ra1) : 0.f;
                }
                hb_mbar_wait(&m.full[st], ph);
                if (!active) {
                    hb_mbar_arrive(&m.empty[st]);
                    continue;
                }
                const unsigned char *stg = m.stages + st * HF_STAGE_BYTES;
                hf_block<TA, TB>(part, stg + c * (64 * HF_BK), stg + HF_A_BYTES);
                // The stage's data and scales are read: hand it back before promoting.
                hb_mbar_arrive(&m.empty[st]);
                const float s0 = a0 * sbk, s1 = a1 * sbk;
#pragma unroll
                for (int j = 0; j < HF_BN / 8; j++) {
                    tot[4 * j + 0] = fmaf(part[4 * j + 0], s0, tot[4 * j + 0]);
                    tot[4 * j + 1] = fmaf(part[4 * j + 1], s0, tot[4 * j + 1]);
                    tot[4 * j + 2] = fmaf(part[4 * j + 2], s1, tot[4 * j + 2]);
                    tot[4 * j + 3] = fmaf(part[4 * j + 3], s1, tot[4 * j + 3]);
                }
            }
            if (active) hf_epilogue(tot, y, (u64)(row0 + c * 64), rows - c * 64, n0, N, w, lane, f32, 0);
        }
    }
}

// Weight gradient: dw[g] (R×C) = A_g · B_gᵀ, contracting over the tokens of group g.
//   A: FP8 [R, Mp] (tmA, box {128 tokens, 128 rows}), the columnwise (ColT) form of x (dw
//      [G, K, N]) or dy ([G, N, K]); its scales F32 [Mp/128, R] (sa).
//   B: FP8 [C, Mp] (tmB) likewise, the other operand; scales [Mp/128, C] (sb). The
//   consumers read the scales of their rows and columns from global memory a stage ahead.
// Group g's tokens are the 128-token blocks [P_g, P_g + ceil(M_g/128)), P_g =
// Σ_{h<g} ceil(M_h/128) (hb_setup's tile offsets with one column tile and no light
// groups); the quantization zeroed the padding tokens of each group's last block, so no
// masking is needed. Promotion scales element (i, j) by s_a[i]·s_b[j]. Tiles (g, m-tile,
// n-tile) are dealt round-robin; an empty group's tile writes zeros (accum: nothing). accum
// adds the result to dw.
template <int TA, int TB>
__device__ __forceinline__ void hf_wgrad(const dl_tmap *tmA, const dl_tmap *tmB, const float *sa, const float *sb, void *dw,
                                         const int *sizes, int G, int M, int R, int C, i64 *status, int op, int f32, int accum) {
    extern __shared__ unsigned char hf_raw[];
    const hf_smem m = hf_carve(hf_raw);
    __shared__ hb_sched sc;
    __shared__ int bad;
    const int tid = threadIdx.x;
    if (tid < 32) {
        const int e = hb_setup(sizes, G, M, 1, 0, m.tstart, m.lstart, &sc, m.rstart, status, op, m.full, m.empty, HF_STAGES);
        if (tid == 0) bad = e;
    }
    __syncthreads();
    if (bad) return;
    const int tm = (R + HF_BM - 1) / HF_BM, tn = (C + HF_BN - 1) / HF_BN;
    const int total = G * tm * tn;
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
                const int g = tile / (tm * tn), local = tile % (tm * tn);
                const int m0 = (local % tm) * HF_BM, n0 = (local / tm) * HF_BN;
                const int p0 = m.tstart[g], nkb = m.tstart[g + 1] - p0;
                for (int kb = 0; kb < nkb; kb++, it++) {
                    const int st = it % HF_STAGES;
                    const u32 ph = (it / HF_STAGES) & 1;
                    hb_mbar_wait(&m.empty[st], ph ^ 1);
                    unsigned char *stg = m.stages + st * HF_STAGE_BYTES;
                    hb_mbar_expect_tx(&m.full[st], HF_STAGE_BYTES);
                    hb_tma2d(stg, tmA, (p0 + kb) * HF_BK, m0, &m.full[st]);
                    hb_tma2d(stg + HF_A_BYTES, tmB, (p0 + kb) * HF_BK, n0, &m.full[st]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1;
        const int w = (tid % 128) / 32, lane = tid % 32;
        const int r = w * 16 + lane / 4;
        float part[64], tot[64];
#pragma unroll
        for (int i = 0; i < 64; i++) part[i] = 0.f;
        int it = 0;
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            const int g = tile / (tm * tn), local = tile % (tm * tn);
            const int m0 = (local % tm) * HF_BM, n0 = (local / tm) * HF_BN;
            const int p0 = m.tstart[g], nkb = m.tstart[g + 1] - p0;
            if (nkb == 0 && accum) continue;
            const bool active = m0 + c * 64 < R;
            // The scales of the thread's two rows and 32 columns, loaded from global memory
            // a stage ahead (rows past R and columns past C: 0).
            const int ra0 = m0 + c * 64 + r, ra1 = ra0 + 8;
            float sa0n = 0.f, sa1n = 0.f;
            float2 sbn[HF_BN / 8];
            if (nkb > 0) {
                const float *sap = sa + (i64)p0 * R, *sbp = sb + (i64)p0 * C;
                sa0n = ra0 < R ? __ldg(sap + ra0) : 0.f;
                sa1n = ra1 < R ? __ldg(sap + ra1) : 0.f;
#pragma unroll
                for (int j = 0; j < HF_BN / 8; j++) {
                    const int cj = n0 + 8 * j + 2 * (lane % 4);
                    sbn[j] = cj < C ? __ldg((const float2 *)(sbp + cj)) : make_float2(0.f, 0.f);
                }
            }
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] = 0.f;
            for (int kb = 0; kb < nkb; kb++, it++) {
                const int st = it % HF_STAGES;
                const u32 ph = (it / HF_STAGES) & 1;
                const float sa0 = sa0n, sa1 = sa1n;
                float2 sbv[HF_BN / 8];
#pragma unroll
                for (int j = 0; j < HF_BN / 8; j++) sbv[j] = sbn[j];
                if (kb + 1 < nkb) {
                    const float *sap = sa + (i64)(p0 + kb + 1) * R, *sbp = sb + (i64)(p0 + kb + 1) * C;
                    sa0n = ra0 < R ? __ldg(sap + ra0) : 0.f;
                    sa1n = ra1 < R ? __ldg(sap + ra1) : 0.f;
#pragma unroll
                    for (int j = 0; j < HF_BN / 8; j++) {
                        const int cj = n0 + 8 * j + 2 * (lane % 4);
                        sbn[j] = cj < C ? __ldg((const float2 *)(sbp + cj)) : make_float2(0.f, 0.f);
                    }
                }
                hb_mbar_wait(&m.full[st], ph);
                if (!active) {
                    hb_mbar_arrive(&m.empty[st]);
                    continue;
                }
                const unsigned char *stg = m.stages + st * HF_STAGE_BYTES;
                hf_block<TA, TB>(part, stg + c * (64 * HF_BK), stg + HF_A_BYTES);
                hb_mbar_arrive(&m.empty[st]);
#pragma unroll
                for (int j = 0; j < HF_BN / 8; j++) {
                    tot[4 * j + 0] = fmaf(part[4 * j + 0], sa0 * sbv[j].x, tot[4 * j + 0]);
                    tot[4 * j + 1] = fmaf(part[4 * j + 1], sa0 * sbv[j].y, tot[4 * j + 1]);
                    tot[4 * j + 2] = fmaf(part[4 * j + 2], sa1 * sbv[j].x, tot[4 * j + 2]);
                    tot[4 * j + 3] = fmaf(part[4 * j + 3], sa1 * sbv[j].y, tot[4 * j + 3]);
                }
            }
            if (active) hf_epilogue(tot, dw, (u64)g * R + m0 + c * 64, R - m0 - c * 64, n0, C, w, lane, f32, accum);
        }
    }
}

#define HF_BODY(TA, TB) hf_gemm<TA, TB>(&tmA, &tmB, sa, Mr, y, sb, sizes, G, M, N, Kc, ks, ns, gs, status, op, light, f32);
#define HF_WBODY(TA, TB) hf_wgrad<TA, TB>(&tmA, &tmB, sa, sb, dw, sizes, G, M, R, C, status, op, f32, acc);
#else
#define HF_BODY(TA, TB)
#define HF_WBODY(TA, TB)
#endif

// Forward and input gradient, A of element type TA and B of TB (0 E4M3, 1 E5M2); f32
// selects f32 output (else bf16).
#define HF_KERNEL(NAME, TA, TB)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                                        \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const float *sa, int Mr, void *y,         \
             const float *sb, const int *sizes, int G, int M, int N, int Kc, i64 ks, i64 ns, i64 gs, i64 *status, int op,         \
             int light, int f32) {                                                                                               \
        HF_BODY(TA, TB)                                                                                                          \
    }

HF_KERNEL(dl_hopper_fp8_e4m3_e4m3, 0, 0)
HF_KERNEL(dl_hopper_fp8_e4m3_e5m2, 0, 1)
HF_KERNEL(dl_hopper_fp8_e5m2_e4m3, 1, 0)
HF_KERNEL(dl_hopper_fp8_e5m2_e5m2, 1, 1)

// Weight gradient, A of element type TA and B of TB; f32 output else bf16; acc adds.
#define HF_WKERNEL(NAME, TA, TB)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                                        \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, const float *sa, const float *sb,         \
             void *dw, const int *sizes, int G, int M, int R, int C, i64 *status, int op, int f32, int acc) {                     \
        HF_WBODY(TA, TB)                                                                                                         \
    }

HF_WKERNEL(dl_hopper_fp8_wgrad_e4m3_e4m3, 0, 0)
HF_WKERNEL(dl_hopper_fp8_wgrad_e4m3_e5m2, 0, 1)
HF_WKERNEL(dl_hopper_fp8_wgrad_e5m2_e4m3, 1, 0)
HF_WKERNEL(dl_hopper_fp8_wgrad_e5m2_e5m2, 1, 1)
