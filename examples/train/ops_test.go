package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// upT uploads v as a tensor of dtype typ and shape, and returns it with the values it
// holds (v rounded to typ).
func upT(t *testing.T, s *device.Stream, typ device.DType, v []float32, shape ...int) (*device.Tensor, []float32) {
	t.Helper()
	x := dt.Must(device.FromFloat32(s, typ, v, shape...))
	return x, down(t, s, x)
}

// tolFor is the tolerance of an op's output of dtype typ: bf16 rounds once.
func tolFor(typ device.DType, f32 float64) float64 {
	if typ == device.BF16 {
		return 8e-3
	}
	return f32
}

// TestOps checks the dense ops of the model on each device, in each compute dtype,
// against float64 references, at sizes that are not multiples of the block size,
// outputs poisoned first.
func TestOps(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(7)
		for _, typ := range []device.DType{device.F32, device.BF16} {
			// Some sizes repeat tokens often (V of 2 or 7 over hundreds of rows) or cut
			// the GPU's warps of 32 rows and groups of 4 columns.
			for _, c := range []struct{ B, W, V, H int }{{1, 1, 2, 1}, {37, 5, 11, 19}, {300, 3, 7, 300}, {600, 2, 300, 33}, {203, 6, 2, 64}, {70, 3, 5, 1028}, {40, 2, 3, 4100}} {
				t.Run(fmt.Sprintf("%v/B=%d,W=%d,V=%d,H=%d", typ, c.B, c.W, c.V, c.H), func(t *testing.T) {
					testOps(t, s, r, typ, c.B, c.W, c.V, c.H)
				})
			}
		}
	})
}

func testOps(t *testing.T, s *device.Stream, r *rand.Rand, typ device.DType, B, W, V, H int) {
	ts := device.NewTemps(s)
	defer ts.Free()
	keep := func(x *device.Tensor, v []float32) (*device.Tensor, []float32) { ts.Add(x); return x, v }
	alloc := func(dtype device.DType, shape ...int) *device.Tensor {
		x := dt.Must(s.Alloc(dtype, shape...))
		ts.Add(x)
		dt.Poison(t, s, x)
		return x
	}
	ld := W + 2
	tokv := randTokens(uint64(B), B*ld, V, true)
	tok := dt.Must(device.FromSlice(s, device.I32, tokv, B, ld))
	ts.Add(tok)
	embv := dt.Normal(r, W*V*H, 1)
	emb := up(t, s, embv, W*V, H)
	ts.Add(emb)
	rmsRef := func(row []float64) float64 {
		ss := 0.0
		for _, v := range row {
			ss += v * v
		}
		return 1 / math.Sqrt(ss/float64(H)+rmsEps)
	}

	// embedNorm: the embedding (the f32 sum in increasing w, bit for bit) and its norm.
	h, xn, rstd := alloc(device.F32, B, H), alloc(typ, B, H), alloc(device.F32, B)
	dt.NoErr(t, embedNorm(s, h, xn, rstd, emb, tok, W, V))
	wantH, wantXn, wantR := make([]float64, B*H), make([]float64, B*H), make([]float64, B)
	sumH := make([]float32, B*H)
	for b := range B {
		for w := range W {
			if v := int(tokv[b*ld+w]); v < V {
				for j := range H {
					wantH[b*H+j] += float64(embv[(w*V+v)*H+j])
					sumH[b*H+j] += embv[(w*V+v)*H+j]
				}
			}
		}
		wantR[b] = rmsRef(wantH[b*H : (b+1)*H])
		for j := range H {
			wantXn[b*H+j] = wantH[b*H+j] * wantR[b]
		}
	}
	if diff := cmp.Diff(sumH, down(t, s, h)); diff != "" {
		t.Errorf("embedNorm h differs from the sums in increasing w (-want +got):\n%s", diff)
	}
	near(t, "embedNorm xn", down(t, s, xn), wantXn, tolFor(typ, 1e-5))
	near(t, "embedNorm rstd", down(t, s, rstd), wantR, 1e-5)

	// addNorm: the residual add and the next norm.
	hiv := dt.Normal(r, B*H, 2)
	hi := up(t, s, hiv, B, H)
	ts.Add(hi)
	y, yv := keep(upT(t, s, typ, dt.Normal(r, B*H, 1), B, H))
	ho, xn2, rstd2 := alloc(device.F32, B, H), alloc(typ, B, H), alloc(device.F32, B)
	dt.NoErr(t, addNorm(s, ho, xn2, rstd2, hi, y))
	for b := range B {
		for j := range H {
			wantH[b*H+j] = float64(hiv[b*H+j]) + float64(yv[b*H+j])
		}
		wantR[b] = rmsRef(wantH[b*H : (b+1)*H])
		for j := range H {
			wantXn[b*H+j] = wantH[b*H+j] * wantR[b]
		}
	}
	near(t, "addNorm ho", down(t, s, ho), wantH, 1e-6)
	near(t, "addNorm xn", down(t, s, xn2), wantXn, tolFor(typ, 1e-5))
	near(t, "addNorm rstd", down(t, s, rstd2), wantR, 1e-5)

	// normBackward of the norm of ho, into dx or added to it, with and without the copy.
	dxn, dxnv := keep(upT(t, s, typ, dt.Normal(r, B*H, 1), B, H))
	hov, rv := down(t, s, ho), down(t, s, rstd2)
	for _, c := range []struct{ acc, copyOnly bool }{{false, false}, {true, false}, {true, true}} {
		acc := c.acc
		prev := dt.Normal(r, B*H, 1)
		dx := up(t, s, prev, B, H)
		ts.Add(dx)
		if !acc {
			dt.Poison(t, s, dx)
		}
		dxc := alloc(typ, B, H)
		dt.NoErr(t, normBackward(s, dx, dxc, dxn, ho, rstd2, acc, c.copyOnly))
		want := make([]float64, B*H)
		for b := range B {
			rb, dot := float64(rv[b]), 0.0
			for j := range H {
				dot += float64(dxnv[b*H+j]) * float64(hov[b*H+j]) * rb
			}
			for j := range H {
				want[b*H+j] = rb * (float64(dxnv[b*H+j]) - float64(hov[b*H+j])*rb*dot/float64(H))
				if acc {
					want[b*H+j] += float64(prev[b*H+j])
				}
			}
		}
		what := fmt.Sprintf("normBackward(accumulate=%v, copyOnly=%v)", acc, c.copyOnly)
		if c.copyOnly {
			if diff := cmp.Diff(prev, down(t, s, dx)); diff != "" {
				t.Errorf("%s: dx was written (-before +after):\n%s", what, diff)
			}
		} else {
			near(t, what+" dx", down(t, s, dx), want, 1e-4)
		}
		near(t, what+" dxc", down(t, s, dxc), want, tolFor(typ, 1e-4))
	}
	if err := normBackward(s, alloc(device.F32, B, H), nil, dxn, ho, rstd2, true, true); err == nil || !strings.Contains(err.Error(), "copyOnly without dxc") {
		t.Errorf("normBackward with copyOnly and no dxc: error %v", err)
	}

	// softmaxCE: logits [B, H] (H plays the vocabulary), with and without the gradient.
	zv := dt.Normal(r, B*H, 3)
	z := up(t, s, zv, B, H)
	ts.Add(z)
	const col = 1
	for _, grad := range []bool{false, true} {
		lossInit := dt.Normal(r, B, 1)
		loss := up(t, s, lossInit, B)
		ts.Add(loss)
		var dz *device.Tensor
		if grad {
			dz = alloc(typ, B, H)
		}
		tokH := randTokens(uint64(B+H), B*ld, H, true)
		tt := dt.Must(device.FromSlice(s, device.I32, tokH, B, ld))
		ts.Add(tt)
		dt.NoErr(t, softmaxCE(s, loss, dz, z, tt, col, 0.5))
		wantL, wantD := make([]float64, B), make([]float64, B*H)
		for b := range B {
			m := math.Inf(-1)
			for j := range H {
				m = math.Max(m, float64(zv[b*H+j]))
			}
			se := 0.0
			for j := range H {
				se += math.Exp(float64(zv[b*H+j]) - m)
			}
			tg := int(tokH[b*ld+col])
			wantL[b] = float64(lossInit[b])
			if tg < H {
				wantL[b] += math.Log(se) + m - float64(zv[b*H+tg])
			}
			for j := range H {
				p := 0.0
				if tg < H {
					p = math.Exp(float64(zv[b*H+j])-m) / se
				}
				if j == tg {
					p--
				}
				wantD[b*H+j] = 0.5 * p
			}
		}
		near(t, fmt.Sprintf("softmaxCE(grad=%v) loss", grad), down(t, s, loss), wantL, 1e-5)
		if grad {
			near(t, "softmaxCE dlogits", down(t, s, dz), wantD, tolFor(typ, 1e-5))
		}
	}

	// embedGroup: each position's rows grouped by token in increasing b, ids outside [0, V)
	// left out, perm past the grouped rows untouched. Token 0 is made frequent, so that its
	// entries have rows in every part of embedBackward's sums.
	for b := 0; b < B; b += 3 {
		tokv[b*ld] = 0
	}
	tok = dt.Must(device.FromSlice(s, device.I32, tokv, B, ld))
	ts.Add(tok)
	perm, offs := alloc(device.I32, W, B), alloc(device.I32, W, V+1)
	dt.NoErr(t, embedGroup(s, perm, offs, tok, W, V))
	rows := make([][][]int, W) // each position's rows of each token, in increasing b
	wantPerm, wantOffs := make([]int32, W*B), make([]int32, 0, W*(V+1))
	for w := range W {
		rows[w] = make([][]int, V)
		for b := range B {
			if v := int(tokv[b*ld+w]); v >= 0 && v < V {
				rows[w][v] = append(rows[w][v], b)
			}
		}
		i := 0
		for v := range V {
			wantOffs = append(wantOffs, int32(i))
			for _, b := range rows[w][v] {
				wantPerm[w*B+i] = int32(b)
				i++
			}
		}
		wantOffs = append(wantOffs, int32(i))
		for ; i < B; i++ {
			wantPerm[w*B+i] = -1 // the poison, left as it was
		}
	}
	gotPerm, gotOffs := make([]int32, W*B), make([]int32, W*(V+1))
	dt.NoErr(t, device.Download(s, perm, gotPerm))
	dt.NoErr(t, device.Download(s, offs, gotOffs))
	if diff := cmp.Diff(wantOffs, gotOffs); diff != "" {
		t.Errorf("embedGroup offs (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantPerm, gotPerm); diff != "" {
		t.Errorf("embedGroup perm (-want +got):\n%s", diff)
	}

	// embedBackward from the grouping, dh in the compute dtype (bf16 widened exactly): each
	// entry the f32 sum of its rows in increasing b, cut into embParts parts summed one by
	// one and then in order, bit for bit.
	dh, dhv := keep(upT(t, s, typ, dt.Normal(r, B*H, 1), B, H))
	demb := alloc(device.F32, W*V, H)
	dt.NoErr(t, embedBackward(s, demb, dh, perm, offs, W, V))
	want := make([]float32, W*V*H)
	for w := range W {
		for v, bs := range rows[w] {
			q := (len(bs) + embParts - 1) / embParts
			for p := range embParts {
				part := make([]float32, H)
				for i := p * q; i < min((p+1)*q, len(bs)); i++ {
					for j := range H {
						part[j] += dhv[bs[i]*H+j]
					}
				}
				for j := range H {
					if p == 0 {
						want[(w*V+v)*H+j] = part[j]
					} else {
						want[(w*V+v)*H+j] += part[j]
					}
				}
			}
		}
	}
	got := down(t, s, demb)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("embedBackward differs from the sums in increasing b (-want +got):\n%s", diff)
	}
	// And the sums are the rows' sums, within f32 rounding of float64 ones.
	exact := make([]float64, W*V*H)
	for b := range B {
		for w := range W {
			if v := int(tokv[b*ld+w]); v >= 0 && v < V {
				for j := range H {
					exact[(w*V+v)*H+j] += float64(dhv[b*H+j])
				}
			}
		}
	}
	near(t, "embedBackward against float64 sums", got, exact, 1e-6*float64(B))
}

// adamCases are the parameters of TestAdamW: lengths around the chunk and the groups
// of 4, with and without weight decay and compute copy, and where each tensor's element
// 0 sits in a group of 4 elements (16 bytes of f32, 8 of bf16): all at the start of
// one, all at the same place past it (the kernel takes the first elements one by one,
// then groups of 4), or not alike (it takes every element one by one).
var adamCases = []struct {
	n            int
	decay, copy  bool
	p, g, m, v   int // the place of element 0 in its group, 0 to 3
	c            int
	shift, chunk int // adamShift (-1: one element at a time) and the kernel's chunks of this parameter
}{
	{n: 1, decay: true, copy: true, chunk: 1},
	{n: 3, copy: true, p: 1, g: 1, m: 1, v: 1, c: 1, shift: 1, chunk: 1},
	{n: 5, decay: true, chunk: 1},
	{n: 7, decay: true, copy: true, p: 3, g: 3, m: 3, v: 3, c: 3, shift: 3, chunk: 1},
	{n: adamChunk - 1, copy: true, p: 2, g: 2, m: 2, v: 2, c: 2, shift: 2, chunk: 2},
	{n: adamChunk, decay: true, copy: true, chunk: 1},
	{n: adamChunk + 1, p: 1, g: 1, m: 1, v: 1, shift: 1, chunk: 2},
	{n: 3*adamChunk + 17, decay: true, copy: true, chunk: 4},
	{n: 5000, decay: true, copy: true, p: 3, g: 3, m: 3, v: 3, c: 3, shift: 3, chunk: 3},
	{n: 5000, copy: true, g: 1, shift: -1, chunk: 3},              // the gradient alone is off
	{n: 4099, decay: true, copy: true, c: 2, shift: -1, chunk: 3}, // the copy alone is off
	{n: 20000, decay: true, chunk: 10},
	{n: 300, p: 2, g: 2, m: 2, v: 2, shift: 2, chunk: 1},
}

// adamOut is one parameter's state after TestAdamW's steps: its buffers whole, the
// elements around the tensors included, and where in them the tensors start.
type adamOut struct {
	P, M, V []float32
	C       []uint16
	At      [5]int // of p, g, m, v and c
}

// adamGuard is the number of elements of a test buffer past its tensor; 3 more may come
// before it.
const adamGuard = 5

// groupStart returns the first element of a buffer at addr (elements of size bytes) at
// place pos of a group of 4 elements; the CPU's tensors have no address, and start at pos.
func groupStart(addr, size uintptr, pos int) int {
	for j := range 4 {
		if int((addr+uintptr(j)*size)%(4*size)/size) == pos {
			return j
		}
	}
	return pos
}

// runAdam builds the parameters of adamCases on s, their moments of dtype moments and
// gradients of dtype grads (values from seed 9, every buffer's elements outside its tensor
// NaN), and takes AdamW steps 1 to steps with hyp. It returns the buffers and the values
// the tensors started with.
func runAdam(t *testing.T, s *device.Stream, moments, grads device.DType, hyp adamHyper, steps int) ([]adamOut, [][4][]float32) {
	r := dt.Rand(9)
	ts := device.NewTemps(s)
	defer ts.Free()
	nan := float32(math.NaN())
	var ps []adamParam
	var bufs [][5]*device.Tensor
	var in [][4][]float32
	var ats [][5]int
	for i, c := range adamCases {
		x := [4][]float32{dt.Normal(r, c.n, 1), dt.Normal(r, c.n, 1), dt.Normal(r, c.n, 0.1), dt.Normal(r, c.n, 0.1)}
		for j := range x[3] {
			x[3][j] *= x[3][j]
		}
		// Zero and tiny gradients and moments, whose squares and quotients are subnormal.
		x[1][0], x[3][0] = 0, 0
		if c.n > 2 {
			x[1][1], x[2][1], x[3][1] = 1e-20, 1e-30, 1e-38
		}
		var b [5]*device.Tensor
		var at [5]int
		views := make([]*device.Tensor, 4)
		for k, pos := range []int{c.p, c.g, c.m, c.v} {
			typ := device.F32
			switch {
			case k == 1:
				typ = grads
			case k >= 2:
				typ = moments
			}
			if typ == device.BF16 {
				for j, y := range x[k] {
					x[k][j] = roundBF16(y) // what the tensor holds
				}
			}
			b[k] = dt.Must(s.Alloc(typ, 3+c.n+adamGuard))
			ts.Add(b[k])
			at[k] = groupStart(b[k].Ptr(), uintptr(typ.Size()), pos)
			v := make([]float32, b[k].Len())
			for j := range v {
				v[j] = nan
			}
			copy(v[at[k]:], x[k])
			dt.NoErr(t, b[k].SetFloat32(s, v))
			views[k] = dt.Must(b[k].View(at[k], c.n))
		}
		q := adamParam{p: views[0], g: views[1], m: views[2], v: views[3], decay: c.decay}
		if c.copy {
			b[4] = dt.Must(s.Alloc(device.BF16, 3+c.n+adamGuard))
			ts.Add(b[4])
			dt.Poison(t, s, b[4])
			at[4] = groupStart(b[4].Ptr(), 2, c.c)
			q.c = dt.Must(b[4].View(at[4], c.n))
		}
		if s.Device().IsCUDA() {
			if got := adamShift(q); got != c.shift {
				t.Fatalf("parameter %d: adamShift = %d, want %d", i, got, c.shift)
			}
			if got := adamChunks(c.n, c.shift); got != int64(c.chunk) {
				t.Fatalf("parameter %d: %d chunks, want %d", i, got, c.chunk)
			}
		}
		ps = append(ps, q)
		bufs = append(bufs, b)
		ats = append(ats, at)
		in = append(in, x)
	}
	tab := dt.Must(newAdamTable(s, ps))
	defer tab.Free()
	for n := 1; n <= steps; n++ {
		dt.NoErr(t, tab.step(s, hyp, n))
	}
	out := make([]adamOut, len(ps))
	for i, b := range bufs {
		out[i] = adamOut{P: down(t, s, b[0]), M: down(t, s, b[2]), V: down(t, s, b[3]), At: ats[i]}
		if b[4] != nil {
			out[i].C = make([]uint16, b[4].Len())
			dt.NoErr(t, device.Download(s, b[4], out[i].C))
		}
	}
	return out, in
}

// roundBF16 returns x rounded to bfloat16, nearest even.
func roundBF16(x float32) float32 { return device.BF16ToFloat32(device.BF16FromFloat32(x)) }

// TestAdamW checks the multi-tensor AdamW step on each device, with f32 and with bf16
// moments and gradients: on the CPU against a float64 reference (which rounds bf16 moments after each
// step as the step does), on a GPU against the CPU bit for bit (parameters, moments and
// compute copies), for the parameters of adamCases, whose buffers' elements around the
// tensors must stay untouched.
func TestAdamW(t *testing.T) {
	hyp := adamHyper{LR: 0.01, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8, WeightDecay: 0.1}
	const steps = 3
	for _, moments := range []device.DType{device.F32, device.BF16} {
		for _, grads := range []device.DType{device.F32, device.BF16} {
			t.Run(fmt.Sprintf("moments_%v_grads_%v", moments, grads), func(t *testing.T) {
				testAdamW(t, moments, grads, hyp, steps)
			})
		}
	}
}

func testAdamW(t *testing.T, moments, grads device.DType, hyp adamHyper, steps int) {
	cpu, in := runAdam(t, device.CPU().Stream(), moments, grads, hyp, steps)
	// bf16 moments: the reference rounds them too, once from float64 where the step rounds
	// from float32, so the two can differ by an ulp of bf16 now and then, and p with them.
	tolP, tolM := 1e-5, 1e-5
	round := func(x float64) float64 { return x }
	if moments == device.BF16 {
		tolP, tolM = 1e-3, 8e-3 // an ulp of m moves p by lr·2^-8·|m/√v|, up to ~10 in these random states
		round = func(x float64) float64 { return float64(roundBF16(float32(x))) }
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		got := cpu
		if d.IsCUDA() {
			got, _ = runAdam(t, d.Stream(), moments, grads, hyp, steps)
			for i := range got {
				if diff := cmp.Diff(bitsOf(cpu[i], adamCases[i].n), bitsOf(got[i], adamCases[i].n)); diff != "" {
					t.Errorf("parameter %d (%+v): the GPU's step differs from the CPU's (-cpu +gpu):\n%s", i, adamCases[i], diff)
				}
			}
		}
		for i, c := range adamCases {
			x, o := in[i], got[i]
			what := fmt.Sprintf("parameter %d", i)
			// The float64 reference, step by step.
			p, g, m, v := f64s(x[0]), f64s(x[1]), f64s(x[2]), f64s(x[3])
			wd := 0.0
			if c.decay {
				wd = hyp.WeightDecay
			}
			for n := 1; n <= steps; n++ {
				c1, c2 := 1/(1-math.Pow(hyp.Beta1, float64(n))), 1/(1-math.Pow(hyp.Beta2, float64(n)))
				for j := range p {
					m[j] = hyp.Beta1*m[j] + (1-hyp.Beta1)*g[j]
					v[j] = hyp.Beta2*v[j] + (1-hyp.Beta2)*g[j]*g[j]
					p[j] = p[j]*(1-hyp.LR*wd) - hyp.LR*m[j]*c1/(math.Sqrt(v[j]*c2)+hyp.Eps)
					m[j], v[j] = round(m[j]), round(v[j])
				}
			}
			ap, am, av, ac := o.At[0], o.At[2], o.At[3], o.At[4]
			near(t, what+" p", o.P[ap:ap+c.n], p, tolP)
			near(t, what+" m", o.M[am:am+c.n], m, tolM)
			near(t, what+" v", o.V[av:av+c.n], v, tolM)
			for _, b := range []struct {
				name string
				buf  []float32
				off  int
			}{{"p", o.P, ap}, {"m", o.M, am}, {"v", o.V, av}} {
				for j, y := range b.buf {
					if (j < b.off || j >= b.off+c.n) && y == y {
						t.Fatalf("%s %s: buffer element %d, outside the tensor [%d, %d), was written: %v", what, b.name, j, b.off, b.off+c.n, y)
					}
				}
			}
			if moments == device.BF16 {
				for _, b := range []struct {
					name string
					buf  []float32
				}{{"m", o.M[am : am+c.n]}, {"v", o.V[av : av+c.n]}} {
					for j, y := range b.buf {
						if y != roundBF16(y) {
							t.Fatalf("%s %s[%d] = %v, not a bf16 value", what, b.name, j, y)
						}
					}
				}
			}
			if c.copy {
				for j, h := range o.C {
					if j < ac || j >= ac+c.n {
						if h != 0xFFFF {
							t.Fatalf("%s compute copy: buffer element %d, outside the tensor [%d, %d), was written: %#x", what, j, ac, ac+c.n, h)
						}
					} else if pv := o.P[ap+j-ac]; h != device.BF16FromFloat32(pv) {
						t.Fatalf("%s compute copy [%d] = %#x, want bf16(%v) = %#x", what, j-ac, h, pv, device.BF16FromFloat32(pv))
					}
				}
			}
		}
	})
}

// TestAdamTableMoments checks that a table's moments are all of one dtype, f32 or bf16,
// and so are its gradients.
func TestAdamTableMoments(t *testing.T) {
	s := device.CPU().Stream()
	ts := device.NewTemps(s)
	defer ts.Free()
	p, g := ts.Alloc(device.F32, 8), ts.Alloc(device.F32, 8)
	f32, bf16, f16 := ts.Alloc(device.F32, 8), ts.Alloc(device.BF16, 8), ts.Alloc(device.F16, 8)
	dt.NoErr(t, ts.Err())
	for _, c := range []struct {
		name string
		ps   []adamParam
		want string // in the error; "" for none
	}{
		{"bf16", []adamParam{{p: p, g: g, m: bf16, v: bf16}}, ""},
		{"mixed", []adamParam{{p: p, g: g, m: bf16, v: f32}}, "parameter 0's second moment is f32[8]@cpu, want bf16"},
		{"mixed_params", []adamParam{{p: p, g: g, m: f32, v: f32}, {p: p, g: g, m: bf16, v: bf16}}, "parameter 1's first moment is bf16[8]@cpu, want f32"},
		{"f16", []adamParam{{p: p, g: g, m: f16, v: f16}}, "parameter 0's first moment is f16[8]@cpu, want f32"},
		{"bf16_grads", []adamParam{{p: p, g: bf16, m: f32, v: f32}, {p: p, g: bf16, m: f32, v: f32}}, ""},
		{"mixed_grads", []adamParam{{p: p, g: bf16, m: f32, v: f32}, {p: p, g: g, m: f32, v: f32}}, "parameter 1's gradient is f32[8]@cpu, want bf16"},
		{"f16_grads", []adamParam{{p: p, g: f16, m: f32, v: f32}}, "parameter 0's gradient is f16[8]@cpu, want f32"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tab, err := newAdamTable(s, c.ps)
			if c.want == "" {
				dt.NoErr(t, err)
				dt.NoErr(t, tab.Free())
			} else if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one saying %q", err, c.want)
			}
		})
	}
}

// bitsOf returns the bits of the n values of each tensor of o (p, m, v and, if any, the
// compute copy), for exact comparisons.
func bitsOf(o adamOut, n int) [4][]uint32 {
	var b [4][]uint32
	for k, x := range []struct {
		v  []float32
		at int
	}{{o.P, o.At[0]}, {o.M, o.At[2]}, {o.V, o.At[3]}} {
		b[k] = make([]uint32, n)
		for i, y := range x.v[x.at : x.at+n] {
			b[k][i] = math.Float32bits(y)
		}
	}
	if o.C != nil {
		for _, h := range o.C[o.At[4] : o.At[4]+n] {
			b[3] = append(b[3], uint32(h))
		}
	}
	return b
}

func f64s(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// TestGroupShift checks where the AdamW kernel finds a parameter's groups of 4
// elements, from its tensors' addresses.
func TestGroupShift(t *testing.T) {
	for _, c := range []struct {
		name  string
		addrs []elemAddr
		want  int
	}{
		{"aligned", []elemAddr{{256, 4}, {512, 4}, {1024, 4}, {2048, 4}, {4096, 2}}, 0},
		{"all_past_by_one", []elemAddr{{260, 4}, {516, 4}, {1028, 4}, {2052, 4}, {4098, 2}}, 1},
		{"all_past_by_three", []elemAddr{{268, 4}, {524, 4}, {1036, 4}, {2060, 4}}, 3},
		{"gradient_differs", []elemAddr{{256, 4}, {260, 4}, {1024, 4}, {2048, 4}}, -1},
		{"copy_differs", []elemAddr{{264, 4}, {520, 4}, {1032, 4}, {2056, 4}, {4098, 2}}, -1},
		{"misaligned_element", []elemAddr{{258, 4}, {514, 4}, {1026, 4}, {2050, 4}}, -1},
		{"odd_copy", []elemAddr{{256, 4}, {4097, 2}}, -1},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := groupShift(c.addrs); got != c.want {
				t.Errorf("groupShift = %d, want %d", got, c.want)
			}
		})
	}
}

// TestAdamWVector checks that every parameter of a model is one the AdamW kernel moves 4
// elements at a time, in each compute and moment dtype: on a GPU every tensor of a
// parameter starts at the same place of a group of 4 elements (the replicated parameters'
// gradients, views of one buffer, at multiples of gradAlign elements).
func TestAdamWVector(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, typ := range []device.DType{device.F32, device.BF16} {
			for _, moments := range []device.DType{device.F32, device.BF16} {
				what := fmt.Sprintf("%v compute, %v moments", typ, moments)
				cfg := ModelConfig{Vocab: 13, Window: 3, Hidden: 8, FFN: 4, SharedFFN: 6, Experts: 4, TopK: 2, Layers: 2}
				m := dt.Must(newModel(d, cfg, 3, modelOptions{DType: typ, Moments: moments}))
				n := 0
				for _, tab := range append(append([]*adamTable{m.adam}, m.adamW1...), m.adamW2...) {
					if tab.moments != moments {
						t.Errorf("%s: an AdamW table's moments are %v", what, tab.moments)
					}
					for _, q := range tab.ps {
						n++
						if d.IsCUDA() && adamShift(q) < 0 {
							t.Errorf("%s: parameter %s is moved one element at a time", what, q.name)
						}
					}
				}
				if n != len(m.params) {
					t.Errorf("%s: the AdamW tables hold %d parameters, the model %d", what, n, len(m.params))
				}
				for _, p := range m.params {
					if off := (p.g.Ptr() - m.dpGrad.Ptr()) / 4; !p.expert && off%gradAlign != 0 {
						t.Errorf("%s: gradient of %s at element %d of the replicated gradients, want a multiple of %d", what, p.name, off, gradAlign)
					}
				}
				dt.NoErr(t, m.Free())
			}
		}
	})
}

// TestRankOps checks the sum over ranks and the routing statistics on each device:
// both are exact.
func TestRankOps(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(10)
		const R, n = 3, 1001
		inv := dt.Normal(r, R*n, 1)
		in, out := up(t, s, inv, R*n), dt.Must(s.Alloc(device.F32, n))
		defer device.FreeAll(in, out)
		dt.Poison(t, s, out)
		dt.NoErr(t, rankSum(s, out, in, R))
		want := make([]float32, n)
		for i := range want {
			for k := range R {
				want[i] += inv[k*n+i]
			}
		}
		if diff := cmp.Diff(want, down(t, s, out)); diff != "" {
			t.Errorf("rankSum (-want +got):\n%s", diff)
		}

		acc := dt.Must(device.FromSlice(s, device.I64, []int64{1, 2, 3, 4}, 4))
		load := dt.Must(device.FromSlice(s, device.I32, []int32{5, 6, 7}, 3))
		dropped := dt.Must(device.FromSlice(s, device.I32, []int32{9}, 1))
		defer device.FreeAll(acc, load, dropped)
		dt.NoErr(t, statsAdd(s, acc, load, dropped))
		dt.NoErr(t, statsAdd(s, acc, load, nil))
		got := make([]int64, 4)
		dt.NoErr(t, device.Download(s, acc, got))
		if diff := cmp.Diff([]int64{11, 14, 17, 13}, got); diff != "" {
			t.Errorf("statsAdd (-want +got):\n%s", diff)
		}
	})
}

// TestBatcher checks that the batcher hands out each step's rows of the global batch in
// order, and stops cleanly before its last step.
func TestBatcher(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		text := []byte(strings.Repeat("the quick brown fox jumps over the lazy dog. ", 20))
		const B, W, R, rank = 5, 4, 3, 1
		bt := dt.Must(newBatcher(s, text, 7, 3, 9, B, W, rank, R))
		for step := 3; step < 7; step++ {
			tok := dt.Must(bt.next(s))
			got := make([]int32, tok.Len())
			dt.NoErr(t, device.Download(s, tok, got))
			n := B * (W + 1)
			want := trainBatch(text, 7, step, R*B, W)[rank*n : (rank+1)*n]
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("step %d (-want +got):\n%s", step, diff)
			}
			dt.NoErr(t, bt.release(s))
		}
		dt.NoErr(t, bt.close())
	})
}

// TestPeak checks which device names get the H100/H200 SXM peak.
func TestPeak(t *testing.T) {
	for _, c := range []struct {
		name string
		want float64
	}{
		{"NVIDIA H200", 989e12}, {"NVIDIA H100 80GB HBM3", 989e12}, {"NVIDIA H100 PCIe", 0},
		{"NVIDIA H200 NVL", 0}, {"NVIDIA A100-SXM4-80GB", 0}, {"cpu", 0},
	} {
		if got, _ := peakFor(c.name); got != c.want {
			t.Errorf("peakFor(%q) = %g, want %g", c.name, got, c.want)
		}
	}
	if got, _ := peak(device.CPU()); got != 0 {
		t.Errorf("peak(cpu) = %g, want 0", got)
	}
}

// TestFlopsPerToken checks the model FLOPs against a count by hand.
func TestFlopsPerToken(t *testing.T) {
	c := ModelConfig{Vocab: 256, Window: 16, Hidden: 1024, FFN: 1024, SharedFFN: 512, Experts: 16, TopK: 2, Layers: 2}
	// Per layer: router 2·1024·16, experts 2·(2·1024·2048 + 2·1024·1024), shared 2·1024·1024 + 2·512·1024.
	layer := 2.0*1024*16 + 2*(2*1024*2048+2*1024*1024) + 2*1024*1024 + 2*512*1024
	want := 3 * (2*layer + 2*1024*256)
	if got := c.flopsPerToken(); got != want {
		t.Errorf("flopsPerToken = %g, want %g", got, want)
	}
}

// TestKernelConstants checks the Go mirrors of kernels/train.cu's constants.
func TestKernelConstants(t *testing.T) {
	for _, c := range []struct {
		name string
		want int
	}{{"TR_EMB_VEC", embVec}, {"TR_EMB_PARTS", embParts}, {"TR_EMB_COLS", embCols}, {"TR_ADAM_CHUNK", adamChunk}} {
		var got int
		if i := strings.Index(kernelSrc, "#define "+c.name+" "); i < 0 {
			t.Errorf("kernels/train.cu has no %s", c.name)
		} else if _, err := fmt.Sscanf(kernelSrc[i+len("#define "+c.name+" "):], "%d", &got); err != nil || got != c.want {
			t.Errorf("%s is %d (%v), the Go mirror %d", c.name, got, err, c.want)
		}
	}
	if 32*embParts != threads {
		t.Errorf("tr_embed_bwd's %d warps are not the %d threads of a launch", embParts, threads)
	}
}
