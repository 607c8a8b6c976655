// Stable counting sort of expert assignments: assignment a = t*K + k with expert
// idx[a] gets row offsets[e] + (its rank among the assignments of expert e, in
// order of a). Three launches, no host synchronization:
//   dl_moe_sort_count:   one warp per chunk of ch assignments counts them per expert;
//   dl_moe_sort_scan:    one block turns the counts into per-chunk starting ranks,
//                        per-expert totals (capped by the capacity), offsets, drops;
//   dl_moe_sort_scatter: one warp per chunk walks it in order and writes the rows.
// Within a warp, __match_any_sync groups lanes holding the same expert: a lane's rank
// is its group's running count plus the group's lanes before it.
#include "moe.cuh"

// The status record of an index outside [-1, E): moe's domain, the op Sort and the
// code (moe/status.go), with the assignment, its index and E.
#define DL_MOE_STATUS_DOMAIN 3
#define DL_MOE_STATUS_SORT 1
#define DL_MOE_BAD_INDEX 1

// Counts the assignments of chunk c per expert into cnt[c*E + e]. Entries outside
// [-1, E) count as -1 (no expert) and are recorded in status (a device.Status, null
// for none). Dynamic shared memory: (blockDim.x/32) * E ints.
extern "C" __global__ void dl_moe_sort_count(const int *__restrict__ idx, i64 n, int E, int ch, int nchunks,
                                             int *__restrict__ cnt, i64 *__restrict__ status) {
    extern __shared__ int sm[];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int c = blockIdx.x * (blockDim.x >> 5) + w;
    if (c >= nchunks) return;
    int *my = sm + w * E;
    for (int e = lane; e < E; e += 32) my[e] = 0;
    __syncwarp();
    i64 base = (i64)c * ch;
    i64 end = base + ch < n ? base + ch : n;
    i64 bad = -1; // the lane's first assignment with a bad index
    int badv = 0;
    for (i64 a0 = base; a0 < end; a0 += 32) {
        i64 a = a0 + lane;
        int e = a < end ? idx[a] : -1;
        if (e < -1 || e >= E) {
            if (bad < 0) {
                bad = a;
                badv = e;
            }
            e = -1;
        }
        unsigned m = __match_any_sync(DL_FULL, e);
        if (e >= 0 && lane == 31 - __clz(m)) my[e] += __popc(m);
        __syncwarp();
    }
    if (bad >= 0)
        dl_status_set(status, DL_STATUS_CODE(DL_MOE_STATUS_DOMAIN, DL_MOE_STATUS_SORT, DL_MOE_BAD_INDEX), bad, badv, E);
    for (int e = lane; e < E; e += 32) cnt[(i64)c * E + e] = my[e];
}

// One block of blockDim.x >= E threads (a multiple of 32, at most 1024): thread e
// replaces cnt[c*E + e] by the number of assignments to e in chunks before c,
// writes demand[e] (all assignments to e), counts[e] = min(demand[e], cap),
// offsets[0..E] (exclusive scan of counts; offsets[E] = rows used), *dropped, and
// sets src[r] = -1 for the unused rows r in [offsets[E], rows).
extern "C" __global__ void dl_moe_sort_scan(int *__restrict__ cnt, int nchunks, int E, int cap,
                                            int *__restrict__ counts, int *__restrict__ offsets,
                                            int *__restrict__ demand, int *__restrict__ dropped,
                                            int *__restrict__ src, i64 rows) {
    __shared__ int sh[1024];
    __shared__ int drop;
    int e = threadIdx.x;
    if (e == 0) drop = 0;
    int run = 0;
    if (e < E) {
        for (int c = 0; c < nchunks; c++) {
            i64 i = (i64)c * E + e;
            int v = cnt[i];
            cnt[i] = run;
            run += v;
        }
    }
    int kept = run < cap ? run : cap;
    sh[e] = kept;
    __syncthreads();
    for (int o = 1; o < blockDim.x; o <<= 1) {
        int v = e >= o ? sh[e - o] : 0;
        __syncthreads();
        sh[e] += v;
        __syncthreads();
    }
    if (run > kept) atomicAdd(&drop, run - kept);
    if (e < E) {
        offsets[e] = sh[e] - kept;
        counts[e] = kept;
        demand[e] = run;
    }
    int total = sh[blockDim.x - 1];
    if (e == 0) offsets[E] = total;
    __syncthreads();
    if (e == 0) *dropped = drop;
    for (i64 r = total + e; r < rows; r += blockDim.x) src[r] = -1;
}

// Writes row[a] (-1 for no expert or over capacity) and src[row[a]] = a. cnt holds
// the starting ranks from dl_moe_sort_scan. Dynamic shared memory as dl_moe_sort_count.
extern "C" __global__ void dl_moe_sort_scatter(const int *__restrict__ idx, i64 n, int E, int ch, int nchunks,
                                               const int *__restrict__ cnt, const int *__restrict__ offsets,
                                               int cap, int *__restrict__ row, int *__restrict__ src) {
    extern __shared__ int sm[];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int c = blockIdx.x * (blockDim.x >> 5) + w;
    if (c >= nchunks) return;
    int *my = sm + w * E;
    for (int e = lane; e < E; e += 32) my[e] = cnt[(i64)c * E + e];
    __syncwarp();
    i64 base = (i64)c * ch;
    i64 end = base + ch < n ? base + ch : n;
    unsigned before = (1u << lane) - 1u;
    for (i64 a0 = base; a0 < end; a0 += 32) {
        i64 a = a0 + lane;
        int e = a < end ? idx[a] : -1;
        if (e < 0 || e >= E) e = -1;
        unsigned m = __match_any_sync(DL_FULL, e);
        int rank = (e >= 0 ? my[e] : 0) + __popc(m & before);
        __syncwarp();
        if (e >= 0 && lane == 31 - __clz(m)) my[e] += __popc(m);
        __syncwarp();
        if (a < end) {
            int r = -1;
            if (e >= 0 && rank < cap) {
                r = offsets[e] + rank;
                src[r] = (int)a;
            }
            row[a] = r;
        }
    }
}

// Thread e of one block (blockDim.x >= E) writes out[e] = counts[e], and for the last
// expert rows - offsets[E-1]: group sizes that cover all rows of the expert-row tensors,
// the unused rows [offsets[E], rows) going to the last expert.
extern "C" __global__ void dl_moe_pad_sizes(int *__restrict__ out, const int *__restrict__ counts,
                                            const int *__restrict__ offsets, int E, int rows) {
    int e = threadIdx.x;
    if (e < E) out[e] = e == E - 1 ? rows - offsets[E - 1] : counts[e];
}
