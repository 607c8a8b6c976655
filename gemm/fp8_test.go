package gemm_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// blockShapes are the cases of the blockwise suite: M not a multiple of 128, K with a
// short last block, groups of 1 to 127 rows, empty groups, skewed sizes, rows past
// sum(sizes), several row, column and contraction tiles, and K, N not multiples of 16
// (which the Hopper kernels leave to the portable path; the weight gradient only, as
// quant.QuantizeWeights needs multiples of 16).
var blockShapes = []shape{
	{"tiny-groups", 3, 40, 32, 48, "uniform"},
	{"ragged", 6, 300, 160, 144, "skewed"},
	{"short", 4, 260, 256, 128, "short"},
	{"many-groups", 40, 700, 128, 256, "skewed"},
	{"tiles", 2, 520, 384, 272, "uniform"},
	{"odd", 3, 50, 40, 24, "uniform"},
	{"all-empty", 4, 64, 128, 128, "empty"},
}

// bop is one call of an FP8 family in the tests and its host operands.
type bop struct {
	fam    family
	name   string
	f      form
	layout gemm.WeightLayout // wgrad: dw's layout
	out    device.DType
	acc    bool
	sizes  []int32
	M      int
	a, b   *hostQ // fwd: x; dgrad: dy; wgrad: x and dy
	w      *hostW // fwd, dgrad
	c0     []float32
	// grouped: the rowwise operand (fwd, dgrad) is quantized in the groups of sizes, which
	// then sum to M (MXFP8, whose rowwise scale rows follow the groups then).
	grouped bool
}

func (o *bop) String() string {
	g := ""
	if o.grouped {
		g = "/grouped"
	}
	return fmt.Sprintf("%s/%s/%v/%v/%v%s", o.fam.name, o.name, o.f, o.layout, o.out, g)
}

// newBop makes a call of family fam's form f on shape sh with random operands: the first
// quantized with ra, the second (w or dy) with rb (fam's counterparts of these blockwise
// recipes). Rows past sum(sizes) are NaN; the weight gradient has none (its M is
// sum(sizes): quant's columnwise groups cover all M rows).
func newBop(fam family, seed uint64, sh shape, f form, layout gemm.WeightLayout, out device.DType, ra, rb recipe, acc bool) *bop {
	ra, rb = fam.recipe(ra), fam.recipe(rb)
	r := dt.Rand(seed)
	o := &bop{fam: fam, name: sh.name, f: f, layout: layout, out: out, acc: acc, M: sh.M, sizes: genSizes(r, sh.G, sh.M, sh.dist)}
	used := o.used()
	if f == wgrad {
		o.M = used
	}
	rows := func(cols int) []float32 {
		v := dt.Normal(r, o.M*cols, 1)
		nanRows(v[used*cols:])
		return v
	}
	switch f {
	case fwd:
		o.a = o.quantize(ra, rows(sh.K), sh.K)
	case dgrad:
		o.a = o.quantize(ra, rows(sh.N), sh.N)
	default:
		o.a = o.quantize(ra, rows(sh.K), sh.K)
		o.b = o.quantize(rb, rows(sh.N), sh.N)
	}
	if f != wgrad {
		o.w = quantizeWeights(rb, dt.Normal(r, sh.G*sh.K*sh.N, 0.05), sh.G, sh.K, sh.N, f == fwd)
	}
	if acc {
		o.c0 = rounded(out, dt.Normal(r, prod(o.outShape()), 4))
	}
	return o
}

// used returns sum(sizes).
func (o *bop) used() int {
	n := 0
	for _, s := range o.sizes {
		n += int(s)
	}
	return n
}

// groupRows quantizes o's rowwise operand again, in the groups of o.sizes, and returns o.
func (o *bop) groupRows() *bop {
	if o.f == wgrad || o.used() != o.M {
		panic(fmt.Sprintf("%v: only a forward or input gradient whose sizes sum to M has grouped rows", o))
	}
	o.grouped = true
	o.a = o.quantize(o.a.r, o.a.v, o.a.K)
	return o
}

// quantize quantizes v, o.M rows of k values, as the call reads it: rowwise for the
// forward and the input gradient (in the groups of o.sizes when o.grouped), columnwise in
// the groups of o.sizes for the weight gradient.
func (o *bop) quantize(r recipe, v []float32, k int) *hostQ {
	if o.f == wgrad || o.grouped {
		return quantize(r, v, o.M, k, o.sizes, o.f == wgrad)
	}
	return quantize(r, v, o.M, k, nil, false)
}

// dims returns G, K and N of the call.
func (o *bop) dims() (G, K, N int) {
	if o.f == wgrad {
		return len(o.sizes), o.a.K, o.b.K
	}
	return o.w.G, o.w.K, o.w.N
}

func (o *bop) outShape() []int {
	G, K, N := o.dims()
	switch o.f {
	case fwd:
		return []int{o.M, N}
	case dgrad:
		return []int{o.M, K}
	}
	if o.layout == gemm.NK {
		return []int{G, N, K}
	}
	return []int{G, K, N}
}

// reference returns the expected output in float64 from the dequantized operands and, per
// element, the sum of the magnitudes of its terms (the scale of its rounding errors).
func (o *bop) reference() (ref, abs []float64) {
	_, K, N := o.dims()
	n := prod(o.outShape())
	ref, abs = make([]float64, n), make([]float64, n)
	add := func(i int, x, y float32) {
		p := float64(x) * float64(y)
		ref[i] += p
		abs[i] += math.Abs(p)
	}
	off := 0
	for g, sz := range o.sizes {
		for m := off; m < off+int(sz); m++ {
			switch o.f {
			case fwd:
				for k := range K {
					for j := range N {
						add(m*N+j, o.a.deq[m*K+k], o.w.deq[(g*K+k)*N+j])
					}
				}
			case dgrad:
				for k := range K {
					for j := range N {
						add(m*K+k, o.a.deq[m*N+j], o.w.deq[(g*K+k)*N+j])
					}
				}
			default:
				for k := range K {
					for j := range N {
						i := (g*K+k)*N + j
						if o.layout == gemm.NK {
							i = (g*N+j)*K + k
						}
						add(i, o.a.deq[m*K+k], o.b.deq[m*N+j])
					}
				}
			}
		}
		off += int(sz)
	}
	for i, v := range o.c0 {
		ref[i] += float64(v)
		abs[i] += math.Abs(float64(v))
	}
	return ref, abs
}

// zeros returns the output ranges that must be +0: rows past sum(sizes) (fwd, dgrad) or
// the empty groups' dw (wgrad without acc).
func (o *bop) zeros() [][2]int {
	shape := o.outShape()
	if o.f != wgrad {
		used := 0
		for _, s := range o.sizes {
			used += int(s)
		}
		return [][2]int{{used * shape[1], o.M * shape[1]}}
	}
	var z [][2]int
	per := shape[1] * shape[2]
	for g, s := range o.sizes {
		if s == 0 && !o.acc {
			z = append(z, [2]int{g * per, (g + 1) * per})
		}
	}
	return z
}

// call runs the call on s with the uploaded operands into c.
func (o *bop) call(s *device.Stream, c *device.Tensor, a, b, w quantized, sz *device.Tensor, opt *gemm.Options) error {
	return fp8Call(o.fam, o.f, s, c, a, b, w, sz, opt)
}

// fp8Call runs family fam's form f on s into c: a is x (fwd, wgrad) or dy (dgrad), b dy
// (wgrad), w the weights (fwd, dgrad); operands the form does not take may be nil.
func fp8Call(fam family, f form, s *device.Stream, c *device.Tensor, a, b, w quantized, sz *device.Tensor, opt *gemm.Options) error {
	if fam.mx {
		x, _ := a.(*quant.MXFP8)
		dy, _ := b.(*quant.MXFP8)
		mw, _ := w.(*quant.MXFP8Weights)
		switch f {
		case fwd:
			return gemm.RaggedDotMXFP8(s, c, x, mw, sz, opt)
		case dgrad:
			return gemm.RaggedDotMXFP8InputGrad(s, c, x, mw, sz, opt)
		}
		return gemm.RaggedDotMXFP8WeightGrad(s, c, x, dy, sz, opt)
	}
	x, _ := a.(*quant.Blockwise)
	dy, _ := b.(*quant.Blockwise)
	bw, _ := w.(*quant.BlockwiseWeights)
	switch f {
	case fwd:
		return gemm.RaggedDotBlockwise(s, c, x, bw, sz, opt)
	case dgrad:
		return gemm.RaggedDotBlockwiseInputGrad(s, c, x, bw, sz, opt)
	}
	return gemm.RaggedDotBlockwiseWeightGrad(s, c, x, dy, sz, opt)
}

// upload puts o's quantized operands on s (a, and b or w where o has them; nil otherwise)
// with its sizes, an I32[G] tensor; free releases them all.
func (o *bop) upload(s *device.Stream) (a, b, w quantized, sz *device.Tensor, free func()) {
	a = o.a.upload(s)
	if o.b != nil {
		b = o.b.upload(s)
	}
	if o.w != nil {
		w = o.w.upload(s)
	}
	sz = dt.Must(device.FromSlice(s, device.I32, o.sizes, len(o.sizes)))
	return a, b, w, sz, func() {
		for _, q := range []quantized{a, b, w} {
			if q != nil {
				q.Free()
			}
		}
		sz.Free()
	}
}

// run executes the call on s into a poisoned output (replayed from a captured graph when
// capture is set) and returns the output's and its guard's bytes.
func (o *bop) run(t *testing.T, s *device.Stream, opt *gemm.Options, capture bool) result {
	t.Helper()
	a, b, w, sz, free := o.upload(s)
	n := prod(o.outShape())
	base := dt.Must(s.Alloc(o.out, n+guard))
	dt.Poison(t, s, base)
	c := dt.Must(base.View(0, o.outShape()...))
	if o.acc {
		dt.NoErr(t, c.SetFloat32(s, o.c0))
	}
	if opt == nil {
		opt = &gemm.Options{}
	}
	opt.Layout, opt.Accumulate = o.layout, o.acc
	call := func() error { return o.call(s, c, a, b, w, sz, opt) }
	if capture {
		dt.NoErr(t, s.BeginCapture())
		err := call()
		g, cerr := s.EndCapture()
		dt.NoErr(t, err)
		dt.NoErr(t, cerr)
		dt.NoErr(t, g.Launch(s))
		dt.NoErr(t, g.Close())
	} else {
		dt.NoErr(t, call())
	}
	all := dt.Must(download(s, base))
	free()
	base.Free()
	es := o.out.Size()
	return result{out: all[:n*es], guard: all[n*es:]}
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// overflowed reports whether g, a GPU result, stands for ref = ±Inf of the CPU path or the
// reference: a value past 2^100 of its sign. An MXFP8 element at the largest scale
// dequantizes past f32's range on the CPU, while the GPU scales its block's sum by the
// product of the two scales, which may stay in range.
func overflowed(g, ref float64) bool {
	return math.IsInf(ref, 0) && math.Abs(g) >= 0x1p100 && math.Signbit(g) == math.Signbit(ref)
}

// check compares res with the reference: each element within tol·abs of it (NaN or ±Inf
// in the reference: a NaN or infinite result), the relative Frobenius error at most tol,
// the zeros exactly +0 and the guard untouched.
func (o *bop) check(t *testing.T, res result, ref, abs []float64, tol float64) {
	t.Helper()
	if !allBytes(res.guard, 0xFF) {
		t.Fatalf("%v: the guard past the output was written", o)
	}
	got := decode(o.out, res.out)
	cols := o.outShape()[len(o.outShape())-1]
	var num, den float64
	for i, want := range ref {
		g := float64(got[i])
		if !finite(want) {
			if finite(g) && !overflowed(g, want) {
				t.Fatalf("%v: element (%d, %d) = %v, want NaN or ±Inf", o, i/cols, i%cols, g)
			}
			continue
		}
		if !finite(g) || math.Abs(g-want) > tol*abs[i] {
			t.Fatalf("%v: element (%d, %d) = %v, want %v (±%.3g)", o, i/cols, i%cols, g, want, tol*abs[i])
		}
		num += (g - want) * (g - want)
		den += want * want
	}
	if den > 0 && math.Sqrt(num/den) > tol {
		t.Fatalf("%v: relative error %.3g > %g", o, math.Sqrt(num/den), tol)
	}
	for _, z := range o.zeros() {
		for i := z[0]; i < z[1]; i++ {
			if math.Float32bits(got[i]) != 0 {
				t.Fatalf("%v: element (%d, %d) = %v, want +0", o, i/cols, i%cols, got[i])
			}
		}
	}
}

// tol is the bound of check: on the CPU (f32 products and sums of exact dequantized
// values) 1e-4 with f32 output and 5e-3 with bf16 output (half a bf16 unit is 2^-9 of
// the magnitude); on a GPU, 1e-2 (FP8 tensor-core sums of scale blocks promoted
// into f32).
func (o *bop) tol(d *device.Device) float64 {
	switch {
	case d.IsCUDA():
		return 1e-2
	case o.out == device.F32:
		return 1e-4
	}
	return 5e-3
}

// checkClose compares a GPU result with the CPU's: the same non-finite elements and a
// relative Frobenius error of the rest at most 1e-2.
func (o *bop) checkClose(t *testing.T, gpu, cpu result) {
	t.Helper()
	g, c := decode(o.out, gpu.out), decode(o.out, cpu.out)
	var num, den float64
	for i := range c {
		x, y := float64(g[i]), float64(c[i])
		if finite(x) != finite(y) && !overflowed(x, y) {
			t.Fatalf("%v: GPU element %d = %v, CPU %v", o, i, x, y)
		}
		if finite(y) {
			num += (x - y) * (x - y)
			den += y * y
		}
	}
	if den > 0 && math.Sqrt(num/den) > 1e-2 {
		t.Fatalf("%v: GPU and CPU differ by %.3g (relative)", o, math.Sqrt(num/den))
	}
}

// runCheck runs o on d against the reference and, on a GPU, against the CPU.
func (o *bop) runCheck(t *testing.T, d *device.Device) result {
	t.Helper()
	res := o.run(t, d.Stream(), nil, false)
	ref, abs := o.reference()
	o.check(t, res, ref, abs, o.tol(d))
	if d.IsCUDA() {
		o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
	}
	return res
}

// blockForms are the forms of the suite: forward, input gradient, weight gradient in both
// layouts.
var blockForms = []struct {
	f      form
	layout gemm.WeightLayout
}{{fwd, gemm.KN}, {dgrad, gemm.KN}, {wgrad, gemm.KN}, {wgrad, gemm.NK}}

// The tests below run on either FP8 family; each has a TestBlockwise… and a TestMXFP8…
// entry point.

// TestRaggedDotBlockwise is the shared suite: every shape and form, bf16 and f32 outputs,
// E4M3 and E5M2 operands with f32 and power-of-two scales, on fresh random data into
// poisoned outputs, against the float64 reference of the dequantized operands and, on a
// GPU, against the CPU.
func TestRaggedDotBlockwise(t *testing.T) { testFP8Suite(t, blockwiseFam) }

// testFP8Suite is the shared suite of family fam: output dtypes and recipes alternate
// from shape to shape and form to form, and MXFP8's rowwise operands are quantized in the
// groups of the sizes in every other pair of shapes whose sizes sum to M.
func testFP8Suite(t *testing.T, fam family) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		seed := uint64(100)
		for j, sh := range blockShapes {
			for i, bf := range blockForms {
				seed++
				out, ra, rb := device.F32, e4m3F32, e5m2Pow2
				if (j+i)%2 == 0 {
					out, ra, rb = device.BF16, e5m2Pow2, e4m3F32
				}
				if bf.f != wgrad {
					if !fam.weightsOK(sh.K, sh.N) {
						continue
					}
					rb = e4m3F32
				}
				o := newBop(fam, seed, sh, bf.f, bf.layout, out, ra, rb, false)
				if fam.mx && bf.f != wgrad && (j/2)%2 == 0 && o.used() == o.M {
					o.groupRows()
				}
				o.runCheck(t, d)
			}
		}
	})
}

// TestRaggedDotBlockwiseAccumulate checks dw += x_gᵀ·dy_g in both layouts and dtypes, with
// empty groups left as they were.
func TestRaggedDotBlockwiseAccumulate(t *testing.T) { testFP8Accumulate(t, blockwiseFam) }

func testFP8Accumulate(t *testing.T, fam family) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, sh := range []shape{blockShapes[1], blockShapes[3]} {
			for j, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
				out := []device.DType{device.F32, device.BF16}[(i+j)%2]
				o := newBop(fam, uint64(200+2*i+j), sh, wgrad, layout, out, e4m3F32, e5m2Pow2, true)
				res := o.runCheck(t, d)
				got := decode(out, res.out)
				per := sh.K * sh.N
				for g, n := range o.sizes {
					for e := g * per; n == 0 && e < (g+1)*per; e++ {
						if math.Float32bits(got[e]) != math.Float32bits(o.c0[e]) {
							t.Fatalf("%v: empty group %d changed under Accumulate", o, g)
						}
					}
				}
			}
		}
	})
}

// TestBlockwisePortable runs the suite's forms on shapes the Hopper kernels take with
// those turned off, so that on the H100 and H200 the portable path (dequantize to bf16,
// then the bf16 ragged_dot) that other GPUs run is tested too.
func TestBlockwisePortable(t *testing.T) { testFP8Portable(t, blockwiseFam) }

func testFP8Portable(t *testing.T, fam family) {
	defer gemm.ForceMMA(true)()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, sh := range []shape{blockShapes[1], blockShapes[3]} {
			for j, bf := range blockForms {
				o := newBop(fam, uint64(800+4*i+j), sh, bf.f, bf.layout, device.BF16, e4m3F32, e5m2Pow2, false)
				if fam.mx && bf.f != wgrad && i == 1 {
					o.groupRows()
				}
				o.runCheck(t, d)
			}
		}
	})
}

// TestBlockwiseManyTiles runs each form on a GPU with more tiles than a persistent grid
// holds (several rounds of tiles per block, the pipeline's phases carried across tiles),
// against the CPU path.
func TestBlockwiseManyTiles(t *testing.T) { testFP8ManyTiles(t, blockwiseFam) }

func testFP8ManyTiles(t *testing.T, fam family) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		if !d.IsCUDA() {
			t.Skip("a GPU test")
		}
		sh := shape{"many-tiles", 8, 4000, 512, 1024, "skewed"}
		for i, bf := range blockForms {
			o := newBop(fam, uint64(900+i), sh, bf.f, bf.layout, device.BF16, e4m3F32, e5m2Pow2, false)
			o.checkClose(t, o.run(t, d.Stream(), nil, false), o.run(t, device.CPU().Stream(), nil, false))
		}
	})
}

// spread returns a power of two 2^e, e in [-20, 20], that depends on (i, j) only.
func spread(i, j int) float32 {
	h := (uint64(i)*0x9E3779B97F4A7C15 ^ uint64(j)*0xC2B2AE3D27D4EB4F) >> 40
	return float32(math.Ldexp(1, int(h%41)-20))
}

// TestBlockwiseScaleSpread gives every scale block of each operand its own magnitude, 2^e
// with e in [-20, 20], so that a scale read from the wrong block, row or column changes
// the result far beyond the tolerance; one block of each operand is all zeros.
func TestBlockwiseScaleSpread(t *testing.T) { testFP8ScaleSpread(t, blockwiseFam) }

// testFP8ScaleSpread is TestBlockwiseScaleSpread for family fam; MXFP8's rowwise operands
// are quantized without groups with the first recipe and in the groups of the sizes with
// the second.
func testFP8ScaleSpread(t *testing.T, fam family) {
	sh := shape{"spread", 3, 300, 384, 256, "skewed"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, bf := range blockForms {
			for j, r := range []recipe{e4m3F32, e4m3Pow2} {
				o := newBop(fam, uint64(300+2*i+j), sh, bf.f, bf.layout, device.F32, r, r, false)
				o.grouped = fam.mx && bf.f != wgrad && j == 1
				requantize(o)
				o.runCheck(t, d)
			}
		}
	})
}

// requantize replaces o's operands by spread ones built from their dequantized values:
// rowwise operands scaled per (row, block of the family's columns), columnwise ones per
// (block of tokens, column), weights per block of the orientation the call reads
// (blockwise: 128×128; MXFP8: 32 along the contracted dimension), and zeroes the first
// block of each.
func requantize(o *bop) {
	G, K, N := o.dims()
	bs := o.fam.bs
	rows := func(h *hostQ) *hostQ {
		v := append([]float32(nil), h.deq...)
		off, tb := 0, 0 // the group's first row and token block
		for _, sz := range o.sizes {
			for i := range int(sz) {
				m := off + i
				for k := range h.K {
					f := spread(m, k/bs)
					if o.f == wgrad {
						f = spread(tb+i/bs, k)
					}
					if (o.f == wgrad && tb+i/bs == 0) || (o.f != wgrad && m == 0 && k < bs) {
						f = 0
					}
					v[m*h.K+k] *= f
				}
			}
			off += int(sz)
			tb += ceil(int(sz), bs)
		}
		return o.quantize(h.r, v, h.K)
	}
	o.a = rows(o.a)
	if o.b != nil {
		o.b = rows(o.b)
	}
	if o.w != nil {
		bk, bn, zero := blk, blk, float32(1) // blockwise: 128×128 blocks; an all-zero block has scale 1
		if o.fam.mx {
			bk, bn, zero = bs, 1, 0 // KMajor: 1×32 along K; an all-zero block has code 0
			if !o.w.kMajor {
				bk, bn = 1, bs // NMajor: 1×32 along N
			}
		}
		v := append([]float32(nil), o.w.deq...)
		for i := range v {
			g, k, n := i/(K*N), i/N%K, i%N
			f := spread(g*1000+k/bk, n/bn+7)
			if g == 0 && k < bk && n < bn {
				f = 0
			}
			v[i] *= f
		}
		o.w = quantizeWeights(o.w.r, v, G, K, N, o.w.kMajor)
		if o.w.scales[0] != zero {
			panic(fmt.Sprintf("the all-zero weight block's scale is %v, not %v", o.w.scales[0], zero))
		}
	}
}

// TestBlockwiseNaN: NaN elements and an infinite value (whose block gets the scale +Inf)
// make NaN or ±Inf only in the outputs they reach (their rows, or their weight's column in
// their group); every other output is finite and correct.
func TestBlockwiseNaN(t *testing.T) { testFP8NaN(t, blockwiseFam) }

// testFP8NaN is TestBlockwiseNaN for family fam (in MXFP8 an infinite value gets its
// block the largest scale, comes back as ±Inf and flushes the rest of its block to zeros).
func testFP8NaN(t *testing.T, fam family) {
	sh := shape{"nan", 3, 200, 256, 256, "uniform"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, bf := range blockForms {
			o := newBop(fam, uint64(400+i), sh, bf.f, bf.layout, device.BF16, e4m3F32, e4m3F32, false)
			o.sizes = []int32{100, 60, 40}
			// Magnitudes of at least 0.25 everywhere (the CPU's gonum skips zero terms,
			// which would hide a NaN partner), then the non-finite values.
			poison := func(h *hostQ, nan, inf [2]int) *hostQ {
				v := append([]float32(nil), h.deq...)
				for j := range v {
					v[j] = float32(math.Copysign(0.25+math.Abs(float64(v[j])), float64(v[j])))
				}
				v[nan[0]*h.K+nan[1]] = float32(math.NaN())
				v[inf[0]*h.K+inf[1]] = float32(math.Inf(1))
				return o.quantize(h.r, v, h.K)
			}
			o.a = poison(o.a, [2]int{5, 130}, [2]int{177, 3})
			if o.b != nil {
				o.b = poison(o.b, [2]int{120, 40}, [2]int{60, 250})
			}
			if o.w != nil {
				v := append([]float32(nil), o.w.deq...)
				v[(1*sh.K+40)*sh.N+200] = float32(math.NaN())
				o.w = quantizeWeights(o.w.r, v, sh.G, sh.K, sh.N, o.w.kMajor)
			}
			ref, _ := o.reference()
			bad := 0
			for _, v := range ref {
				if !finite(v) {
					bad++
				}
			}
			if bad == 0 || bad > len(ref)/10 {
				t.Fatalf("%v: %d of %d outputs are not finite in the reference", o, bad, len(ref))
			}
			o.runCheck(t, d)
		}
	})
}

// TestBlockwiseScalePow2: with power-of-two scales, 2^k times an operand quantizes to the
// same elements with scales 2^k times larger, and the output is exactly 2^k times larger.
func TestBlockwiseScalePow2(t *testing.T) { testFP8ScalePow2(t, blockwiseFam) }

func testFP8ScalePow2(t *testing.T, fam family) {
	sh := shape{"pow2", 4, 300, 256, 160, "skewed"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, bf := range blockForms {
			for _, e := range []int{9, -13} {
				o := newBop(fam, uint64(500+i), sh, bf.f, bf.layout, device.F32, e4m3Pow2, e5m2Pow2, false)
				h := &o.a
				if o.b != nil {
					h = &o.b
				}
				v := append([]float32(nil), (*h).deq...)
				*h = o.quantize((*h).r, v, (*h).K)
				base := o.run(t, s, nil, false)
				for j := range v {
					v[j] = float32(math.Ldexp(float64(v[j]), e))
				}
				q := o.quantize((*h).r, v, (*h).K)
				if string(q.codes) != string((*h).codes) {
					t.Fatalf("2^%d·v quantizes to other elements", e)
				}
				for j, sc := range q.scales {
					if want := (*h).scales[j]; sc != float32(math.Ldexp(float64(want), e)) {
						t.Fatalf("2^%d·v: scale %d is %v, want 2^%d·%v", e, j, sc, e, want)
					}
				}
				*h = q
				scaled := o.run(t, s, nil, false)
				want, got := decode(o.out, base.out), decode(o.out, scaled.out)
				for j := range want {
					if w := float32(math.Ldexp(float64(want[j]), e)); math.Float32bits(got[j]) != math.Float32bits(w) {
						t.Fatalf("%v: 2^%d·operand: element %d = %v, want 2^%d·%v = %v", o, e, j, got[j], e, want[j], w)
					}
				}
			}
		}
	})
}

// TestBlockwiseMatchesBF16 compares each form with the bf16 form on the dequantized
// operands (power-of-two scales: the dequantized values are bf16 numbers): the same bytes
// on the CPU, which runs the same f32 path on the same values, and within 1e-2 on a GPU.
func TestBlockwiseMatchesBF16(t *testing.T) { testFP8MatchesBF16(t, blockwiseFam) }

func testFP8MatchesBF16(t *testing.T, fam family) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, sh := range []shape{blockShapes[1], blockShapes[4]} {
			for j, bf := range blockForms {
				o := newBop(fam, uint64(600+4*i+j), sh, bf.f, bf.layout, device.F32, e4m3Pow2, e5m2Pow2, false)
				fp8 := o.run(t, s, nil, false)
				G, K, N := o.dims()
				sz := dt.Must(device.FromSlice(s, device.I32, o.sizes, len(o.sizes)))
				y := dt.Must(s.Alloc(device.F32, o.outShape()...))
				var a, b *device.Tensor
				var err error
				switch o.f {
				case fwd:
					a = upload(t, s, device.BF16, o.a.deq, []int{o.M, K})
					if fam.fwdNK { // w_g [N][K], as KMajor
						b = upload(t, s, device.BF16, kMajor(o.w.deq, G, K, N), []int{G, N, K})
						err = gemm.RaggedDot(s, y, a, b, sz, &gemm.Options{Layout: gemm.NK})
					} else {
						b = upload(t, s, device.BF16, o.w.deq, []int{G, K, N})
						err = gemm.RaggedDot(s, y, a, b, sz, nil)
					}
				case dgrad:
					a = upload(t, s, device.BF16, o.a.deq, []int{o.M, N})
					b = upload(t, s, device.BF16, o.w.deq, []int{G, K, N})
					err = gemm.RaggedDotInputGrad(s, y, a, b, sz, nil)
				default:
					a = upload(t, s, device.BF16, o.a.deq, []int{o.M, K})
					b = upload(t, s, device.BF16, o.b.deq, []int{o.M, N})
					err = gemm.RaggedDotWeightGrad(s, y, a, b, sz, &gemm.Options{Layout: o.layout})
				}
				dt.NoErr(t, err)
				bf16 := result{out: dt.Must(download(s, y))}
				device.FreeAll(sz, y, a, b)
				if !d.IsCUDA() {
					if string(bf16.out) != string(fp8.out) {
						t.Fatalf("%v: the FP8 form and the bf16 form on the dequantized operands differ", o)
					}
					continue
				}
				o.checkClose(t, fp8, bf16)
			}
		}
	})
}

// kMajor returns w [G, K, N] transposed to [G, N, K].
func kMajor(w []float32, G, K, N int) []float32 {
	out := make([]float32, len(w))
	for i, v := range w {
		g, k, n := i/(K*N), i/N%K, i%N
		out[(g*N+n)*K+k] = v
	}
	return out
}

// TestBlockwiseForwardReadsKMajor: the forward needs no more of w than KMajor and Scales:
// with NMajor (the input gradient's) freed it gives the same bytes.
func TestBlockwiseForwardReadsKMajor(t *testing.T) {
	checkReadsOnly(t, blockwiseFam, fwd, func(w quantized) { dt.NoErr(t, w.(*quant.BlockwiseWeights).NMajor.Free()) })
}

// checkReadsOnly checks that family fam's form f (fwd or dgrad) gives the same bytes
// after free has freed the parts of w that f does not read.
func checkReadsOnly(t *testing.T, fam family, f form, free func(w quantized)) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		o := newBop(fam, 1000, blockShapes[1], f, gemm.KN, device.F32, e4m3F32, e4m3F32, false)
		x, w := o.a.upload(s), o.w.upload(s)
		sz := dt.Must(device.FromSlice(s, device.I32, o.sizes, len(o.sizes)))
		y := [2]*device.Tensor{dt.Must(s.Alloc(device.F32, o.outShape()...)), dt.Must(s.Alloc(device.F32, o.outShape()...))}
		defer func() {
			x.Free()
			w.Free()
			device.FreeAll(sz, y[0], y[1])
		}()
		dt.NoErr(t, o.call(s, y[0], x, nil, w, sz, nil))
		free(w)
		dt.NoErr(t, o.call(s, y[1], x, nil, w, sz, nil))
		if string(dt.Must(download(s, y[0]))) != string(dt.Must(download(s, y[1]))) {
			t.Fatalf("%v: the call gives other bytes with the parts of w it does not read freed", o)
		}
	})
}

// TestBlockwiseDeterministicAndCapture: two runs give the same bytes, and so does the
// call captured in a graph and replayed.
func TestBlockwiseDeterministicAndCapture(t *testing.T) { testFP8Deterministic(t, blockwiseFam) }

func testFP8Deterministic(t *testing.T, fam family) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, bf := range blockForms {
			o := newBop(fam, uint64(700+i), blockShapes[3], bf.f, bf.layout, device.BF16, e4m3F32, e5m2Pow2, false)
			checkDeterministic(t, s, o)
		}
	})
}

// TestBlockwiseInvalidSizes: a negative size or sizes summing past M are an error at once
// on the CPU (recorded in the Status when replayed from a graph) and, on a GPU, recorded
// in the Status with nothing written; the record names the blockwise form.
func TestBlockwiseInvalidSizes(t *testing.T) { testFP8InvalidSizes(t, blockwiseFam) }

func testFP8InvalidSizes(t *testing.T, fam family) {
	cases := []struct {
		sizes []int32
		want  string
	}{
		{[]int32{3, -2, 5}, "sizes[1] = -2 < 0"},
		{[]int32{10, 20, 11}, "sizes sum to 41 > M=40"},
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, tc := range cases {
			for _, bf := range blockForms[:3] {
				for _, capture := range []bool{false, true} {
					// Quantized with valid sizes of as many groups; the call gets tc.sizes.
					o := newBop(fam, 7, shape{"invalid", 3, 40, 32, 48, "uniform"}, bf.f, gemm.KN, device.BF16, e4m3F32, e4m3F32, false)
					o.sizes = tc.sizes
					st := dt.Must(device.NewStatus(s))
					err := invalidSizesErr(t, s, o, tc.sizes, st, capture)
					if want := "gemm: " + fam.op(bf.f) + ": " + tc.want; err == nil || err.Error() != want {
						t.Fatalf("%v %v capture=%v: error %v, want %q", o, tc.sizes, capture, err, want)
					}
					st.Free()
				}
			}
		}
	})
}

// runErr runs o once into a poisoned output and returns the call's error; a failed call
// must leave the output as it was.
func (o *bop) runErr(t *testing.T, s *device.Stream, opt *gemm.Options) error {
	a, b, w, sz, free := o.upload(s)
	c := dt.Must(s.Alloc(o.out, o.outShape()...))
	dt.Poison(t, s, c)
	defer func() {
		free()
		c.Free()
	}()
	err := o.call(s, c, a, b, w, sz, opt)
	if err != nil && !allBytes(dt.Must(download(s, c)), 0xFF) {
		return fmt.Errorf("the call failed (%v) but wrote its output", err)
	}
	return err
}
