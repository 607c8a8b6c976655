package quant

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
)

// An independent reference of the blockwise recipe, written from its rules and kept
// apart from the package's code paths: scales through math.Frexp, elements through the
// value tables of refFormats, each group quantized alone.

// refBlockScale is the scale rule on amax (≥ 0, NaN-free).
func refBlockScale(amax float32, f Format, k ScaleKind) float32 {
	if amax == 0 {
		return 1
	}
	if math.IsInf(float64(amax), 1) {
		return amax
	}
	v := amax / f.Max() // one float32 division, as the rule says
	if k == ScaleF32 {
		if v == 0 {
			return 1
		}
		return v
	}
	e := -126
	if v > 0 {
		frac, exp := math.Frexp(float64(v)) // v = frac·2^exp, frac in [0.5, 1)
		e = exp
		if frac == 0.5 {
			e = exp - 1
		}
	}
	return float32(math.Ldexp(1, min(max(e, -126), 127)))
}

func refAmax(v []float32) float32 {
	a := 0.0
	for _, x := range v {
		if !math.IsNaN(float64(x)) {
			a = math.Max(a, math.Abs(float64(x)))
		}
	}
	return float32(a)
}

// refElem is the code of v in a block of scale s: the float32 quotient, encoded.
func refElem(f Format, v, s float32) uint8 { return refFormats[f].encode(float64(v / s)) }

// refValue is the value of code c of format f, NaN for the NaN codes.
func refValue(f Format, c uint8) float64 {
	if f == E4M3 && c&0x7f == 0x7f || f == E5M2 && c&0x7f > 0x7c {
		return math.NaN()
	}
	v := math.Inf(1)
	if f == E4M3 || c&0x7f != 0x7c {
		rf := refFormats[f]
		for i, code := range rf.codes {
			if code == c&0x7f {
				v = rf.vals[i]
			}
		}
	}
	if c&0x80 != 0 {
		return -v
	}
	return v
}

// refDequant is decode(c)·s in float32, NaN as 0x7FC00000.
func refDequant(f Format, c uint8, s float32) float32 {
	v := float32(refValue(f, c)) * s
	if v != v {
		return math.Float32frombits(0x7fc00000)
	}
	return v
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

// refBlockwise quantizes x (m×k, row-major) with opt's format, scale kind and direction,
// grouped by sizes (nil: no groups; invalid sizes: the ungrouped blocks) with room for g
// groups. Scales are returned as their float32 bytes.
func refBlockwise(x []float32, m, k int, sizes []int32, groups int, opt BlockOptions) refOut {
	nb, mr := (k+127)/128, 4*((m+3)/4)
	ntiles := (m + 127) / 128
	if sizes != nil {
		ntiles = m/128 + min(groups, m)
	}
	mp := 128 * ntiles
	valid := true
	sum := 0
	for _, s := range sizes {
		valid = valid && s >= 0
		sum += int(s)
	}
	if sizes == nil || !valid || sum != m {
		sizes = []int32{int32(m)}
	}
	out := refOut{}
	if opt.Dir.rows() {
		out.row = make([]byte, m*k)
		sc := make([]float32, nb*mr)
		for r := range m {
			for b := range nb {
				blk := x[r*k+128*b : r*k+min(128*b+128, k)]
				s := refBlockScale(refAmax(blk), opt.Format, opt.Scale)
				sc[b*mr+r] = s
				for i, v := range blk {
					out.row[r*k+128*b+i] = refElem(opt.Format, v, s)
				}
			}
		}
		out.rowScale = f32Bytes(sc)
	}
	if opt.Dir.cols() {
		out.col = make([]byte, k*mp)
		sc := make([]float32, ntiles*k)
		row0, t := 0, 0
		for _, mg := range sizes {
			for b := 0; b < int(mg); b += 128 {
				n := min(int(mg)-b, 128)
				for j := range k {
					col := make([]float32, n)
					for i := range col {
						col[i] = x[(row0+b+i)*k+j]
					}
					s := refBlockScale(refAmax(col), opt.Format, opt.Scale)
					sc[t*k+j] = s
					for i, v := range col {
						out.col[j*mp+128*t+i] = refElem(opt.Format, v, s)
					}
				}
				t++
			}
			row0 += int(mg)
		}
		out.colScale = f32Bytes(sc)
	}
	return out
}

// refWeights quantizes w (g×k×n, or g×n×k with nk) in 128×128 blocks into KMajor,
// NMajor and the scales' bytes.
func refWeights(w []float32, g, k, n int, nk bool, f Format, kind ScaleKind) (kmaj, nmaj, scales []byte) {
	at := func(e, i, j int) float32 { // w_e[i][j], i along K, j along N
		if nk {
			return w[(e*n+j)*k+i]
		}
		return w[(e*k+i)*n+j]
	}
	nkb, nnb := (k+127)/128, (n+127)/128
	kmaj, nmaj = make([]byte, g*k*n), make([]byte, g*k*n)
	sc := make([]float32, g*nkb*nnb)
	for e := range g {
		for bi := range nkb {
			for bj := range nnb {
				var blk []float32
				for i := 128 * bi; i < min(128*bi+128, k); i++ {
					for j := 128 * bj; j < min(128*bj+128, n); j++ {
						blk = append(blk, at(e, i, j))
					}
				}
				s := refBlockScale(refAmax(blk), f, kind)
				sc[(e*nkb+bi)*nnb+bj] = s
				for i := 128 * bi; i < min(128*bi+128, k); i++ {
					for j := 128 * bj; j < min(128*bj+128, n); j++ {
						c := refElem(f, at(e, i, j), s)
						kmaj[(e*n+j)*k+i] = c
						nmaj[(e*k+i)*n+j] = c
					}
				}
			}
		}
	}
	return kmaj, nmaj, f32Bytes(sc)
}

// bwValues returns n values in rows of k: blocks of 128 along each row of normal values
// of a random magnitude (2^±20, a sixteenth of them 2^-140 to 2^109), some all-zero
// blocks, and with specials, rare NaN, ±Inf, −0, subnormals and random bits.
func bwValues(r *rand.Rand, n, k int, specials bool) []float32 {
	v := make([]float32, n)
	scale := 1.0
	for i := range v {
		if i%128 == 0 || (k > 0 && i%k == 0) {
			switch e := r.IntN(16); {
			case e == 0:
				scale = math.Ldexp(1, r.IntN(250)-140)
			case e == 1:
				scale = 0
			default:
				scale = math.Ldexp(1, r.IntN(41)-20)
			}
		}
		v[i] = float32(r.NormFloat64() * scale)
		if !specials {
			continue
		}
		switch r.IntN(1024) {
		case 0:
			v[i] = float32(math.NaN())
		case 1:
			v[i] = float32(math.Inf(1 - 2*r.IntN(2)))
		case 2, 3:
			v[i] = float32(math.Copysign(0, -1))
		case 4, 5:
			v[i] = math.Float32frombits(r.Uint32() & 0x807fffff)
		case 6:
			v[i] = math.Float32frombits(r.Uint32())
		}
	}
	return v
}
