package quant

import (
	"fmt"
	"math"
	"math/big"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/baseline"
)

func TestKernelsCompileBlockwise(t *testing.T) {
	dt.CheckCompiles(t, blockwiseKernels, softBlockwiseKernels)
}

// bwVariant is one way to run the blockwise kernels on a GPU: the hardware or the
// software element conversion, with 16-byte or element-by-element loads.
type bwVariant struct {
	name   string
	prog   *device.Program
	scalar bool
}

func bwVariants(d *device.Device) []bwVariant {
	if !d.IsCUDA() {
		return []bwVariant{{name: "cpu"}}
	}
	return []bwVariant{{"hw", blockwiseKernels, false}, {"sw", softBlockwiseKernels, false}, {"hw-scalar", blockwiseKernels, true}}
}

// use selects v's kernels until the returned function is called.
func (v bwVariant) use() func() {
	if v.prog == nil {
		return func() {}
	}
	p, sc := bwProgram, bwForceScalar
	bwProgram, bwForceScalar = v.prog, v.scalar
	return func() { bwProgram, bwForceScalar = p, sc }
}

// bwSource makes x, m×k of dtype in from vals, at an element offset of its storage
// (so that offset 1 is not 16-byte aligned), and returns it with its exact values.
func bwSource(t testing.TB, s *device.Stream, in device.DType, vals []float32, m, k, offset int) (*device.Tensor, []float32) {
	t.Helper()
	base := dt.Must(device.FromFloat32(s, in, append(make([]float32, offset), vals...), offset+m*k))
	x := dt.Must(base.View(offset, m, k))
	return x, dt.Must(x.Float32s(s))
}

// bwQuantBytes quantizes x into poisoned outputs allocated for groups groups and
// returns their bytes (ColT and ColTScale in refOut's col and colScale).
func bwQuantBytes(t testing.TB, s *device.Stream, x *device.Tensor, opt BlockOptions, groups int) (refOut, *Blockwise) {
	t.Helper()
	aopt := opt
	if opt.GroupSizes != nil && groups > opt.GroupSizes.Len() {
		aopt.GroupSizes = dt.Must(s.Alloc(device.I32, groups))
		defer aopt.GroupSizes.Free()
	}
	q := dt.Must(AllocBlockwise(s, x.Dim(0), x.Dim(1), aopt))
	for _, o := range []*device.Tensor{q.Row, q.RowScale, q.ColT, q.ColTScale} {
		if o != nil {
			dt.Poison(t, s, o)
		}
	}
	dt.NoErr(t, QuantizeBlockwiseInto(s, q, x, opt))
	return refOut{download(t, s, q.Row), download(t, s, q.RowScale), download(t, s, q.ColT), download(t, s, q.ColTScale)}, q
}

// bwDequantBytes dequantizes q's direction dir into a poisoned tensor of dtype out and
// returns its bytes.
func bwDequantBytes(t testing.TB, s *device.Stream, q *Blockwise, dir Direction, out device.DType) []byte {
	t.Helper()
	y := dt.Must(s.Alloc(out, q.M, q.K))
	defer y.Free()
	dt.Poison(t, s, y)
	dt.NoErr(t, DequantizeBlockwise(s, y, q, dir))
	return download(t, s, y)
}

// f32sOf returns the float32 values of little-endian bytes b.
func f32sOf(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	device.DecodeFloat32(device.F32, v, b)
	return v
}

// firstDiff describes the first difference of two byte slices, or returns "".
func firstDiff(got, want []byte, size int) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			e := i / size
			return fmt.Sprintf("element %d is % x, want % x", e, got[e*size:(e+1)*size], want[e*size:(e+1)*size])
		}
	}
	return ""
}

// bwOptions lists every Format, ScaleKind and Direction.
func bwOptions() []BlockOptions {
	var os []BlockOptions
	for _, f := range []Format{E4M3, E5M2} {
		for _, k := range []ScaleKind{ScaleF32, ScalePow2} {
			for _, d := range []Direction{Rowwise, Columnwise, Both} {
				os = append(os, BlockOptions{Format: f, Scale: k, Dir: d})
			}
		}
	}
	return os
}

type bwCase struct {
	m, k     int
	sizes    []int32 // nil: no groups
	groups   int     // the groups the layout has room for (at least len(sizes))
	specials bool
	offset   int // the source's element offset in its storage
}

func ones(n int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = 1
	}
	return s
}

var bwCases = []bwCase{
	{m: 1, k: 1}, {m: 3, k: 100, specials: true}, {m: 64, k: 128}, {m: 127, k: 256, specials: true},
	{m: 128, k: 136}, {m: 129, k: 264, specials: true}, {m: 300, k: 520}, {m: 0, k: 128}, {m: 40},
	{m: 130, k: 136, specials: true, offset: 1}, {m: 33, k: 64, offset: 8},
	{m: 385, k: 128, sizes: []int32{0, 1, 127, 128, 129}, specials: true},
	{m: 300, k: 136, sizes: []int32{129, 0, 1, 127, 43}, groups: 7},
	{m: 200, k: 264, sizes: []int32{200}, specials: true}, {m: 200, k: 100, sizes: []int32{0, 0, 200, 0}},
	{m: 257, k: 256, sizes: baseline.ZipfSizes(16, 257, 2), specials: true}, {m: 64, k: 128, sizes: ones(64)},
	{m: 0, k: 128, sizes: []int32{0, 0}}, {m: 129, k: 72, sizes: []int32{129, 0}, offset: 1},
	{m: 70, k: 48, sizes: []int32{30, 40}, groups: 4, specials: true},
}

// TestQuantizeBlockwise checks the CPU against the independent reference and every GPU
// kernel variant against the CPU, bit for bit, with outputs poisoned first: every option
// over the case table (each case takes a rotating third of them), quantization and
// dequantization in both directions.
func TestQuantizeBlockwise(t *testing.T) {
	opts := bwOptions()
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range bwCases {
			for oi, opt := range opts {
				if (oi+ci)%3 != 0 {
					continue
				}
				in := []device.DType{device.BF16, device.F32}[(oi/3+ci)%2]
				name := fmt.Sprintf("%d×%d %v groups %v %v %v %v", c.m, c.k, in, c.sizes, opt.Format, opt.Scale, opt.Dir)
				vals := bwValues(dt.Rand(uint64(1000*ci+oi)), c.m*c.k, c.k, c.specials)
				groups := max(c.groups, len(c.sizes))
				// The CPU's outputs: those of the reference on the CPU, those the GPU must give.
				xc, exact := bwSource(t, cpu, in, vals, c.m, c.k, c.offset)
				copt := opt
				copt.GroupSizes = groupTensor(t, cpu, c.sizes)
				want, qc := bwQuantBytes(t, cpu, xc, copt, groups)
				if !d.IsCUDA() {
					ref := refBlockwise(exact, c.m, c.k, c.sizes, groups, opt)
					if diff := diffOut(want, ref); diff != "" {
						t.Errorf("%s: against the reference: %s (Col: ColT)", name, diff)
					}
					checkRefDequant(t, name, qc, want, exact)
				}
				x, _ := bwSource(t, s, in, vals, c.m, c.k, c.offset)
				opt.GroupSizes = groupTensor(t, s, c.sizes)
				for _, v := range bwVariants(d) {
					restore := v.use()
					got, q := bwQuantBytes(t, s, x, opt, groups)
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%s %s: %s (Col: ColT)", v.name, name, diff)
					}
					for _, dir := range []Direction{Rowwise, Columnwise} {
						if (dir == Rowwise && !opt.Dir.rows()) || (dir == Columnwise && !opt.Dir.cols()) {
							continue
						}
						for _, out := range []device.DType{device.F32, device.BF16} {
							g, w := bwDequantBytes(t, s, q, dir, out), bwDequantBytes(t, cpu, qc, dir, out)
							if diff := firstDiff(g, w, out.Size()); diff != "" {
								t.Errorf("%s %s: DequantizeBlockwise %v → %v: %s", v.name, name, dir, out, diff)
							}
						}
					}
					if q.Status != nil {
						dt.NoErr(t, q.Status.Check(s))
					}
					restore()
					q.Free()
				}
				device.FreeAll(x, opt.GroupSizes, xc, copt.GroupSizes)
				qc.Free()
			}
		}
	})
}

// checkRefDequant checks DequantizeBlockwise of a CPU q, whose outputs are out, against
// decode·scale from the reference's tables, and that it is within the rounding bound of
// the source's values x where the block is finite.
func checkRefDequant(t *testing.T, name string, q *Blockwise, out refOut, x []float32) {
	t.Helper()
	s := device.CPU().Stream()
	m, k, mp := q.M, q.K, q.alloc.g.mp()
	scale := func(b []byte, i int) float32 { return f32sOf(b[4*i : 4*i+4])[0] }
	for _, dir := range []Direction{Rowwise, Columnwise} {
		if (dir == Rowwise && q.Row == nil) || (dir == Columnwise && q.ColT == nil) {
			continue
		}
		want := make([]float32, m*k)
		ts := bwStoredTiles(q)
		for i := range want {
			r, j := i/k, i%k
			if dir == Rowwise {
				want[i] = refDequant(q.Format, out.row[i], scale(out.rowScale, (j/128)*q.alloc.g.mr+r))
				continue
			}
			for tt, tl := range ts {
				if p := r - int(tl.row0); p >= 0 && p < int(tl.n) {
					want[i] = refDequant(q.Format, out.col[j*mp+128*tt+p], scale(out.colScale, tt*k+j))
				}
			}
		}
		got := f32sOf(bwDequantBytes(t, s, q, dir, device.F32))
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Errorf("%s: DequantizeBlockwise %v: element %d = %v, want %v", name, dir, i, got[i], want[i])
				return
			}
		}
	}
}

// TestBlockwiseQuotient checks the fused quotient of the kernels (kernels/blockwise.cu,
// dl_bw_enc8, how 1), modeled here with exact fused multiply-adds, on float32 scales in
// [2^-80, 2^120] and quotients up to E5M2's Max: it is the IEEE quotient, but where both
// lie far below E5M2's smallest subnormal, and it always gives the same E4M3 and E5M2
// codes.
func TestBlockwiseQuotient(t *testing.T) {
	fma := func(a, b, c float32) float32 {
		x := new(big.Float).SetPrec(300).SetFloat64(float64(a))
		x.Mul(x, new(big.Float).SetPrec(300).SetFloat64(float64(b)))
		x.Add(x, new(big.Float).SetPrec(300).SetFloat64(float64(c)))
		if x.Sign() == 0 { // an exact zero sum: −0 only from −0 + −0
			if math.Signbit(float64(a*b)) && math.Signbit(float64(c)) {
				return float32(math.Copysign(0, -1))
			}
			return 0
		}
		f, _ := x.Float32()
		return f
	}
	fused := func(v, s float32) float32 {
		y := 1 / s
		q := v * y
		q = fma(-fma(s, q, -v), y, q)
		return fma(-fma(s, q, -v), y, q)
	}
	r := dt.Rand(7)
	n := 0
	for it := 0; n < 200000; it++ {
		e := r.IntN(200) - 80
		if it%3 == 0 {
			e = -80 + r.IntN(3) // near the smallest fused scale
		}
		s := float32(math.Ldexp(1+r.Float64(), min(e, 119)))
		var v float32
		switch it % 4 {
		case 0: // up to E4M3's or E5M2's Max
			v = float32(r.Float64()*[]float64{448, 57344}[r.IntN(2)]) * s
		case 1: // quotients within a few ulps of a float32 midpoint
			q := float32(math.Ldexp(1+r.Float64(), r.IntN(36)-20))
			mid := float64(q) + float64(math.Float32frombits(math.Float32bits(q)+1)-q)/2
			v = math.Float32frombits(math.Float32bits(float32(mid*float64(s))) + uint32(r.IntN(5)) - 2)
		case 2:
			v = float32(math.Ldexp(r.Float64(), -r.IntN(80))) * s
		case 3:
			v = math.Float32frombits(r.Uint32() & 0x7fffffff)
		}
		if v != v || math.IsInf(float64(v), 0) || float64(v) > float64(s)*57344*1.0001 {
			continue
		}
		if r.IntN(2) == 0 {
			v = -v
		}
		n++
		want, got := v/s, fused(v, s)
		if math.Float32bits(want) != math.Float32bits(got) && (math.Abs(float64(want)) >= 0x1p-19 || math.Signbit(float64(want)) != math.Signbit(float64(got))) {
			t.Fatalf("%v / %v: fused quotient %v, want %v", v, s, got, want)
		}
		for _, f := range []Format{E4M3, E5M2} {
			if f.encode(got) != f.encode(want) {
				t.Fatalf("%v / %v: %v code %#x, want %#x", v, s, f, f.encode(got), f.encode(want))
			}
		}
	}
	for _, v := range []float32{0, float32(math.Copysign(0, -1))} {
		if got := fused(v, 3); math.Float32bits(got) != math.Float32bits(v) {
			t.Errorf("fused quotient of %v by 3 is %v", v, got)
		}
	}
}

// TestQuantizeBlockwiseLargeGPU compares the GPU with the CPU, bit for bit, on a bf16
// 8192×7168 activation in 128 skewed groups (both directions, both scale kinds) and on
// bf16 2×2048×7168 weights, every kernel variant.
func TestQuantizeBlockwiseLargeGPU(t *testing.T) {
	g := dt.GPU(t)
	s, cpu := g.Stream(), device.CPU().Stream()
	const m, k = 8192, 7168
	sizes := baseline.ZipfSizes(128, m, 1)
	vals := bwValues(dt.Rand(5), m*k, k, true)
	for _, kind := range []ScaleKind{ScaleF32, ScalePow2} {
		opt := BlockOptions{Scale: kind, Dir: Both}
		xc, _ := bwSource(t, cpu, device.BF16, vals, m, k, 0)
		opt.GroupSizes = groupTensor(t, cpu, sizes)
		want, qc := bwQuantBytes(t, cpu, xc, opt, 0)
		xg, _ := bwSource(t, s, device.BF16, vals, m, k, 0)
		opt.GroupSizes = groupTensor(t, s, sizes)
		for _, v := range bwVariants(g) {
			restore := v.use()
			got, q := bwQuantBytes(t, s, xg, opt, 0)
			restore()
			if diff := diffOut(got, want); diff != "" {
				t.Errorf("%s %v: %s (Col: ColT)", v.name, kind, diff)
			}
			q.Free()
		}
		device.FreeAll(xc, xg, opt.GroupSizes)
		qc.Free()
	}
	const ge, kw, nw = 2, 2048, 7168
	wv := bwValues(dt.Rand(6), ge*kw*nw, nw, true)
	quant := func(s *device.Stream) [3][]byte {
		w := dt.Must(device.FromFloat32(s, device.BF16, wv, ge, kw, nw))
		defer w.Free()
		q := dt.Must(QuantizeWeights(s, w, BlockOptions{Scale: ScalePow2}))
		defer q.Free()
		return [3][]byte{download(t, s, q.KMajor), download(t, s, q.NMajor), download(t, s, q.Scales)}
	}
	want := quant(cpu)
	for _, v := range bwVariants(g) {
		restore := v.use()
		got := quant(s)
		restore()
		for i, name := range []string{"KMajor", "NMajor", "Scales"} {
			if diff := firstDiff(got[i], want[i], 1); diff != "" {
				t.Errorf("%s weights: %s: %s", v.name, name, diff)
			}
		}
	}
}
