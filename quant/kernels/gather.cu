// Gathers of rowwise-quantized rows, package quant's GatherBlockwise and GatherMXFP8
// (quant/gather.go gives the rules; the Go code there is the reference): destination
// row r is source row index[r] / per, codes and scales, or a zero row where index[r] is
// -1 (or out of range, which is recorded in the status).
//
// One block of 128 threads per destination scale row: the rows [0, R) copy their codes
// (16 bytes a thread and step when K is a multiple of 16 and both code tensors are
// 16-byte aligned: the _w16 kernels; else bytes: _w1) and scales; the padding ones
// past R only zero their scales.
#include "dl.cuh"

// The status record of an index entry out of range: quant's domain (quant/status.go),
// the op given, code 3; values: the row, the entry, the bound M·per.
#define DL_GATHER_STATUS_DOMAIN 2
#define DL_GATHER_STATUS_INDEX 3

// dl_gather_src returns the source row of destination row r (r < R): index[r] / per,
// or -1 for a zero row; entries outside [-1, M·per) are recorded in status.
__device__ __forceinline__ i64 dl_gather_src(const int *index, int r, int per, int M, i64 *status, int op) {
    const i64 e = index[r], lim = (i64)M * per;
    if (e >= 0 && e < lim) return e / per;
    if (e != -1 && threadIdx.x == 0) dl_status_set(status, DL_STATUS_CODE(DL_GATHER_STATUS_DOMAIN, op, DL_GATHER_STATUS_INDEX), r, e, lim);
    return -1;
}

// dl_gather_codes copies the K codes of source row i (or zeros, i < 0) to row r.
template <int V>
__device__ __forceinline__ void dl_gather_codes(u8 *dq, const u8 *sq, i64 r, i64 i, i64 K) {
    if (V == 16) {
        uint4 *d = (uint4 *)(dq + r * K);
        const uint4 *s = (const uint4 *)(sq + (i < 0 ? 0 : i) * K);
        const uint4 z = make_uint4(0, 0, 0, 0);
        for (i64 j = threadIdx.x; j < K / 16; j += blockDim.x) d[j] = i < 0 ? z : s[j];
    } else {
        u8 *d = dq + r * K;
        const u8 *s = sq + (i < 0 ? 0 : i) * K;
        for (i64 j = threadIdx.x; j < K; j += blockDim.x) d[j] = i < 0 ? (u8)0 : s[j];
    }
}

// Blockwise: scales F32 [nb, mrd] (destination) and [nb, mrs] (source), the scale of row
// r, block b at b·mr + r; a zero row's scale is 1, a padding column's (r ≥ R) 0.
template <int V>
__device__ __forceinline__ void dl_gather_bw(u8 *dq, const u8 *sq, float *ds, const float *ss, const int *index, int R, int per, int M,
                                             i64 K, i64 mrd, i64 mrs, i64 nb, i64 *status, int op) {
    const int r = blockIdx.x;
    if (r >= R) {
        for (i64 b = threadIdx.x; b < nb; b += blockDim.x) ds[b * mrd + r] = 0.f;
        return;
    }
    const i64 i = dl_gather_src(index, r, per, M, status, op);
    for (i64 b = threadIdx.x; b < nb; b += blockDim.x) ds[b * mrd + r] = i < 0 ? 1.f : ss[b * mrs + i];
    dl_gather_codes<V>(dq, sq, r, i, K);
}

// MXFP8: scales E8M0 [rows, cp], row r's cp bytes at r·cp; a zero row's and a padding
// row's (r ≥ R) are code 0.
template <int V>
__device__ __forceinline__ void dl_gather_mx(u8 *dq, const u8 *sq, u8 *ds, const u8 *ss, const int *index, int R, int per, int M,
                                             i64 K, i64 cp, i64 *status, int op) {
    const int r = blockIdx.x;
    if (r >= R) {
        for (i64 j = threadIdx.x; j < cp; j += blockDim.x) ds[r * cp + j] = 0;
        return;
    }
    const i64 i = dl_gather_src(index, r, per, M, status, op);
    for (i64 j = threadIdx.x; j < cp; j += blockDim.x) ds[r * cp + j] = i < 0 ? (u8)0 : ss[i * cp + j];
    dl_gather_codes<V>(dq, sq, r, i, K);
}

// The kernels: grid = the destination's scale rows (blockwise: mrd = a; MXFP8: rows = a),
// block = 128 threads. For blockwise b is mrs and c nb; for MXFP8 b is cp.
#define DL_GATHER_KERNELS(V)                                                                                                     \
    extern "C" __global__ void dl_gather_bw_w##V(u8 *dq, const u8 *sq, float *ds, const float *ss, const int *index, int R,     \
                                                 int per, int M, i64 K, i64 a, i64 b, i64 c, i64 *status, int op) {             \
        dl_gather_bw<V>(dq, sq, ds, ss, index, R, per, M, K, a, b, c, status, op);                                              \
    }                                                                                                                            \
    extern "C" __global__ void dl_gather_mx_w##V(u8 *dq, const u8 *sq, u8 *ds, const u8 *ss, const int *index, int R, int per,  \
                                                 int M, i64 K, i64 a, i64 b, i64 c, i64 *status, int op) {                      \
        dl_gather_mx<V>(dq, sq, ds, ss, index, R, per, M, K, b, status, op);                                                    \
    }
DL_GATHER_KERNELS(16)
DL_GATHER_KERNELS(1)
