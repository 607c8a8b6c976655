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
			for _, c := range []struct{ B, W, V, H int }{{1, 1, 2, 1}, {37, 5, 11, 19}, {300, 3, 7, 300}, {600, 2, 300, 33}} {
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

	// embedNorm: the embedding and its norm.
	h, xn, rstd := alloc(device.F32, B, H), alloc(typ, B, H), alloc(device.F32, B)
	dt.NoErr(t, embedNorm(s, h, xn, rstd, emb, tok, W, V))
	wantH, wantXn, wantR := make([]float64, B*H), make([]float64, B*H), make([]float64, B)
	for b := range B {
		for w := range W {
			if v := int(tokv[b*ld+w]); v < V {
				for j := range H {
					wantH[b*H+j] += float64(embv[(w*V+v)*H+j])
				}
			}
		}
		wantR[b] = rmsRef(wantH[b*H : (b+1)*H])
		for j := range H {
			wantXn[b*H+j] = wantH[b*H+j] * wantR[b]
		}
	}
	near(t, "embedNorm h", down(t, s, h), wantH, 1e-5)
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
	for _, acc := range []bool{false, true} {
		prev := dt.Normal(r, B*H, 1)
		dx := up(t, s, prev, B, H)
		ts.Add(dx)
		if !acc {
			dt.Poison(t, s, dx)
		}
		dxc := alloc(typ, B, H)
		dt.NoErr(t, normBackward(s, dx, dxc, dxn, ho, rstd2, acc))
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
		what := fmt.Sprintf("normBackward(accumulate=%v)", acc)
		near(t, what+" dx", down(t, s, dx), want, 1e-4)
		near(t, what+" dxc", down(t, s, dxc), want, tolFor(typ, 1e-4))
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

	// embedBackward: rows grouped by token, summed in order.
	dhv := dt.Normal(r, B*H, 1)
	dh := up(t, s, dhv, B, H)
	ts.Add(dh)
	demb, perm, offs := alloc(device.F32, W*V, H), alloc(device.I32, W, B), alloc(device.I32, W, V+1)
	dt.NoErr(t, embedBackward(s, demb, dh, tok, perm, offs, W, V))
	want := make([]float64, W*V*H)
	for b := range B {
		for w := range W {
			if v := int(tokv[b*ld+w]); v < V {
				for j := range H {
					want[(w*V+v)*H+j] += float64(dhv[b*H+j])
				}
			}
		}
	}
	near(t, "embedBackward", down(t, s, demb), want, 1e-4)
}

// TestAdamW checks the multi-tensor AdamW step on each device against a float64
// reference: parameters of several sizes (one chunk, several, a partial last one),
// with and without weight decay and compute copy.
func TestAdamW(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(9)
		ts := device.NewTemps(s)
		defer ts.Free()
		type vals struct{ p, g, m, v []float32 }
		var ps []adamParam
		var in []vals
		for i, n := range []int{1, 5000, adamChunk, 3*adamChunk + 17, 300} {
			x := vals{dt.Normal(r, n, 1), dt.Normal(r, n, 1), dt.Normal(r, n, 0.1), dt.Normal(r, n, 0.1)}
			for j := range x.v {
				x.v[j] *= x.v[j]
			}
			q := adamParam{p: up(t, s, x.p, n), g: up(t, s, x.g, n), m: up(t, s, x.m, n), v: up(t, s, x.v, n), decay: i%2 == 0}
			ts.Add(q.p, q.g, q.m, q.v)
			if i%3 != 1 {
				q.c = dt.Must(s.Alloc(device.BF16, n))
				ts.Add(q.c)
				dt.Poison(t, s, q.c)
			}
			ps = append(ps, q)
			in = append(in, x)
		}
		tab := dt.Must(newAdamTable(s, ps))
		defer tab.Free()
		hyp := adamHyper{LR: 0.01, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8, WeightDecay: 0.1}
		const step = 3
		dt.NoErr(t, tab.step(s, hyp, step))
		c1, c2 := 1/(1-math.Pow(0.9, step)), 1/(1-math.Pow(0.99, step))
		for i, q := range ps {
			x, n := in[i], len(in[i].p)
			wantP, wantM, wantV := make([]float64, n), make([]float64, n), make([]float64, n)
			wd := 0.0
			if q.decay {
				wd = hyp.WeightDecay
			}
			for j := range n {
				g := float64(x.g[j])
				wantM[j] = 0.9*float64(x.m[j]) + 0.1*g
				wantV[j] = 0.99*float64(x.v[j]) + 0.01*g*g
				wantP[j] = float64(x.p[j])*(1-0.01*wd) - 0.01*wantM[j]*c1/(math.Sqrt(wantV[j]*c2)+1e-8)
			}
			what := fmt.Sprintf("parameter %d", i)
			near(t, what+" p", down(t, s, q.p), wantP, 1e-5)
			near(t, what+" m", down(t, s, q.m), wantM, 1e-5)
			near(t, what+" v", down(t, s, q.v), wantV, 1e-5)
			if q.c != nil {
				pv := down(t, s, q.p)
				for j, c := range down(t, s, q.c) {
					if w := device.BF16ToFloat32(device.BF16FromFloat32(pv[j])); c != w {
						t.Fatalf("%s compute copy [%d] = %v, want bf16(%v) = %v", what, j, c, pv[j], w)
					}
				}
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
