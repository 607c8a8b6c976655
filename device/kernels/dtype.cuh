// Element type conversions for device code. Each function is a bit-exact
// mirror of the Go function named beside it in device/dtype.go and follows
// its structure, so the two can be read side by side. Rounding is to nearest,
// ties to even; see the Go documentation for the NaN, Inf and saturation rules.
//
// The file is compiled by NVRTC and includes nothing.

#ifndef DROPLESS_DTYPE_CUH
#define DROPLESS_DTYPE_CUH

// Quiet NaN returned when decoding an E4M3, E5M2 or E8M0 NaN code (nanF32).
#define DL_NAN_F32 0x7fc00000u

// BF16FromFloat32.
__device__ __forceinline__ unsigned short dl_f32_to_bf16(float x)
{
    unsigned int b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)0x7fffu;
    }
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

// Two BF16FromFloat32 in one word, lo in the low half. On sm_80 and newer one
// cvt.rn.bf16x2.f32, which rounds the same way and gives the same NaN (0x7fff).
__device__ __forceinline__ unsigned int dl_f32x2_to_bf16x2(float lo, float hi)
{
#if __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned int)dl_f32_to_bf16(lo) | ((unsigned int)dl_f32_to_bf16(hi) << 16);
#endif
}

// BF16ToFloat32.
__device__ __forceinline__ float dl_bf16_to_f32(unsigned short h)
{
    return __uint_as_float((unsigned int)h << 16);
}

// F16FromFloat32.
__device__ __forceinline__ unsigned short dl_f32_to_f16(float x)
{
    unsigned int b = __float_as_uint(x);
    unsigned int sign = (b >> 16) & 0x8000u;
    unsigned int a = b & 0x7fffffffu;
    if (a > 0x7f800000u) { // NaN
        return (unsigned short)0x7fffu;
    }
    if (a >= 0x477ff000u) { // >= 65520: rounds to Inf
        return (unsigned short)(sign | 0x7c00u);
    }
    if (a >= 0x38800000u) { // >= 2^-14: normal
        a -= 112u << 23;
        a += 0xfffu + ((a >> 13) & 1u);
        return (unsigned short)(sign | (a >> 13));
    }
    if (a >= 0x33000000u) { // >= 2^-25: subnormal, unit 2^-24
        unsigned int m = (a & 0x7fffffu) | 0x800000u;
        unsigned int s = 126u - (a >> 23);
        m += (1u << (s - 1u)) - 1u + ((m >> s) & 1u);
        return (unsigned short)(sign | (m >> s));
    }
    return (unsigned short)sign;
}

// F16ToFloat32.
__device__ __forceinline__ float dl_f16_to_f32(unsigned short h)
{
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int m = (unsigned int)h & 0x3ffu;
    if (e == 0x1fu) { // Inf, NaN
        return __uint_as_float(sign | 0x7f800000u | (m << 13));
    }
    if (e != 0u) { // normal
        return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    }
    if (m != 0u) { // subnormal m*2^-24
        unsigned int n = 32u - (unsigned int)__clz((int)m);
        return __uint_as_float(sign | ((n + 102u) << 23) | ((m << (24u - n)) & 0x7fffffu));
    }
    return __uint_as_float(sign);
}

// E4M3FromFloat32: saturating, NaN -> 0x7f.
__device__ __forceinline__ unsigned char dl_f32_to_e4m3(float x)
{
    unsigned int b = __float_as_uint(x);
    unsigned int sign = (b >> 24) & 0x80u;
    unsigned int a = b & 0x7fffffffu;
    if (a > 0x7f800000u) { // NaN
        return (unsigned char)0x7fu;
    }
    if (a >= 0x43e00000u) { // >= 448, Inf: saturate
        return (unsigned char)(sign | 0x7eu);
    }
    if (a >= 0x3c800000u) { // >= 2^-6: normal
        a -= 120u << 23;
        a += 0x7ffffu + ((a >> 20) & 1u);
        return (unsigned char)(sign | (a >> 20));
    }
    if (a >= 0x3a800000u) { // >= 2^-10: subnormal, unit 2^-9
        unsigned int m = (a & 0x7fffffu) | 0x800000u;
        unsigned int s = 141u - (a >> 23);
        m += (1u << (s - 1u)) - 1u + ((m >> s) & 1u);
        return (unsigned char)(sign | (m >> s));
    }
    return (unsigned char)sign;
}

// E4M3ToFloat32.
__device__ __forceinline__ float dl_e4m3_to_f32(unsigned char c)
{
    unsigned int sign = ((unsigned int)c & 0x80u) << 24;
    unsigned int e = ((unsigned int)c >> 3) & 0xfu;
    unsigned int m = (unsigned int)c & 0x7u;
    if (e == 0xfu && m == 0x7u) { // NaN
        return __uint_as_float(DL_NAN_F32);
    }
    if (e != 0u) { // normal
        return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
    }
    if (m != 0u) { // subnormal m*2^-9
        unsigned int n = 32u - (unsigned int)__clz((int)m);
        return __uint_as_float(sign | ((n + 117u) << 23) | ((m << (24u - n)) & 0x7fffffu));
    }
    return __uint_as_float(sign);
}

// E5M2FromFloat32: saturating, NaN -> 0x7f.
__device__ __forceinline__ unsigned char dl_f32_to_e5m2(float x)
{
    unsigned int b = __float_as_uint(x);
    unsigned int sign = (b >> 24) & 0x80u;
    unsigned int a = b & 0x7fffffffu;
    if (a > 0x7f800000u) { // NaN
        return (unsigned char)0x7fu;
    }
    if (a >= 0x47600000u) { // >= 57344, Inf: saturate
        return (unsigned char)(sign | 0x7bu);
    }
    if (a >= 0x38800000u) { // >= 2^-14: normal
        a -= 112u << 23;
        a += 0xfffffu + ((a >> 21) & 1u);
        return (unsigned char)(sign | (a >> 21));
    }
    if (a >= 0x37000000u) { // >= 2^-17: subnormal, unit 2^-16
        unsigned int m = (a & 0x7fffffu) | 0x800000u;
        unsigned int s = 134u - (a >> 23);
        m += (1u << (s - 1u)) - 1u + ((m >> s) & 1u);
        return (unsigned char)(sign | (m >> s));
    }
    return (unsigned char)sign;
}

// E5M2ToFloat32.
__device__ __forceinline__ float dl_e5m2_to_f32(unsigned char c)
{
    unsigned int sign = ((unsigned int)c & 0x80u) << 24;
    unsigned int e = ((unsigned int)c >> 2) & 0x1fu;
    unsigned int m = (unsigned int)c & 0x3u;
    if (e == 0x1fu && m != 0u) { // NaN
        return __uint_as_float(DL_NAN_F32);
    }
    if (e == 0x1fu) { // Inf
        return __uint_as_float(sign | 0x7f800000u);
    }
    if (e != 0u) { // normal
        return __uint_as_float(sign | ((e + 112u) << 23) | (m << 21));
    }
    if (m != 0u) { // subnormal m*2^-16
        unsigned int n = 32u - (unsigned int)__clz((int)m);
        return __uint_as_float(sign | ((n + 110u) << 23) | ((m << (24u - n)) & 0x7fffffu));
    }
    return __uint_as_float(sign);
}

// E8M0FromFloat32: nearest power of two, ties to the even code, clamped to
// 0..254; NaN, Inf, zero and negative inputs -> 0xff.
__device__ __forceinline__ unsigned char dl_f32_to_e8m0(float x)
{
    unsigned int b = __float_as_uint(x);
    if (b == 0u || b >= 0x7f800000u) { // +0, Inf, NaN, negative
        return (unsigned char)0xffu;
    }
    if (b < 0x00800000u) { // subnormal: 2^-127 or 2^-126
        if (b > 0x00600000u) {
            return (unsigned char)1u;
        }
        return (unsigned char)0u;
    }
    b += 0x3fffffu + ((b >> 23) & 1u);
    unsigned int c = b >> 23;
    if (c > 254u) {
        c = 254u;
    }
    return (unsigned char)c;
}

// E8M0ToFloat32.
__device__ __forceinline__ float dl_e8m0_to_f32(unsigned char c)
{
    if (c == 0xffu) {
        return __uint_as_float(DL_NAN_F32);
    }
    if (c == 0u) {
        return __uint_as_float(0x00400000u);
    }
    return __uint_as_float((unsigned int)c << 23);
}

// I32FromFloat32: truncate, saturate, NaN -> 0.
__device__ __forceinline__ int dl_f32_to_i32(float x)
{
    if ((__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u) { // NaN
        return 0;
    }
    if (x >= 2147483648.0f) {
        return 2147483647;
    }
    if (x <= -2147483648.0f) {
        return -2147483647 - 1;
    }
    return (int)x;
}

// I64FromFloat32: truncate, saturate, NaN -> 0.
__device__ __forceinline__ long long dl_f32_to_i64(float x)
{
    if ((__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u) { // NaN
        return 0;
    }
    if (x >= 9223372036854775808.0f) {
        return 9223372036854775807LL;
    }
    if (x <= -9223372036854775808.0f) {
        return -9223372036854775807LL - 1LL;
    }
    return (long long)x;
}

#endif // DROPLESS_DTYPE_CUH
