// SwiGLU quantized as it is computed (moe/swiglu_fp8.go): package quant's activation
// kernels instantiated for DlSwigluSrc, the loader of a = silu(gate) * up of rows
// h = [gate | up] (2F columns), so that a is never written: the kernels round each value
// to h's dtype, as swiglu.cu's store does, and quantize it. Rows at or past *used (all
// when used is null) are zeros, as swiglu.cu writes them. Compiled with
// DL_SWIGLU_MX=1 for the MXFP8 kernels, 0 for the blockwise ones (each layer needs one
// recipe). quant_source.cuh describes the loader's functions.
#include "moe.cuh"

#ifndef DL_SWIGLU_MX
#define DL_SWIGLU_MX 1
#endif

#if DL_SWIGLU_MX
#include "quant_mxfp8.cuh"
#else
#include "quant_blockwise.cuh"
#endif

// DlSwigluSrc is the loader of a[M, F] = SwiGLU(h) for h[M, 2F] of E (u16: bf16, or
// float); swigluLoader of moe/swiglu_fp8.go mirrors its fields.
template <typename E>
struct DlSwigluSrc {
    typedef E T;
    const E *h;
    const int *used;
    i64 rows, F;

    template <bool VEC>
    __device__ __forceinline__ void load8(u64 r, u64 c, int n, float f[8]) const {
        const E *g = h + (i64)r * 2 * F + (i64)c;
        if ((i64)r >= dl_total(used, rows)) n = 0;
        if (VEC && n >= 8) {
            float u[8];
            dl_load8(g, f);
            dl_load8(g + F, u);
#pragma unroll
            for (int e = 0; e < 8; e++) f[e] = dl_swiglu(f[e], u[e]);
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = e < n ? dl_swiglu(dl_ld(g + e), dl_ld(g + F + e)) : 0.f;
    }

    __device__ __forceinline__ float at(u64 r, u64 c) const {
        if ((i64)r >= dl_total(used, rows)) return 0.f;
        const E *g = h + (i64)r * 2 * F + (i64)c;
        return dl_swiglu(dl_ld(g), dl_ld(g + F));
    }
};

#if DL_SWIGLU_MX
DL_MX_SOURCE_KERNELS(dl_moe_swiglu_mxq_bf16, DlSwigluSrc<u16>, 6)
DL_MX_SOURCE_KERNELS(dl_moe_swiglu_mxq_f32, DlSwigluSrc<float>, 4)
#else
DL_BW_SOURCE_KERNELS(dl_moe_swiglu_bwq_bf16, DlSwigluSrc<u16>, 3)
DL_BW_SOURCE_KERNELS(dl_moe_swiglu_bwq_f32, DlSwigluSrc<float>, 2)
#endif
