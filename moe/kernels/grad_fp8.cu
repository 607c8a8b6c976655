// The operands of an FP8 layer's backward quantized as they are computed
// (moe/grad_fp8.go): package quant's activation kernels instantiated for two loaders,
// so that the tensors of the activations' dtype they stand for are never written:
//
//   - DlSwigluGradSrc: dh[M, 2F] = [da * up * silu'(gate) | da * silu(gate)] of
//     h = [gate | up] and da[M, F], as swiglu.cu's swiglu_bwd stores it; rows at or past
//     *used (all when used is null) are zeros;
//   - DlGatherSrc: row r = w[a] * x[a / per] with a = source[r] the row's assignment (w
//     null: x[a / per] itself; a < 0: a zero row), as permute.cu's gather (the permuted
//     rows of x) and combine_bwd (the expert rows' gradient dyp of dy) store it;
//   - DlFP8RowsSrc: rows quantized rowwise in E4M3 (the dispatched rows of x with
//     Config.EP), dequantized: code times its block's scale, as an f32 product.
//
// The kernels round each value to the dtype E, as those stores do, and quantize it.
// Compiled with DL_GRAD_MX=1 for the MXFP8 kernels, 0 for the blockwise ones (each layer
// needs one recipe), DL_GRAD_FP8ROWS=1 for DlFP8RowsSrc's alone, 0 for the others (a
// layer with Config.EP needs the first, one without the others), and for the others
// DL_GRAD_F32=1 for those of f32 activations, 0 for bf16 ones: each layer compiles only
// what it runs (each program's kernels take NVRTC seconds to tens of seconds). quant_source.cuh describes the loaders' functions.
#include "moe.cuh"

#ifndef DL_GRAD_MX
#define DL_GRAD_MX 1
#endif
#ifndef DL_GRAD_FP8ROWS
#define DL_GRAD_FP8ROWS 0
#endif
#ifndef DL_GRAD_F32
#define DL_GRAD_F32 0
#endif

#if DL_GRAD_MX
#include "quant_mxfp8.cuh"
#else
#include "quant_blockwise.cuh"
#endif

// DlSwigluGradSrc is the loader of dh[M, 2F] for h[M, 2F] and da[M, F] of E (u16: bf16,
// or float); swigluGradLoader of moe/grad_fp8.go mirrors its fields. Its 16-byte loads
// need F a multiple of 8 (8 columns from a multiple of 8 lie in one half).
template <typename E>
struct DlSwigluGradSrc {
    typedef E T;
    const E *h;
    const E *da;
    const int *used;
    i64 rows, F;

    __device__ __forceinline__ float at(u64 r, u64 c) const {
        if ((i64)r >= dl_total(used, rows)) return 0.f;
        const bool up = (i64)c >= F;
        const i64 j = up ? (i64)c - F : (i64)c;
        float dg, du;
        dl_swiglu_bwd(dl_ld(h + (i64)r * 2 * F + j), dl_ld(h + (i64)r * 2 * F + F + j), dl_ld(da + (i64)r * F + j), dg,
                      du);
        return up ? du : dg;
    }

    template <bool VEC>
    __device__ __forceinline__ void load8(u64 r, u64 c, int n, float f[8]) const {
        if ((i64)r >= dl_total(used, rows)) n = 0;
        if (VEC && n >= 8) {
            const bool up = (i64)c >= F;
            const i64 j = up ? (i64)c - F : (i64)c;
            float g[8], u[8], d[8];
            dl_load8(h + (i64)r * 2 * F + j, g);
            dl_load8(h + (i64)r * 2 * F + F + j, u);
            dl_load8(da + (i64)r * F + j, d);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float dg, du;
                dl_swiglu_bwd(g[e], u[e], d[e], dg, du);
                f[e] = up ? du : dg;
            }
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = e < n ? at(r, c + e) : 0.f;
    }
};

// DlGatherSrc is the loader of the rows w[a] * x[a / per], a = source[r], of x[., K] of
// E; gatherLoader of moe/grad_fp8.go mirrors its fields.
template <typename E>
struct DlGatherSrc {
    typedef E T;
    const E *x;
    const int *source;
    const float *w;
    i64 per, K;

    __device__ __forceinline__ float at(u64 r, u64 c) const {
        const int a = source[r];
        if (a < 0) return 0.f;
        const float v = dl_ld(x + (i64)(a / per) * K + (i64)c);
        return w ? __fmul_rn(v, w[a]) : v;
    }

    template <bool VEC>
    __device__ __forceinline__ void load8(u64 r, u64 c, int n, float f[8]) const {
        const int a = source[r];
        if (a < 0) n = 0;
        if (VEC && n >= 8) {
            dl_load8(x + (i64)(a / per) * K + (i64)c, f);
            if (w) {
                const float g = w[a];
#pragma unroll
                for (int e = 0; e < 8; e++) f[e] = __fmul_rn(f[e], g);
            }
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = e < n ? at(r, c + e) : 0.f;
    }
};

// DlFP8RowsSrc is the loader of rows [M, K] quantized rowwise to E4M3: the value at
// (r, c) is e4m3(codes[r * K + c]) * scale, an f32 product rounded to nearest, with the
// scale of the row's block of c: MXFP8 (DL_GRAD_MX) an E8M0 code at scales[r * ld + c / 32]
// (quant's plain rowwise scales), blockwise an f32 at scales[(c / 128) * ld + r] (one
// scale row per block). fp8RowsLoader of moe/grad_fp8.go mirrors its fields. Its 8-column
// loads need K a multiple of 8 and codes 8-byte aligned: the 8 columns from a multiple
// of 8 lie in one block of either recipe.
struct DlFP8RowsSrc {
    typedef float T;
    const unsigned char *codes;
    const void *scales;
    i64 K, ld;

    __device__ __forceinline__ float scale(u64 r, u64 c) const {
#if DL_GRAD_MX
        return dl_e8m0_to_f32(((const unsigned char *)scales)[(i64)r * ld + (i64)(c / 32)]);
#else
        return ((const float *)scales)[(i64)(c / 128) * ld + (i64)r];
#endif
    }

    __device__ __forceinline__ float at(u64 r, u64 c) const {
        return __fmul_rn(dl_e4m3_to_f32(codes[(i64)r * K + (i64)c]), scale(r, c));
    }

    template <bool VEC>
    __device__ __forceinline__ void load8(u64 r, u64 c, int n, float f[8]) const {
        if (VEC && n >= 8) {
            const uint2 v = *(const uint2 *)(codes + (i64)r * K + (i64)c);
            const float g = scale(r, c);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const unsigned w = e < 4 ? v.x : v.y;
                f[e] = __fmul_rn(dl_e4m3_to_f32((unsigned char)(w >> (8 * (e & 3)))), g);
            }
            return;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = e < n ? at(r, c + e) : 0.f;
    }
};

#if DL_GRAD_FP8ROWS
#if DL_GRAD_MX
DL_MX_SOURCE_KERNELS(dl_moe_fp8rows_mxq_f32, DlFP8RowsSrc, 4)
#else
DL_BW_SOURCE_KERNELS(dl_moe_fp8rows_bwq_f32, DlFP8RowsSrc, 2)
#endif
#elif DL_GRAD_MX && DL_GRAD_F32
DL_MX_SOURCE_KERNELS(dl_moe_dh_mxq_f32, DlSwigluGradSrc<float>, 3)
DL_MX_SOURCE_KERNELS(dl_moe_rows_mxq_f32, DlGatherSrc<float>, 4)
#elif DL_GRAD_MX
DL_MX_SOURCE_KERNELS(dl_moe_dh_mxq_bf16, DlSwigluGradSrc<u16>, 4)
DL_MX_SOURCE_KERNELS(dl_moe_rows_mxq_bf16, DlGatherSrc<u16>, 6)
#elif DL_GRAD_F32
DL_BW_SOURCE_KERNELS(dl_moe_dh_bwq_f32, DlSwigluGradSrc<float>, 2)
DL_BW_SOURCE_KERNELS(dl_moe_rows_bwq_f32, DlGatherSrc<float>, 2)
#else
DL_BW_SOURCE_KERNELS(dl_moe_dh_bwq_bf16, DlSwigluGradSrc<u16>, 2)
DL_BW_SOURCE_KERNELS(dl_moe_rows_bwq_bf16, DlGatherSrc<u16>, 3)
#endif
