package quant

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// Format is the element format of an MXFP8 tensor.
type Format int

// Element formats.
const (
	E4M3 Format = iota // OCP FP8 E4M3: max ±448, NaN 0x7F/0xFF, no infinity (the default)
	E5M2               // OCP FP8 E5M2: max ±57344, has ±Inf
)

// DType returns the element dtype: device.E4M3 or device.E5M2.
func (f Format) DType() device.DType {
	if f == E5M2 {
		return device.E5M2
	}
	return device.E4M3
}

// Max returns the largest finite element value: 448 for E4M3, 57344 for E5M2.
func (f Format) Max() float32 {
	if f == E5M2 {
		return 57344
	}
	return 448
}

// String returns "e4m3" or "e5m2".
func (f Format) String() string {
	switch f {
	case E4M3:
		return "e4m3"
	case E5M2:
		return "e5m2"
	}
	return fmt.Sprintf("Format(%d)", int(f))
}

func (f Format) valid() bool { return f == E4M3 || f == E5M2 }

// emax is the exponent of the format's largest power of two (the OCP rule's emax_elem).
func (f Format) emax() int {
	if f == E5M2 {
		return 15
	}
	return 8
}

// rcp is fp32(1/Max), the factor of the RCEIL rule.
func (f Format) rcp() float32 {
	if f == E5M2 {
		return float32(1.0 / 57344)
	}
	return float32(1.0 / 448)
}

// encode converts x to the format: nearest, ties to even, saturating to ±Max
// (±Inf included), NaN to 0x7F, the sign of zero kept.
func (f Format) encode(x float32) uint8 {
	if f == E5M2 {
		return device.E5M2FromFloat32(x)
	}
	return device.E4M3FromFloat32(x)
}

// decode returns the exact value of code c (a quiet NaN for NaN codes).
func (f Format) decode(c uint8) float32 {
	if f == E5M2 {
		return device.E5M2ToFloat32(c)
	}
	return device.E4M3ToFloat32(c)
}

// decodeTabs holds decode of every code: E4M3's, then E5M2's.
var decodeTabs = func() (t [2][256]float32) {
	for c := range 256 {
		t[0][c], t[1][c] = device.E4M3ToFloat32(uint8(c)), device.E5M2ToFloat32(uint8(c))
	}
	return t
}()

// decodeTable returns decode of every code of f, indexed by the code.
func (f Format) decodeTable() *[256]float32 {
	if f == E5M2 {
		return &decodeTabs[1]
	}
	return &decodeTabs[0]
}

// ScaleMode is the rule that picks a block's E8M0 scale from its largest magnitude.
type ScaleMode int

// Scale rules.
const (
	// RCEIL, the default, is the rule of Transformer Engine and cuBLAS: the scale is
	// amax·fp32(1/Max) rounded up to a power of two, so no element clips.
	RCEIL ScaleMode = iota
	// FLOOR is the OCP MX v1.0 rule: 2^(floor(log2 amax) − emax), emax 8 for E4M3 and
	// 15 for E5M2; elements whose magnitude exceeds Max after scaling saturate.
	FLOOR
)

// String returns "rceil" or "floor".
func (m ScaleMode) String() string {
	switch m {
	case RCEIL:
		return "rceil"
	case FLOOR:
		return "floor"
	}
	return fmt.Sprintf("ScaleMode(%d)", int(m))
}

func (m ScaleMode) valid() bool { return m == RCEIL || m == FLOOR }

// Direction says which blocks Quantize forms: rows of 1×32, columns of 32×1, or both.
type Direction int

// Directions.
const (
	Rowwise    Direction = iota // 1×32 blocks along K (forward operands); the default
	Columnwise                  // 32×1 blocks along M (weight-gradient operands)
	Both                        // both, from one read of the source
)

// String returns "rowwise", "columnwise" or "both".
func (d Direction) String() string {
	switch d {
	case Rowwise:
		return "rowwise"
	case Columnwise:
		return "columnwise"
	case Both:
		return "both"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

func (d Direction) valid() bool { return d >= Rowwise && d <= Both }
func (d Direction) rows() bool  { return d == Rowwise || d == Both }
func (d Direction) cols() bool  { return d == Columnwise || d == Both }

// scaleCode returns the E8M0 code of the scale of a block whose largest magnitude is
// amax (≥ 0, not NaN: NaN elements are left out of amax). An infinite amax gives 254.
// Both rules saturate to 0..254; an all-zero block gives 0.
func scaleCode(amax float32, f Format, m ScaleMode) uint8 {
	if m == FLOOR {
		e := int(math.Float32bits(amax) >> 23)
		if e >= 255 {
			return 254
		}
		return uint8(max(e-f.emax(), 0))
	}
	// The explicit conversion rounds the product to float32 (no fused operation).
	b := math.Float32bits(float32(amax * f.rcp()))
	e, mant := b>>23, b&0x7fffff
	switch {
	case e >= 255: // Inf
		return 254
	case e == 0: // zero or subnormal: 2^-127 (code 0) holds everything up to it
		if mant > 0x400000 {
			return 1
		}
		return 0
	case mant != 0 && e < 254:
		e++
	}
	return uint8(e)
}

// invScale returns 2^(127−c), the exact factor that maps a block's values onto its
// elements, for c in 0..254 (2^-127 is a float32 subnormal).
func invScale(c uint8) float32 {
	if c == 254 {
		return math.Float32frombits(0x00400000)
	}
	return math.Float32frombits(uint32(254-c) << 23)
}

// nanF32 is the NaN Dequantize writes.
var nanF32 = math.Float32frombits(0x7fc00000)

// dequantValue returns element e of format f under scale code c, in float32: exact
// unless the product overflows (±Inf) or falls below float32's subnormals; NaN codes
// and the NaN scale 0xFF give the quiet NaN 0x7FC00000.
func dequantValue(f Format, e, c uint8) float32 {
	v := float32(f.decode(e) * device.E8M0ToFloat32(c))
	if v != v {
		return nanF32
	}
	return v
}

// swizzle returns the byte offset of scale (r, c) in the swizzled layout of a scale
// matrix with cols columns (a multiple of 4) and a multiple of 128 rows: 128×4 tiles of
// 512 bytes ordered row-major by (r/128, c/4); inside a tile
// (r%32)·16 + ((r%128)/32)·4 + c%4.
func swizzle(r, c, cols int) int {
	return ((r/128)*(cols/4)+c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4
}
