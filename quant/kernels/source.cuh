// The sources of package quant's quantization kernels (quant_mxfp8.cuh,
// quant_blockwise.cuh), shared by its own programs and by the programs of quant.Source,
// which include it by the name quant_source.cuh.
//
// A kernel reads its M x K source through a loader Src of one of two kinds:
//
//   - DlQTensor<In>: a row-major [M, K] tensor of In (u16 for bf16, or float), read as
//     it is;
//   - a value source (quant.Source's loader): a struct of the caller's program,
//     passed by value as the kernel's argument, with
//
//       typedef u16 T;  (or float)  the dtype whose tensor the source stands for;
//       template <bool VEC>
//       __device__ void load8(u64 r, u64 c, int n, float f[8]) const;
//           the values of row r, columns [c, c + min(n, 8)) into f[0..), +0 into the
//           rest (n may be 0 or less: no values, no reads); VEC only with n >= 8, when
//           16-byte loads apply at c (c is then a multiple of 8 and quant.Source.Vec
//           was set);
//       __device__ float at(u64 r, u64 c) const;  the value at (r, c).
//
//     The kernels call them for rows r < M and columns c < K only, and round what they
//     return to T (dl_q_round) as storing it in a tensor of T would: the result is bit
//     for bit that of quantizing the tensor of T holding the source's values.

#ifndef DROPLESS_QUANT_SOURCE_CUH
#define DROPLESS_QUANT_SOURCE_CUH

#include "dl.cuh"

// DlQTensor is the loader of a row-major [M, K] tensor x of In.
template <typename In>
struct DlQTensor {
    typedef In T;
    const In *x;
    u64 K;
};

// dl_q_round returns v rounded to T as a store to a tensor of T rounds it (bf16: to
// nearest even, NaN to NaN), widened back to float.
template <typename T>
__device__ __forceinline__ float dl_q_round(float v);
template <>
__device__ __forceinline__ float dl_q_round<u16>(float v)
{
    return dl_bf16_to_f32(dl_f32_to_bf16(v));
}
template <>
__device__ __forceinline__ float dl_q_round<float>(float v)
{
    return v;
}

#endif
