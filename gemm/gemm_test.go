package gemm_test

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// form names one of the three entry points.
type form int

const (
	fwd form = iota
	dgrad
	wgrad
)

func (f form) String() string { return [...]string{"fwd", "dgrad", "wgrad"}[f] }

// shape is a case of the shared suite.
type shape struct {
	name       string
	G, M, K, N int
	dist       string // uniform, skewed, short (sum < M), empty
}

var shapes = []shape{
	{"1x1x1", 1, 1, 1, 1, "uniform"},
	{"odd", 3, 17, 3, 5, "uniform"},
	{"odd-short", 4, 129, 17, 33, "short"},
	{"vec-small", 5, 200, 64, 136, "skewed"},
	{"vec-big", 2, 300, 72, 264, "uniform"},
	{"vec-big-short", 3, 400, 64, 256, "short"},
	{"many-groups", 300, 600, 16, 24, "skewed"},
	{"g1100", 1100, 2000, 8, 8, "skewed"},
	{"g4200", 4200, 5000, 8, 16, "skewed"},
	{"all-empty", 4, 40, 8, 8, "empty"},
	{"k0", 2, 10, 0, 8, "uniform"},
}

// genSizes returns G group sizes: uniform sums to M in random parts; skewed sums to M
// with Zipf-like weights and an eighth of the groups empty; short sums to less than M
// with some groups empty; empty is all zeros.
func genSizes(r *rand.Rand, G, M int, dist string) []int32 {
	s := make([]int32, G)
	if G == 0 {
		return s
	}
	total := M
	switch dist {
	case "empty":
		return s
	case "short":
		total = M - 1 - r.IntN(max(M/3, 1))
	}
	w := make([]float64, G)
	sum := 0.0
	for g := range w {
		switch dist {
		case "skewed", "short":
			w[g] = 1 / math.Pow(float64(r.IntN(G)+1), 1.1)
			if r.IntN(8) == 0 {
				w[g] = 0
			}
		default:
			w[g] = 0.5 + r.Float64()
		}
		sum += w[g]
	}
	if sum == 0 {
		w[0], sum = 1, 1
	}
	left := total
	for g := range s {
		v := int(math.Floor(w[g] / sum * float64(total)))
		s[g] = int32(v)
		left -= v
	}
	for left > 0 { // spread the remainder over non-empty groups
		g := r.IntN(G)
		if w[g] > 0 {
			s[g]++
			left--
		}
	}
	return s
}

// operands holds one case's inputs as float32 values already rounded to their dtype.
type operands struct {
	sh         shape
	f          form
	layout     gemm.WeightLayout
	in, out    device.DType
	accumulate bool
	offset     int // elements before the operands in their allocations (unaligned views)
	sizes      []int32
	a, b, c0   []float32 // the two operands; c0 the initial output (Accumulate)
	aShape     []int
	bShape     []int
	cShape     []int
}

func rounded(dt device.DType, v []float32) []float32 {
	b := make([]byte, len(v)*dt.Size())
	device.EncodeFloat32(dt, b, v)
	out := make([]float32, len(v))
	device.DecodeFloat32(dt, out, b)
	return out
}

func newOperands(seed uint64, sh shape, f form, layout gemm.WeightLayout, in, out device.DType, accumulate bool) *operands {
	r := dt.Rand(seed)
	o := &operands{sh: sh, f: f, layout: layout, in: in, out: out, accumulate: accumulate}
	o.sizes = genSizes(r, sh.G, sh.M, sh.dist)
	G, M, K, N := sh.G, sh.M, sh.K, sh.N
	wshape := []int{G, K, N}
	if layout == gemm.NK {
		wshape = []int{G, N, K}
	}
	switch f {
	case fwd:
		o.aShape, o.bShape, o.cShape = []int{M, K}, wshape, []int{M, N}
	case dgrad:
		o.aShape, o.bShape, o.cShape = []int{M, N}, wshape, []int{M, K}
	case wgrad:
		o.aShape, o.bShape, o.cShape = []int{M, K}, []int{M, N}, wshape
	}
	o.a = rounded(in, dt.Normal(r, prod(o.aShape), 1))
	o.b = rounded(in, dt.Normal(r, prod(o.bShape), 1))
	// Rows past the groups belong to none: NaN there must reach no result.
	used := 0
	for _, s := range o.sizes {
		used += max(0, int(s))
	}
	if used <= M {
		nanRows(o.a[used*o.aShape[1]:])
		if f == wgrad {
			nanRows(o.b[used*N:])
		}
	}
	if accumulate {
		o.c0 = rounded(out, dt.Normal(r, prod(o.cShape), 4))
	}
	return o
}

func nanRows(v []float32) {
	for i := range v {
		v[i] = float32(math.NaN())
	}
}

func prod(s []int) int {
	n := 1
	for _, d := range s {
		n *= d
	}
	return n
}

func (o *operands) String() string {
	acc := ""
	if o.accumulate {
		acc = "+acc"
	}
	return fmt.Sprintf("%s/%v/%v/%v->%v%s", o.sh.name, o.f, o.layout, o.in, o.out, acc)
}

// reference computes the expected output in float64 from the rounded inputs.
func (o *operands) reference() []float64 {
	G, K, N := o.sh.G, o.sh.K, o.sh.N
	off := make([]int, G+1)
	for g, s := range o.sizes {
		off[g+1] = off[g] + int(s)
	}
	// w(g, k, n) for either layout.
	w := func(g, k, n int) float64 {
		if o.layout == gemm.NK {
			return float64(o.b[(g*N+n)*K+k])
		}
		return float64(o.b[(g*K+k)*N+n])
	}
	ref := make([]float64, prod(o.cShape))
	switch o.f {
	case fwd:
		for g := 0; g < G; g++ {
			for i := off[g]; i < off[g+1]; i++ {
				for n := 0; n < N; n++ {
					s := 0.0
					for k := 0; k < K; k++ {
						s += float64(o.a[i*K+k]) * w(g, k, n)
					}
					ref[i*N+n] = s
				}
			}
		}
	case dgrad:
		for g := 0; g < G; g++ {
			for i := off[g]; i < off[g+1]; i++ {
				for k := 0; k < K; k++ {
					s := 0.0
					for n := 0; n < N; n++ {
						s += float64(o.a[i*N+n]) * w(g, k, n)
					}
					ref[i*K+k] = s
				}
			}
		}
	case wgrad:
		for g := 0; g < G; g++ {
			for k := 0; k < K; k++ {
				for n := 0; n < N; n++ {
					s := 0.0
					for i := off[g]; i < off[g+1]; i++ {
						s += float64(o.a[i*K+k]) * float64(o.b[i*N+n])
					}
					idx := (g*K+k)*N + n
					if o.layout == gemm.NK {
						idx = (g*N+n)*K + k
					}
					if o.accumulate {
						s += float64(o.c0[idx])
					}
					ref[idx] = s
				}
			}
		}
	}
	return ref
}

// groupsOf returns, for each group, the output element ranges it owns, and the
// trailing range that must be zero (forward and input gradient).
func (o *operands) groups() (ranges [][2]int, tail [2]int) {
	G, M := o.sh.G, o.sh.M
	cols := o.cShape[len(o.cShape)-1]
	if o.f == wgrad {
		per := o.sh.K * o.sh.N
		for g := 0; g < G; g++ {
			ranges = append(ranges, [2]int{g * per, (g + 1) * per})
		}
		return ranges, [2]int{}
	}
	row := 0
	for _, s := range o.sizes {
		ranges = append(ranges, [2]int{row * cols, (row + int(s)) * cols})
		row += int(s)
	}
	return ranges, [2]int{row * cols, M * cols}
}

const guard = 64 // elements past the output that must stay poisoned

// result runs o on d and returns the output's raw bytes and its guard's bytes.
type result struct {
	out, guard []byte
}

func upload(t *testing.T, s *device.Stream, typ device.DType, v []float32, shape []int) *device.Tensor {
	t.Helper()
	x := dt.Must(s.Alloc(typ, shape...))
	dt.NoErr(t, x.SetFloat32(s, v))
	return x
}

// uploadAt is upload into a view offset elements into its allocation.
func uploadAt(t *testing.T, s *device.Stream, typ device.DType, v []float32, shape []int, offset int) *device.Tensor {
	t.Helper()
	if offset == 0 {
		return upload(t, s, typ, v, shape)
	}
	base := dt.Must(s.Alloc(typ, len(v)+offset))
	x := dt.Must(base.View(offset, shape...))
	dt.NoErr(t, x.SetFloat32(s, v))
	return x
}

// run executes the case on s; when capture is set it records the call in a graph
// and replays it instead.
func (o *operands) run(t *testing.T, s *device.Stream, opt *gemm.Options, capture bool) result {
	t.Helper()
	a := uploadAt(t, s, o.in, o.a, o.aShape, o.offset)
	b := uploadAt(t, s, o.in, o.b, o.bShape, o.offset)
	sz := dt.Must(device.FromSlice(s, device.I32, o.sizes, len(o.sizes)))
	n := prod(o.cShape)
	base := dt.Must(s.Alloc(o.out, n+guard))
	dt.Poison(t, s, base)
	c := dt.Must(base.View(0, o.cShape...))
	if o.accumulate {
		dt.NoErr(t, c.SetFloat32(s, o.c0))
	}
	if opt == nil {
		opt = &gemm.Options{}
	}
	opt.Layout = o.layout
	opt.Accumulate = o.accumulate
	call := func() error {
		switch o.f {
		case fwd:
			return gemm.RaggedDot(s, c, a, b, sz, opt)
		case dgrad:
			return gemm.RaggedDotInputGrad(s, c, a, b, sz, opt)
		default:
			return gemm.RaggedDotWeightGrad(s, c, a, b, sz, opt)
		}
	}
	if capture {
		dt.NoErr(t, s.BeginCapture())
		err := call()
		g, err2 := s.EndCapture()
		dt.NoErr(t, err)
		dt.NoErr(t, err2)
		dt.NoErr(t, g.Launch(s))
		dt.NoErr(t, g.Close())
	} else {
		dt.NoErr(t, call())
	}
	all := make([]byte, base.Bytes())
	dt.NoErr(t, base.CopyToHost(s, all))
	for _, x := range []*device.Tensor{a, b, sz, base} {
		x.Free()
	}
	es := o.out.Size()
	return result{out: all[:n*es], guard: all[n*es:]}
}

func decode(typ device.DType, b []byte) []float32 {
	v := make([]float32, len(b)/typ.Size())
	device.DecodeFloat32(typ, v, b)
	return v
}

// tol is the relative error allowed against the float64 reference: 1e-5 when the
// whole computation is f32, else 1e-2.
func (o *operands) tol() float64 {
	if o.in == device.F32 && o.out == device.F32 {
		return 1e-5
	}
	return 1e-2
}

// checkAgainstRef compares got with the float64 reference group by group: the
// norm-wise relative error, and each element against tol·(|ref| + rms of the group).
// Trailing rows must be exact zeros, the guard untouched.
func (o *operands) checkAgainstRef(t *testing.T, res result, ref []float64) {
	t.Helper()
	if !allBytes(res.guard, 0xFF) {
		t.Fatalf("%v: the guard past the output was written", o)
	}
	got := decode(o.out, res.out)
	tol := o.tol()
	ranges, tail := o.groups()
	for g, rg := range ranges {
		var num, den float64
		for i := rg[0]; i < rg[1]; i++ {
			d := float64(got[i]) - ref[i]
			num += d * d
			den += ref[i] * ref[i]
		}
		if o.f == wgrad && o.sizes[g] == 0 && !o.accumulate {
			for i := rg[0]; i < rg[1]; i++ {
				if math.Float32bits(got[i]) != 0 {
					t.Fatalf("%v: group %d is empty but dw[%d] element %d = %v, want +0", o, g, g, i-rg[0], got[i])
				}
			}
			continue
		}
		if rg[1] == rg[0] {
			continue
		}
		rms := math.Sqrt(den / float64(rg[1]-rg[0]))
		if den > 0 && math.Sqrt(num/den) > tol || math.IsNaN(num) {
			t.Fatalf("%v: group %d (size %d): relative error %.3g > %g", o, g, o.sizes[g], math.Sqrt(num/den), tol)
		}
		for i := rg[0]; i < rg[1]; i++ {
			if d := math.Abs(float64(got[i]) - ref[i]); !(d <= tol*(math.Abs(ref[i])+rms)) {
				t.Fatalf("%v: group %d element %d: got %v, want %v", o, g, i-rg[0], got[i], ref[i])
			}
		}
	}
	for i := tail[0]; i < tail[1]; i++ {
		if math.Float32bits(got[i]) != 0 {
			cols := o.cShape[1]
			t.Fatalf("%v: trailing row %d column %d = %v, want +0", o, i/cols, i%cols, got[i])
		}
	}
}

// checkClose compares a GPU result with the CPU's: within one bf16 rounding (bf16
// output) or 1e-5 (f32 output) relative to |cpu| + rms.
func (o *operands) checkClose(t *testing.T, gpu, cpu result) {
	t.Helper()
	g, c := decode(o.out, gpu.out), decode(o.out, cpu.out)
	var ss float64
	for _, v := range c {
		ss += float64(v) * float64(v)
	}
	rms := math.Sqrt(ss / float64(max(len(c), 1)))
	rel, abs := 1e-5, 1e-5*rms
	if o.out == device.BF16 {
		rel, abs = 1.0/128, 1e-3*rms
	}
	if o.in == device.BF16 && o.out == device.F32 {
		rel, abs = 1e-5, 1e-5*rms
	}
	for i := range c {
		if d := math.Abs(float64(g[i]) - float64(c[i])); !(d <= rel*math.Abs(float64(c[i]))+abs) {
			t.Fatalf("%v: GPU element %d = %v, CPU %v", o, i, g[i], c[i])
		}
	}
}

func allBytes(b []byte, v byte) bool {
	for _, x := range b {
		if x != v {
			return false
		}
	}
	return true
}

var dtypePairs = [][2]device.DType{
	{device.BF16, device.BF16}, {device.BF16, device.F32}, {device.F32, device.F32}, {device.F32, device.BF16},
}

// TestRaggedDot is the shared suite: every shape, form, layout and dtype pair, against
// a float64 reference, on the CPU and (when present) the GPU, where the result is also
// compared with the CPU's.
func TestRaggedDot(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		seed := uint64(1)
		for _, sh := range shapes {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
					for _, p := range dtypePairs {
						seed++
						o := newOperands(seed, sh, f, layout, p[0], p[1], false)
						res := o.run(t, s, nil, false)
						o.checkAgainstRef(t, res, o.reference())
						if d.IsCUDA() {
							o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
						}
					}
				}
			}
		}
	})
}

// TestUnalignedViews runs aligned shapes on operands that start one element into
// their allocations, which the GPU must load without 16-byte copies.
func TestUnalignedViews(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		checkBF16(t, d, 3000, []shape{shapes[3], shapes[4]}, 1)
	})
}

// TestPortableKernels runs aligned bf16 shapes with the Hopper kernels turned off, so
// that on the H100 and H200 the mma.sync kernels that other GPUs run are tested too.
func TestPortableKernels(t *testing.T) {
	defer gemm.ForceMMA(true)()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		checkBF16(t, d, 4000, []shape{shapes[3], shapes[4], shapes[5]}, 0)
	})
}

// checkBF16 runs every form and layout of each shape on bf16 operands that start
// offset elements into their allocations (seeds from seed on), against the reference
// and, on a GPU, against the CPU.
func checkBF16(t *testing.T, d *device.Device, seed uint64, shs []shape, offset int) {
	t.Helper()
	s := d.Stream()
	for i, sh := range shs {
		for _, f := range []form{fwd, dgrad, wgrad} {
			for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
				o := newOperands(seed+uint64(i), sh, f, layout, device.BF16, device.BF16, false)
				o.offset = offset
				res := o.run(t, s, nil, false)
				o.checkAgainstRef(t, res, o.reference())
				if d.IsCUDA() {
					o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
				}
			}
		}
	}
}

// TestWeightGradAccumulate checks dw += x_gᵀ·dy_g in both dtypes and layouts, with
// empty groups left bit for bit as they were.
func TestWeightGradAccumulate(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, sh := range []shape{shapes[2], shapes[3], shapes[4], shapes[6]} {
			for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
				for _, p := range dtypePairs {
					o := newOperands(uint64(1000+i), sh, wgrad, layout, p[0], p[1], true)
					res := o.run(t, s, nil, false)
					o.checkAgainstRef(t, res, o.reference())
					// Empty groups keep their bytes.
					es := o.out.Size()
					per := sh.K * sh.N
					init := make([]byte, len(o.c0)*es)
					device.EncodeFloat32(o.out, init, o.c0)
					for g, n := range o.sizes {
						lo, hi := g*per*es, (g+1)*per*es
						if n == 0 && !bytes.Equal(res.out[lo:hi], init[lo:hi]) {
							t.Fatalf("%v: empty group %d changed under Accumulate", o, g)
						}
					}
					if d.IsCUDA() {
						o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
					}
				}
			}
		}
	})
}

// TestDeterministicAndCapture checks that two runs give the same bytes and that a
// call captured in a graph and replayed gives them too.
func TestDeterministicAndCapture(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, sh := range []shape{shapes[3], shapes[5], shapes[7]} {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, p := range [][2]device.DType{{device.BF16, device.BF16}, {device.F32, device.F32}} {
					o := newOperands(uint64(2000+i), sh, f, gemm.NK, p[0], p[1], false)
					checkDeterministic(t, s, o)
				}
			}
		}
	})
}

// TestInvalidSizes checks negative sizes and sizes summing past M: on the CPU an error
// at once; on the GPU no error from the call, the error in the Status, and no output
// written (the poisoned output and its guard stay as they were). A captured CPU call
// records the error in the Status like the GPU. K=17, N=23 takes the padded copies of
// the Hopper kernels on the H100 and H200, whose output is copied back all the same.
func TestInvalidSizes(t *testing.T) {
	cases := []struct {
		sizes []int32
		want  string
	}{
		{[]int32{3, -2, 5}, "sizes[1] = -2 < 0"},
		{[]int32{-1, -7}, "sizes[0] = -1 < 0"},
		{[]int32{10, 20, 11}, "sizes sum to 41 > M=40"},
		{[]int32{math.MaxInt32, math.MaxInt32, 2}, fmt.Sprintf("sizes sum to %d > M=40", 2*int64(math.MaxInt32)+2)},
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, tc := range cases {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, kn := range [][2]int{{16, 24}, {17, 23}} {
					for _, capture := range []bool{false, true} {
						sh := shape{name: fmt.Sprintf("invalid-k%d-n%d", kn[0], kn[1]), G: len(tc.sizes), M: 40, K: kn[0], N: kn[1]}
						o := newOperands(7, sh, f, gemm.KN, device.BF16, device.BF16, false)
						o.sizes = tc.sizes
						st := dt.Must(device.NewStatus(s))
						err := invalidSizesErr(t, s, o, tc.sizes, st, capture)
						op := map[form]string{fwd: "RaggedDot", dgrad: "RaggedDotInputGrad", wgrad: "RaggedDotWeightGrad"}[f]
						if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), op+":") {
							t.Fatalf("%v %v capture=%v: error %v, want %q from %s", o, tc.sizes, capture, err, tc.want, op)
						}
						dt.NoErr(t, st.Reset(s))
						dt.NoErr(t, st.Check(s))
						st.Free()
					}
				}
			}
		}
	})
}

// runner is a call under test on its operands, dense or blockwise: run and runErr write
// a poisoned output.
type runner interface {
	fmt.Stringer
	run(t *testing.T, s *device.Stream, opt *gemm.Options, capture bool) result
	runErr(t *testing.T, s *device.Stream, opt *gemm.Options) error
}

// checkDeterministic checks that two runs of o on s give the same bytes and that the
// call captured in a graph and replayed gives them too, its guard left as it was.
func checkDeterministic(t *testing.T, s *device.Stream, o runner) {
	t.Helper()
	a := o.run(t, s, nil, false)
	b := o.run(t, s, nil, false)
	if !bytes.Equal(a.out, b.out) {
		t.Fatalf("%v: two runs differ", o)
	}
	c := o.run(t, s, nil, true)
	if !bytes.Equal(a.out, c.out) || !allBytes(c.guard, 0xFF) {
		t.Fatalf("%v: the captured graph's result differs from the direct call's", o)
	}
}

// invalidSizesErr runs o, whose sizes are invalid, on s with opt.Status st and returns
// the error: the call's on the CPU when not captured, else the one recorded in st, after
// checking that neither the poisoned output nor its guard was written.
func invalidSizesErr(t *testing.T, s *device.Stream, o runner, sizes []int32, st *device.Status, capture bool) error {
	t.Helper()
	opt := &gemm.Options{Status: st}
	if !s.Device().IsCUDA() && !capture {
		return o.runErr(t, s, opt)
	}
	res := o.run(t, s, opt, capture)
	if !allBytes(res.out, 0xFF) || !allBytes(res.guard, 0xFF) {
		t.Fatalf("%v %v: invalid sizes but the output was written", o, sizes)
	}
	return st.Check(s)
}

// runErr runs o once (no capture) and returns the call's error.
func (o *operands) runErr(t *testing.T, s *device.Stream, opt *gemm.Options) error {
	t.Helper()
	a := upload(t, s, o.in, o.a, o.aShape)
	b := upload(t, s, o.in, o.b, o.bShape)
	sz := dt.Must(device.FromSlice(s, device.I32, o.sizes, len(o.sizes)))
	c := dt.Must(s.Alloc(o.out, o.cShape...))
	dt.Poison(t, s, c)
	defer func() {
		for _, x := range []*device.Tensor{a, b, sz, c} {
			x.Free()
		}
	}()
	var err error
	switch o.f {
	case fwd:
		err = gemm.RaggedDot(s, c, a, b, sz, opt)
	case dgrad:
		err = gemm.RaggedDotInputGrad(s, c, a, b, sz, opt)
	default:
		err = gemm.RaggedDotWeightGrad(s, c, a, b, sz, opt)
	}
	if err != nil && !allBytes(dt.Must(download(s, c)), 0xFF) {
		t.Fatalf("%v: the call failed but wrote its output", o)
	}
	return err
}

func download(s *device.Stream, x *device.Tensor) ([]byte, error) {
	b := make([]byte, x.Bytes())
	return b, x.CopyToHost(s, b)
}

// TestDeviceStatus checks the device's own status, used when Options.Status is nil.
func TestDeviceStatus(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		dt.NoErr(t, gemm.ResetStatus(s))
		dt.NoErr(t, gemm.CheckStatus(s))
		sh := shape{name: "status", G: 3, M: 20, K: 8, N: 8}
		o := newOperands(9, sh, fwd, gemm.KN, device.BF16, device.F32, false)
		o.sizes = []int32{4, 4, 13}
		if d.IsCUDA() {
			o.run(t, s, nil, false)
		} else {
			o.run(t, s, nil, true) // a replayed CPU graph records like the GPU
		}
		err := gemm.CheckStatus(s)
		if err == nil || !strings.Contains(err.Error(), "RaggedDot: sizes sum to 21 > M=20") {
			t.Fatalf("CheckStatus = %v, want sizes sum to 21 > M=20", err)
		}
		// The first error is kept.
		o.sizes = []int32{4, -4, 1}
		if d.IsCUDA() {
			o.run(t, s, nil, false)
		} else {
			o.run(t, s, nil, true)
		}
		if err2 := gemm.CheckStatus(s); err2 == nil || err2.Error() != err.Error() {
			t.Fatalf("CheckStatus after a second error = %v, want the first, %v", err2, err)
		}
		dt.NoErr(t, gemm.ResetStatus(s))
		dt.NoErr(t, gemm.CheckStatus(s))
	})
}

// TestArgErrors checks that bad arguments are errors naming the argument.
func TestArgErrors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		al := func(typ device.DType, shape ...int) *device.Tensor { return dt.Must(s.Alloc(typ, shape...)) }
		x := al(device.BF16, 10, 8)
		w := al(device.BF16, 2, 8, 6)
		y := al(device.BF16, 10, 6)
		sz := dt.Must(device.FromSlice(s, device.I32, []int32{4, 6}, 2))
		freed := al(device.BF16, 10, 8)
		freed.Free()
		cases := []struct {
			name string
			err  error
			want string
		}{
			{"nil y", gemm.RaggedDot(s, nil, x, w, sz, nil), "y is nil"},
			{"freed x", gemm.RaggedDot(s, y, freed, w, sz, nil), "x"},
			{"sizes dtype", gemm.RaggedDot(s, y, x, w, al(device.I64, 2), nil), "sizes is i64[2]"},
			{"sizes rank", gemm.RaggedDot(s, y, x, w, al(device.I32, 2, 1), nil), "want i32[G]"},
			{"dtype mix", gemm.RaggedDot(s, y, al(device.F32, 10, 8), w, sz, nil), "want both bf16 or both f32"},
			{"int operands", gemm.RaggedDot(s, y, al(device.I32, 10, 8), al(device.I32, 2, 8, 6), sz, nil), "want both bf16 or both f32"},
			{"out dtype", gemm.RaggedDot(s, al(device.F16, 10, 6), x, w, sz, nil), "want bf16 or f32"},
			{"w groups", gemm.RaggedDot(s, y, x, al(device.BF16, 3, 8, 6), sz, nil), "want w[G=2, K, N]"},
			{"x cols", gemm.RaggedDot(s, y, al(device.BF16, 10, 7), w, sz, nil), "want x[10, 8]"},
			{"y shape", gemm.RaggedDot(s, al(device.BF16, 10, 5), x, w, sz, nil), "y is bf16[10 5]@"},
			{"NK shapes", gemm.RaggedDot(s, y, x, w, sz, &gemm.Options{Layout: gemm.NK}), "layout NK"},
			{"layout", gemm.RaggedDot(s, y, x, w, sz, &gemm.Options{Layout: 7}), "opt.Layout is WeightLayout(7)"},
			{"accumulate fwd", gemm.RaggedDot(s, y, x, w, sz, &gemm.Options{Accumulate: true}), "Accumulate applies to RaggedDotWeightGrad only"},
			{"dgrad dx", gemm.RaggedDotInputGrad(s, al(device.BF16, 10, 6), y, w, sz, nil), "want dx[10, 8]"},
			{"wgrad M", gemm.RaggedDotWeightGrad(s, w, x, al(device.BF16, 9, 6), sz, nil), "the same M"},
			{"wgrad dw", gemm.RaggedDotWeightGrad(s, al(device.BF16, 2, 6, 8), x, y, sz, nil), "want [2 8 6] (layout KN)"},
			{"stream", gemm.RaggedDot(nil, y, x, w, sz, nil), "nil stream"},
		}
		for _, c := range cases {
			if c.err == nil || !strings.Contains(c.err.Error(), c.want) {
				t.Errorf("%s: error %v, want %q", c.name, c.err, c.want)
			}
		}
		if d.IsCUDA() {
			cpu := device.CPU().Stream()
			xc := dt.Must(cpu.Alloc(device.BF16, 10, 8))
			if err := gemm.RaggedDot(s, y, xc, w, sz, nil); err == nil || !strings.Contains(err.Error(), "x is on cpu") {
				t.Errorf("mixed devices: error %v", err)
			}
		}
	})
}
