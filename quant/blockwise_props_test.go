package quant

import (
	"fmt"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/baseline"
)

var (
	inf32   = float32(math.Inf(1))
	nan32   = float32(math.NaN())
	negZero = float32(math.Copysign(0, -1))
)

// bwVector is a block worked out by hand: its first values (the rest +0), its scale, the
// codes of those values (the rest 0x00) and their dequantized values (the rest rest).
type bwVector struct {
	name  string
	f     Format
	kind  ScaleKind
	vals  []float32
	scale float32
	codes []uint8
	deq   []float32
	rest  float32
}

var bwVectors = []bwVector{
	// amax 1344 = 3·448: f = 3; 1/3 = 0.333… rounds to 0.34375 (0x2B), −3/3 = −1.
	{"f32 scale", E4M3, ScaleF32, []float32{1344, 1, -3}, 3, []uint8{0x7e, 0x2b, 0xb8}, []float32{1344, 1.03125, -3}, 0},
	// f = 3 rounds up to 4: 336 is halfway between 320 and 352 and goes to the even 320.
	{"pow2 scale", E4M3, ScalePow2, []float32{1344, 1, -3}, 4, []uint8{0x7a, 0x28, 0xb4}, []float32{1280, 1, -3}, 0},
	{"e5m2 f32 scale", E5M2, ScaleF32, []float32{114688, -1.5, 3}, 2, []uint8{0x7b, 0xba, 0x3e}, []float32{114688, -1.5, 3}, 0},
	{"e5m2 pow2 exact", E5M2, ScalePow2, []float32{57344, 0.25}, 1, []uint8{0x7b, 0x34}, []float32{57344, 0.25}, 0},
	{"all zero", E4M3, ScaleF32, []float32{0, negZero}, 1, []uint8{0x00, 0x80}, []float32{0, negZero}, 0},
	{"all zero pow2", E5M2, ScalePow2, []float32{negZero, negZero}, 1, []uint8{0x80, 0x80}, []float32{negZero, negZero}, 0},
	{"NaN left out", E4M3, ScaleF32, []float32{nan32, 448, 2, negZero}, 1, []uint8{0x7f, 0x7e, 0x40, 0x80}, []float32{nan32, 448, 2, negZero}, 0},
	{"NaN e5m2", E5M2, ScalePow2, []float32{3, nan32}, 0x1p-14, []uint8{0x7a, 0x7f}, []float32{3, nan32}, 0},
	// amax +Inf: scale +Inf, finite values 0 (sign kept), ±Inf NaN; all dequantize to NaN.
	{"+Inf", E4M3, ScaleF32, []float32{inf32, 5, -7}, inf32, []uint8{0x7f, 0x00, 0x80}, []float32{nan32, nan32, nan32}, nan32},
	{"-Inf", E5M2, ScalePow2, []float32{-inf32, 1}, inf32, []uint8{0x7f, 0x00}, []float32{nan32, nan32}, nan32},
	{"-0 alone", E4M3, ScalePow2, []float32{negZero}, 1, []uint8{0x80}, []float32{negZero}, 0},
	// amax 2^-149: f = 2^-149/448 underflows to 0: scale 1 (f32) or 2^-126 (pow2).
	{"underflowing f32 scale", E4M3, ScaleF32, []float32{0x1p-149}, 1, []uint8{0x00}, []float32{0}, 0},
	{"underflowing pow2 scale", E4M3, ScalePow2, []float32{0x1p-149, -0x1p-149}, 0x1p-126, []uint8{0x00, 0x80}, []float32{0, negZero}, 0},
	// 2^-130/448 is a subnormal f: the scale keeps it (f32) or clamps to 2^-126 (pow2).
	{"subnormal f32 scale", E4M3, ScaleF32, []float32{0x1p-130 * 448}, 0x1p-130, []uint8{0x7e}, []float32{0x1p-130 * 448}, 0},
	{"clamped pow2 scale", E4M3, ScalePow2, []float32{0x1p-130 * 448}, 0x1p-126, []uint8{0x5e}, []float32{0x1p-130 * 448}, 0},
}

// TestBlockwiseVectors checks the hand-computed blocks as rows of x (Row) and as columns
// of x (ColT), and their dequantization, on every device.
func TestBlockwiseVectors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, v := range bwVectors {
			for _, dir := range []Direction{Rowwise, Columnwise} {
				vals := make([]float32, 128)
				copy(vals, v.vals)
				m, k := 1, 128
				if dir == Columnwise {
					m, k = 128, 1
				}
				x := dt.Must(device.FromFloat32(s, device.F32, vals, m, k))
				opt := BlockOptions{Format: v.f, Scale: v.kind, Dir: dir}
				got, q := bwQuantBytes(t, s, x, opt, 0)
				codes, scale := got.col, got.colScale
				if dir == Rowwise {
					codes, scale = got.row, got.rowScale[:4]
				}
				name := fmt.Sprintf("%s %v", v.name, dir)
				if sc := f32sOf(scale)[0]; math.Float32bits(sc) != math.Float32bits(v.scale) {
					t.Errorf("%s: scale %v, want %v", name, sc, v.scale)
				}
				for i, c := range codes {
					want := uint8(0)
					if i < len(v.codes) {
						want = v.codes[i]
					}
					if c != want {
						t.Errorf("%s: element %d code %#02x, want %#02x", name, i, c, want)
					}
				}
				deq := f32sOf(bwDequantBytes(t, s, q, dir, device.F32))
				for i, y := range deq {
					want := v.rest
					if i < len(v.deq) {
						want = v.deq[i]
					}
					if math.Float32bits(y) != math.Float32bits(want) && !(y != y && want != want) {
						t.Errorf("%s: element %d dequantized to %v, want %v", name, i, y, want)
					}
				}
				q.Free()
				x.Free()
			}
		}
	})
}

// TestBlockwiseColTIsRowOfTranspose checks that ColT, per group, is the Row of the
// group's rows transposed (and ColTScale its RowScale), that padding columns and
// blocks are 0, and that Row does not depend on the groups.
func TestBlockwiseColTIsRowOfTranspose(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const k = 136
		for _, sizes := range [][]int32{{0, 1, 127, 128, 129}, {300}, {5, 0, 0, 200, 3}, baseline.ZipfSizes(12, 321, 4)} {
			m := 0
			for _, n := range sizes {
				m += int(n)
			}
			vals := bwValues(dt.Rand(uint64(m)), m*k, k, true)
			x := dt.Must(device.FromFloat32(s, device.BF16, vals, m, k))
			exact := dt.Must(x.Float32s(s))
			gs := groupTensor(t, s, sizes)
			for _, f := range []Format{E4M3, E5M2} {
				opt := BlockOptions{Format: f, Scale: ScalePow2, Dir: Both, GroupSizes: gs}
				got, q := bwQuantBytes(t, s, x, opt, 0)
				plain, qp := bwQuantBytes(t, s, x, BlockOptions{Format: f, Scale: ScalePow2}, 0)
				if got.row == nil || string(got.row) != string(plain.row) || string(got.rowScale) != string(plain.rowScale) {
					t.Errorf("sizes %v %v: grouped Row differs from the ungrouped Row", sizes, f)
				}
				mp, ntiles := q.ColT.Dim(1), q.ColTScale.Dim(0)
				row0, p := 0, 0
				for _, mg := range sizes {
					xt := make([]float32, k*int(mg)) // the group's rows transposed: [K, M_g]
					for r := range int(mg) {
						for j := range k {
							xt[j*int(mg)+r] = exact[(row0+r)*k+j]
						}
					}
					xg := dt.Must(device.FromFloat32(s, device.F32, xt, k, int(mg)))
					tr, qt := bwQuantBytes(t, s, xg, BlockOptions{Format: f, Scale: ScalePow2}, 0)
					mr, nb := qt.RowScale.Dim(1), qt.RowScale.Dim(0)
					scales, trScales := f32sOf(got.colScale), f32sOf(tr.rowScale)
					for j := range k {
						for r := range int(mg) {
							if a, b := got.col[j*mp+128*p+r], tr.row[j*int(mg)+r]; a != b {
								t.Fatalf("sizes %v %v: ColT[%d][%d] = %#x, Row of the transposed group %d: %#x", sizes, f, j, 128*p+r, a, row0, b)
							}
						}
						for b := range nb {
							if a, w := scales[(p+b)*k+j], trScales[b*mr+j]; math.Float32bits(a) != math.Float32bits(w) {
								t.Fatalf("sizes %v %v: ColTScale[%d][%d] = %v, RowScale of the transposed group: %v", sizes, f, p+b, j, a, w)
							}
						}
						for c := int(mg); c < 128*nb; c++ {
							if a := got.col[j*mp+128*p+c]; a != 0 {
								t.Fatalf("sizes %v %v: padding ColT[%d][%d] = %#x, want 0", sizes, f, j, 128*p+c, a)
							}
						}
					}
					p += nb
					row0 += int(mg)
					device.FreeAll(xg)
					qt.Free()
				}
				for j := range k {
					for c := 128 * p; c < mp; c++ {
						if got.col[j*mp+c] != 0 {
							t.Fatalf("sizes %v %v: ColT[%d][%d] after the groups = %#x, want 0", sizes, f, j, c, got.col[j*mp+c])
						}
					}
				}
				for i, v := range f32sOf(got.colScale)[p*k : ntiles*k] {
					if v != 0 || math.Signbit(float64(v)) {
						t.Fatalf("sizes %v %v: ColTScale entry %d after the groups = %v, want 0", sizes, f, p*k+i, v)
					}
				}
				q.Free()
				qp.Free()
			}
			device.FreeAll(x, gs)
		}
	})
}

// TestBlockwiseRoundTrip checks that dequantized values are within half a unit of the
// element format's last place of the source (relative 2^-4 for E4M3, 2^-3 for E5M2;
// below the normal range, half of the smallest subnormal times the scale), in both
// directions and for both scale kinds.
func TestBlockwiseRoundTrip(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 200, 264
		vals := bwValues(dt.Rand(3), m*k, k, false)
		x := dt.Must(device.FromFloat32(s, device.F32, vals, m, k))
		defer x.Free()
		gs := groupTensor(t, s, []int32{70, 0, 130})
		defer gs.Free()
		for _, f := range []Format{E4M3, E5M2} {
			rel, sub := 0x1p-4, 0x1p-10
			if f == E5M2 {
				rel, sub = 0x1p-3, 0x1p-17
			}
			for _, kind := range []ScaleKind{ScaleF32, ScalePow2} {
				q := dt.Must(QuantizeBlockwise(s, x, BlockOptions{Format: f, Scale: kind, Dir: Both, GroupSizes: gs}))
				rs, cs := dt.Must(q.RowScale.Float32s(s)), dt.Must(q.ColTScale.Float32s(s))
				for _, dir := range []Direction{Rowwise, Columnwise} {
					y := f32sOf(bwDequantBytes(t, s, q, dir, device.F32))
					for i, v := range vals {
						r, j := i/k, i%k
						sc := rs[(j/128)*q.RowScale.Dim(1)+r]
						if dir == Columnwise {
							tb := 0 // the token block of row r: groups 70, 0, 130
							if r >= 70 {
								tb = 1 + (r-70)/128
							}
							sc = cs[tb*k+j]
						}
						bound := math.Max(math.Abs(float64(v))*rel, float64(sc)*sub) * (1 + 0x1p-18)
						if e := math.Abs(float64(y[i]) - float64(v)); !(e <= bound) {
							t.Fatalf("%v %v %v: element (%d, %d) = %v dequantized to %v: error %g > %g", f, kind, dir, r, j, v, y[i], e, bound)
						}
					}
				}
				q.Free()
			}
		}
	})
}

// TestBlockwiseInvalidSizes checks the records of invalid group sizes in q.Status and
// in a shared opt.Status (the first one kept until Reset), that they leave Row as
// without groups and ColT in the ungrouped blocks, and that valid sizes record nothing.
func TestBlockwiseInvalidSizes(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 64, 128
		vals := bwValues(dt.Rand(9), m*k, k, false)
		x := dt.Must(device.FromFloat32(s, device.BF16, vals, m, k))
		defer x.Free()
		plain, qp := bwQuantBytes(t, s, x, BlockOptions{Dir: Both}, 0)
		defer qp.Free()
		gs := groupTensor(t, s, []int32{30, 40})
		defer gs.Free()

		q := dt.Must(QuantizeBlockwise(s, x, BlockOptions{Dir: Both, GroupSizes: gs}))
		defer q.Free()
		if got, want := errString(q.Status.Check(s)), "quant: QuantizeBlockwise: sizes sum to 70 > M=64"; got != want {
			t.Errorf("q.Status.Check() = %q, want %q", got, want)
		}
		got := refOut{download(t, s, q.Row), download(t, s, q.RowScale), download(t, s, q.ColT), download(t, s, q.ColTScale)}
		// Ungrouped, the 64 rows are one block: ColT's first 128 columns; the rest is
		// padding (Mp = 128·(0 + min(2, 64)) = 256).
		mp := q.ColT.Dim(1)
		want := refOut{plain.row, plain.rowScale, make([]byte, k*mp), make([]byte, len(got.colScale))}
		for j := range k {
			copy(want.col[j*mp:j*mp+128], plain.col[j*128:(j+1)*128])
		}
		copy(want.colScale, plain.colScale)
		if diff := diffOut(got, want); diff != "" {
			t.Errorf("sizes sum to 70: outputs other than Row without groups and ColT in ungrouped blocks: %s", diff)
		}

		st := dt.Must(device.NewStatus(s))
		defer st.Free()
		for i, step := range []struct {
			reset bool
			sizes []int32
			want  string
		}{
			{false, []int32{30, 34}, ""},
			{false, []int32{-1, 65}, "quant: QuantizeBlockwiseInto: sizes[0] = -1 < 0"},
			{false, []int32{30, 30}, "quant: QuantizeBlockwiseInto: sizes[0] = -1 < 0"},
			{true, []int32{30, 30}, "quant: QuantizeBlockwiseInto: sizes sum to 60 < M=64"},
			{true, []int32{64, -5}, "quant: QuantizeBlockwiseInto: sizes[1] = -5 < 0"},
			{true, []int32{0, 64}, ""},
		} {
			if step.reset {
				dt.NoErr(t, st.Reset(s))
			}
			dt.NoErr(t, device.Upload(s, gs, step.sizes))
			dt.NoErr(t, QuantizeBlockwiseInto(s, q, x, BlockOptions{Dir: Both, GroupSizes: gs, Status: st}))
			if got := errString(st.Check(s)); got != step.want {
				t.Errorf("step %d, sizes %v: opt.Status.Check() = %q, want %q", i, step.sizes, got, step.want)
			}
			if row := download(t, s, q.Row); string(row) != string(plain.row) {
				t.Errorf("step %d, sizes %v: Row differs from the Row without groups", i, step.sizes)
			}
		}
		if got, want := errString(q.Status.Check(s)), "quant: QuantizeBlockwise: sizes sum to 70 > M=64"; got != want {
			t.Errorf("q.Status.Check() after calls with opt.Status = %q, want %q", got, want)
		}
	})
}

type bwWeightCase struct {
	g, k, n  int
	nk       bool
	specials bool
	offset   int
}

var bwWeightCases = []bwWeightCase{
	{g: 1, k: 16, n: 16}, {g: 2, k: 128, n: 128, specials: true}, {g: 3, k: 144, n: 48, nk: true},
	{g: 1, k: 272, n: 400, specials: true}, {g: 2, k: 48, n: 272, nk: true, specials: true},
	{g: 0, k: 32, n: 32}, {g: 2, k: 0, n: 64}, {g: 1, k: 160, n: 144, offset: 1}, {g: 2, k: 128, n: 16, nk: true, offset: 3},
}

// TestQuantizeWeights checks the CPU against the reference and every GPU kernel variant
// against the CPU, bit for bit with outputs poisoned: KMajor and NMajor hold the same
// codes transposed with one set of scales, and DequantizeWeights.
func TestQuantizeWeights(t *testing.T) {
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range bwWeightCases {
			for oi, opt := range bwOptions() {
				if opt.Dir != Rowwise {
					continue
				}
				opt.NK = c.nk
				in := []device.DType{device.BF16, device.F32}[(oi+ci)%2]
				name := fmt.Sprintf("%d×%d×%d nk %v %v %v %v", c.g, c.k, c.n, c.nk, in, opt.Format, opt.Scale)
				r, cc := c.k, c.n
				if c.nk {
					r, cc = c.n, c.k
				}
				vals := bwValues(dt.Rand(uint64(100*ci+oi)), c.g*r*cc, cc, c.specials)
				quant := func(s *device.Stream) ([3][]byte, *BlockwiseWeights) {
					base := dt.Must(device.FromFloat32(s, in, append(make([]float32, c.offset), vals...), c.offset+len(vals)))
					defer base.Free()
					w := dt.Must(base.View(c.offset, c.g, r, cc))
					q := dt.Must(QuantizeWeights(s, w, opt))
					dt.Poison(t, s, q.KMajor, q.NMajor, q.Scales)
					dt.NoErr(t, quantizeWeightsInto(s, q, w))
					return [3][]byte{download(t, s, q.KMajor), download(t, s, q.NMajor), download(t, s, q.Scales)}, q
				}
				want, qc := quant(cpu)
				if !d.IsCUDA() {
					exact := dt.Must(dt.Must(device.FromFloat32(cpu, in, vals, len(vals))).Float32s(cpu))
					km, nm, sc := refWeights(exact, c.g, c.k, c.n, c.nk, opt.Format, opt.Scale)
					for i, ref := range [3][]byte{km, nm, sc} {
						if diff := firstDiff(want[i], ref, 1); diff != "" {
							t.Errorf("%s: %s against the reference: %s", name, []string{"KMajor", "NMajor", "Scales"}[i], diff)
						}
					}
				}
				for _, v := range bwVariants(d) {
					restore := v.use()
					got, q := quant(s)
					for i := range got {
						if diff := firstDiff(got[i], want[i], 1); diff != "" {
							t.Errorf("%s %s: %s: %s", v.name, name, []string{"KMajor", "NMajor", "Scales"}[i], diff)
						}
					}
					for _, out := range []device.DType{device.F32, device.BF16} {
						deq := func(s *device.Stream, q *BlockwiseWeights) []byte {
							y := dt.Must(s.Alloc(out, c.g, c.k, c.n))
							defer y.Free()
							dt.Poison(t, s, y)
							dt.NoErr(t, DequantizeWeights(s, y, q))
							return download(t, s, y)
						}
						g, w := deq(s, q), deq(cpu, qc)
						if diff := firstDiff(g, w, out.Size()); diff != "" {
							t.Errorf("%s %s: DequantizeWeights → %v: %s", v.name, name, out, diff)
						}
						if !d.IsCUDA() && out == device.F32 {
							checkWeightDequant(t, name, qc, want, f32sOf(w))
						}
					}
					restore()
					q.Free()
				}
				qc.Free()
			}
		}
	})
}

// checkWeightDequant checks dequantized weights y [G, K, N] against decode·scale of the
// NMajor codes and scales of want.
func checkWeightDequant(t *testing.T, name string, q *BlockwiseWeights, want [3][]byte, y []float32) {
	t.Helper()
	sc := f32sOf(want[2])
	nkb, nnb := (q.K+127)/128, (q.N+127)/128
	for i, v := range y {
		g, kk, n := i/(q.K*q.N), i/q.N%q.K, i%q.N
		w := refDequant(q.Format, want[1][i], sc[(g*nkb+kk/128)*nnb+n/128])
		if math.Float32bits(v) != math.Float32bits(w) {
			t.Errorf("%s: DequantizeWeights element %d = %v, want %v", name, i, v, w)
			return
		}
	}
}

// TestQuantizeWeightsOrientations checks that [G, N, K] weights with opt.NK give the same
// outputs as the same weights stored [G, K, N].
func TestQuantizeWeightsOrientations(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const g, k, n = 2, 272, 144
		kn := bwValues(dt.Rand(11), g*k*n, n, true)
		nk := nkOf(kn, g, k, n)
		for _, kind := range []ScaleKind{ScaleF32, ScalePow2} {
			var outs [2][3][]byte
			for o, vals := range [][]float32{kn, nk} {
				shape := []int{g, k, n}
				if o == 1 {
					shape = []int{g, n, k}
				}
				w := dt.Must(device.FromFloat32(s, device.BF16, vals, shape...))
				q := dt.Must(QuantizeWeights(s, w, BlockOptions{Scale: kind, NK: o == 1}))
				outs[o] = [3][]byte{download(t, s, q.KMajor), download(t, s, q.NMajor), download(t, s, q.Scales)}
				q.Free()
				w.Free()
			}
			for i, name := range []string{"KMajor", "NMajor", "Scales"} {
				if diff := firstDiff(outs[1][i], outs[0][i], 1); diff != "" {
					t.Errorf("%v: %s of NK weights against KN: %s", kind, name, diff)
				}
			}
			km, nm := outs[0][0], outs[0][1]
			for e := range g {
				for i := range k {
					for j := range n {
						if a, b := km[(e*n+j)*k+i], nm[(e*k+i)*n+j]; a != b {
							t.Fatalf("%v: KMajor[%d][%d][%d] = %#x, NMajor[%d][%d][%d] = %#x", kind, e, j, i, a, e, i, j, b)
						}
					}
				}
			}
		}
	})
}

// TestBlockwiseCapture checks that a grouped quantization captured in a graph reads the
// group sizes when the graph runs.
func TestBlockwiseCapture(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		const m, k = 100, 128
		x := dt.Must(device.FromFloat32(s, device.F32, bwValues(dt.Rand(2), m*k, k, false), m, k))
		defer x.Free()
		gs := groupTensor(t, s, []int32{100, 0})
		defer gs.Free()
		opt := BlockOptions{Dir: Columnwise, GroupSizes: gs}
		q := dt.Must(AllocBlockwise(s, m, k, opt))
		defer q.Free()
		dt.NoErr(t, s.BeginCapture())
		dt.NoErr(t, QuantizeBlockwiseInto(s, q, x, opt))
		g := dt.Must(s.EndCapture())
		defer g.Close()
		for _, sizes := range [][]int32{{0, 100}, {60, 40}} {
			dt.NoErr(t, device.Upload(s, gs, sizes))
			dt.NoErr(t, g.Launch(s))
			want, qw := bwQuantBytes(t, s, x, opt, 0)
			if got := download(t, s, q.ColT); string(got) != string(want.col) {
				t.Errorf("sizes %v: the graph's ColT differs from a direct quantization", sizes)
			}
			qw.Free()
		}
		dt.NoErr(t, q.Status.Check(s))
	})
}
