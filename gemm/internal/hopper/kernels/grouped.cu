#include "dl.cuh"

// Hopper (sm_90a) grouped GEMM for ragged_dot: y[M, N] = A[M, Kc] · B_g for the rows of each
// group g, bf16 operands, f32 accumulation, bf16 or f32 output.
//
// A is K-major (row-major [M, Kc]), loaded by TMA in 128×64 boxes with 128-byte swizzle.
// B_g comes from a 3-D tensor map over the weights [G, ·, ·]:
//   K-major (BMN = 0): box {64 contraction, 256 output} — w[G,N,K] forward, w[G,K,N] input gradient;
//   MN-major (BMN = 1): four boxes {64 output, 64 contraction} — w[G,K,N] forward.
// A persistent grid walks the tiles of all groups (each group's m-tiles inner, in bands, so CTAs
// running together share a weight tile; the forward spreads the tiles of short groups among
// the others and claims its last rounds of tiles from a counter, see the tile schedule
// below); group offsets are prefix sums computed from the sizes on the device. One producer
// warp issues TMA into a 4-stage ring guarded by mbarriers and hands each tile's position to
// the consumers through a small ring of its own; two consumer warpgroups each run
// m64n256k16 wgmma on 64 of the tile's 128 rows.
// Rows past a group's end and columns past N are masked in the epilogue; TMA zero-fills
// reads past the tensors' ends, so any M, any Kc, N ≥ 1 work (strides must be 16-byte multiples).
// Invalid sizes (negative, or summing past M) set status and write nothing.

struct __align__(64) dl_tmap {
    u64 v[16];
};

#define HB_BM 128
#define HB_BN 256
#define HB_BK 64
#define HB_STAGES 4
#define HB_A_BYTES (HB_BM * HB_BK * 2)
#define HB_B_BYTES (HB_BN * HB_BK * 2)
#define HB_STAGE_BYTES (HB_A_BYTES + HB_B_BYTES)
#define HB_MAXG 1024
#define HB_TQ 4
#define HB_CLAIMED 3
#define HB_SPLIT_MAX 16

// Status records are those of package gemm (its domain; op is the gemm call's form):
// DL_STATUS_CODE(HB_STATUS_DOMAIN, op, 1) for a negative size, values (group, size, M);
// code 2 for sizes summing past M, values (the first group past M, the sum up to it, M).
#define HB_STATUS_DOMAIN 1

// Tail: zero rows [sum(sizes), M) of y. Does nothing for invalid sizes. Warp 0 sums the
// sizes, 32 at a time. It also zeroes the forward's tile counter next and the ncnt
// counters cnt of its split tiles (either may be null), as it runs first.
extern "C" __global__ void dl_hopper_zero_tail(void *y, const int *sizes, int G, int M, int N, int f32, int *next, int *cnt, int ncnt) {
    __shared__ int tot;
    if (next && blockIdx.x == 0 && threadIdx.x == 0) *next = 0;
    if (cnt && blockIdx.x == 0)
        for (int i = threadIdx.x; i < ncnt; i += blockDim.x) cnt[i] = 0;
    if (threadIdx.x < 32) {
        long long s = 0;
        int neg = 0;
        for (int g = threadIdx.x; g < G; g += 32) {
            const int v = sizes[g];
            neg |= v < 0;
            s += v;
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) s += __shfl_xor_sync(DL_FULL, s, o);
        neg = __any_sync(DL_FULL, neg);
        if (threadIdx.x == 0) tot = (!neg && s <= M) ? (int)s : M;
    }
    __syncthreads();
    u64 start = (u64)tot * N, end = (u64)M * N;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = start + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += stride) {
        if (f32) ((float *)y)[i] = 0.f;
        else ((unsigned short *)y)[i] = 0;
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ u32 hb_smem(const void *p) { return (u32)__cvta_generic_to_shared(p); }

// hb_align returns the first 1024-byte aligned byte of the dynamic shared memory raw (the
// 128-byte swizzle needs it). It offsets raw rather than rounding an integer, so that the
// compiler still knows the result for shared memory and addresses it with 32-bit shared
// loads and stores instead of generic 64-bit ones.
__device__ __forceinline__ unsigned char *hb_align(unsigned char *raw) { return raw + ((1024 - (hb_smem(raw) & 1023)) & 1023); }

__device__ __forceinline__ void hb_mbar_init(u64 *bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(hb_smem(bar)), "r"(count));
}
__device__ __forceinline__ void hb_mbar_expect_tx(u64 *bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(hb_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void hb_mbar_arrive(u64 *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(hb_smem(bar)) : "memory");
}
__device__ __forceinline__ void hb_mbar_wait(u64 *bar, u32 parity) {
    u32 ok = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok)
                     : "r"(hb_smem(bar)), "r"(parity)
                     : "memory");
    } while (!ok);
}
__device__ __forceinline__ void hb_tma2d(void *dst, const dl_tmap *tm, int c0, int c1, u64 *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(hb_smem(dst)),
        "l"((u64)tm), "r"(hb_smem(bar)), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ void hb_tma3d(void *dst, const dl_tmap *tm, int c0, int c1, int c2, u64 *bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(hb_smem(dst)),
        "l"((u64)tm), "r"(hb_smem(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// L2 cache hints of the forward kernels' TMA loads (the hint argument: bits 0-1 for A,
// bits 2-3 for B; 0 the default, 1 evict first, 2 evict last): hb_policy makes the
// policy of one operand's loads.
__device__ __forceinline__ u64 hb_policy(int p) {
    u64 pol;
    if (p == 1) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    else if (p == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ void hb_tma2d_hint(void *dst, const dl_tmap *tm, int c0, int c1, u64 *bar, u64 pol) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(hb_smem(dst)),
        "l"((u64)tm), "r"(hb_smem(bar)), "r"(c0), "r"(c1), "l"(pol)
        : "memory");
}
__device__ __forceinline__ void hb_tma3d_hint(void *dst, const dl_tmap *tm, int c0, int c1, int c2, u64 *bar, u64 pol) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(hb_smem(dst)),
        "l"((u64)tm), "r"(hb_smem(bar)), "r"(c0), "r"(c1), "r"(c2), "l"(pol)
        : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ u64 hb_desc(const void *p, u32 lbo, u32 sbo) {
    u64 d = (u64)((hb_smem(p) & 0x3FFFF) >> 4);
    d |= (u64)((lbo >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

// wgmma m64n256k16, bf16 operands from shared memory, f32 accumulators in d[128].
// TA, TB: 0 when the operand is K-major, 1 when MN-major. scale_d == 0 zeroes the accumulators first.
template <int TA, int TB>
__device__ __forceinline__ void dl_wgmma_m64n256k16(float *d, unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

// Tile schedule of the forward kernels. A group of fewer than light rows (one row tile by
// default) is light: its tiles stream the group's whole weight tile for little math, bound
// by memory; the other groups' tiles are heavy, bound by the tensor cores. The T tiles are
// walked in a merged order that spreads the L light tiles evenly among the others (position
// p is light when floor((p+1)·L/T) > floor(p·L/T)), so that the light tiles' memory traffic
// overlaps the heavy tiles' math instead of running in bursts. Within each class tiles
// follow the groups' order, each group's row tiles innermost within bands of row tiles
// (below), so that CTAs running together share a weight tile. Positions are dealt
// round-robin (CTA b takes b, b + gridDim.x, ...) up to the last claim rounds; the CTAs
// then claim the rest one at a time from a counter in global memory, so that tiles of
// unequal cost (short tiles, uneven memory traffic) even out at the end. Where the tiles
// cost alike, dealing keeps the CTAs that share a weight tile in step, which claiming all
// of them loses (more L2 traffic); on a skewed routing (the largest group more than twice
// the mean: tiles of unequal cost) dealt CTAs drift apart, and claiming every position
// keeps those that start together on neighbouring tiles (claim < 0 chooses so by the
// sizes). Within a group the row tiles are walked in bands of band row tiles
// (the last band may be shorter), each band's tiles with its row tiles innermost
// (hb_place): a large group's CTAs running together then cover about band row tiles ×
// gridDim.x/band column tiles instead of one column tile of many row tiles, so that the A
// rows and B columns they read from L2 at each step of the contraction are few, and fewer
// are re-read from memory for the next column tiles.
// sched holds L and T, the band and the column tiles nc per row tile, and whether the
// routing is skewed, computed once by warp 0.
struct hb_sched {
    unsigned L, T;
    int band, nc, skew;
};

// hb_setup, run by the 32 threads of warp 0: scans the group sizes into row offsets
// rstart[0..G] (and, when tstart is not null, tile offsets of ntn tiles per BM-row block:
// tstart for the heavy groups, lstart for the light ones, with sc the schedule's constants
// and its bands of band row tiles, 0 for none: each group one band), 32 groups at a time
// with warp shuffles, records the first invalid size in status (block 0 only; null: none)
// as an error of op and initializes the S-stage barrier ring (full: one arrival and the
// transaction bytes; empty: ecount arrivals). It returns, in every lane, the error code: 0,
// 1 (a negative size) or 2 (sizes sum past M).
template <int BM = HB_BM>
__device__ __forceinline__ int hb_setup(const int *sizes, int G, int M, int ntn, int light, int band, int *tstart, int *lstart,
                                        hb_sched *sc, int *rstart, i64 *status, int op, u64 *full, u64 *empty, int S,
                                        int ecount) {
    const int lane = threadIdx.x & 31;
    long long r = 0;
    int t = 0, l = 0, err = 0, eg = 0, mx = 0;
    long long ev = 0;
    for (int base = 0; base < G; base += 32) {
        const int g = base + lane;
        const int sz = g < G ? sizes[g] : 0;
        mx = max(mx, sz);
        const int nt = sz > 0 ? ((sz + BM - 1) / BM) * ntn : 0;
        const int tl = sz < light ? 0 : nt, ll = sz < light ? nt : 0;
        long long rin = sz; // inclusive prefix sums within the 32 groups
        int tin = tl, lin = ll;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long a = __shfl_up_sync(DL_FULL, rin, o);
            const int b = __shfl_up_sync(DL_FULL, tin, o);
            const int c = __shfl_up_sync(DL_FULL, lin, o);
            if (lane >= o) rin += a, tin += b, lin += c;
        }
        // Before the first negative size the prefix sums are exact, so the first error is
        // the earlier of the first negative size and the first sum past M.
        const unsigned neg = __ballot_sync(DL_FULL, g < G && sz < 0);
        const unsigned over = __ballot_sync(DL_FULL, g < G && r + rin > M);
        const int fn = neg ? __ffs(neg) - 1 : 32, fo = over ? __ffs(over) - 1 : 32;
        if (g < G) {
            rstart[g] = (int)(r + rin - sz);
            if (tstart) tstart[g] = t + tin - tl, lstart[g] = l + lin - ll;
        }
        if (fn < 32 || fo < 32) {
            const int at = min(fn, fo);
            err = fo < fn ? 2 : 1;
            eg = base + at;
            ev = __shfl_sync(DL_FULL, fo < fn ? r + rin : (long long)sz, at);
            break;
        }
        r += __shfl_sync(DL_FULL, rin, 31);
        t += __shfl_sync(DL_FULL, tin, 31);
        l += __shfl_sync(DL_FULL, lin, 31);
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = max(mx, __shfl_xor_sync(DL_FULL, mx, o));
    if (lane == 0) {
        if (!err) {
            rstart[G] = (int)r;
            if (tstart) {
                tstart[G] = t, lstart[G] = l;
                sc->L = l, sc->T = t + l, sc->band = band > 0 ? band : max(1, (M + BM - 1) / BM), sc->nc = ntn;
                sc->skew = (long long)mx * G > 2 * r;
            }
        }
        if (err && blockIdx.x == 0) dl_status_set(status, DL_STATUS_CODE(HB_STATUS_DOMAIN, op, err), eg, ev, M);
        for (int s = 0; s < S; s++) {
            hb_mbar_init(&full[s], 1);
            hb_mbar_init(&empty[s], ecount);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    return err;
}

// The group of tile i of a class with tile offsets ts: the largest g with ts[g] <= i (a group
// with tiles in the class, as ts[g+1] > i).
__device__ __forceinline__ int hb_group(const int *ts, int G, int i) {
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (ts[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// hb_pick returns the group of schedule position p (in [0, T)) and sets *local to the
// tile's index within the group.
__device__ __forceinline__ int hb_pick(const hb_sched *sc, const int *tstart, const int *lstart, int G, int p, int *local) {
    const u64 a = (u64)p * sc->L;
    const unsigned q = (unsigned)(a / sc->T), r = (unsigned)(a - (u64)q * sc->T);
    const bool lt = r + sc->L >= sc->T;
    const int *ts = lt ? lstart : tstart;
    const int i = lt ? (int)q : p - (int)q;
    const int g = hb_group(ts, G, i);
    *local = i - ts[g];
    return g;
}

// hb_place sets the row tile *mt and column tile *nt of tile local of a group of mtiles row
// tiles (of sc->nc column tiles each): bands of sc->band row tiles, row tiles innermost.
__device__ __forceinline__ void hb_place(const hb_sched *sc, int local, int mtiles, int *mt, int *nt) {
    const int per = sc->band * sc->nc; // tiles of a whole band
    const int b = local / per, q = local - b * per;
    const int w = min(sc->band, mtiles - b * sc->band);
    *mt = b * sc->band + q % w;
    *nt = q / w;
}

// Split tiles. Where the T tiles leave a last round of R < gridDim.x tiles, that round
// would keep gridDim.x − R CTAs idle for a whole tile (3% of mixtral's input gradient:
// 4,096 tiles of 448 k-blocks on 132 CTAs). With a workspace, each of those R tiles is
// split along the contraction into s = min(HB_SPLIT_MAX, gridDim.x / R, k-blocks / 4)
// units at positions T − R + [0, R·s): unit q (counted from T − R) is part q % s of tile
// T − R + q / s and takes its k-blocks [part·nkb/s, (part+1)·nkb/s). Each unit writes its f32 partial
// sums to slot (its position − (T − R)) of the workspace and counts itself on its tile's
// counter; the unit that counts last sums the tile's s partials in the order of their
// k-ranges, whichever CTA it runs on, and stores the tile: the result depends on the
// sizes and the grid only (the same bytes on every run of a call). No unit waits for
// another (a CTA may run two units of one tile).
struct hb_span {
    int tile, k0, k1, u; // u: the unit's index from T − R, −1 for a whole tile
};

// hb_split returns the units per split tile for T tiles of nkb k-blocks on P CTAs, 1 for
// none; ws says whether the call has a workspace.
__device__ __forceinline__ int hb_split(int T, int nkb, int P, bool ws) {
    const int R = T % P;
    if (!ws || R == 0) return 1;
    return max(1, min(HB_SPLIT_MAX, min(P / R, nkb / 4)));
}

// hb_unit returns the span of position p of a walk of T tiles of nkb k-blocks, the last
// R = T % P split into s units each (s = 1: none).
__device__ __forceinline__ hb_span hb_unit(int p, int T, int nkb, int P, int s) {
    const int base = T - T % P;
    if (s <= 1 || p < base) return hb_span{p, 0, nkb, -1};
    const int q = p - base, part = q % s;
    return hb_span{base + q / s, part * nkb / s, (part + 1) * nkb / s, q};
}

// Epilogues of the forward kernels (EPI): HB_EPI_DIRECT stores each thread's pairs of
// values from the accumulator layout (4-byte stores, each warp store touching 8 rows);
// HB_EPI_STAGED (bf16 output, y 16-byte aligned) stores through shared memory
// (hb_store_staged).
#define HB_EPI_DIRECT 0
#define HB_EPI_STAGED 1

// hb_store_staged writes a warp's 16 rows × 64·NQ columns of a tile in the wgmma
// accumulator layout (the thread's d[4j + 2h + {0,1}] at row lane/4 + 8h, columns
// 8j + 2(lane%4) + {0,1}) as bf16 into rows row0 + [0, rows) (rows may be ≤ 0: nothing)
// and columns n0 + [0, 64·NQ) ∩ [0, N) of y [·, N], N a multiple of 8 and y 16-byte
// aligned. wb is 2 KB of shared memory that the warp alone uses: each pass puts 64 columns
// there as 16 rows of 128 bytes, 16-byte chunk j of row l at chunk j ^ (l%8) (conflict-free
// writes of each pair and reads of each chunk), then stores them as 16-byte chunks, each
// warp store writing 4 whole 128-byte rows: a quarter of the store instructions and an
// eighth of the L1 wavefronts of stores from the accumulator layout. wb is part of a stage
// of the TMA ring: the proxy fence at the end orders these accesses before the producer's
// next TMA write of it, so the caller may hand the stage back at once.
template <int NQ>
__device__ __forceinline__ void hb_store_staged(const float *d, unsigned char *wb, unsigned short *y, u64 row0, int rows, int n0, int N,
                                                int lane) {
    const int lr = lane / 4, rc = lane % 8, rr0 = lane / 8;
    unsigned char *wp = wb + lr * 128 + (lane % 4) * 4;
#pragma unroll
    for (int q = 0; q < NQ; q++) {
        if (n0 + 64 * q >= N) break;
        const int col = n0 + 64 * q + 8 * rc;
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const int j = 8 * q + jj;
                *(u32 *)(wp + h * 1024 + ((jj ^ lr) << 4)) = dl_f32x2_to_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            }
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int l = 4 * i + rr0;
            const uint4 v = *(const uint4 *)(wb + l * 128 + ((rc ^ (l & 7)) << 4));
            if (l < rows && col < N) *(uint4 *)(y + (row0 + l) * (u64)N + col) = v;
        }
        __syncwarp();
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <int BMN, int F32OUT, int EPI>
__device__ __forceinline__ void hb_grouped(const dl_tmap *tmA, const dl_tmap *tmB, void *y, const int *sizes, int G, int M, int N,
                                           int Kc, i64 *status, int op, int light, int band, int claim, int *next, float *part,
                                           int *cnt, int hint) {
    extern __shared__ unsigned char hb_raw[];
    unsigned char *smem = hb_align(hb_raw);
    u64 *full = (u64 *)(smem + HB_STAGES * HB_STAGE_BYTES);
    u64 *empty = full + HB_STAGES;
    int *tstart = (int *)(empty + HB_STAGES);
    int *rstart = tstart + (HB_MAXG + 1);
    int *lstart = rstart + (HB_MAXG + 1);
    __shared__ hb_sched sc;
    __shared__ int bad;
    // Schedule positions handed from the producer to the consumers: a ring of HB_TQ slots
    // with a full and an empty barrier each (-1 ends the walk).
    __shared__ int tq[HB_TQ];
    __shared__ __align__(8) u64 tbar[2 * HB_TQ];
    const int tid = threadIdx.x;
    const int ntn = (N + HB_BN - 1) / HB_BN;
    if (tid < 32) {
        const int e = hb_setup(sizes, G, M, ntn, light, band, tstart, lstart, &sc, rstart, status, op, full, empty, HB_STAGES, 256);
        if (tid == 0) {
            bad = e;
            for (int i = 0; i < HB_TQ; i++) hb_mbar_init(&tbar[i], 1), hb_mbar_init(&tbar[HB_TQ + i], 256);
        }
    }
    __syncthreads();
    if (bad) return;
    const int tiles = tstart[G] + lstart[G];
    const int nkb = (Kc + HB_BK - 1) / HB_BK;
    const int P = gridDim.x;
    const int ns = hb_split(tiles, nkb, P, part != nullptr); // units per split tile
    const int total = ns > 1 ? tiles - tiles % P + (tiles % P) * ns : tiles; // positions
    // The warpgroup index, broadcast from lane 0 so that the compiler sees it uniform over
    // the warp: the branch on active below must not look divergent, or ptxas serializes
    // every wgmma (waiting for each before issuing the next).
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int it = 0;
            const u64 pa = hb_policy(hint & 3), pb = hb_policy((hint >> 2) & 3);
            const int rounds = claim >= 0 ? claim : sc.skew ? total : HB_CLAIMED;
            const int fixed = max(0, total / P - rounds) * P;
            for (int j = 0;; j++) {
                const int slot = j % HB_TQ;
                hb_mbar_wait(&tbar[HB_TQ + slot], ((j / HB_TQ) & 1) ^ 1);
                int tile = blockIdx.x + j * gridDim.x;
                if (tile >= fixed) tile = fixed + atomicAdd(next, 1);
                tq[slot] = tile < total ? tile : -1;
                hb_mbar_arrive(&tbar[slot]);
                if (tile >= total) break;
                const hb_span sp = hb_unit(tile, tiles, nkb, P, ns);
                int local;
                int g = hb_pick(&sc, tstart, lstart, G, sp.tile, &local);
                int mtiles = (rstart[g + 1] - rstart[g] + HB_BM - 1) / HB_BM;
                int mt, nt;
                hb_place(&sc, local, mtiles, &mt, &nt);
                int row0 = rstart[g] + mt * HB_BM, n0 = nt * HB_BN;
                for (int kb = sp.k0; kb < sp.k1; kb++, it++) {
                    int st = it % HB_STAGES;
                    u32 ph = (it / HB_STAGES) & 1;
                    hb_mbar_wait(&empty[st], ph ^ 1);
                    unsigned char *sa = smem + st * HB_STAGE_BYTES;
                    unsigned char *sb = sa + HB_A_BYTES;
                    hb_mbar_expect_tx(&full[st], HB_STAGE_BYTES);
                    if (hint) {
                        hb_tma2d_hint(sa, tmA, kb * HB_BK, row0, &full[st], pa);
                        if (BMN) {
#pragma unroll
                            for (int b = 0; b < 4; b++) hb_tma3d_hint(sb + b * 8192, tmB, n0 + 64 * b, kb * HB_BK, g, &full[st], pb);
                        } else {
                            hb_tma3d_hint(sb, tmB, kb * HB_BK, n0, g, &full[st], pb);
                        }
                    } else {
                        hb_tma2d(sa, tmA, kb * HB_BK, row0, &full[st]);
                        if (BMN) {
#pragma unroll
                            for (int b = 0; b < 4; b++) hb_tma3d(sb + b * 8192, tmB, n0 + 64 * b, kb * HB_BK, g, &full[st]);
                        } else {
                            hb_tma3d(sb, tmB, kb * HB_BK, n0, g, &full[st]);
                        }
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1;
        const int w = (tid % 128) / 32, lane = tid % 32;
        __shared__ int last; // the unit counted last on its tile
        float d[128];
        int it = 0, prev = 0;
        for (int j = 0;; j++) {
            const int slot = j % HB_TQ;
            hb_mbar_wait(&tbar[slot], (j / HB_TQ) & 1);
            const int tile = tq[slot];
            hb_mbar_arrive(&tbar[HB_TQ + slot]);
            if (tile < 0) break;
            const hb_span sp = hb_unit(tile, tiles, nkb, P, ns);
            int local;
            int g = hb_pick(&sc, tstart, lstart, G, sp.tile, &local);
            int sz = rstart[g + 1] - rstart[g];
            int mtiles = (sz + HB_BM - 1) / HB_BM;
            int mt, nt;
            hb_place(&sc, local, mtiles, &mt, &nt);
            int row0 = rstart[g] + mt * HB_BM, n0 = nt * HB_BN;
            int rows = min(HB_BM, sz - mt * HB_BM);
            // A warpgroup whose 64 rows all lie past the group's end keeps the barrier
            // protocol but issues no wgmma, leaving the tensor cores to the other one.
            const bool active = c * 64 < rows;
            for (int kb = sp.k0; kb < sp.k1; kb++, it++) {
                int st = it % HB_STAGES;
                u32 ph = (it / HB_STAGES) & 1;
                hb_mbar_wait(&full[st], ph);
                if (!active) {
                    hb_mbar_arrive(&empty[st]);
                    continue;
                }
                unsigned char *sa = smem + st * HB_STAGE_BYTES + c * (64 * 128);
                unsigned char *sb = smem + st * HB_STAGE_BYTES + HB_A_BYTES;
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    u64 da = hb_desc(sa + kk * 32, 0, 1024);
                    if (BMN) {
                        u64 db = hb_desc(sb + kk * 2048, 8192, 1024);
                        dl_wgmma_m64n256k16<0, 1>(d, da, db, kb > sp.k0 || kk);
                    } else {
                        u64 db = hb_desc(sb + kk * 32, 0, 1024);
                        dl_wgmma_m64n256k16<0, 0>(d, da, db, kb > sp.k0 || kk);
                    }
                }
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // Keep one batch in flight: release the previous stage once its batch is done.
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (kb > sp.k0) hb_mbar_arrive(&empty[prev]);
                prev = st;
            }
            const bool ran = active && sp.k1 > sp.k0; // holds stage prev
            if (ran) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            if (sp.u >= 0) {
                // A unit of a split tile: its partial sums to its slot, then the count; the
                // last unit sums the tile's slots and stores the tile. Both consumer
                // warpgroups take part in the barriers; an idle one stores nothing.
                const int ct = tid - 128;
                if (ran) {
                    float4 *wp = (float4 *)part + (size_t)sp.u * (HB_BM * HB_BN / 4) + ct;
#pragma unroll
                    for (int i = 0; i < 32; i++) __stcg(wp + i * 256, make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]));
                }
                __threadfence();
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
                if (ct == 0) last = atomicAdd(&cnt[sp.tile - (tiles - tiles % P)], 1) == ns - 1;
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
                // Broadcast from lane 0, uniform over the warp as wg is (see above).
                if (!__shfl_sync(DL_FULL, last, 0)) {
                    if (ran) hb_mbar_arrive(&empty[prev]);
                    continue;
                }
                __threadfence();
                if (!active) continue;
                const float4 *rp = (const float4 *)part + (size_t)(sp.u - sp.u % ns) * (HB_BM * HB_BN / 4) + ct;
#pragma unroll
                for (int i = 0; i < 32; i++) {
                    const float4 v = __ldcg(rp + i * 256);
                    d[4 * i] = v.x, d[4 * i + 1] = v.y, d[4 * i + 2] = v.z, d[4 * i + 3] = v.w;
                }
                for (int q = 1; q < ns; q++) {
#pragma unroll
                    for (int i = 0; i < 32; i++) {
                        const float4 v = __ldcg(rp + (size_t)q * (HB_BM * HB_BN / 4) + i * 256);
                        d[4 * i] += v.x, d[4 * i + 1] += v.y, d[4 * i + 2] += v.z, d[4 * i + 3] += v.w;
                    }
                }
            } else if (!active) {
                continue;
            }
            if (EPI == HB_EPI_STAGED && ran) {
                // Each warp's rows pass through its 2 KB of the warpgroup's A rows in the
                // tile's last stage, which its MMAs have finished reading; the stage goes
                // back to the producer after the epilogue.
                unsigned char *wb = smem + prev * HB_STAGE_BYTES + c * (64 * 128) + w * 2048;
                hb_store_staged<4>(d, wb, (unsigned short *)y, (u64)(row0 + c * 64 + w * 16), rows - c * 64 - w * 16, n0, N, lane);
                hb_mbar_arrive(&empty[prev]);
                continue;
            }
            if (ran) hb_mbar_arrive(&empty[prev]);
            // Epilogue: thread holds rows r and r+8, columns 8j + 2(lane%4) + {0,1}.
            int r = c * 64 + w * 16 + lane / 4;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int rr = r + 8 * h;
                if (rr >= rows) continue;
                u64 rowoff = (u64)(row0 + rr) * N;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    int col = n0 + 8 * j + 2 * (lane % 4);
                    float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                    if (F32OUT) {
                        float *yp = (float *)y + rowoff + col;
                        if (col + 1 < N) {
                            *(float2 *)yp = make_float2(v0, v1);
                        } else if (col < N) {
                            yp[0] = v0;
                        }
                    } else {
                        unsigned short *yp = (unsigned short *)y + rowoff + col;
                        if (col + 1 < N) {
                            *(u32 *)yp = dl_f32x2_to_bf16x2(v0, v1);
                        } else if (col < N) {
                            yp[0] = dl_f32_to_bf16(v0);
                        }
                    }
                }
            }
        }
    }
}

// Weight gradient: dw[g] (K×N) = x_gᵀ · dy_g, contracting over the group's rows. Both operands
// are MN-major: x [M,K] gives A = x_gᵀ in 2 boxes {64 K, 64 rows}, dy [M,N] gives B in 4 boxes
// {64 N, 64 rows}. Rows of the last block past the group's end belong to the next group or
// to no group: the consumers zero them in A and B before the wgmma. An empty group writes
// zeros (or leaves dw unchanged when accumulating). ACC adds to dw instead of overwriting it.
// STG: stage the tile in shared memory (128-byte swizzled, 64×64 boxes) and write it with
// asynchronous TMA stores that overlap the next tile's main loop; bf16 output without
// accumulation only. Then only 3 stages fit beside the 64 KB staging area.
template <int F32OUT, int ACC, int STG>
__device__ __forceinline__ void hb_wgrad(const dl_tmap *tmX, const dl_tmap *tmDY, const dl_tmap *tmDW, void *dw, const int *sizes,
                                         int G, int M, int K, int N, i64 *status, int op) {
    constexpr int S = STG ? 3 : HB_STAGES;
    extern __shared__ unsigned char hb_raw[];
    unsigned char *smem = hb_align(hb_raw);
    unsigned char *stg = smem + S * HB_STAGE_BYTES;
    u64 *full = (u64 *)(stg + (STG ? 65536 : 0));
    u64 *empty = full + S;
    int *rstart = (int *)(empty + S);
    __shared__ int bad;
    const int tid = threadIdx.x;
    if (tid < 32) {
        const int e = hb_setup(sizes, G, M, 0, 0, 0, nullptr, nullptr, nullptr, rstart, status, op, full, empty, S, 256);
        if (tid == 0) bad = e;
    }
    __syncthreads();
    if (bad) return;
    const int tk = (K + HB_BM - 1) / HB_BM, tn = (N + HB_BN - 1) / HB_BN;
    const int total = G * tk * tn;
    const int wg = __shfl_sync(DL_FULL, tid / 128, 0); // uniform over the warp, as above
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
                int g = tile / (tk * tn), local = tile % (tk * tn);
                int m0 = (local % tk) * HB_BM, n0 = (local / tk) * HB_BN;
                int nkb = (rstart[g + 1] - rstart[g] + HB_BK - 1) / HB_BK;
                for (int kb = 0; kb < nkb; kb++, it++) {
                    int st = it % S;
                    u32 ph = (it / S) & 1;
                    hb_mbar_wait(&empty[st], ph ^ 1);
                    unsigned char *sa = smem + st * HB_STAGE_BYTES;
                    unsigned char *sb = sa + HB_A_BYTES;
                    int row = rstart[g] + kb * HB_BK;
                    hb_mbar_expect_tx(&full[st], HB_STAGE_BYTES);
#pragma unroll
                    for (int j = 0; j < 2; j++) hb_tma2d(sa + j * 8192, tmX, m0 + 64 * j, row, &full[st]);
#pragma unroll
                    for (int j = 0; j < 4; j++) hb_tma2d(sb + j * 8192, tmDY, n0 + 64 * j, row, &full[st]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = wg - 1, ct = tid % 128;
        const int w = ct / 32, lane = tid % 32;
        float d[128];
        int it = 0, prev = 0;
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            int g = tile / (tk * tn), local = tile % (tk * tn);
            int m0 = (local % tk) * HB_BM, n0 = (local / tk) * HB_BN;
            int sz = rstart[g + 1] - rstart[g];
            int nkb = (sz + HB_BK - 1) / HB_BK;
            if (nkb == 0) {
                if (ACC) continue;
#pragma unroll
                for (int i = 0; i < 128; i++) d[i] = 0.f;
            }
            for (int kb = 0; kb < nkb; kb++, it++) {
                int st = it % S;
                u32 ph = (it / S) & 1;
                hb_mbar_wait(&full[st], ph);
                unsigned char *sa = smem + st * HB_STAGE_BYTES + c * 8192;
                unsigned char *sb = smem + st * HB_STAGE_BYTES + HB_A_BYTES;
                int valid = sz - kb * HB_BK;
                if (valid < HB_BK) {
                    // Rows past the group's end (the next group's, or whatever lies
                    // between sum(sizes) and M, NaN included) must not reach the sums:
                    // each warpgroup zeroes them in its A box and in two of the four B
                    // boxes, and both wait for each other before the wgmma.
                    uint4 z = make_uint4(0, 0, 0, 0);
                    for (int i = valid * 8 + ct; i < HB_BK * 8; i += 128) ((uint4 *)sa)[i] = z;
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        uint4 *bz = (uint4 *)(sb + (2 * c + j) * 8192);
                        for (int i = valid * 8 + ct; i < HB_BK * 8; i += 128) bz[i] = z;
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    asm volatile("bar.sync 3, 256;\n" ::: "memory");
                }
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    u64 da = hb_desc(sa + kk * 2048, 8192, 1024);
                    u64 db = hb_desc(sb + kk * 2048, 8192, 1024);
                    dl_wgmma_m64n256k16<1, 1>(d, da, db, (kb | kk) != 0);
                }
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // Keep one batch in flight: release the previous stage once its batch is done.
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (kb > 0) hb_mbar_arrive(&empty[prev]);
                prev = st;
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            if (nkb > 0) hb_mbar_arrive(&empty[prev]);
            if (STG) {
                unsigned char *mine = stg + c * 32768;
                if (ct == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
                // The pair of columns 8j + 2(lane%4) of rows r and r+8 (r = 16w + lane/4) goes to
                // box j/8, 16-byte chunk (j%8) ^ (r%8) of the row: one base address a thread,
                // immediate offsets for the rest.
                const int r = w * 16 + lane / 4, x = r & 7;
                unsigned char *row = mine + r * 128 + (lane % 4) * 4;
#pragma unroll
                for (int h = 0; h < 2; h++) {
#pragma unroll
                    for (int j = 0; j < 32; j++) {
                        u32 v = dl_f32x2_to_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                        *(u32 *)(row + h * 1024 + (j >> 3) * 8192 + (((j & 7) ^ x) << 4)) = v;
                    }
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
                if (ct == 0) {
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        if (n0 + 64 * b < N && m0 + 64 * c < K)
                            asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"((u64)tmDW),
                                         "r"(hb_smem(mine + b * 8192)), "r"(n0 + 64 * b), "r"(m0 + 64 * c), "r"(g)
                                         : "memory");
                    }
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                }
                continue;
            }
            int r = c * 64 + w * 16 + lane / 4;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int rr = m0 + r + 8 * h;
                if (rr >= K) continue;
                u64 rowoff = ((u64)g * K + rr) * N;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    int col = n0 + 8 * j + 2 * (lane % 4);
                    float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                    if (F32OUT) {
                        float *yp = (float *)dw + rowoff + col;
                        if (col + 1 < N) {
                            if (ACC) {
                                float2 o = *(float2 *)yp;
                                v0 += o.x, v1 += o.y;
                            }
                            *(float2 *)yp = make_float2(v0, v1);
                        } else if (col < N) {
                            yp[0] = ACC ? yp[0] + v0 : v0;
                        }
                    } else {
                        unsigned short *yp = (unsigned short *)dw + rowoff + col;
                        if (col + 1 < N) {
                            if (ACC) {
                                u32 o = *(u32 *)yp;
                                v0 += dl_bf16_to_f32((unsigned short)o), v1 += dl_bf16_to_f32((unsigned short)(o >> 16));
                            }
                            *(u32 *)yp = dl_f32x2_to_bf16x2(v0, v1);
                        } else if (col < N) {
                            yp[0] = dl_f32_to_bf16(ACC ? dl_bf16_to_f32(yp[0]) + v0 : v0);
                        }
                    }
                }
            }
        }
        if (STG && ct == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HB_BODY(BMN, F32, EPI) hb_grouped<BMN, F32, EPI>(&tmA, &tmB, y, sizes, G, M, N, Kc, status, op, light, band, claim, next, part, cnt, hint);
#else
#define HB_BODY(BMN, F32, EPI)
#endif

#define HB_KERNEL(NAME, BMN, F32, EPI)                                                                                   \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                                \
        NAME(const __grid_constant__ dl_tmap tmA, const __grid_constant__ dl_tmap tmB, void *y, const int *sizes, int G, \
             int M, int N, int Kc, i64 *status, int op, int light, int band, int claim, int *next, float *part,     \
             int *cnt, int hint) {                                                                                               \
        HB_BODY(BMN, F32, EPI)                                                                                           \
    }

HB_KERNEL(dl_hopper_kmaj_bf16, 0, 0, HB_EPI_STAGED)
HB_KERNEL(dl_hopper_kmaj_bf16_direct, 0, 0, HB_EPI_DIRECT)
HB_KERNEL(dl_hopper_kmaj_f32, 0, 1, HB_EPI_DIRECT)
HB_KERNEL(dl_hopper_mnmaj_bf16, 1, 0, HB_EPI_STAGED)
HB_KERNEL(dl_hopper_mnmaj_bf16_direct, 1, 0, HB_EPI_DIRECT)
HB_KERNEL(dl_hopper_mnmaj_f32, 1, 1, HB_EPI_DIRECT)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HB_WBODY(F32, ACC, STG) hb_wgrad<F32, ACC, STG>(&tmX, &tmDY, &tmDW, dw, sizes, G, M, K, N, status, op);
#else
#define HB_WBODY(F32, ACC, STG)
#endif

#define HB_WKERNEL(NAME, F32, ACC, STG)                                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                             \
        NAME(const __grid_constant__ dl_tmap tmX, const __grid_constant__ dl_tmap tmDY, const __grid_constant__ dl_tmap tmDW, \
             void *dw, const int *sizes, int G, int M, int K, int N, i64 *status, int op) {                            \
        HB_WBODY(F32, ACC, STG)                                                                                       \
    }

HB_WKERNEL(dl_hopper_wgrad_bf16, 0, 0, 1)
HB_WKERNEL(dl_hopper_wgrad_f32, 1, 0, 0)
HB_WKERNEL(dl_hopper_wgrad_bf16_acc, 0, 1, 0)
HB_WKERNEL(dl_hopper_wgrad_f32_acc, 1, 1, 0)
