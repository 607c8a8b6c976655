package quant

import (
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/google/go-cmp/cmp"
)

// transpose returns the k×m transpose of the m×k matrix v (elements of n bytes).
func transpose[T any](v []T, m, k int) []T {
	out := make([]T, len(v))
	for r := range m {
		for c := range k {
			out[c*m+r] = v[r*k+c]
		}
	}
	return out
}

// TestTranspose checks rowwise(X) == transpose(columnwise(Xᵀ)) and the converse, for
// data and scales, plain and swizzled.
func TestTranspose(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, sh := range [][2]int{{33, 64}, {130, 96}, {64, 200}, {5, 3}} {
			m, k := sh[0], sh[1]
			for _, swz := range []bool{false, true} {
				vals := testValues(dt.Rand(uint64(m*k)), m*k, true)
				x := dt.Must(device.FromFloat32(s, device.F32, vals, m, k))
				xt := dt.Must(device.FromFloat32(s, device.F32, transpose(vals, m, k), k, m))
				opt := Options{Dir: Both, Swizzle: swz}
				a, qa := quantBytes(t, s, x, opt)
				b, qb := quantBytes(t, s, xt, opt)
				if diff := cmp.Diff(a.row, transpose(b.col, k, m)); diff != "" {
					t.Errorf("%d×%d: Row(X) != Col(Xᵀ)ᵀ:\n%s", m, k, diff)
				}
				if diff := cmp.Diff(a.col, transpose(b.row, k, m)); diff != "" {
					t.Errorf("%d×%d: Col(X) != Row(Xᵀ)ᵀ:\n%s", m, k, diff)
				}
				rs, cs := qa.RowScale.Shape(), qb.ColScale.Shape()
				if swz {
					if diff := cmp.Diff(a.rowScale, b.colScale); diff != "" {
						t.Errorf("%d×%d swizzled: RowScale(X) != ColScale(Xᵀ):\n%s", m, k, diff)
					}
				} else if rs[0] != cs[1] || rs[1] != cs[0] {
					t.Errorf("%d×%d: RowScale %v, ColScale of the transpose %v", m, k, rs, cs)
				} else if diff := cmp.Diff(a.rowScale, transpose(b.colScale, cs[0], cs[1])); diff != "" {
					t.Errorf("%d×%d: RowScale(X) != ColScale(Xᵀ)ᵀ:\n%s", m, k, diff)
				}
				for _, q := range []*MXFP8{qa, qb} {
					q.Free()
				}
				x.Free()
				xt.Free()
			}
		}
	})
}

// TestGroupsConcat checks that grouped quantization equals quantizing each group alone
// and concatenating, byte for byte, with the scale regions the package doc gives.
func TestGroupsConcat(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, c := range []struct {
			k     int
			sizes []int32
		}{{64, []int32{0, 10, 23, 0}}, {96, []int32{31, 33, 96, 140}}, {288, []int32{2, 128, 0, 1}}, {40, []int32{7}}, {256, baseline.ZipfSizes(16, 1000, 3)}} {
			m := 0
			for _, n := range c.sizes {
				m += int(n)
			}
			for _, swz := range []bool{false, true} {
				vals := testValues(dt.Rand(uint64(m)), m*c.k, true)
				x := dt.Must(device.FromFloat32(s, device.BF16, vals, m, c.k))
				opt := Options{Dir: Both, Swizzle: swz, Format: E5M2, GroupSizes: groupTensor(t, s, c.sizes)}
				got, q := quantBytes(t, s, x, opt)
				opt.GroupSizes = nil
				var want refOut
				row0 := 0
				for _, n := range c.sizes {
					xg := dt.Must(x.Rows(row0, row0+int(n)))
					part, qg := quantBytes(t, s, xg, opt)
					want.row = append(want.row, part.row...)
					want.col = append(want.col, part.col...)
					want.rowScale = append(want.rowScale, part.rowScale...)
					want.colScale = append(want.colScale, part.colScale...)
					qg.Free()
					row0 += int(n)
				}
				want.rowScale = append(want.rowScale, make([]byte, len(got.rowScale)-len(want.rowScale))...)
				want.colScale = append(want.colScale, make([]byte, len(got.colScale)-len(want.colScale))...)
				if diff := diffOut(got, want); diff != "" {
					t.Errorf("sizes %v k %d swizzled %v: %s", c.sizes, c.k, swz, diff)
				}
				q.Free()
				x.Free()
			}
		}
	})
}

// TestScaleShift checks that scaling the input by 2^e shifts every scale code by e and
// keeps the elements, and that negating it flips the elements' signs only.
func TestScaleShift(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 64, 96
		for _, f := range []Format{E4M3, E5M2} {
			for _, mode := range []ScaleMode{RCEIL, FLOOR} {
				vals := testValues(dt.Rand(7), m*k, false)
				opt := Options{Format: f, Mode: mode, Dir: Both}
				x := dt.Must(device.FromFloat32(s, device.F32, vals, m, k))
				base, q := quantBytes(t, s, x, opt)
				q.Free()
				x.Free()
				for _, e := range []int{-5, 3, 17} {
					sv := make([]float32, len(vals))
					for i, v := range vals {
						sv[i] = v * float32(math.Pow(2, float64(e)))
					}
					x := dt.Must(device.FromFloat32(s, device.F32, sv, m, k))
					got, q := quantBytes(t, s, x, opt)
					want := base
					want.rowScale = shiftCodes(base.rowScale, e, q.g.nbk, q.g.cp)
					want.colScale = shiftCodes(base.colScale, e, q.g.k, q.g.kp)
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%v %v ×2^%d: %s", f, mode, e, diff)
					}
					q.Free()
					x.Free()
				}
				neg := make([]float32, len(vals))
				for i, v := range vals {
					neg[i] = -v
				}
				x = dt.Must(device.FromFloat32(s, device.F32, neg, m, k))
				got, q := quantBytes(t, s, x, opt)
				want := base
				want.row, want.col = flipSigns(base.row), flipSigns(base.col)
				if diff := diffOut(got, want); diff != "" {
					t.Errorf("%v %v negated: %s", f, mode, diff)
				}
				q.Free()
				x.Free()
			}
		}
	})
}

// shiftCodes adds e to the codes of the first used columns of each row of a plain
// scale matrix of cols columns.
func shiftCodes(b []byte, e, used, cols int) []byte {
	out := append([]byte(nil), b...)
	for i := range out {
		if i%cols < used && out[i] != 0 {
			out[i] = byte(int(out[i]) + e)
		}
	}
	return out
}

// flipSigns negates element codes, NaN (0x7F) excepted.
func flipSigns(b []byte) []byte {
	out := append([]byte(nil), b...)
	for i, c := range out {
		if c != 0x7f {
			out[i] = c ^ 0x80
		}
	}
	return out
}

// halfMax is the code of Max/2 (224 in E4M3, 28672 in E5M2).
func halfMax(f Format) uint8 { return f.encode(f.Max() / 2) }

// TestRequantize checks that dequantizing and quantizing again reproduces the values,
// and the codes except in RCEIL blocks whose largest element is exactly Max/2: those
// come back one scale lower (fp32(1/448)·224 rounds to exactly 1/2), same values.
func TestRequantize(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 96, 160
		for _, f := range []Format{E4M3, E5M2} {
			for _, mode := range []ScaleMode{RCEIL, FLOOR} {
				r := dt.Rand(11)
				vals := testValues(r, m*k, false)
				for i := range vals { // NaNs, and blocks whose amax rounds to Max/2
					switch r.IntN(50) {
					case 0:
						vals[i] = float32(math.NaN())
					case 1:
						vals[i] = float32(math.Copysign(float64(f.Max()/2)*(1+1.0/256)*math.Pow(2, float64(r.IntN(20)-10)), float64(vals[i])))
					}
				}
				opt := Options{Format: f, Mode: mode, Dir: Rowwise}
				x := dt.Must(device.FromFloat32(s, device.F32, vals, m, k))
				q := dt.Must(Quantize(s, x, opt))
				y := dt.Must(s.Alloc(device.F32, m, k))
				dt.NoErr(t, Dequantize(s, y, q, Rowwise))
				q2 := dt.Must(Quantize(s, y, opt))
				y2 := dt.Must(s.Alloc(device.F32, m, k))
				dt.NoErr(t, Dequantize(s, y2, q2, Rowwise))
				v1, v2 := dt.Must(y.Float32s(s)), dt.Must(y2.Float32s(s))
				for i := range v1 {
					if math.Float32bits(v1[i]) != math.Float32bits(v2[i]) {
						t.Fatalf("%v %v: element %d: dq(q(dq(q))) = %g, dq(q) = %g", f, mode, i, v2[i], v1[i])
					}
				}
				e1, e2 := download(t, s, q.Row), download(t, s, q2.Row)
				s1, s2 := download(t, s, q.RowScale), download(t, s, q2.RowScale)
				shifted := 0
				for row := range m {
					for b := range q.g.nbk {
						blk := e1[row*k+32*b : row*k+min(32*b+32, k)]
						mx := uint8(0)
						for _, c := range blk {
							if c&0x7f != 0x7f && c&0x7f > mx {
								mx = c & 0x7f
							}
						}
						exempt := mode == RCEIL && mx == halfMax(f)
						same := s1[row*q.g.cp+b] == s2[row*q.g.cp+b] && string(blk) == string(e2[row*k+32*b:row*k+min(32*b+32, k)])
						if exempt {
							shifted++
							if s2[row*q.g.cp+b] != s1[row*q.g.cp+b]-1 {
								t.Errorf("%v %v: row %d block %d (largest element Max/2): scale %d → %d, want one lower", f, mode, row, b, s1[row*q.g.cp+b], s2[row*q.g.cp+b])
							}
						} else if !same {
							t.Errorf("%v %v: row %d block %d: q(dq(q)) != q", f, mode, row, b)
						}
					}
				}
				if mode == RCEIL && shifted == 0 {
					t.Errorf("%v: no block with largest element Max/2 was exercised", f)
				}
				for _, z := range []*device.Tensor{x, y, y2} {
					z.Free()
				}
				q.Free()
				q2.Free()
			}
		}
	})
}

// TestNaNInf checks the NaN and infinity policy in both directions and formats.
func TestNaNInf(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	type block struct {
		name  string
		vals  []float32 // the rest of the 32 are 1.5
		code  uint8     // expected scale (E4M3, RCEIL)
		first []uint8   // expected leading elements (E4M3)
	}
	blocks := []block{
		{"NaN among finite", []float32{nan, 448, -nan}, 127, []uint8{0x7f, 0x7e, 0x7f, 0x3c}},
		{"all NaN", filled(nan), 0, []uint8{0x7f, 0x7f}},
		{"+Inf", []float32{inf, 2}, 254, []uint8{0x7e, 0x00}},
		{"-Inf and NaN", []float32{-inf, nan}, 254, []uint8{0xfe, 0x7f}},
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, v := range variants(d) {
			restore := v.use()
			for _, b := range blocks {
				vals := filled(1.5)
				copy(vals, b.vals)
				for _, dir := range []Direction{Rowwise, Columnwise} {
					m, k := 1, 32
					if dir == Columnwise {
						m, k = 32, 1
					}
					x := dt.Must(device.FromFloat32(s, device.BF16, vals, m, k))
					got, q := quantBytes(t, s, x, Options{Dir: dir})
					data, sc := got.row, got.rowScale
					if dir == Columnwise {
						data, sc = got.col, got.colScale
					}
					if sc[0] != b.code || string(data[:len(b.first)]) != string(b.first) {
						t.Errorf("%s %s %v: scale %d elements % x, want %d % x", v.name, b.name, dir, sc[0], data[:len(b.first)], b.code, b.first)
					}
					if i := strings.IndexByte(string(sc), 0xff); i >= 0 {
						t.Errorf("%s %s %v: scale byte %d is 0xFF", v.name, b.name, dir, i)
					}
					y := dt.Must(s.Alloc(device.F32, m, k))
					dt.NoErr(t, Dequantize(s, y, q, dir))
					out := dt.Must(y.Float32s(s))
					for i, in := range vals {
						switch {
						case math.IsNaN(float64(in)) && !math.IsNaN(float64(out[i])):
							t.Errorf("%s %s %v: NaN input %d dequantized to %g", v.name, b.name, dir, i, out[i])
						case math.IsInf(float64(in), 0) && out[i] != in:
							t.Errorf("%s %s %v: %g input %d dequantized to %g", v.name, b.name, dir, in, i, out[i])
						}
					}
					y.Free()
					q.Free()
					x.Free()
				}
			}
			restore()
		}
	})
}

func filled(v float32) []float32 {
	b := make([]float32, 32)
	for i := range b {
		b[i] = v
	}
	return b
}

// TestInvalidGroups checks that bad group sizes are recorded in q.Status and turn every
// output (Col or ColT) into NaN, and that a later valid quantization into the same q
// recovers.
func TestInvalidGroups(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 33, 64
		x := dt.Must(device.FromFloat32(s, device.BF16, testValues(dt.Rand(3), m*k, false), m, k))
		for ci, c := range []struct {
			sizes []int32
			want  string
		}{{[]int32{-1, 34}, "negative"}, {[]int32{30, 4}, "sum"}, {[]int32{10, 10, 10}, "sum"}, {[]int32{-3, 36}, "negative"}} {
			for _, v := range variants(d) {
				restore := v.use()
				opt := Options{Dir: Both, Transpose: ci >= 2, GroupSizes: groupTensor(t, s, c.sizes)}
				got, q := quantBytes(t, s, x, opt)
				restore()
				if err := q.Status.Check(s); err == nil || !strings.Contains(err.Error(), c.want) {
					t.Errorf("%s sizes %v: Status.Check() = %v, want an error about %q", v.name, c.sizes, err, c.want)
				}
				for name, b := range map[string][]byte{"Row": got.row, "Col or ColT": got.col} {
					if i := strings.IndexFunc(string(b), func(r rune) bool { return r != 0x7f }); i >= 0 {
						t.Errorf("%s sizes %v: %s byte %d is %#x, want 0x7F", v.name, c.sizes, name, i, b[i])
					}
				}
				for name, b := range map[string][]byte{"RowScale": got.rowScale, "ColScale": got.colScale} {
					for i, c := range b {
						if c != 0xff {
							t.Errorf("%s: %s byte %d is %#x, want 0xFF", v.name, name, i, c)
							break
						}
					}
				}
				y := dt.Must(s.Alloc(device.F32, m, k))
				dt.NoErr(t, Dequantize(s, y, q, Columnwise))
				for i, f := range dt.Must(y.Float32s(s)) {
					if !math.IsNaN(float64(f)) {
						t.Fatalf("%s sizes %v: dequantized element %d is %g, want NaN", v.name, c.sizes, i, f)
					}
				}
				qw := dt.Must(Alloc(s, m, k, opt)) // a fresh q of the same layout
				poison(t, s, qw)
				opt.GroupSizes = groupTensor(t, s, []int32{13, 20})
				dt.NoErr(t, q.Status.Reset(s))
				dt.NoErr(t, QuantizeInto(s, q, x, opt))
				dt.NoErr(t, q.Status.Check(s))
				dt.NoErr(t, QuantizeInto(s, qw, x, opt))
				if diff := diffOut(outBytes(t, s, q), outBytes(t, s, qw)); diff != "" {
					t.Errorf("%s sizes %v: valid sizes after invalid ones, against a fresh q: %s", v.name, c.sizes, diff)
				}
				qw.Free()
				y.Free()
				q.Free()
			}
		}
		x.Free()
	})
}

// TestGraphCapture captures a grouped quantization (plain and transposed) and checks that
// replays match the direct result: nothing in it waits for the host.
func TestGraphCapture(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		const m, k = 300, 96
		x := dt.Must(device.FromFloat32(s, device.BF16, testValues(dt.Rand(9), m*k, true), m, k))
		for _, tr := range []bool{false, true} {
			opt := Options{Dir: Both, Swizzle: !tr, Transpose: tr, GroupSizes: groupTensor(t, s, []int32{31, 33, 96, 140})}
			want, _ := quantBytes(t, s, x, opt)
			q := dt.Must(Alloc(s, m, k, opt))
			poison(t, s, q)
			dt.NoErr(t, s.BeginCapture())
			dt.NoErr(t, QuantizeInto(s, q, x, opt))
			g, err := s.EndCapture()
			dt.NoErr(t, err)
			for range 2 {
				dt.NoErr(t, g.Launch(s))
				if diff := diffOut(outBytes(t, s, q), want); diff != "" {
					t.Fatalf("transposed %v: graph replay: %s", tr, diff)
				}
			}
			g.Close()
			q.Free()
		}
	})
}

func TestErrors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x := dt.Must(s.Alloc(device.BF16, 64, 64))
		x3 := dt.Must(s.Alloc(device.BF16, 2, 32, 32))
		xi := dt.Must(s.Alloc(device.I32, 64, 64))
		gf := dt.Must(s.Alloc(device.F32, 2))
		g2 := dt.Must(s.Alloc(device.I32, 2, 1))
		g0 := dt.Must(s.Alloc(device.I32, 0))
		q := dt.Must(Quantize(s, x, Options{}))
		y := dt.Must(s.Alloc(device.F32, 64, 64))
		for name, err := range map[string]error{
			"rank 3 source":         errOf(Quantize(s, x3, Options{})),
			"int source":            errOf(Quantize(s, xi, Options{})),
			"bad format":            errOf(Quantize(s, x, Options{Format: 7})),
			"bad mode":              errOf(Quantize(s, x, Options{Mode: 5})),
			"bad direction":         errOf(Quantize(s, x, Options{Dir: 9})),
			"f32 group sizes":       errOf(Quantize(s, x, Options{GroupSizes: gf})),
			"rank 2 group sizes":    errOf(Quantize(s, x, Options{GroupSizes: g2})),
			"no groups for rows":    errOf(Quantize(s, x, Options{GroupSizes: g0})),
			"negative shape":        errOf(Alloc(s, -1, 4, Options{})),
			"into other shape":      QuantizeInto(s, q, x3, Options{}),
			"into other format":     QuantizeInto(s, q, x, Options{Format: E5M2}),
			"into other direction":  QuantizeInto(s, q, x, Options{Dir: Both}),
			"into other swizzle":    QuantizeInto(s, q, x, Options{Swizzle: true}),
			"into other grouping":   QuantizeInto(s, q, x, Options{GroupSizes: gf}),
			"nil q":                 QuantizeInto(s, nil, x, Options{}),
			"dequantize both":       Dequantize(s, y, q, Both),
			"dequantize missing":    Dequantize(s, y, q, Columnwise),
			"dequantize into int":   Dequantize(s, xi, q, Rowwise),
			"dequantize into shape": Dequantize(s, x3, q, Rowwise),
			"dequantize nil":        Dequantize(s, y, nil, Rowwise),
		} {
			if err == nil {
				t.Errorf("%s: no error", name)
			} else {
				t.Logf("%s: %v", name, err)
			}
		}
		if d.IsCUDA() { // tensors of another device
			c := device.CPU().Stream()
			xc := dt.Must(c.Alloc(device.BF16, 64, 64))
			if _, err := Quantize(s, xc, Options{}); err == nil {
				t.Error("source on the CPU, stream on the GPU: no error")
			}
			if err := Dequantize(c, xc, q, Rowwise); err == nil {
				t.Error("q on the GPU, stream on the CPU: no error")
			}
		}
		q.Free()
		x.Free()
	})
}

func errOf[T any](_ T, err error) error { return err }

// TestSwizzleSpec checks the swizzle against the specification's examples (256×8).
func TestSwizzleSpec(t *testing.T) {
	got := map[[2]int]int{}
	want := map[[2]int]int{{1, 0}: 16, {32, 0}: 4, {0, 1}: 1, {128, 0}: 1024, {255, 7}: 2047}
	for rc := range want {
		got[rc] = swizzle(rc[0], rc[1], 8)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Error(diff)
	}
	seen := make([]bool, 256*8) // a bijection onto [0, 2048)
	for r := range 256 {
		for c := range 8 {
			seen[swizzle(r, c, 8)] = true
		}
	}
	if i := sort.Search(len(seen), func(i int) bool { return !seen[i] }); i < len(seen) && !seen[i] {
		t.Errorf("offset %d not hit", i)
	}
}

// TestScaleCode checks the scale rules against the reference on random and edge amax.
func TestScaleCode(t *testing.T) {
	r := dt.Rand(1)
	var amaxes []float32
	for e := -149; e <= 127; e++ {
		p := math.Ldexp(1, e)
		for _, m := range []float64{1, 1.0000001, 1.5, 1.75, 1.9999999} {
			amaxes = append(amaxes, float32(p*m))
		}
	}
	for range 10000 {
		amaxes = append(amaxes, math.Float32frombits(r.Uint32()&0x7fffffff))
	}
	amaxes = append(amaxes, 0, float32(math.Inf(1)), math.MaxFloat32, 448, 57344, 480, 224)
	for _, a := range amaxes {
		if math.IsNaN(float64(a)) {
			continue
		}
		for _, f := range []Format{E4M3, E5M2} {
			for _, m := range []ScaleMode{RCEIL, FLOOR} {
				if got, want := scaleCode(a, f, m), refCode(a, f, m); got != want {
					t.Errorf("scaleCode(%g, %v, %v) = %d, want %d", a, f, m, got, want)
				}
			}
		}
	}
}

// TestEncodeExhaustive checks the element conversion of every float32 of a random
// sample and of every bf16 value against the reference rounding.
func TestEncodeExhaustive(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 3))
	check := func(x float32) {
		for _, f := range []Format{E4M3, E5M2} {
			if got, want := f.encode(x), refFormats[f].encode(float64(x)); got != want {
				t.Fatalf("%v encode(%g = %#08x) = %#02x, want %#02x", f, x, math.Float32bits(x), got, want)
			}
		}
	}
	for i := range 65536 {
		check(device.BF16ToFloat32(uint16(i)))
	}
	for range 200000 {
		check(math.Float32frombits(r.Uint32()))
	}
}
