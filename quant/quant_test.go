package quant

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/baseline"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, kernels, softKernels) }

// variant is one way to run quantization on a device: on a GPU the hardware or the
// software element conversion, each with the fast or the general kernel.
type variant struct {
	name    string
	prog    *device.Program
	general bool
}

func variants(d *device.Device) []variant {
	if !d.IsCUDA() {
		return []variant{{name: "cpu"}}
	}
	return []variant{{"hw", kernels, false}, {"hw-general", kernels, true}, {"sw", softKernels, false}, {"sw-general", softKernels, true}}
}

// use selects v's kernels until the returned function is called.
func (v variant) use() func() {
	if v.prog == nil {
		return func() {}
	}
	p, g := program, forceGeneral
	program, forceGeneral = v.prog, v.general
	return func() { program, forceGeneral = p, g }
}

// download returns t's bytes (nil for nil).
func download(t testing.TB, s *device.Stream, x *device.Tensor) []byte {
	t.Helper()
	if x == nil {
		return nil
	}
	b := make([]byte, x.Bytes())
	dt.NoErr(t, x.CopyToHost(s, b))
	return b
}

// quantBytes quantizes x into poisoned outputs and returns them (ColT as col when
// transposed).
func quantBytes(t testing.TB, s *device.Stream, x *device.Tensor, opt Options) (refOut, *MXFP8) {
	t.Helper()
	q := dt.Must(Alloc(s, x.Dim(0), x.Dim(1), opt))
	poison(t, s, q)
	dt.NoErr(t, QuantizeInto(s, q, x, opt))
	return outBytes(t, s, q), q
}

// outBytes returns q's outputs (ColT as col when q is transposed).
func outBytes(t testing.TB, s *device.Stream, q *MXFP8) refOut {
	t.Helper()
	col := q.Col
	if q.Transposed {
		col = q.ColT
	}
	return refOut{download(t, s, q.Row), download(t, s, q.RowScale), download(t, s, col), download(t, s, q.ColScale)}
}

// poison fills q's outputs with 0xFF.
func poison(t testing.TB, s *device.Stream, q *MXFP8) {
	t.Helper()
	for _, x := range []*device.Tensor{q.Row, q.RowScale, q.Col, q.ColT, q.ColScale} {
		if x != nil {
			dt.Poison(t, s, x)
		}
	}
}

// diffOut describes the first difference between two outputs, or returns "".
func diffOut(got, want refOut) string {
	for _, c := range []struct {
		name      string
		got, want []byte
	}{{"Row", got.row, want.row}, {"RowScale", got.rowScale, want.rowScale}, {"Col", got.col, want.col}, {"ColScale", got.colScale, want.colScale}} {
		if len(c.got) != len(c.want) {
			return fmt.Sprintf("%s: %d bytes, want %d", c.name, len(c.got), len(c.want))
		}
		for i := range c.got {
			if c.got[i] != c.want[i] {
				n := 0
				for j := i; j < len(c.got); j++ {
					if c.got[j] != c.want[j] {
						n++
					}
				}
				return fmt.Sprintf("%s: byte %d of %d is %#02x, want %#02x (%d bytes differ)", c.name, i, len(c.got), c.got[i], c.want[i], n)
			}
		}
	}
	return ""
}

// testValues returns n values: blocks of normal values of random magnitude, zeros,
// and with specials, NaN, ±Inf, ±0 and float32 subnormals sprinkled in.
func testValues(r *rand.Rand, n int, specials bool) []float32 {
	v := make([]float32, n)
	scale := 1.0
	for i := range v {
		if i%32 == 0 {
			scale = math.Pow(2, float64(r.IntN(80)-40))
		}
		v[i] = float32(r.NormFloat64() * scale)
		if !specials {
			continue
		}
		switch k := r.IntN(64); k {
		case 0:
			v[i] = float32(math.NaN())
		case 1:
			v[i] = float32(math.Inf(1 - 2*r.IntN(2)))
		case 2:
			v[i] = 0
		case 3:
			v[i] = float32(math.Copysign(0, -1))
		case 4:
			v[i] = math.Float32frombits(r.Uint32() & 0x807fffff)
		case 5:
			v[i] = math.Float32frombits(r.Uint32())
		}
	}
	return v
}

// upload makes x from vals and returns it with its exact values (bf16 rounds).
func upload(t testing.TB, s *device.Stream, in device.DType, vals []float32, m, k int) (*device.Tensor, []float32) {
	t.Helper()
	x := dt.Must(device.FromFloat32(s, in, vals, m, k))
	return x, dt.Must(x.Float32s(s))
}

func groupTensor(t testing.TB, s *device.Stream, sizes []int32) *device.Tensor {
	t.Helper()
	if sizes == nil {
		return nil
	}
	return dt.Must(device.FromSlice(s, device.I32, sizes, len(sizes)))
}

type quantCase struct {
	m, k     int
	sizes    []int32 // nil: no groups
	specials bool
}

var quantCases = []quantCase{
	{1, 1, nil, false}, {3, 7, nil, true}, {33, 64, nil, true}, {64, 96, nil, false},
	{100, 256, nil, true}, {130, 288, nil, false}, {37, 300, nil, true}, {257, 520, nil, false},
	{0, 64, nil, false}, {40, 0, nil, false},
	{33, 64, []int32{0, 10, 23, 0}, true}, {33, 64, []int32{1, 32}, false},
	{100, 256, []int32{50, 0, 50}, false}, {100, 256, []int32{1, 1, 98}, true},
	{130, 288, []int32{2, 128}, false}, {130, 288, []int32{64, 64, 2}, true}, {130, 288, []int32{0, 0, 130, 0}, false},
	{300, 96, []int32{31, 33, 96, 140}, true}, {257, 520, []int32{0, 257}, false}, {70, 33, []int32{35, 35}, true},
	{0, 64, []int32{0, 0}, false},
}

// optionCombos lists every Format, ScaleMode, Direction, Swizzle and, for columnwise
// directions, Transpose.
func optionCombos() []Options {
	var os []Options
	for _, f := range []Format{E4M3, E5M2} {
		for _, m := range []ScaleMode{RCEIL, FLOOR} {
			for _, d := range []Direction{Rowwise, Columnwise, Both} {
				for _, swz := range []bool{false, true} {
					for _, tr := range []bool{false, true} {
						if tr && !d.cols() {
							continue
						}
						os = append(os, Options{Format: f, Mode: m, Dir: d, Swizzle: swz, Transpose: tr})
					}
				}
			}
		}
	}
	return os
}

// TestQuantize checks Quantize against the independent reference on every device and
// kernel variant: every option combination over the case table (each case takes a
// rotating third of them, so every combination meets several shapes and groupings).
func TestQuantize(t *testing.T) {
	combos := optionCombos()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range quantCases {
			for oi, opt := range combos {
				if (oi+ci)%3 != 0 {
					continue
				}
				in := []device.DType{device.BF16, device.F32}[(oi/3+ci)%2]
				r := dt.Rand(uint64(1000*ci + oi))
				x, vals := upload(t, s, in, testValues(r, c.m*c.k, c.specials), c.m, c.k)
				opt.GroupSizes = groupTensor(t, s, c.sizes)
				q0 := dt.Must(Alloc(s, c.m, c.k, opt))
				want := refQuantize(vals, c.m, c.k, c.sizes, opt, q0.Tiles())
				q0.Free()
				for _, v := range variants(d) {
					restore := v.use()
					got, q := quantBytes(t, s, x, opt)
					restore()
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%s: %d×%d %v groups %v %+v: %s", v.name, c.m, c.k, in, c.sizes, opt, diff)
					}
					if q.Status != nil {
						dt.NoErr(t, q.Status.Check(s))
					}
					q.Free()
				}
				x.Free()
				if opt.GroupSizes != nil {
					opt.GroupSizes.Free()
				}
			}
		}
	})
}

// TestQuantizeLargeGPU compares the GPU with the CPU on a bf16 65536/8×7168 tensor in
// skewed groups, both directions (columnwise data plain, swizzled, and transposed),
// every kernel variant.
func TestQuantizeLargeGPU(t *testing.T) {
	g := dt.GPU(t)
	const m, k = 8192, 7168
	sizes := baseline.ZipfSizes(128, m, 1)
	vals := testValues(dt.Rand(5), m*k, true)
	cpu := device.CPU().Stream()
	for _, grouped := range []bool{false, true} {
		for _, lay := range []struct{ swz, tr bool }{{false, false}, {true, false}, {false, true}} {
			swz := lay.swz
			opt := Options{Dir: Both, Swizzle: swz, Transpose: lay.tr}
			var gs []int32
			if grouped {
				gs = sizes
			}
			xc, _ := upload(t, cpu, device.BF16, vals, m, k)
			opt.GroupSizes = groupTensor(t, cpu, gs)
			want, _ := quantBytes(t, cpu, xc, opt)
			s := g.Stream()
			xg, _ := upload(t, s, device.BF16, vals, m, k)
			opt.GroupSizes = groupTensor(t, s, gs)
			for _, v := range variants(g) {
				restore := v.use()
				got, q := quantBytes(t, s, xg, opt)
				restore()
				if diff := diffOut(got, want); diff != "" {
					t.Errorf("%s grouped %v swizzled %v transposed %v: %s", v.name, grouped, swz, lay.tr, diff)
				}
				q.Free()
			}
			xg.Free()
		}
	}
}

// TestDequantize checks Dequantize against element·2^(c−127) computed in float64.
func TestDequantize(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range quantCases {
			for fi, f := range []Format{E4M3, E5M2} {
				opt := Options{Format: f, Dir: Both, Swizzle: ci%2 == 1, Transpose: (ci/2+fi)%2 == 1, GroupSizes: groupTensor(t, s, c.sizes)}
				x, _ := upload(t, s, device.F32, testValues(dt.Rand(uint64(ci)), c.m*c.k, c.specials), c.m, c.k)
				q := dt.Must(Quantize(s, x, opt))
				out := outBytes(t, s, q)
				for _, dir := range []Direction{Rowwise, Columnwise} {
					data, scale := out.row, out.rowScale
					if dir == Columnwise {
						data, scale = out.col, out.colScale
					}
					want := refDequantize(q, data, scale, c.sizes, dir)
					for _, out := range []device.DType{device.F32, device.BF16} {
						y := dt.Must(s.Alloc(out, c.m, c.k))
						dt.Poison(t, s, y)
						dt.NoErr(t, Dequantize(s, y, q, dir))
						got := download(t, s, y)
						wb := make([]byte, len(got))
						device.EncodeFloat32(out, wb, want)
						for i := range got {
							if got[i] != wb[i] {
								e := i / out.Size()
								t.Fatalf("%d×%d %v %v → %v: element %d (row %d col %d) bytes % x, want % x", c.m, c.k, f, dir, out, e, e/c.k, e%c.k,
									got[e*out.Size():(e+1)*out.Size()], wb[e*out.Size():(e+1)*out.Size()])
							}
						}
						y.Free()
					}
				}
				q.Free()
				x.Free()
			}
		}
	})
}

// refDequantize decodes q's data and scales (laid out as refQuantize says, ColT when q is
// transposed) in float64.
func refDequantize(q *MXFP8, data, scale []byte, sizes []int32, dir Direction) []float32 {
	m, k := q.M, q.K
	ld := 32 * q.Tiles()
	nbk := (k + 31) / 32
	cp, kp := 4*((nbk+3)/4), 128*((k+127)/128)
	out := make([]float32, m*k)
	if sizes == nil {
		sizes = []int32{int32(m)}
	}
	dec := func(e, c uint8) float32 {
		v := float64(q.Format.decode(e)) * math.Pow(2, float64(int(c)-127))
		if c == 0xff || math.IsNaN(v) {
			return nanF32
		}
		return float32(v)
	}
	row0, srow, scol := 0, 0, 0
	for _, s := range sizes {
		mg := int(s)
		rows := 128 * ((mg + 127) / 128)
		for r := range mg {
			for j := range k {
				var off int
				switch {
				case dir == Rowwise && q.Swizzled:
					off = srow*cp + refSwizzle(r, j/32, cp)
				case dir == Rowwise:
					off = (srow+r)*cp + j/32
				case q.Swizzled:
					off = scol*kp + refSwizzle(j, r/32, rows/32)
				default:
					off = (scol+r/32)*kp + j
				}
				e := data[(row0+r)*k+j]
				if dir == Columnwise && q.Transposed {
					e = data[j*ld+32*scol+r]
				}
				out[(row0+r)*k+j] = dec(e, scale[off])
			}
		}
		row0 += mg
		srow += rows
		scol += rows / 32
	}
	return out
}

// specVector is one test vector of the specification: a block's values (the rest of
// its 32 are zeros) and the expected scale code and leading elements.
type specVector struct {
	name  string
	f     Format
	mode  ScaleMode
	vals  []float32
	code  uint8
	elems []uint8
}

var specVectors = func() []specVector {
	p := func(e float64) float32 { return float32(math.Pow(2, e)) }
	rep := func(v float32) []float32 {
		b := make([]float32, 32)
		for i := range b {
			b[i] = v
		}
		return b
	}
	reb := func(c uint8) []uint8 {
		b := make([]uint8, 32)
		for i := range b {
			b[i] = c
		}
		return b
	}
	negz := float32(math.Copysign(0, -1))
	return []specVector{
		{"zeros", E4M3, RCEIL, rep(0), 0x00, reb(0x00)},
		{"-0", E4M3, RCEIL, rep(negz), 0x00, reb(0x80)},
		{"448", E4M3, RCEIL, rep(448), 127, reb(0x7e)},
		{"-448", E4M3, RCEIL, rep(-448), 127, reb(0xfe)},
		{"480", E4M3, RCEIL, rep(480), 128, reb(0x77)},
		{"480 floor", E4M3, FLOOR, rep(480), 127, reb(0x7e)},
		{"449", E4M3, RCEIL, rep(449), 128, reb(0x76)},
		{"3.5", E4M3, RCEIL, rep(3.5), 120, reb(0x7e)},
		{"150", E4M3, RCEIL, []float32{150}, 126, nil},
		{"150 floor", E4M3, FLOOR, []float32{150}, 126, nil},
		{"1 0.5 -0.25", E4M3, RCEIL, []float32{1, 0.5, -0.25}, 119, []uint8{0x78, 0x70, 0xe8, 0}},
		{"ties", E4M3, RCEIL, []float32{448, 1.0625, 1.1875, p(-10), 3 * p(-10), 3.5 * p(-9)}, 127, []uint8{0x7e, 0x38, 0x3a, 0x00, 0x02, 0x04}},
		{"2^-126", E4M3, RCEIL, []float32{p(-126)}, 0, []uint8{0x40}},
		{"2^-140", E4M3, RCEIL, []float32{p(-140)}, 0, []uint8{0x00}},
		{"57344 e5m2", E5M2, RCEIL, rep(57344), 127, reb(0x7b)},
	}
}()

// TestSpecVectors checks the specification's vectors rowwise (as 1×32 blocks) and
// columnwise (as 32×1 blocks), from f32 and, where every value is a bf16, from bf16.
func TestSpecVectors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, v := range variants(d) {
			restore := v.use()
			for _, sv := range specVectors {
				block := make([]float32, 32)
				copy(block, sv.vals)
				for _, in := range []device.DType{device.F32, device.BF16} {
					if in == device.BF16 && !bf16Exact(block) {
						continue
					}
					for _, dir := range []Direction{Rowwise, Columnwise} {
						m, k := 1, 32
						if dir == Columnwise {
							m, k = 32, 1
						}
						x := dt.Must(device.FromFloat32(s, in, block, m, k))
						got, q := quantBytes(t, s, x, Options{Format: sv.f, Mode: sv.mode, Dir: dir})
						data, sc := got.row, got.rowScale
						if dir == Columnwise {
							data, sc = got.col, got.colScale
						}
						if sc[0] != sv.code {
							t.Errorf("%s %s %v %v: scale %d, want %d", v.name, sv.name, in, dir, sc[0], sv.code)
						}
						if n := len(sv.elems); n > 0 && string(data[:n]) != string(sv.elems) {
							t.Errorf("%s %s %v %v: elements % x, want % x", v.name, sv.name, in, dir, data[:n], sv.elems)
						}
						for i, b := range sc[1:] {
							if b != 0 {
								t.Errorf("%s %s %v %v: padding scale byte %d is %#x", v.name, sv.name, in, dir, i+1, b)
								break
							}
						}
						q.Free()
						x.Free()
					}
				}
			}
			restore()
		}
	})
}

func bf16Exact(v []float32) bool {
	for _, x := range v {
		if device.BF16ToFloat32(device.BF16FromFloat32(x)) != x {
			return false
		}
	}
	return true
}

// exhaustiveInput returns, for every bf16 code i, row i of a [65536, 96] tensor:
// block 0 holds the value alone (its own scale), block 1 the value next to 448 (scale
// 2^0 whenever |value| ≤ 448), block 2 the value next to 448·2^-120 (scale 2^-120),
// which brings bf16's smallest values into the elements' subnormal range.
func exhaustiveInput() []float32 {
	const k = 96
	v := make([]float32, 65536*k)
	for i := range 65536 {
		x := device.BF16ToFloat32(uint16(i))
		row := v[i*k:]
		row[0] = x
		row[32], row[33] = 448, x
		row[64], row[65] = float32(448*math.Pow(2, -120)), x
	}
	return v
}

// TestExhaustiveBF16 puts every bf16 value through the element conversion in blocks of
// known scale, both directions, every format and rule, and checks it against the
// reference (on the CPU) and the CPU (on a GPU, every kernel variant).
func TestExhaustiveBF16(t *testing.T) {
	const m, k = 65536, 96
	vals := exhaustiveInput()
	cpu := device.CPU().Stream()
	xc, _ := upload(t, cpu, device.BF16, vals, m, k)
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x, _ := upload(t, s, device.BF16, vals, m, k)
		for _, f := range []Format{E4M3, E5M2} {
			for _, mode := range []ScaleMode{RCEIL, FLOOR} {
				opt := Options{Format: f, Mode: mode, Dir: Both}
				want, q := quantBytes(t, cpu, xc, opt)
				q.Free()
				if !d.IsCUDA() {
					checkExhaustive(t, vals, want, f, mode)
					continue
				}
				for _, v := range variants(d) {
					restore := v.use()
					got, q := quantBytes(t, s, x, opt)
					restore()
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%s %v %v: %s", v.name, f, mode, diff)
					}
					q.Free()
				}
			}
		}
		x.Free()
	})
}

// checkExhaustive checks the rowwise result of exhaustiveInput with the reference.
func checkExhaustive(t *testing.T, vals []float32, got refOut, f Format, mode ScaleMode) {
	const k = 96
	rf := refFormats[f]
	bad := 0
	for i := range 65536 {
		for b := range 3 {
			blk := vals[i*k+32*b : i*k+32*b+32]
			a := float32(0)
			for _, x := range blk {
				if x == x && abs32(x) > a {
					a = abs32(x)
				}
			}
			c := refCode(a, f, mode)
			if got.rowScale[i*4+b] != c {
				t.Errorf("%v %v: bf16 %#04x block %d: scale %d, want %d", f, mode, i, b, got.rowScale[i*4+b], c)
				bad++
			}
			x := blk[min(b, 1)] // the value sits at index 0 of block 0 and index 1 of the others
			e := rf.encode(float64(x) * math.Pow(2, float64(127-int(c))))
			pos := i*k + 32*b + min(b, 1)
			if got.row[pos] != e {
				t.Errorf("%v %v: bf16 %#04x (%g) block %d (scale %d): element %#02x, want %#02x", f, mode, i, x, b, c, got.row[pos], e)
				bad++
			}
			if bad > 10 {
				t.Fatal("too many errors")
			}
		}
	}
}

// nkOf returns the [G, N, K] transpose of weights kn stored [G, K, N].
func nkOf(kn []float32, g, k, n int) []float32 {
	nk := make([]float32, len(kn))
	for e := range g {
		for i := range k {
			for j := range n {
				nk[(e*n+j)*k+i] = kn[(e*k+i)*n+j]
			}
		}
	}
	return nk
}
