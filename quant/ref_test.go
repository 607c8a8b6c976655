package quant

import (
	"math"
	"sort"
)

// An independent reference, written from the specification in float64 and kept apart
// from the package's code paths: each group is quantized alone into its own
// ungrouped layout and the results are concatenated.

// refFormat lists a format's finite non-negative values and their codes.
type refFormat struct {
	vals  []float64
	codes []uint8
	max   float64
}

var refFormats = map[Format]*refFormat{E4M3: newRefFormat(E4M3), E5M2: newRefFormat(E5M2)}

func newRefFormat(f Format) *refFormat {
	r := &refFormat{}
	for c := 0; c < 0x80; c++ {
		var v float64
		if f == E4M3 {
			e, m := c>>3, c&7
			if e == 15 && m == 7 {
				continue // NaN
			}
			if e == 0 {
				v = float64(m) * math.Pow(2, -9)
			} else {
				v = (1 + float64(m)/8) * math.Pow(2, float64(e-7))
			}
		} else {
			e, m := c>>2, c&3
			if e == 31 {
				continue // Inf, NaN
			}
			if e == 0 {
				v = float64(m) * math.Pow(2, -16)
			} else {
				v = (1 + float64(m)/4) * math.Pow(2, float64(e-15))
			}
		}
		r.vals = append(r.vals, v)
		r.codes = append(r.codes, uint8(c))
	}
	r.max = r.vals[len(r.vals)-1]
	return r
}

// encode rounds v to the nearest value, ties to the even code, saturating to ±max.
func (r *refFormat) encode(v float64) uint8 {
	if math.IsNaN(v) {
		return 0x7f
	}
	sign := uint8(0)
	if math.Signbit(v) {
		sign = 0x80
	}
	a := math.Abs(v)
	if a >= r.max {
		return sign | r.codes[len(r.codes)-1]
	}
	i := sort.SearchFloat64s(r.vals, a) // vals[i-1] < a <= vals[i]
	if r.vals[i] == a {
		return sign | r.codes[i]
	}
	lo, hi := i-1, i
	switch dl, dh := a-r.vals[lo], r.vals[hi]-a; {
	case dl < dh:
		return sign | r.codes[lo]
	case dh < dl:
		return sign | r.codes[hi]
	case r.codes[lo]&1 == 0:
		return sign | r.codes[lo]
	}
	return sign | r.codes[hi]
}

// refCode is the scale rule on amax (≥ 0, NaN-free).
func refCode(amax float32, f Format, m ScaleMode) uint8 {
	if math.IsInf(float64(amax), 1) {
		return 254
	}
	if amax == 0 {
		return 0
	}
	var k int
	if m == FLOOR {
		_, e := math.Frexp(float64(amax)) // amax = frac·2^e, frac in [0.5, 1)
		k = e - 1 - f.emax()
	} else {
		p := float32(amax * float32(1/float64(f.Max()))) // fp32 product, as the spec says
		if math.IsInf(float64(p), 1) {
			return 254
		}
		if p == 0 {
			return 0
		}
		frac, e := math.Frexp(float64(p))
		k = e
		if frac == 0.5 {
			k = e - 1
		}
	}
	return uint8(min(max(k+127, 0), 254))
}

func refSwizzle(r, c, cols int) int {
	tile := (r/128)*(cols/4) + c/4
	return tile*512 + (r%32)*16 + ((r%128)/32)*4 + c%4
}

// refOut is a quantization's outputs as bytes; col holds Col, or ColT when transposed.
type refOut struct{ row, rowScale, col, colScale []byte }

// refQuantize quantizes x (m×k, row-major) with opt's format, mode, direction, swizzle
// and transposition, grouped by sizes (nil: one group), into a layout of ntiles tiles.
// Transposed, group g's row r is column 128·P_g + r of ColT [k, 32·ntiles], where
// 128·P_g counts the rows of the scale tiles of the groups before it.
func refQuantize(x []float32, m, k int, sizes []int32, opt Options, ntiles int) refOut {
	f := refFormats[opt.Format]
	nbk := (k + 31) / 32
	cp, kp := 4*((nbk+3)/4), 128*((k+127)/128)
	out := refOut{}
	if opt.Dir.rows() {
		out.row, out.rowScale = make([]byte, m*k), make([]byte, 32*ntiles*cp)
	}
	ld := 32 * ntiles // ColT's columns
	if opt.Dir.cols() {
		out.col, out.colScale = make([]byte, m*k), make([]byte, ntiles*kp)
		if opt.Transpose {
			out.col = make([]byte, k*ld)
		}
	}
	valid := true
	sum := 0
	for _, s := range sizes {
		if s < 0 {
			valid = false
		}
		sum += int(s)
	}
	if sizes != nil && sum != m {
		valid = false
	}
	if !valid {
		for _, b := range [][]byte{out.row, out.col} {
			for i := range b {
				b[i] = 0x7f
			}
		}
		for _, b := range [][]byte{out.rowScale, out.colScale} {
			for i := range b {
				b[i] = 0xff
			}
		}
		return out
	}
	if sizes == nil {
		sizes = []int32{int32(m)}
	}
	elem := func(v float32, code uint8) uint8 { return f.encode(float64(v) * math.Pow(2, float64(127-int(code)))) }
	amaxOf := func(v []float32) float32 {
		a := float32(0)
		for _, x := range v {
			if !math.IsNaN(float64(x)) && float32(math.Abs(float64(x))) > a {
				a = float32(math.Abs(float64(x)))
			}
		}
		return a
	}
	row0, srow, scol := 0, 0, 0 // source row, rowwise scale row, columnwise scale row of the group
	for _, s := range sizes {
		mg := int(s)
		rows := 128 * ((mg + 127) / 128) // the group's own rowwise scale rows
		crow := rows / 32                // and columnwise scale rows
		if out.row != nil {
			for r := range mg {
				for b := range nbk {
					blk := x[(row0+r)*k+32*b : (row0+r)*k+min(32*b+32, k)]
					c := refCode(amaxOf(blk), opt.Format, opt.Mode)
					off := (srow+r)*cp + b
					if opt.Swizzle {
						off = srow*cp + refSwizzle(r, b, cp)
					}
					out.rowScale[off] = c
					for i, v := range blk {
						out.row[(row0+r)*k+32*b+i] = elem(v, c)
					}
				}
			}
		}
		if out.col != nil {
			col := make([]float32, 0, 32)
			for bi := range (mg + 31) / 32 {
				for j := range k {
					col = col[:0]
					for r := 32 * bi; r < min(32*bi+32, mg); r++ {
						col = append(col, x[(row0+r)*k+j])
					}
					c := refCode(amaxOf(col), opt.Format, opt.Mode)
					off := (scol+bi)*kp + j
					if opt.Swizzle { // the transposed [kp, crow] matrix, swizzled
						off = scol*kp + refSwizzle(j, bi, crow)
					}
					out.colScale[off] = c
					for i, v := range col {
						if opt.Transpose {
							out.col[j*ld+32*scol+32*bi+i] = elem(v, c)
						} else {
							out.col[(row0+32*bi+i)*k+j] = elem(v, c)
						}
					}
				}
			}
		}
		row0 += mg
		srow += rows
		scol += crow
	}
	return out
}

// refMXWeights quantizes w (g×k×n, or g×n×k with nk) to MXFP8 weights from the rule:
// KMajor [g, n, k] in 1×32 blocks along k with KScale [g, ceil(k/128), n, 4], NMajor
// [g, k, n] in blocks along n with NScale [g, ceil(n/128), k, 4], scale slots past the
// last block 0.
func refMXWeights(w []float32, g, k, n int, nk bool, f Format, mode ScaleMode) (kmaj, kscale, nmaj, nscale []byte) {
	at := func(e, i, j int) float32 { // w_e[i][j], i along K, j along N
		if nk {
			return w[(e*n+j)*k+i]
		}
		return w[(e*k+i)*n+j]
	}
	rf := refFormats[f]
	// quant quantizes the lines of length ln of g·nl lines (value at(e, line, p) for
	// p < ln) into codes [g, nl, ln] and scales [g, ceil(ln/128), nl, 4].
	quant := func(nl, ln int, at func(e, line, p int) float32) ([]byte, []byte) {
		codes, scales := make([]byte, g*nl*ln), make([]byte, g*((ln+127)/128)*nl*4)
		for e := range g {
			for l := range nl {
				for b := 0; 32*b < ln; b++ {
					a := float32(0)
					for p := 32 * b; p < min(32*b+32, ln); p++ {
						if v := at(e, l, p); !math.IsNaN(float64(v)) && float32(math.Abs(float64(v))) > a {
							a = float32(math.Abs(float64(v)))
						}
					}
					c := refCode(a, f, mode)
					scales[((e*((ln+127)/128)+b/4)*nl+l)*4+b%4] = c
					for p := 32 * b; p < min(32*b+32, ln); p++ {
						codes[(e*nl+l)*ln+p] = rf.encode(float64(at(e, l, p)) * math.Pow(2, float64(127-int(c))))
					}
				}
			}
		}
		return codes, scales
	}
	kmaj, kscale = quant(n, k, func(e, l, p int) float32 { return at(e, p, l) })
	nmaj, nscale = quant(k, n, func(e, l, p int) float32 { return at(e, l, p) })
	return kmaj, kscale, nmaj, nscale
}
