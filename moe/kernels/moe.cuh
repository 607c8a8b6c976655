// Shared definitions of package moe's kernels: each .cu includes this header, which
// includes dl.cuh (integer names, DL_FULL, warp and block sums, status records).
// Elements are f32 (float) or bf16 (unsigned short); arithmetic is f32.

#ifndef DROPLESS_MOE_CUH
#define DROPLESS_MOE_CUH

#include "dl.cuh"

#define DL_NEG_INF __int_as_float(0xff800000)
#define DL_POS_INF __int_as_float(0x7f800000)
#define DL_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float dl_ld(const float *p) { return *p; }
__device__ __forceinline__ float dl_ld(const u16 *p) { return dl_bf16_to_f32(*p); }
__device__ __forceinline__ void dl_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void dl_st(u16 *p, float v) { *p = dl_f32_to_bf16(v); }

// dl_vec moves V consecutive elements between memory and floats. V > 1 needs
// 16-byte aligned addresses (the host picks V).
template <typename T, int V> struct dl_vec {
    static __device__ __forceinline__ void load(const T *p, float *v) {
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = dl_ld(p + i);
    }
    static __device__ __forceinline__ void store(T *p, const float *v) {
#pragma unroll
        for (int i = 0; i < V; i++) dl_st(p + i, v[i]);
    }
};

template <> struct dl_vec<float, 4> {
    static __device__ __forceinline__ void load(const float *p, float *v) {
        float4 q = *(const float4 *)p;
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    }
    static __device__ __forceinline__ void store(float *p, const float *v) {
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    }
};

template <> struct dl_vec<u16, 8> {
    static __device__ __forceinline__ void load(const u16 *p, float *v) {
        uint4 q = *(const uint4 *)p;
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ void store(u16 *p, const float *v) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = (u32)dl_f32_to_bf16(v[2 * i]) | ((u32)dl_f32_to_bf16(v[2 * i + 1]) << 16);
        *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
    }
};

// dl_load8 loads the 8 elements at p (16-byte aligned) as floats, by the
// 16-byte specializations of dl_vec above.
template <typename E>
__device__ __forceinline__ void dl_load8(const E *p, float f[8]) {
#pragma unroll
    for (int k = 0; k < 8; k += 16 / (int)sizeof(E)) dl_vec<E, 16 / (int)sizeof(E)>::load(p + k, f + k);
}

// dl_sigmoid returns 1 / (1 + exp(-g)), the sum and the quotient rounded on their own
// (no contraction with exp's last product), so that every kernel that includes this
// header computes the same bits.
__device__ __forceinline__ float dl_sigmoid(float g) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-g))); }

// dl_silu returns g * sigmoid(g), and its limit 0 for g = -inf (not -inf * 0 = NaN).
__device__ __forceinline__ float dl_silu(float g) { return g == DL_NEG_INF ? 0.f : __fmul_rn(g, dl_sigmoid(g)); }

// dl_swiglu returns silu(g) * u, SwiGLU's output of gate g and up u: the value that
// swiglu.cu stores (rounded to the tensor's dtype) and that swiglu_fp8.cu quantizes.
__device__ __forceinline__ float dl_swiglu(float g, float u) { return __fmul_rn(dl_silu(g), u); }

// dl_silu_grad sets ds = silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g), and
// v = silu(g), or their limits: 0 and 0 at g = -inf, 1 and +inf at +inf; each step
// rounded on its own, as moe/swiglu.go computes them.
__device__ __forceinline__ void dl_silu_grad(float g, float &ds, float &v) {
    if (g == DL_NEG_INF || g == DL_POS_INF) {
        ds = g > 0.f ? 1.f : 0.f;
        v = g > 0.f ? g : 0.f;
        return;
    }
    float s = dl_sigmoid(g);
    ds = __fmul_rn(s, __fadd_rn(1.f, __fmul_rn(g, __fsub_rn(1.f, s))));
    v = __fmul_rn(g, s);
}

// dl_swiglu_bwd sets dg = d * u * silu'(g) and du = d * silu(g), the gradients of
// SwiGLU's gate g and up u for the gradient d of its output, each product rounded on
// its own (no contraction): the values that swiglu.cu stores and that grad_fp8.cu
// quantizes.
__device__ __forceinline__ void dl_swiglu_bwd(float g, float u, float d, float &dg, float &du) {
    float ds, v;
    dl_silu_grad(g, ds, v);
    dg = __fmul_rn(__fmul_rn(d, u), ds);
    du = __fmul_rn(d, v);
}

// dl_total returns the number of used rows: *total, or rows when total is null.
__device__ __forceinline__ i64 dl_total(const int *total, i64 rows) {
    if (total == 0) return rows;
    i64 t = *total;
    return t < 0 ? 0 : (t > rows ? rows : t);
}

#endif
