package device

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"
)

// DType is the element type of a Tensor.
type DType uint8

// Element types. The zero value is Invalid.
const (
	Invalid DType = iota
	F32           // IEEE binary32
	F16           // IEEE binary16
	BF16          // bfloat16
	E4M3          // OCP FP8 E4M3 (bias 7, max 448, no Inf, NaN S.1111.111)
	E5M2          // OCP FP8 E5M2 (bias 15, max 57344, has Inf)
	E8M0          // OCP MX scale: unsigned 8-bit exponent, bias 127, 0xFF NaN
	I32           // two's complement int32
	I64           // two's complement int64
)

// DTypes lists every valid DType.
var DTypes = []DType{F32, F16, BF16, E4M3, E5M2, E8M0, I32, I64}

var dtypeNames = [...]string{
	Invalid: "invalid",
	F32:     "f32",
	F16:     "f16",
	BF16:    "bf16",
	E4M3:    "e4m3",
	E5M2:    "e5m2",
	E8M0:    "e8m0",
	I32:     "i32",
	I64:     "i64",
}

var dtypeSizes = [...]int{
	F32:  4,
	F16:  2,
	BF16: 2,
	E4M3: 1,
	E5M2: 1,
	E8M0: 1,
	I32:  4,
	I64:  8,
}

// Size returns the number of bytes of one element of type t,
// or 0 if t is not valid.
func (t DType) Size() int {
	if int(t) < len(dtypeSizes) {
		return dtypeSizes[t]
	}
	return 0
}

// String returns the short name of t ("f32", "bf16", "e4m3", ...),
// "invalid" for Invalid and "DType(N)" for an unknown value.
func (t DType) String() string {
	if int(t) < len(dtypeNames) {
		return dtypeNames[t]
	}
	return "DType(" + strconv.Itoa(int(t)) + ")"
}

// ParseDType returns the DType named s, the inverse of String.
// Matching is case-insensitive; "invalid" is rejected.
func ParseDType(s string) (DType, error) {
	name := strings.ToLower(s)
	for _, t := range DTypes {
		if dtypeNames[t] == name {
			return t, nil
		}
	}
	return Invalid, fmt.Errorf("device: unknown dtype %q", s)
}

// Valid reports whether t is one of DTypes.
func (t DType) Valid() bool { return t >= F32 && t <= I64 }

// IsFloat reports whether t is a valid floating-point type,
// that is any valid type other than I32 and I64.
func (t DType) IsFloat() bool { return t >= F32 && t <= E8M0 }

// Canonical NaN codes produced by the narrowing conversions.
const (
	nanF16  = 0x7fff
	nanBF16 = 0x7fff
	nanE4M3 = 0x7f
	nanE5M2 = 0x7f
	nanE8M0 = 0xff
)

// nanF32 is the quiet NaN returned when decoding an E4M3, E5M2 or E8M0 NaN code.
const nanF32 = 0x7fc00000

// BF16FromFloat32 returns the bfloat16 bits nearest to x, ties to even.
// Subnormals are kept, values that round past the largest finite bfloat16
// become ±Inf, and NaN becomes the canonical NaN 0x7FFF (sign dropped).
func BF16FromFloat32(x float32) uint16 {
	b := math.Float32bits(x)
	if b&0x7fffffff > 0x7f800000 {
		return nanBF16
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// BF16ToFloat32 returns the float32 value of the bfloat16 bits h. The
// conversion is exact; NaN payloads are kept.
func BF16ToFloat32(h uint16) float32 {
	return math.Float32frombits(uint32(h) << 16)
}

// F16FromFloat32 returns the IEEE binary16 bits nearest to x, ties to even,
// rounding once directly from x, subnormals included. Values that round past
// 65504 (|x| >= 65520) become ±Inf, and NaN becomes the canonical NaN 0x7FFF
// (sign dropped).
func F16FromFloat32(x float32) uint16 {
	b := math.Float32bits(x)
	sign := uint16(b>>16) & 0x8000
	a := b & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN
		return nanF16
	case a >= 0x477ff000: // >= 65520: rounds to Inf
		return sign | 0x7c00
	case a >= 0x38800000: // >= 2^-14: normal
		a -= 112 << 23
		a += 0xfff + (a>>13)&1
		return sign | uint16(a>>13)
	case a >= 0x33000000: // >= 2^-25: subnormal, unit 2^-24
		m := a&0x7fffff | 0x800000
		s := 126 - a>>23
		m += 1<<(s-1) - 1 + (m>>s)&1
		return sign | uint16(m>>s)
	default:
		return sign
	}
}

// F16ToFloat32 returns the float32 value of the IEEE binary16 bits h. The
// conversion is exact; NaN payloads are kept.
func F16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	e := uint32(h>>10) & 0x1f
	m := uint32(h) & 0x3ff
	switch {
	case e == 0x1f: // Inf, NaN
		return math.Float32frombits(sign | 0x7f800000 | m<<13)
	case e != 0: // normal
		return math.Float32frombits(sign | (e+112)<<23 | m<<13)
	case m != 0: // subnormal m·2^-24
		n := uint32(bits.Len32(m))
		return math.Float32frombits(sign | (n+102)<<23 | (m<<(24-n))&0x7fffff)
	default:
		return math.Float32frombits(sign)
	}
}

// E4M3FromFloat32 returns the OCP FP8 E4M3 code nearest to x, ties to even,
// subnormals included (the smallest is 2^-9; |x| <= 2^-10 gives ±0). The
// conversion saturates like PTX cvt.rn.satfinite: ±Inf and every |x| >= 448
// give ±448 (0x7E/0xFE). NaN gives 0x7F. The sign of zero is kept.
func E4M3FromFloat32(x float32) uint8 {
	b := math.Float32bits(x)
	sign := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN
		return nanE4M3
	case a >= 0x43e00000: // >= 448, Inf: saturate
		return sign | 0x7e
	case a >= 0x3c800000: // >= 2^-6: normal
		a -= 120 << 23
		a += 0x7ffff + (a>>20)&1
		return sign | uint8(a>>20)
	case a >= 0x3a800000: // >= 2^-10: subnormal, unit 2^-9
		m := a&0x7fffff | 0x800000
		s := 141 - a>>23
		m += 1<<(s-1) - 1 + (m>>s)&1
		return sign | uint8(m>>s)
	default:
		return sign
	}
}

// E4M3ToFloat32 returns the float32 value of the E4M3 code c. The conversion
// is exact; 0x7F and 0xFF decode to a quiet NaN.
func E4M3ToFloat32(c uint8) float32 {
	sign := uint32(c&0x80) << 24
	e := uint32(c>>3) & 0xf
	m := uint32(c) & 0x7
	switch {
	case e == 0xf && m == 0x7: // NaN
		return math.Float32frombits(nanF32)
	case e != 0: // normal
		return math.Float32frombits(sign | (e+120)<<23 | m<<20)
	case m != 0: // subnormal m·2^-9
		n := uint32(bits.Len32(m))
		return math.Float32frombits(sign | (n+117)<<23 | (m<<(24-n))&0x7fffff)
	default:
		return math.Float32frombits(sign)
	}
}

// E5M2FromFloat32 returns the OCP FP8 E5M2 code nearest to x, ties to even,
// subnormals included (the smallest is 2^-16; |x| <= 2^-17 gives ±0). The
// conversion saturates like PTX cvt.rn.satfinite: ±Inf and every |x| >= 57344
// give ±57344 (0x7B/0xFB). NaN gives 0x7F. The sign of zero is kept.
func E5M2FromFloat32(x float32) uint8 {
	b := math.Float32bits(x)
	sign := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN
		return nanE5M2
	case a >= 0x47600000: // >= 57344, Inf: saturate
		return sign | 0x7b
	case a >= 0x38800000: // >= 2^-14: normal
		a -= 112 << 23
		a += 0xfffff + (a>>21)&1
		return sign | uint8(a>>21)
	case a >= 0x37000000: // >= 2^-17: subnormal, unit 2^-16
		m := a&0x7fffff | 0x800000
		s := 134 - a>>23
		m += 1<<(s-1) - 1 + (m>>s)&1
		return sign | uint8(m>>s)
	default:
		return sign
	}
}

// E5M2ToFloat32 returns the float32 value of the E5M2 code c. The conversion
// is exact; 0x7C/0xFC decode to ±Inf and 0x7D-0x7F/0xFD-0xFF to a quiet NaN.
func E5M2ToFloat32(c uint8) float32 {
	sign := uint32(c&0x80) << 24
	e := uint32(c>>2) & 0x1f
	m := uint32(c) & 0x3
	switch {
	case e == 0x1f && m != 0: // NaN
		return math.Float32frombits(nanF32)
	case e == 0x1f: // Inf
		return math.Float32frombits(sign | 0x7f800000)
	case e != 0: // normal
		return math.Float32frombits(sign | (e+112)<<23 | m<<21)
	case m != 0: // subnormal m·2^-16
		n := uint32(bits.Len32(m))
		return math.Float32frombits(sign | (n+110)<<23 | (m<<(24-n))&0x7fffff)
	default:
		return math.Float32frombits(sign)
	}
}

// E8M0FromFloat32 returns the E8M0 scale code of the power of two nearest to
// x. For x = m·2^e with 1 <= m < 2, m < 1.5 gives 2^e, m > 1.5 gives 2^(e+1)
// and m == 1.5 gives the one with the even code; float32 subnormals round the
// same way between 2^-127 and 2^-126. The result is clamped to codes 0..254,
// so positive values below 2^-127 give 0 and values above 2^127 give 254.
// By this library's convention NaN, ±Inf, ±0 and negative inputs, which have
// no E8M0 representation, give the NaN code 0xFF.
func E8M0FromFloat32(x float32) uint8 {
	b := math.Float32bits(x)
	switch {
	case b == 0 || b >= 0x7f800000: // +0, Inf, NaN, negative
		return nanE8M0
	case b < 0x00800000: // subnormal: 2^-127 or 2^-126
		if b > 0x00600000 {
			return 1
		}
		return 0
	}
	b += 0x3fffff + (b>>23)&1
	c := b >> 23
	if c > 254 {
		c = 254
	}
	return uint8(c)
}

// E8M0ToFloat32 returns 2^(c-127) for c in 0..254, exactly (code 0 is the
// float32 subnormal 2^-127), and a quiet NaN for 0xFF.
func E8M0ToFloat32(c uint8) float32 {
	switch c {
	case 0xff:
		return math.Float32frombits(nanF32)
	case 0:
		return math.Float32frombits(0x00400000)
	}
	return math.Float32frombits(uint32(c) << 23)
}

// I32FromFloat32 returns x truncated toward zero and saturated to
// [MinInt32, MaxInt32]; NaN gives 0 (as PTX cvt.rzi.sat.s32.f32).
func I32FromFloat32(x float32) int32 {
	switch {
	case math.Float32bits(x)&0x7fffffff > 0x7f800000: // NaN
		return 0
	case x >= 2147483648.0:
		return math.MaxInt32
	case x <= -2147483648.0:
		return math.MinInt32
	}
	return int32(x)
}

// I64FromFloat32 returns x truncated toward zero and saturated to
// [MinInt64, MaxInt64]; NaN gives 0 (as PTX cvt.rzi.sat.s64.f32).
func I64FromFloat32(x float32) int64 {
	switch {
	case math.Float32bits(x)&0x7fffffff > 0x7f800000: // NaN
		return 0
	case x >= 9223372036854775808.0:
		return math.MaxInt64
	case x <= -9223372036854775808.0:
		return math.MinInt64
	}
	return int64(x)
}

// Decoding tables for the 8-bit types.
var (
	e4m3Table = decodeTable(E4M3ToFloat32)
	e5m2Table = decodeTable(E5M2ToFloat32)
	e8m0Table = decodeTable(E8M0ToFloat32)
)

func decodeTable(f func(uint8) float32) *[256]float32 {
	var t [256]float32
	for i := range t {
		t[i] = f(uint8(i))
	}
	return &t
}

func checkLen(fn string, t DType, want, have int, what string) {
	if !t.Valid() {
		panic("device: " + fn + ": invalid dtype " + t.String())
	}
	if have < want {
		panic(fmt.Sprintf("device: %s: %s too short for %s: %d bytes, need %d", fn, what, t, have, want))
	}
}

// EncodeFloat32 converts src to dtype t and writes len(src)*t.Size() bytes
// to dst, little endian, using the scalar conversions of this package
// (F32 is stored bit for bit). It panics if t is not valid or dst is too short.
// dst must not overlap src.
func EncodeFloat32(t DType, dst []byte, src []float32) {
	n := len(src)
	checkLen("EncodeFloat32", t, n*t.Size(), len(dst), "dst")
	le := binary.LittleEndian
	switch t {
	case F32:
		dst = dst[:4*n]
		for i, x := range src {
			le.PutUint32(dst[4*i:4*i+4], math.Float32bits(x))
		}
	case F16:
		dst = dst[:2*n]
		for i, x := range src {
			le.PutUint16(dst[2*i:2*i+2], F16FromFloat32(x))
		}
	case BF16:
		dst = dst[:2*n]
		for i, x := range src {
			// BF16FromFloat32, written to compile without branches.
			b := math.Float32bits(x)
			h := (b + 0x7fff + (b>>16)&1) >> 16
			if b&0x7fffffff > 0x7f800000 {
				h = nanBF16
			}
			le.PutUint16(dst[2*i:2*i+2], uint16(h))
		}
	case E4M3:
		dst = dst[:n]
		for i, x := range src {
			dst[i] = E4M3FromFloat32(x)
		}
	case E5M2:
		dst = dst[:n]
		for i, x := range src {
			dst[i] = E5M2FromFloat32(x)
		}
	case E8M0:
		dst = dst[:n]
		for i, x := range src {
			dst[i] = E8M0FromFloat32(x)
		}
	case I32:
		dst = dst[:4*n]
		for i, x := range src {
			le.PutUint32(dst[4*i:4*i+4], uint32(I32FromFloat32(x)))
		}
	case I64:
		dst = dst[:8*n]
		for i, x := range src {
			le.PutUint64(dst[8*i:8*i+8], uint64(I64FromFloat32(x)))
		}
	}
}

// DecodeFloat32 reads len(dst) little-endian elements of dtype t from src
// and stores their float32 values in dst. Float types decode exactly; I32 and
// I64 round to nearest even as Go's float32 conversion does. It panics if t
// is not valid or src is too short. dst must not overlap src.
func DecodeFloat32(t DType, dst []float32, src []byte) {
	n := len(dst)
	checkLen("DecodeFloat32", t, n*t.Size(), len(src), "src")
	le := binary.LittleEndian
	switch t {
	case F32:
		src = src[:4*n]
		for i := range dst {
			dst[i] = math.Float32frombits(le.Uint32(src[4*i : 4*i+4]))
		}
	case F16:
		src = src[:2*n]
		for i := range dst {
			dst[i] = F16ToFloat32(le.Uint16(src[2*i : 2*i+2]))
		}
	case BF16:
		src = src[:2*n]
		for i := range dst {
			dst[i] = math.Float32frombits(uint32(le.Uint16(src[2*i:2*i+2])) << 16)
		}
	case E4M3:
		decodeBytes(dst, src[:n], e4m3Table)
	case E5M2:
		decodeBytes(dst, src[:n], e5m2Table)
	case E8M0:
		decodeBytes(dst, src[:n], e8m0Table)
	case I32:
		src = src[:4*n]
		for i := range dst {
			dst[i] = float32(int32(le.Uint32(src[4*i : 4*i+4])))
		}
	case I64:
		src = src[:8*n]
		for i := range dst {
			dst[i] = float32(int64(le.Uint64(src[8*i : 8*i+8])))
		}
	}
}

func decodeBytes(dst []float32, src []byte, table *[256]float32) {
	src = src[:len(dst)]
	for i, c := range src {
		dst[i] = table[c]
	}
}

// convertChunk is the number of elements ConvertBytes stages through float32
// at a time.
const convertChunk = 512

// ConvertBytes converts n little-endian elements of type srcT in src to type
// dstT in dst. This is the library's cast: the same type is copied bit for
// bit; I32 and I64 convert directly, I64 to I32 saturating; every other pair
// goes through float32, decoding exactly (I32 and I64 sources round to
// nearest even) and then encoding with EncodeFloat32's rules, so float to
// float casts round once. It panics if either type is invalid or a slice is
// too short. dst may overlap src only when the types are the same (it is then a
// memmove).
func ConvertBytes(dstT DType, dst []byte, srcT DType, src []byte, n int) {
	if n < 0 {
		panic("device: ConvertBytes: negative length " + strconv.Itoa(n))
	}
	checkLen("ConvertBytes", dstT, n*dstT.Size(), len(dst), "dst")
	checkLen("ConvertBytes", srcT, n*srcT.Size(), len(src), "src")
	le := binary.LittleEndian
	switch {
	case dstT == srcT:
		copy(dst[:n*dstT.Size()], src)
	case dstT == I64 && srcT == I32:
		dst, src = dst[:8*n], src[:4*n]
		for i := 0; i < n; i++ {
			le.PutUint64(dst[8*i:], uint64(int64(int32(le.Uint32(src[4*i:])))))
		}
	case dstT == I32 && srcT == I64:
		dst, src = dst[:4*n], src[:8*n]
		for i := 0; i < n; i++ {
			v := int64(le.Uint64(src[8*i:]))
			v = max(min(v, math.MaxInt32), math.MinInt32)
			le.PutUint32(dst[4*i:], uint32(int32(v)))
		}
	default:
		var buf [convertChunk]float32
		ds, ss := dstT.Size(), srcT.Size()
		for i := 0; i < n; i += convertChunk {
			f := buf[:min(convertChunk, n-i)]
			DecodeFloat32(srcT, f, src[i*ss:])
			EncodeFloat32(dstT, dst[i*ds:], f)
		}
	}
}
