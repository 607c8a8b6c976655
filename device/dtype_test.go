package device

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
)

func TestDTypeProperties(t *testing.T) {
	for _, test := range []struct {
		t       DType
		name    string
		size    int
		isFloat bool
	}{
		{F32, "f32", 4, true},
		{F16, "f16", 2, true},
		{BF16, "bf16", 2, true},
		{E4M3, "e4m3", 1, true},
		{E5M2, "e5m2", 1, true},
		{E8M0, "e8m0", 1, true},
		{I32, "i32", 4, false},
		{I64, "i64", 8, false},
	} {
		if got := test.t.String(); got != test.name {
			t.Errorf("DType(%d).String() = %q, want %q", test.t, got, test.name)
		}
		if got := test.t.Size(); got != test.size {
			t.Errorf("%v.Size() = %d, want %d", test.t, got, test.size)
		}
		if got := test.t.IsFloat(); got != test.isFloat {
			t.Errorf("%v.IsFloat() = %t, want %t", test.t, got, test.isFloat)
		}
		if !test.t.Valid() {
			t.Errorf("%v.Valid() = false", test.t)
		}
		for _, s := range []string{test.name, strings.ToUpper(test.name)} {
			got, err := ParseDType(s)
			if err != nil || got != test.t {
				t.Errorf("ParseDType(%q) = %v, %v, want %v", s, got, err, test.t)
			}
		}
	}
	if len(DTypes) != 8 {
		t.Errorf("len(DTypes) = %d, want 8", len(DTypes))
	}
	for _, bad := range []DType{Invalid, I64 + 1, 255} {
		if bad.Valid() || bad.IsFloat() || bad.Size() != 0 {
			t.Errorf("%v: Valid %t, IsFloat %t, Size %d", bad, bad.Valid(), bad.IsFloat(), bad.Size())
		}
	}
	if got := Invalid.String(); got != "invalid" {
		t.Errorf("Invalid.String() = %q", got)
	}
	if got := DType(200).String(); got != "DType(200)" {
		t.Errorf("DType(200).String() = %q", got)
	}
	for _, s := range []string{"", "invalid", "float32", "f8", "DType(1)"} {
		if got, err := ParseDType(s); err == nil {
			t.Errorf("ParseDType(%q) = %v, want error", s, got)
		}
	}
}

func f32bits(b uint32) float32 { return math.Float32frombits(b) }

func pow2(e int) float32 { return float32(math.Ldexp(1, e)) }

var (
	inf = float32(math.Inf(1))
	nan = float32(math.NaN())
	// negNaN is a NaN with the sign bit set.
	negNaN = f32bits(0xffc00000)
	negZ   = f32bits(0x80000000)
)

func TestBF16FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want uint16
	}{
		{0, 0x0000},
		{negZ, 0x8000},
		{1, 0x3f80},
		{-2, 0xc000},
		{f32bits(0x3f808000), 0x3f80}, // 1+2^-8: tie, to even
		{f32bits(0x3f818000), 0x3f82}, // 1+3·2^-8: tie, to even
		{f32bits(0x3f808001), 0x3f81},
		{f32bits(0x3f807fff), 0x3f80},
		{f32bits(0x00010000), 0x0001}, // subnormal kept
		{f32bits(0x00008000), 0x0000}, // tie, to even
		{f32bits(0x80008000), 0x8000},
		{f32bits(0x00018000), 0x0002},
		{f32bits(0x007f8000), 0x0080}, // rounds up to the smallest normal
		{f32bits(0x7f7f7fff), 0x7f7f},
		{f32bits(0x7f7f8000), 0x7f80}, // tie with the overflow threshold: Inf
		{math.MaxFloat32, 0x7f80},
		{-math.MaxFloat32, 0xff80},
		{inf, 0x7f80},
		{-inf, 0xff80},
		{nan, 0x7fff},
		{negNaN, 0x7fff},
		{f32bits(0x7f800001), 0x7fff}, // signalling NaN stays NaN
		{f32bits(0x7fffffff), 0x7fff},
	} {
		if got := BF16FromFloat32(test.x); got != test.want {
			t.Errorf("BF16FromFloat32(%g [%#08x]) = %#04x, want %#04x", test.x, math.Float32bits(test.x), got, test.want)
		}
	}
}

func TestF16FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want uint16
	}{
		{0, 0x0000},
		{negZ, 0x8000},
		{1, 0x3c00},
		{-2, 0xc000},
		{0.1, 0x2e66},
		{1.0 / 3, 0x3555},
		{2049, 0x6800}, // tie, to even
		{2051, 0x6802}, // tie, to even
		{65504, 0x7bff},
		{65519.99, 0x7bff},
		{65520, 0x7c00}, // tie with the overflow threshold: Inf
		{-65520, 0xfc00},
		{1e10, 0x7c00},
		{inf, 0x7c00},
		{-inf, 0xfc00},
		{nan, 0x7fff},
		{negNaN, 0x7fff},
		{pow2(-14), 0x0400},
		{pow2(-24), 0x0001},
		{pow2(-25), 0x0000},                    // tie, to even
		{-pow2(-25), 0x8000},                   // sign of zero kept
		{f32bits(0x33000001), 0x0001},          // just above 2^-25
		{1.5 * pow2(-24), 0x0002},              // tie, to even
		{2.5 * pow2(-24), 0x0002},              // tie, to even
		{1023 * pow2(-24), 0x03ff},             // largest subnormal
		{1023.5 * pow2(-24), 0x0400},           // tie, to even: smallest normal
		{pow2(-26), 0x0000},                    // below half the smallest subnormal
		{f32bits(0x00000001), 0x0000},          // float32 subnormal
		{-math.SmallestNonzeroFloat32, 0x8000}, // sign of zero kept
	} {
		if got := F16FromFloat32(test.x); got != test.want {
			t.Errorf("F16FromFloat32(%g [%#08x]) = %#04x, want %#04x", test.x, math.Float32bits(test.x), got, test.want)
		}
	}
}

func TestE4M3FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want uint8
	}{
		{0, 0x00},
		{negZ, 0x80},
		{1, 0x38},
		{0.5, 0x30},
		{-0.25, 0xa8},
		{256, 0x78},
		{240, 0x77},
		{0.1, 0x1d},    // 1.625·2^-4
		{1.0625, 0x38}, // tie, to even
		{1.1875, 0x3a}, // tie, to even
		{416, 0x7d},
		{432, 0x7e}, // tie, to even (448 has mantissa 110)
		{448, 0x7e},
		{-448, 0xfe},
		{449, 0x7e}, // saturate: 480 is not representable (0x7F is NaN)
		{464, 0x7e},
		{480, 0x7e},
		{1e30, 0x7e},
		{-1e30, 0xfe},
		{math.MaxFloat32, 0x7e},
		{inf, 0x7e},
		{-inf, 0xfe},
		{nan, 0x7f},
		{negNaN, 0x7f},
		{pow2(-6), 0x08},                       // smallest normal
		{7 * pow2(-9), 0x07},                   // largest subnormal
		{7.5 * pow2(-9), 0x08},                 // tie, to even
		{pow2(-9), 0x01},                       // smallest subnormal
		{pow2(-10), 0x00},                      // tie, to even
		{-pow2(-10), 0x80},                     // tie, to even, sign kept
		{f32bits(0x3a800001), 0x01},            // just above 2^-10
		{1.5 * pow2(-10), 0x01},                // 0.75·2^-9
		{3 * pow2(-10), 0x02},                  // tie, to even
		{3.5 * pow2(-9), 0x04},                 // tie, to even
		{2.5 * pow2(-9), 0x02},                 // tie, to even
		{pow2(-11), 0x00},                      // below half the smallest subnormal
		{math.SmallestNonzeroFloat32, 0x00},    // float32 subnormal
		{-math.SmallestNonzeroFloat32, 0x80},   // sign of zero kept
		{f32bits(0x3effffff), 0x30},            // just below 0.5
		{f32bits(0x43dfffff), 0x7e},            // just below 448
		{f32bits(0x43cfffff), 0x7d},            // just below 416
		{f32bits(0x43d00000), 0x7d},            // 416
		{f32bits(0x43d80000), 0x7e},            // 432, tie
		{f32bits(0x43d7ffff), 0x7d},            // just below 432
		{f32bits(0x3c7fffff), 0x08},            // just below 2^-6
		{f32bits(0x3c700000), 0x08},            // 7.5·2^-9, tie
		{f32bits(0x3c6fffff), 0x07},            // just below 7.5·2^-9
		{f32bits(0x3c000000), 0x04},            // 2^-7
		{f32bits(0x3b000000), 0x01},            // 2^-9
		{f32bits(0xbb400000), 0x82},            // -1.5·2^-9, tie
		{f32bits(0x3b200000), 0x01},            // 1.25·2^-9
		{f32bits(0x3b600000), 0x02},            // 1.75·2^-9
		{f32bits(0x41880000), 0x58},            // 17 = 1.0625·2^4: tie, to even: 16
		{f32bits(0x41900000), 0x59},            // 18
		{f32bits(0xc1980000), 0xda},            // -19 = -1.1875·2^4: tie, to even: -20
		{f32bits(0x7f7fffff), 0x7e},            // MaxFloat32
		{f32bits(0x7f800001), 0x7f},            // signalling NaN
		{f32bits(0x00400000), 0x00},            // float32 subnormal
		{f32bits(0x80800000), 0x80},            // -2^-126
		{f32bits(0x43e00001), 0x7e},            // just above 448
		{f32bits(0xc3f00000), 0xfe},            // -480
		{f32bits(0x3f800000 | 0x100000), 0x39}, // 1.125
	} {
		if got := E4M3FromFloat32(test.x); got != test.want {
			t.Errorf("E4M3FromFloat32(%g [%#08x]) = %#02x, want %#02x", test.x, math.Float32bits(test.x), got, test.want)
		}
	}
}

func TestE5M2FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want uint8
	}{
		{0, 0x00},
		{negZ, 0x80},
		{1, 0x3c},
		{-1, 0xbc},
		{1.25, 0x3d},
		{1.125, 0x3c}, // tie, to even
		{1.375, 0x3e}, // tie, to even
		{49152, 0x7a},
		{53248, 0x7a}, // 1.625·2^15: tie, to even
		{57344, 0x7b},
		{-57344, 0xfb},
		{61440, 0x7b}, // saturate
		{65536, 0x7b},
		{1e30, 0x7b},
		{inf, 0x7b},
		{-inf, 0xfb},
		{nan, 0x7f},
		{negNaN, 0x7f},
		{pow2(-14), 0x04},                    // smallest normal
		{3 * pow2(-16), 0x03},                // largest subnormal
		{3.5 * pow2(-16), 0x04},              // tie, to even
		{pow2(-16), 0x01},                    // smallest subnormal
		{pow2(-17), 0x00},                    // tie, to even
		{-pow2(-17), 0x80},                   // tie, to even, sign kept
		{f32bits(0x37000001), 0x01},          // just above 2^-17
		{3 * pow2(-17), 0x02},                // tie, to even
		{pow2(-18), 0x00},                    // below half the smallest subnormal
		{-math.SmallestNonzeroFloat32, 0x80}, // sign of zero kept
		{f32bits(0x475fffff), 0x7b},          // just below 57344
	} {
		if got := E5M2FromFloat32(test.x); got != test.want {
			t.Errorf("E5M2FromFloat32(%g [%#08x]) = %#02x, want %#02x", test.x, math.Float32bits(test.x), got, test.want)
		}
	}
}

func TestE8M0FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want uint8
	}{
		{1, 127},
		{2, 128},
		{0.5, 126},
		{1.5, 128},  // tie, to even
		{3, 128},    // tie, to even
		{0.75, 126}, // tie, to even
		{6, 130},    // tie, to even
		{f32bits(0x3fbfffff), 127},
		{f32bits(0x3fc00001), 128},
		{f32bits(0x403fffff), 128},
		{f32bits(0x40400001), 129},
		{448, 136}, // 1.75·2^8
		{1.0 / 448, 118},
		{pow2(-126), 1},
		{pow2(-127), 0},
		{f32bits(0x00600000), 0},   // 1.5·2^-127: tie, to even
		{f32bits(0x00600001), 1},   // nearer to 2^-126
		{f32bits(0x005fffff), 0},   // nearer to 2^-127
		{f32bits(0x00c00000), 2},   // 1.5·2^-126: tie, to even
		{f32bits(0x00bfffff), 1},   // nearer to 2^-126
		{pow2(-149), 0},            // clamped
		{pow2(127), 254},           // largest
		{f32bits(0x7f3fffff), 254}, // nearer to 2^127
		{f32bits(0x7f400000), 254}, // 1.5·2^127: clamped
		{math.MaxFloat32, 254},     // clamped
		{0, 0xff},
		{negZ, 0xff},
		{-1, 0xff},
		{-math.SmallestNonzeroFloat32, 0xff},
		{inf, 0xff},
		{-inf, 0xff},
		{nan, 0xff},
		{negNaN, 0xff},
	} {
		if got := E8M0FromFloat32(test.x); got != test.want {
			t.Errorf("E8M0FromFloat32(%g [%#08x]) = %d, want %d", test.x, math.Float32bits(test.x), got, test.want)
		}
	}
	for _, test := range []struct {
		c    uint8
		want uint32
	}{
		{0, 0x00400000},
		{1, 0x00800000},
		{127, 0x3f800000},
		{254, 0x7f000000},
	} {
		if got := math.Float32bits(E8M0ToFloat32(test.c)); got != test.want {
			t.Errorf("E8M0ToFloat32(%d) = %#08x, want %#08x", test.c, got, test.want)
		}
	}
	if x := E8M0ToFloat32(0xff); x == x {
		t.Errorf("E8M0ToFloat32(0xff) = %g, want NaN", x)
	}
}

func TestI32FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want int32
	}{
		{0, 0},
		{negZ, 0},
		{1.9, 1},
		{-1.9, -1},
		{-0.5, 0},
		{16777217, 16777216},
		{2147483520, 2147483520}, // largest float32 below 2^31
		{-2147483520, -2147483520},
		{2147483648, math.MaxInt32},
		{-2147483648, math.MinInt32},
		{-4294967296, math.MinInt32},
		{1e30, math.MaxInt32},
		{inf, math.MaxInt32},
		{-inf, math.MinInt32},
		{nan, 0},
		{negNaN, 0},
	} {
		if got := I32FromFloat32(test.x); got != test.want {
			t.Errorf("I32FromFloat32(%g) = %d, want %d", test.x, got, test.want)
		}
	}
}

func TestI64FromFloat32(t *testing.T) {
	for _, test := range []struct {
		x    float32
		want int64
	}{
		{0, 0},
		{1.9, 1},
		{-1.9, -1},
		{2147483648, 2147483648},
		{-2147483648, -2147483648},
		{f32bits(0x5effffff), 9223371487098961920}, // largest float32 below 2^63
		{f32bits(0xdeffffff), -9223371487098961920},
		{9223372036854775808, math.MaxInt64},
		{-9223372036854775808, math.MinInt64},
		{1e30, math.MaxInt64},
		{-1e30, math.MinInt64},
		{inf, math.MaxInt64},
		{-inf, math.MinInt64},
		{nan, 0},
	} {
		if got := I64FromFloat32(test.x); got != test.want {
			t.Errorf("I64FromFloat32(%g) = %d, want %d", test.x, got, test.want)
		}
	}
}

// codec describes one narrow float format through uint32 codes, for the
// exhaustive and reference tests.
type codec struct {
	name   string
	bits   int // code width
	enc    func(float32) uint32
	dec    func(uint32) float32
	nan    uint32 // canonical NaN code
	signed bool   // has a sign bit (all but E8M0)
	sat    bool   // overflow saturates instead of giving Inf

	// Field layout for the independent float64 decoder.
	ebits, mbits, bias int
	nanCode            func(uint32) bool // magnitude code is NaN
	infCode            uint32            // magnitude code of Inf, 0 if none
	maxCode            uint32            // magnitude code of the largest finite value
}

func (c *codec) signBit() uint32 {
	if !c.signed {
		return 0
	}
	return 1 << (c.bits - 1)
}

func (c *codec) isNaN(code uint32) bool { return c.nanCode(code &^ c.signBit()) }

func (c *codec) isInf(code uint32) bool {
	return c.infCode != 0 && code&^c.signBit() == c.infCode
}

// ref64 decodes code from its fields in float64, independently of dec.
func (c *codec) ref64(code uint32) float64 {
	if c.isNaN(code) {
		return math.NaN()
	}
	s := 1.0
	if code&c.signBit() != 0 {
		s = -1
	}
	mag := code &^ c.signBit()
	if c.isInf(code) {
		return math.Inf(int(s))
	}
	e := int(mag >> c.mbits)
	m := float64(mag & (1<<c.mbits - 1))
	if c.mbits == 0 {
		return math.Ldexp(1, e-c.bias)
	}
	if e == 0 {
		return s * math.Ldexp(m, 1-c.bias-c.mbits)
	}
	return s * math.Ldexp(1+m/float64(int(1)<<c.mbits), e-c.bias)
}

var codecs = []*codec{
	{
		name: "bf16", bits: 16, nan: 0x7fff, signed: true,
		enc:   func(x float32) uint32 { return uint32(BF16FromFloat32(x)) },
		dec:   func(c uint32) float32 { return BF16ToFloat32(uint16(c)) },
		ebits: 8, mbits: 7, bias: 127,
		nanCode: func(c uint32) bool { return c > 0x7f80 },
		infCode: 0x7f80, maxCode: 0x7f7f,
	},
	{
		name: "f16", bits: 16, nan: 0x7fff, signed: true,
		enc:   func(x float32) uint32 { return uint32(F16FromFloat32(x)) },
		dec:   func(c uint32) float32 { return F16ToFloat32(uint16(c)) },
		ebits: 5, mbits: 10, bias: 15,
		nanCode: func(c uint32) bool { return c > 0x7c00 },
		infCode: 0x7c00, maxCode: 0x7bff,
	},
	{
		name: "e4m3", bits: 8, nan: 0x7f, signed: true, sat: true,
		enc:   func(x float32) uint32 { return uint32(E4M3FromFloat32(x)) },
		dec:   func(c uint32) float32 { return E4M3ToFloat32(uint8(c)) },
		ebits: 4, mbits: 3, bias: 7,
		nanCode: func(c uint32) bool { return c == 0x7f },
		maxCode: 0x7e,
	},
	{
		name: "e5m2", bits: 8, nan: 0x7f, signed: true, sat: true,
		enc:   func(x float32) uint32 { return uint32(E5M2FromFloat32(x)) },
		dec:   func(c uint32) float32 { return E5M2ToFloat32(uint8(c)) },
		ebits: 5, mbits: 2, bias: 15,
		nanCode: func(c uint32) bool { return c > 0x7c },
		infCode: 0x7c, maxCode: 0x7b,
	},
	{
		name: "e8m0", bits: 8, nan: 0xff, sat: true,
		enc:   func(x float32) uint32 { return uint32(E8M0FromFloat32(x)) },
		dec:   func(c uint32) float32 { return E8M0ToFloat32(uint8(c)) },
		ebits: 8, mbits: 0, bias: 127,
		nanCode: func(c uint32) bool { return c == 0xff },
		maxCode: 0xfe,
	},
}

func isNaN32(x float32) bool { return x != x }

// sameValue reports whether a and b are both NaN or equal with equal signs.
func sameValue(a float32, b float64) bool {
	if isNaN32(a) || math.IsNaN(b) {
		return isNaN32(a) && math.IsNaN(b)
	}
	return float64(a) == b && math.Signbit(float64(a)) == math.Signbit(b)
}

func TestDecodeFloat32Exhaustive(t *testing.T) {
	for _, c := range codecs {
		for code := uint32(0); code < 1<<c.bits; code++ {
			got, want := c.dec(code), c.ref64(code)
			if !sameValue(got, want) {
				t.Errorf("%s: decode(%#x) = %g, want %g", c.name, code, got, want)
			}
		}
	}
}

func TestRoundTripFloat32Exhaustive(t *testing.T) {
	for _, c := range codecs {
		for code := uint32(0); code < 1<<c.bits; code++ {
			x := c.dec(code)
			got := c.enc(x)
			want := code
			switch {
			case c.isNaN(code):
				if !isNaN32(x) {
					t.Errorf("%s: decode(%#x) = %g, want NaN", c.name, code, x)
				}
				want = c.nan
			case c.isInf(code) && c.sat:
				want = code&c.signBit() | c.maxCode
			}
			if got != want {
				t.Errorf("%s: encode(decode(%#x) = %g) = %#x, want %#x", c.name, code, x, got, want)
			}
		}
	}
}

// next32 returns the float32 after x in the direction of y.
func next32(x, y float32) float32 {
	switch b := math.Float32bits(x); {
	case x == y:
		return x
	case (x < y) == (x >= 0):
		return math.Float32frombits(b + 1)
	default:
		return math.Float32frombits(b - 1)
	}
}

// TestTiesFloat32Exhaustive checks every pair of adjacent finite codes: their
// midpoint rounds to the code with the even last bit, and the float32 values
// on either side of it round to the nearer code.
func TestTiesFloat32Exhaustive(t *testing.T) {
	for _, c := range codecs {
		signs := []uint32{0}
		if c.signed {
			signs = append(signs, c.signBit())
		}
		for _, s := range signs {
			for mag := uint32(0); mag < c.maxCode; mag++ {
				lo, hi := s|mag, s|(mag+1)
				a, b := c.dec(lo), c.dec(hi)
				mid64 := (float64(a) + float64(b)) / 2
				mid := float32(mid64)
				if float64(mid) != mid64 {
					t.Fatalf("%s: midpoint of %#x and %#x not a float32", c.name, lo, hi)
				}
				even := lo
				if lo&1 != 0 {
					even = hi
				}
				if got := c.enc(mid); got != even {
					t.Errorf("%s: encode(%g) = %#x, want %#x (tie between %#x and %#x)", c.name, mid, got, even, lo, hi)
				}
				if got := c.enc(next32(mid, a)); got != lo {
					t.Errorf("%s: encode(%g) = %#x, want %#x", c.name, next32(mid, a), got, lo)
				}
				if got := c.enc(next32(mid, b)); got != hi {
					t.Errorf("%s: encode(%g) = %#x, want %#x", c.name, next32(mid, b), got, hi)
				}
			}
			// Above the largest finite value.
			max := c.dec(s | c.maxCode)
			over := s | c.maxCode
			if !c.sat {
				over = s | c.infCode
			}
			half := math.Abs(float64(max)) - math.Abs(float64(c.dec(s|(c.maxCode-1))))
			if c.mbits > 0 {
				thr := float32(math.Copysign(math.Abs(float64(max))+half/2, float64(max)))
				if got := c.enc(thr); got != over {
					t.Errorf("%s: encode(%g) = %#x, want %#x", c.name, thr, got, over)
				}
				if got := c.enc(next32(thr, max)); got != s|c.maxCode {
					t.Errorf("%s: encode(%g) = %#x, want %#x", c.name, next32(thr, max), got, s|c.maxCode)
				}
			}
			for _, x := range []float32{next32(max, 2*max), 2 * max, inf, math.MaxFloat32} {
				if !c.signed && math.IsInf(float64(x), 0) {
					continue // E8M0 maps Inf to NaN
				}
				if s != 0 {
					x = -float32(math.Abs(float64(x)))
				}
				if c.sat || math.Abs(float64(x)) >= math.Abs(float64(max))+half/2 {
					if got := c.enc(x); got != over {
						t.Errorf("%s: encode(%g) = %#x, want %#x", c.name, x, got, over)
					}
				}
			}
		}
	}
}

// refTable is a sorted table of the non-negative finite values of a codec
// (with Inf as the next power of two for formats that overflow to Inf).
type refTable struct {
	c     *codec
	vals  []float64
	codes []uint32
}

func newRefTable(c *codec) *refTable {
	r := &refTable{c: c}
	for code := uint32(0); code < 1<<c.bits; code++ {
		if code&c.signBit() != 0 || c.isNaN(code) {
			continue
		}
		v := c.ref64(code)
		if math.IsInf(v, 0) {
			if c.sat {
				continue
			}
			// The overflow threshold is half an ulp above the largest finite value.
			v = 2*c.ref64(c.maxCode) - c.ref64(c.maxCode-1)
		}
		r.vals = append(r.vals, v)
		r.codes = append(r.codes, code)
	}
	if !sort.Float64sAreSorted(r.vals) {
		panic(c.name + ": table not sorted")
	}
	return r
}

// nearest returns the code nearest to x by searching the table, ties to the
// even code.
func (r *refTable) nearest(x float32) uint32 {
	c := r.c
	if isNaN32(x) {
		return c.nan
	}
	if !c.signed && (x <= 0 || math.IsInf(float64(x), 1)) {
		return c.nan
	}
	var sign uint32
	if math.Signbit(float64(x)) {
		sign = c.signBit()
	}
	ax := math.Abs(float64(x))
	i := sort.SearchFloat64s(r.vals, ax)
	switch {
	case i == len(r.vals):
		return sign | r.codes[i-1]
	case r.vals[i] == ax || i == 0:
		return sign | r.codes[i]
	}
	mid := (r.vals[i-1] + r.vals[i]) / 2
	switch {
	case ax < mid:
		return sign | r.codes[i-1]
	case ax > mid:
		return sign | r.codes[i]
	case r.codes[i-1]&1 == 0:
		return sign | r.codes[i-1]
	default:
		return sign | r.codes[i]
	}
}

// refRound rounds x to mbits fraction bits and exponent at least emin in
// float64, ties to even, then applies overflow above maxv (saturating or Inf).
func refRound(x float64, mbits, emin int, maxv float64, sat bool) float64 {
	if x == 0 || math.IsNaN(x) {
		return x
	}
	ax := math.Abs(x)
	q := ax
	if !math.IsInf(ax, 0) {
		_, e := math.Frexp(ax)
		e = max(e-1, emin)
		ulp := math.Ldexp(1, e-mbits)
		q = math.RoundToEven(ax/ulp) * ulp
	}
	if q > maxv {
		q = math.Inf(1)
		if sat {
			q = maxv
		}
	}
	return math.Copysign(q, x)
}

func (c *codec) refRound(x float32) float64 {
	return refRound(float64(x), c.mbits, 1-c.bias, c.ref64(c.maxCode), c.sat)
}

// randFloat32 returns random float32 bits: uniform half of the time, else
// with an exponent near the range of c and low mantissa bits set to produce
// values at or next to rounding ties.
func randFloat32(rng *rand.Rand, c *codec) float32 {
	b := rng.Uint32()
	if b&1 == 0 {
		return math.Float32frombits(b)
	}
	emin, emax := 1-c.bias-c.mbits-3, (1<<c.ebits)-c.bias+1
	e := emin + rng.IntN(emax-emin+1)
	be := max(e+127, 0)
	if be > 254 {
		be = 254
	}
	m := rng.Uint32() & 0x7fffff
	switch rng.IntN(4) {
	case 0: // a tie at the rounding position, or next to one
		k := uint(23 - c.mbits)
		if e < 1-c.bias {
			k += uint(1 - c.bias - e)
		}
		k = min(k, 23)
		if k > 0 {
			m = m&^(1<<k-1) | 1<<(k-1)
			m += uint32(rng.IntN(3)) - 1
			m &= 0x7fffff
		}
	case 1: // few significant bits
		m &= 0x7f0000
	}
	return math.Float32frombits(b&0x80000000 | uint32(be)<<23 | m)
}

func TestFloat32Reference(t *testing.T) {
	n := 1 << 20
	if testing.Short() {
		n = 1 << 16
	}
	for _, c := range codecs {
		table := newRefTable(c)
		rng := rand.New(rand.NewPCG(1, uint64(c.bits)<<8|uint64(c.bias)))
		fails := 0
		for i := 0; i < n && fails < 10; i++ {
			x := randFloat32(rng, c)
			got := c.enc(x)
			if want := table.nearest(x); got != want {
				t.Errorf("%s: encode(%g [%#08x]) = %#x, want %#x (table)", c.name, x, math.Float32bits(x), got, want)
				fails++
			}
			if c.mbits == 0 {
				continue
			}
			if want := c.refRound(x); !sameValue(c.dec(got), want) {
				t.Errorf("%s: decode(encode(%g [%#08x])) = %g, want %g (float64)", c.name, x, math.Float32bits(x), c.dec(got), want)
				fails++
			}
		}
	}
}

// TestSubnormalSweepF16BF16 compares F16 and BF16 rounding with the float64
// reference for a dense set of float32 values around their subnormal range.
func TestSubnormalSweepF16BF16(t *testing.T) {
	step := uint32(13)
	if testing.Short() {
		step = 101
	}
	for _, test := range []struct {
		c      *codec
		lo, hi uint32 // float32 biased exponents swept
	}{
		{codecs[1], 100, 114}, // f16: 2^-27 to 2^-13
		{codecs[0], 0, 3},     // bf16: float32 subnormals and the smallest normals
	} {
		c := test.c
		fails := 0
		for e := test.lo; e <= test.hi; e++ {
			for m := uint32(0); m < 1<<23 && fails < 10; m += step {
				for _, s := range []uint32{0, 0x80000000} {
					x := math.Float32frombits(s | e<<23 | m)
					got := c.enc(x)
					if want := c.refRound(x); !sameValue(c.dec(got), want) {
						t.Errorf("%s: decode(encode(%g [%#08x])) = %g, want %g", c.name, x, math.Float32bits(x), c.dec(got), want)
						fails++
					}
				}
			}
		}
	}
}

func testValues(rng *rand.Rand, n int) []float32 {
	x := []float32{0, negZ, 1, -1, 448, 480, 65520, 1e30, -1e30, inf, -inf, nan, negNaN,
		pow2(-10), pow2(-25), pow2(-127), 3e9, -3e9, 1e19, -1e19, 0.5, -2.5, 7.5}
	for len(x) < n {
		switch rng.IntN(3) {
		case 0:
			x = append(x, math.Float32frombits(rng.Uint32()))
		case 1:
			x = append(x, float32(rng.NormFloat64()*100))
		default:
			x = append(x, float32(rng.IntN(2001)-1000))
		}
	}
	return x
}

// scalarBits returns the encoding of x as dtype t, as uint64 bits.
func scalarBits(t DType, x float32) uint64 {
	switch t {
	case F32:
		return uint64(math.Float32bits(x))
	case F16:
		return uint64(F16FromFloat32(x))
	case BF16:
		return uint64(BF16FromFloat32(x))
	case E4M3:
		return uint64(E4M3FromFloat32(x))
	case E5M2:
		return uint64(E5M2FromFloat32(x))
	case E8M0:
		return uint64(E8M0FromFloat32(x))
	case I32:
		return uint64(uint32(I32FromFloat32(x)))
	case I64:
		return uint64(I64FromFloat32(x))
	}
	panic("bad dtype")
}

func getBits(t DType, b []byte, i int) uint64 {
	le := binary.LittleEndian
	switch t.Size() {
	case 1:
		return uint64(b[i])
	case 2:
		return uint64(le.Uint16(b[2*i:]))
	case 4:
		return uint64(le.Uint32(b[4*i:]))
	default:
		return le.Uint64(b[8*i:])
	}
}

// scalarDecode returns the float32 value of bits v of dtype t.
func scalarDecode(t DType, v uint64) float32 {
	switch t {
	case F32:
		return math.Float32frombits(uint32(v))
	case F16:
		return F16ToFloat32(uint16(v))
	case BF16:
		return BF16ToFloat32(uint16(v))
	case E4M3:
		return E4M3ToFloat32(uint8(v))
	case E5M2:
		return E5M2ToFloat32(uint8(v))
	case E8M0:
		return E8M0ToFloat32(uint8(v))
	case I32:
		return float32(int32(v))
	case I64:
		return float32(int64(v))
	}
	panic("bad dtype")
}

func TestEncodeDecodeFloat32(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	src := testValues(rng, 1000)
	for _, dt := range DTypes {
		buf := make([]byte, len(src)*dt.Size()+3)
		for i := range buf {
			buf[i] = 0xaa
		}
		EncodeFloat32(dt, buf, src)
		for i, x := range src {
			if got, want := getBits(dt, buf, i), scalarBits(dt, x); got != want {
				t.Errorf("EncodeFloat32(%v): element %d (%g) = %#x, want %#x", dt, i, x, got, want)
			}
		}
		if !slices.Equal(buf[len(buf)-3:], []byte{0xaa, 0xaa, 0xaa}) {
			t.Errorf("EncodeFloat32(%v) wrote past its length", dt)
		}

		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
		dst := make([]float32, len(src))
		DecodeFloat32(dt, dst, buf)
		for i, got := range dst {
			want := scalarDecode(dt, getBits(dt, buf, i))
			if math.Float32bits(got) != math.Float32bits(want) && !(isNaN32(got) && isNaN32(want)) {
				t.Errorf("DecodeFloat32(%v): element %d = %g, want %g", dt, i, got, want)
			}
		}
	}
}

func TestConvertBytesDType(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 3*convertChunk + 17
	vals := testValues(rng, n)
	for _, st := range DTypes {
		src := make([]byte, n*st.Size())
		EncodeFloat32(st, src, vals)
		if st == I64 {
			// Include integers float32 cannot hold exactly.
			binary.LittleEndian.PutUint64(src[0:], uint64(math.MaxInt64))
			binary.LittleEndian.PutUint64(src[8:], 1<<40+1)
			binary.LittleEndian.PutUint64(src[16:], 1<<24+1)
		}
		for _, dt := range DTypes {
			dst := make([]byte, n*dt.Size())
			ConvertBytes(dt, dst, st, src, n)
			for i := 0; i < n; i++ {
				v := getBits(st, src, i)
				var want uint64
				switch {
				case st == dt:
					want = v
				case st == I32 && dt == I64:
					want = uint64(int64(int32(v)))
				case st == I64 && dt == I32:
					want = uint64(uint32(int32(max(min(int64(v), math.MaxInt32), math.MinInt32))))
				default:
					want = scalarBits(dt, scalarDecode(st, v))
				}
				if got := getBits(dt, dst, i); got != want {
					t.Fatalf("ConvertBytes(%v <- %v): element %d (%#x) = %#x, want %#x", dt, st, i, v, got, want)
				}
			}
		}
	}
	// Casts between float types round once: 1.0625+2^-23 is just above an
	// E4M3 tie, while rounding it to bf16 first would land on the tie.
	src := make([]byte, 4)
	binary.LittleEndian.PutUint32(src, 0x3f880001)
	dst := make([]byte, 1)
	ConvertBytes(E4M3, dst, F32, src, 1)
	if dst[0] != 0x39 {
		t.Errorf("ConvertBytes(e4m3 <- f32 0x3f880001) = %#x, want 0x39", dst[0])
	}
}

func mustPanic(t *testing.T, name, msg string, f func()) {
	t.Helper()
	defer func() {
		t.Helper()
		r := recover()
		if r == nil {
			t.Errorf("%s: no panic", name)
			return
		}
		if s, ok := r.(string); !ok || !strings.Contains(s, msg) {
			t.Errorf("%s: panic %v, want one containing %q", name, r, msg)
		}
	}()
	f()
}

func TestFloat32ConversionPanics(t *testing.T) {
	mustPanic(t, "encode short", "too short", func() { EncodeFloat32(BF16, make([]byte, 3), make([]float32, 2)) })
	mustPanic(t, "encode invalid", "invalid dtype", func() { EncodeFloat32(Invalid, nil, nil) })
	mustPanic(t, "decode short", "too short", func() { DecodeFloat32(I64, make([]float32, 1), make([]byte, 7)) })
	mustPanic(t, "decode invalid", "invalid dtype", func() { DecodeFloat32(DType(99), nil, nil) })
	mustPanic(t, "convert short dst", "too short", func() { ConvertBytes(F32, make([]byte, 7), E4M3, make([]byte, 2), 2) })
	mustPanic(t, "convert short src", "too short", func() { ConvertBytes(E4M3, make([]byte, 2), F32, make([]byte, 7), 2) })
	mustPanic(t, "convert negative", "negative", func() { ConvertBytes(E4M3, nil, F32, nil, -1) })
	mustPanic(t, "convert invalid", "invalid dtype", func() { ConvertBytes(Invalid, nil, F32, nil, 0) })
	// Zero-length conversions are fine.
	EncodeFloat32(F32, nil, nil)
	DecodeFloat32(E8M0, nil, nil)
	ConvertBytes(I32, nil, I64, nil, 0)
}
