package moe

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/offload"
	"github.com/dropless/dropless/quant"
)

var fp8Precisions = []Precision{PrecisionBlockwise, PrecisionMXFP8}

func TestPrecisionString(t *testing.T) {
	for _, tc := range []struct {
		p    Precision
		want string
	}{{PrecisionBF16, "bf16"}, {PrecisionBlockwise, "blockwise"}, {PrecisionMXFP8, "mxfp8"}, {9, "Precision(9)"}} {
		if got := tc.p.String(); got != tc.want {
			t.Errorf("Precision(%d).String() = %q, want %q", int(tc.p), got, tc.want)
		}
	}
}

// relErr returns ‖got − want‖/‖want‖ (Frobenius), 0 when both are zero.
func relErr(got, want []float32) float64 {
	var d, n float64
	for i, w := range want {
		e := float64(got[i]) - float64(w)
		d += e * e
		n += float64(w) * float64(w)
	}
	if n == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / n)
}

// closeRuns fails t unless the output and every gradient of the routed layer in got
// (y, dx, drouter, dw1, dw2) are within tol of want's in relative Frobenius norm,
// logging each error; against names what want is.
func closeRuns(t *testing.T, against string, got, want layerRun, tol float64) {
	t.Helper()
	for _, r := range []struct {
		what      string
		got, want []float32
	}{{"y", got.y, want.y}, {"dx", got.dx, want.dx}, {"drouter", got.dwr, want.dwr},
		{"dw1", got.dw1, want.dw1}, {"dw2", got.dw2, want.dw2}} {
		e := relErr(r.got, r.want)
		t.Logf("%s: relative error %.3g against %s", r.what, e, against)
		if !(e <= tol) {
			t.Errorf("%s: relative error %.4g against %s, want ≤ %g", r.what, e, against, tol)
		}
	}
}

// sameRun fails t unless got is want bit for bit, naming what the two runs are in
// legend ("-want +got").
func sameRun(t *testing.T, legend string, want, got layerRun) {
	t.Helper()
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(layerRun{})); diff != "" {
		t.Errorf("%s:\n%s", legend, diff)
	}
}

// sameOffloaded runs l on d with tc's dtypes and gy once for each offload policy, as a
// subtest, and checks each run against want with same (Stats aside).
func sameOffloaded(t *testing.T, d *device.Device, l *refLayer, tc fp8Case, gy []float32, want layerRun, policies []string,
	same func(t *testing.T, want, got layerRun)) {
	t.Helper()
	for _, pol := range policies {
		t.Run(pol, func(t *testing.T) {
			o := dt.Must(offload.New(d, offload.Config{PoolBytes: 1 << 22, Policy: offload.MustParsePolicy(pol)}))
			defer o.Close()
			lo := *l
			lo.cfg.Offload = o
			got := runLayer(t, d, &lo, tc.typ, tc.rtyp, gy)
			dt.NoErr(t, o.Synchronize())
			w := want
			got.stats, w.stats = Stats{}, Stats{}
			same(t, w, got)
		})
	}
}

// withPrecision returns l with its layer's precision set to p.
func withPrecision(l *refLayer, p Precision) *refLayer {
	c := *l
	c.cfg.Precision = p
	return &c
}

// fp8Case is a layer of the FP8 tests.
type fp8Case struct {
	name       string
	cfg        Config
	T          int
	bias       bool
	typ, rtyp  device.DType
	skewExpert int // ≥ 0: every token goes to this expert (TopK 1)
}

// inputs returns the case's reference layer and output gradient, random from seed.
func (tc fp8Case) inputs(seed uint64) (*refLayer, []float32) {
	r := dt.Rand(seed)
	l := newRef(r, tc.cfg, tc.T, tc.bias || tc.skewExpert >= 0, tc.typ, tc.rtyp)
	if tc.skewExpert >= 0 {
		l.bias[tc.skewExpert] = 10
	}
	return l, randn(r, tc.typ, tc.T*tc.cfg.Hidden, 1)
}

var fp8Cases = []fp8Case{
	{"bf16_softmax_shared", Config{Hidden: 64, FFN: 32, SharedFFN: 32,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.01}}, 256, false, device.BF16, device.BF16, -1},
	{"f32_sigmoid_groups_nk", Config{Hidden: 48, FFN: 32, Layout: gemm.NK,
		Router: RouterConfig{Experts: 16, TopK: 4, Score: Sigmoid, Groups: 4, TopKGroups: 2, Renormalize: true, Scale: 2.5, AuxLoss: 0.001}},
		200, true, device.F32, device.F32, -1},
	// Unused rows: the weight gradients' groups take them into the last expert's.
	{"bf16_capacity", Config{Hidden: 32, FFN: 16, CapacityFactor: 0.75,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true}}, 128, false, device.BF16, device.F32, -1},
	// Widths that are no multiples of 128 or 32 (short last blocks), an odd T.
	{"bf16_odd_sizes", Config{Hidden: 144, FFN: 80, SharedFFN: 16,
		Router: RouterConfig{Experts: 5, TopK: 3}}, 77, false, device.BF16, device.F32, -1},
	// All tokens to expert 3: one group of several 128-token blocks, the others empty.
	{"skew_one_expert", Config{Hidden: 32, FFN: 16,
		Router: RouterConfig{Experts: 8, TopK: 1}}, 300, true, device.F32, device.F32, 3},
	{"no_tokens", Config{Hidden: 16, FFN: 16, SharedFFN: 16,
		Router: RouterConfig{Experts: 4, TopK: 2, AuxLoss: 0.01}}, 0, false, device.BF16, device.F32, -1},
}

// fp8Bound is the bound on the relative Frobenius error of an FP8 layer's results
// against the bf16 layer's on the same inputs. Rounding a Gaussian operand to E4M3 (3
// mantissa bits) in either recipe's blocks is a relative error of about 2.6% rms (the
// ulp/√12 of each binade); a result of the layer carries those of four to six
// quantized operands, some amplified by SwiGLU, which is about 6% (√4 · 2.6% for h,
// more through SwiGLU and the second GEMM). Over several seeds these cases measure
// 5.7–7.8% (blockwise) and 5.9–9.8% (MXFP8, whose power-of-two scales cost a little)
// for the output and every gradient but the shared expert's, and less where the shared
// expert, which stays bf16, adds to y.
func fp8Bound(p Precision) float64 {
	if p == PrecisionMXFP8 {
		return 0.12
	}
	return 0.10
}

// TestLayerFP8 runs the FP8 layers on every device against the bf16 layer on the same
// inputs: the routing and the shared expert's gradients (which the precision does not
// touch) equal, the output and the other gradients within fp8Bound; on a GPU, also
// against the CPU's FP8 layer.
func TestLayerFP8(t *testing.T) {
	type prepared struct {
		l   *refLayer
		gy  []float32
		cpu map[Precision]layerRun
	}
	preps := make([]prepared, len(fp8Cases))
	for i, tc := range fp8Cases {
		l, gy := tc.inputs(uint64(900 + i))
		p := prepared{l: l, gy: gy, cpu: map[Precision]layerRun{}}
		for _, prec := range append([]Precision{PrecisionBF16}, fp8Precisions...) {
			p.cpu[prec] = runLayer(t, device.CPU(), withPrecision(l, prec), tc.typ, tc.rtyp, gy)
		}
		preps[i] = p
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range fp8Cases {
			for _, prec := range fp8Precisions {
				t.Run(name(tc.name, "/", prec), func(t *testing.T) {
					p := preps[i]
					want, got := p.cpu[PrecisionBF16], p.cpu[prec]
					if d.IsCUDA() {
						want = runLayer(t, d, p.l, tc.typ, tc.rtyp, p.gy)
						got = runLayer(t, d, withPrecision(p.l, prec), tc.typ, tc.rtyp, p.gy)
					}
					if diff := cmp.Diff(want.row, got.row); diff != "" {
						t.Errorf("rows of the assignments (-bf16 +%v):\n%s", prec, diff)
					}
					if diff := cmp.Diff(want.stats, got.stats); diff != "" {
						t.Errorf("Stats (-bf16 +%v):\n%s", prec, diff)
					}
					if tc.skewExpert >= 0 && got.stats.Load[tc.skewExpert] != tc.T {
						t.Fatalf("skewed routing: load %v, want all %d tokens on expert %d", got.stats.Load, tc.T, tc.skewExpert)
					}
					// The shared expert's gradients depend on x, dy and its weights only.
					if diff := cmp.Diff(want.dsw1, got.dsw1); diff != "" {
						t.Errorf("dshared_w1 (-bf16 +%v):\n%s", prec, diff)
					}
					if diff := cmp.Diff(want.dsw2, got.dsw2); diff != "" {
						t.Errorf("dshared_w2 (-bf16 +%v):\n%s", prec, diff)
					}
					closeRuns(t, "the bf16 layer", got, want, fp8Bound(prec))
					if !d.IsCUDA() {
						return
					}
					// The GPU against the CPU: the same quantizations, sums in another order.
					closeRuns(t, "the CPU's FP8 layer", got, p.cpu[prec], 2e-2)
				})
			}
		}
	})
}

// fakeQuant returns the values v [m, k] take once quantized in prec's 1×128 or 1×32 blocks
// along k (on the CPU, as the layer quantizes its activations for the forward GEMMs).
func fakeQuant(t *testing.T, prec Precision, v []float64, m, k int) []float64 {
	t.Helper()
	s := device.CPU().Stream()
	x := up(t, s, device.F32, f32s(v), m, k)
	defer x.Free()
	out := alloc(t, s, device.F32, m, k)
	defer out.Free()
	if prec == PrecisionBlockwise {
		q := dt.Must(quant.QuantizeBlockwise(s, x, blockRows))
		defer q.Free()
		dt.NoErr(t, quant.DequantizeBlockwise(s, out, q, quant.Rowwise))
	} else {
		q := dt.Must(quant.Quantize(s, x, mxRows))
		defer q.Free()
		dt.NoErr(t, quant.Dequantize(s, out, q, quant.Rowwise))
	}
	return f64(down(t, s, out))
}

// fakeQuantWeights returns the values of w [g, k, n] in the forward's quantized
// orientation of prec.
func fakeQuantWeights(t *testing.T, prec Precision, w []float64, g, k, n int) []float64 {
	t.Helper()
	s := device.CPU().Stream()
	x := up(t, s, device.F32, f32s(w), g, k, n)
	defer x.Free()
	out := alloc(t, s, device.F32, g, k, n)
	defer out.Free()
	if prec == PrecisionBlockwise {
		q := dt.Must(quant.QuantizeWeights(s, x, quant.BlockOptions{Format: quant.E4M3}))
		defer q.Free()
		dt.NoErr(t, quant.DequantizeWeights(s, out, q))
	} else {
		q := dt.Must(quant.QuantizeMXFP8Weights(s, x, quant.Options{Format: quant.E4M3}))
		defer q.Free()
		dt.NoErr(t, quant.DequantizeMXFP8Weights(s, out, q, true))
	}
	return f64(down(t, s, out))
}

// fp8Forward is the float64 reference of an FP8 layer's output without shared expert:
// the routing of refLayer.forward, each GEMM's operands quantized and dequantized
// (x's rows as the permuted rows, the SwiGLU rows, the weights), products and sums in
// float64, h and a rounded to typ as the layer stores them.
func fp8Forward(t *testing.T, l *refLayer, prec Precision, typ device.DType) []float64 {
	c := l.cfg
	T, H, F, K := l.T, c.Hidden, c.FFN, c.Router.TopK
	base := l.forward()
	xq := fakeQuant(t, prec, l.x, T, H)
	w1 := fakeQuantWeights(t, prec, l.w1, c.Router.Experts, H, 2*F)
	w2 := fakeQuantWeights(t, prec, l.w2, c.Router.Experts, F, H)
	a := make([]float64, T*K*F)
	for i := range T * K {
		tok, e := i/K, int(base.route.idx[i])
		for j := range F {
			var g, u float64
			for h := range H {
				g += xq[tok*H+h] * w1[(e*H+h)*2*F+j]
				u += xq[tok*H+h] * w1[(e*H+h)*2*F+F+j]
			}
			g, u = float64(round(typ, float32(g))), float64(round(typ, float32(u)))
			a[i*F+j] = float64(round(typ, float32(silu(g)*u)))
		}
	}
	aq := fakeQuant(t, prec, a, T*K, F)
	y := make([]float64, T*H)
	for i := range T * K {
		tok, e := i/K, int(base.route.idx[i])
		for h := range H {
			var v float64
			for j := range F {
				v += aq[i*F+j] * w2[(e*F+j)*H+h]
			}
			y[tok*H+h] += base.route.weight[i] * float64(round(typ, float32(v)))
		}
	}
	return y
}

// TestLayerFP8Reference checks the FP8 layers' output on every device against the
// float64 products of the dequantized operands (fp8Forward): equal up to the rounding of
// the f32 sums and of the values quantized, far tighter than the FP8 error itself.
func TestLayerFP8Reference(t *testing.T) {
	cfg := Config{Hidden: 160, FFN: 48, Router: RouterConfig{Experts: 4, TopK: 2, Renormalize: true}}
	const T = 64
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, typ := range dtypes() {
			r := dt.Rand(950)
			l := newRef(r, cfg, T, false, typ, device.F32)
			for _, prec := range fp8Precisions {
				t.Run(name(typ, "/", prec), func(t *testing.T) {
					want := f32s(fp8Forward(t, l, prec, typ))
					got := runLayer(t, d, withPrecision(l, prec), typ, device.F32, nil)
					// f32 on the CPU: the f32 sums of the same dequantized values. Otherwise h
					// differs from the reference's in its last bits (bf16 rounding, or the FP8
					// tensor cores' shorter sums between promotions), and the SwiGLU output,
					// quantized again for W2, turns those differences into whole FP8 steps
					// (about 6% of the element) wherever a value rounds the other way: a few
					// 1e-3 on the GPU in f32 as in bf16.
					bound := 1e-5
					if typ == device.BF16 || d.IsCUDA() {
						bound = 1e-2
					}
					e := relErr(got.y, want)
					t.Logf("y: relative error %.3g against the dequantized reference (%.3g for the bf16 layer)",
						e, relErr(runLayer(t, d, l, typ, device.F32, nil).y, want))
					if !(e <= bound) {
						t.Errorf("y: relative error %.4g against the dequantized reference, want ≤ %g", e, bound)
					}
				})
			}
		}
	})
}

// TestLayerFP8Deterministic runs each FP8 layer twice on the same inputs: every result
// is bit for bit the same.
func TestLayerFP8Deterministic(t *testing.T) {
	tc := fp8Cases[2] // capacity: the padded groups of the weight gradients
	dt.Run(t, func(t *testing.T, d *device.Device) {
		r := dt.Rand(960)
		l := newRef(r, tc.cfg, tc.T, false, tc.typ, tc.rtyp)
		gy := randn(r, tc.typ, tc.T*tc.cfg.Hidden, 1)
		for _, prec := range fp8Precisions {
			lp := withPrecision(l, prec)
			first := runLayer(t, d, lp, tc.typ, tc.rtyp, gy)
			second := runLayer(t, d, lp, tc.typ, tc.rtyp, gy)
			if diff := cmp.Diff(first, second, cmp.AllowUnexported(layerRun{})); diff != "" {
				t.Errorf("%v: two runs differ (-first +second):\n%s", prec, diff)
			}
		}
	})
}

// TestLayerBackwardTwice runs Backward twice on the activations of one Forward, in each
// precision, the second time with Grads.W2Ready and W1Ready: the gradients are the same,
// also for the permuted x that an FP8 layer does not keep (recomputed for each Backward).
func TestLayerBackwardTwice(t *testing.T) {
	tc := fp8Cases[0]
	dt.Run(t, func(t *testing.T, d *device.Device) {
		l, gy := tc.inputs(970)
		for _, prec := range []Precision{PrecisionBF16, PrecisionBlockwise, PrecisionMXFP8} {
			t.Run(prec.String(), func(t *testing.T) {
				lp := withPrecision(l, prec)
				lp.backTwice = true
				runLayer(t, d, lp, tc.typ, tc.rtyp, gy)
			})
		}
	})
}

// TestFP8GradOnePass checks that quantizing each incoming gradient of Backward once, in
// both directions, changes no result: the output and every gradient are bit for bit
// those of the layer that quantizes it by one pass per GEMM (rowwise over all rows for
// the input gradient, columnwise in the weight gradient's groups), on the cases of
// TestLayerFP8 (unused rows of a capacity layer in the last expert's group, short
// blocks, one skewed expert, no tokens) and expert-parallel, where the kept rows are
// fewer than the buffers' and the input gradients' rows past them zeros.
func TestFP8GradOnePass(t *testing.T) {
	same := func(t *testing.T, want, got layerRun) {
		t.Helper()
		sameRun(t, "one pass per gradient against one per GEMM (-two passes +one)", want, got)
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range fp8Cases {
			l, gy := tc.inputs(uint64(990 + i))
			for _, prec := range fp8Precisions {
				t.Run(name(tc.name, "/", prec), func(t *testing.T) {
					two := withPrecision(l, prec)
					two.gradTwoPass = true
					want := runLayer(t, d, two, tc.typ, tc.rtyp, gy)
					if tc.T > 0 && cmp.Equal(want.dw1, make([]float32, len(want.dw1))) {
						t.Fatal("dw1 is all zeros")
					}
					same(t, want, runLayer(t, d, withPrecision(l, prec), tc.typ, tc.rtyp, gy))
				})
			}
		}
		cfg := Config{Hidden: 32, FFN: 16, SharedFFN: 16, Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}
		tokens := []int{40, 0, 70, 18}
		T := 0
		for _, n := range tokens {
			T += n
		}
		r := dt.Rand(999)
		base := newRef(r, cfg, T, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, T*cfg.Hidden, 1)
		for _, prec := range fp8Precisions {
			t.Run(name("ep_4ranks/", prec), func(t *testing.T) {
				two := withPrecision(base, prec)
				two.gradTwoPass = true
				want := runRanks(t, d, two, tokens, device.BF16, gy)
				got := runRanks(t, d, withPrecision(base, prec), tokens, device.BF16, gy)
				for rk := range tokens {
					t.Run(name("rank", rk), func(t *testing.T) { same(t, want[rk], got[rk]) })
				}
			})
		}
	})
}

// TestFP8GradKeptRows checks the input gradients of an incoming gradient quantized for
// both its GEMMs over fewer rows than its tensor's (the kept rows of an expert-parallel
// layer; the rows past them hold anything): bit for bit those of the gradient quantized
// rowwise over all its rows, the rows past the kept ones zeros.
func TestFP8GradKeptRows(t *testing.T) {
	counts := []int32{5, 0, 130, 7}
	const R, used = 200, 142
	cfg := Config{Hidden: 48, FFN: 32, Router: RouterConfig{Experts: 4, TopK: 1}}
	H, F, E := cfg.Hidden, cfg.FFN, cfg.Router.Experts
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(985)
		p := &Params{W1: up(t, s, device.BF16, randn(r, device.BF16, E*H*2*F, 0.2), E, H, 2*F),
			W2: up(t, s, device.BF16, randn(r, device.BF16, E*F*H, 0.2), E, F, H)}
		sizes := upI32(t, s, counts, E)
		defer device.FreeAll(p.W1, p.W2, sizes)
		for _, prec := range fp8Precisions {
			for _, second := range []bool{false, true} {
				t.Run(name(prec, "/", pick(second, "w1", "w2")), func(t *testing.T) {
					c := cfg
					c.Precision = prec
					lay := dt.Must(NewLayer(c))
					defer lay.InvalidateWeights()
					ex := &experts{s: s, cfg: c, p: p, q: dt.Must(lay.weights(s, p)), act: &Activations{counts: sizes}, sizes: sizes, colRow: used}
					n, k := 2*F, H // dh [R,2F] into dxp [R,H]
					if second {
						n, k = H, F // dyp [R,H] into da [R,F]
					}
					dy := up(t, s, device.BF16, randn(r, device.BF16, R*n, 1), R, n)
					defer dy.Free()
					inputGrad := func(dir quant.Direction) []float32 {
						dx := alloc(t, s, device.BF16, R, k)
						defer dx.Free()
						q := dt.Must(ex.newGrad(operand{t: dy}, dir))
						defer q.free()
						dt.NoErr(t, ex.inputGrad(dx, q, second))
						return down(t, s, dx)
					}
					want, got := inputGrad(quant.Rowwise), inputGrad(quant.Both)
					if !cmp.Equal(want[used*k:], make([]float32, (R-used)*k)) {
						t.Fatal("rows past the kept ones of the input gradient over all rows are not zeros")
					}
					if diff := cmp.Diff(want, got); diff != "" {
						t.Errorf("input gradient of the kept rows quantized both ways (-all rows rowwise +kept rows both ways):\n%s", diff)
					}
				})
			}
		}
	})
}

// TestLayerFP8Invalidate checks the contract of the cached quantized weights: a Forward
// after W1 changed in place uses the cached copies, one after InvalidateWeights the new
// values, one given another tensor that tensor's values; a Backward after
// InvalidateWeights gets the gradients of its Forward.
func TestLayerFP8Invalidate(t *testing.T) {
	cfg := Config{Hidden: 32, FFN: 16, Router: RouterConfig{Experts: 4, TopK: 2, Renormalize: true}}
	const T = 48
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(970)
		l := newRef(r, cfg, T, false, device.BF16, device.F32)
		H, F, E := cfg.Hidden, cfg.FFN, cfg.Router.Experts
		w1New := randn(r, device.BF16, E*H*2*F, 0.2)
		gy := randn(r, device.BF16, T*H, 1)
		for _, prec := range fp8Precisions {
			t.Run(prec.String(), func(t *testing.T) {
				c := cfg
				c.Precision = prec
				lay := dt.Must(NewLayer(c))
				defer lay.InvalidateWeights()
				var ts []*device.Tensor
				defer func() { device.FreeAll(ts...) }()
				mk := func(v []float32, shape ...int) *device.Tensor {
					x := up(t, s, device.BF16, v, shape...)
					ts = append(ts, x)
					return x
				}
				x := mk(f32s(l.x), T, H)
				p := &Params{Router: mk(f32s(l.wr), E, H), W1: mk(f32s(l.w1), E, H, 2*F), W2: mk(f32s(l.w2), E, F, H)}
				y := mk(make([]float32, T*H), T, H)
				forward := func(lay *Layer, p *Params) []float32 {
					act := dt.Must(lay.Forward(s, y, x, p))
					dt.NoErr(t, act.Free())
					return down(t, s, y)
				}
				y0 := forward(lay, p)
				// W1 changed in place without InvalidateWeights: the cached copies.
				dt.NoErr(t, p.W1.SetFloat32(s, w1New))
				if diff := cmp.Diff(y0, forward(lay, p)); diff != "" {
					t.Errorf("Forward after W1 changed, not invalidated: output differs from the cached weights' (-before +after):\n%s", diff)
				}
				dt.NoErr(t, lay.InvalidateWeights())
				y1 := forward(lay, p)
				fresh := dt.Must(NewLayer(c))
				want := forward(fresh, p)
				dt.NoErr(t, fresh.InvalidateWeights())
				if diff := cmp.Diff(want, y1); diff != "" {
					t.Errorf("Forward after InvalidateWeights differs from a new layer's (-new layer +invalidated):\n%s", diff)
				}
				if cmp.Equal(y0, y1) {
					t.Error("Forward after InvalidateWeights still gives the old weights' output")
				}
				// Another tensor as W1 (the old values): quantized anew without invalidation.
				p2 := *p
				p2.W1 = mk(f32s(l.w1), E, H, 2*F)
				if diff := cmp.Diff(y0, forward(lay, &p2)); diff != "" {
					t.Errorf("Forward with another W1 tensor holding the first values (-first +other):\n%s", diff)
				}
				// InvalidateWeights between Forward and Backward: Backward quantizes the
				// unchanged weights again, with the same results.
				backward := func(invalidate bool) []float32 {
					act := dt.Must(lay.Forward(s, y, x, p))
					defer act.Free()
					if invalidate {
						dt.NoErr(t, lay.InvalidateWeights())
					}
					g := &Grads{X: mk(make([]float32, T*H), T, H), W1: mk(make([]float32, E*H*2*F), E, H, 2*F)}
					dt.NoErr(t, lay.Backward(s, g, mk(gy, T, H), act))
					return append(down(t, s, g.X), down(t, s, g.W1)...)
				}
				if diff := cmp.Diff(backward(false), backward(true)); diff != "" {
					t.Errorf("gradients differ when the weights are invalidated before Backward (-cached +invalidated):\n%s", diff)
				}
			})
		}
		bf := dt.Must(NewLayer(cfg))
		dt.NoErr(t, bf.InvalidateWeights()) // nothing cached
	})
}

// TestFP8PaddedGroups checks the weight gradients of a layer with unused rows (a
// capacity layer's): quantized in groups that give the unused rows, zeros, to the last
// expert, then multiplied with the experts' own counts, they are those of the kept
// rows quantized in the experts' groups (bit for bit on the CPU).
func TestFP8PaddedGroups(t *testing.T) {
	counts := []int32{5, 0, 130, 7}
	const R, K, N = 200, 32, 48
	used := 0
	for _, c := range counts {
		used += int(c)
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(980)
		xv, dyv := make([]float32, R*K), make([]float32, R*N)
		copy(xv, dt.Normal(r, used*K, 1))
		copy(dyv, dt.Normal(r, used*N, 1))
		x, dy := up(t, s, device.BF16, xv, R, K), up(t, s, device.BF16, dyv, R, N)
		defer device.FreeAll(x, dy)
		off := []int32{0}
		for _, c := range counts {
			off = append(off, off[len(off)-1]+c)
		}
		pm := &Permutation{Experts: len(counts), Rows: R, Counts: upI32(t, s, counts, len(counts)), Offsets: upI32(t, s, off, len(off))}
		defer device.FreeAll(pm.Counts, pm.Offsets)
		padded := alloc(t, s, device.I32, len(counts))
		defer padded.Free()
		dt.NoErr(t, padSizes(s, padded, pm))
		if diff := cmp.Diff([]int32{5, 0, 130, 65}, downI32(t, s, padded)); diff != "" {
			t.Errorf("padSizes (-want +got):\n%s", diff)
		}
		for _, prec := range fp8Precisions {
			for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
				t.Run(name(prec, "/", layout), func(t *testing.T) {
					tmp := device.NewTemps(s)
					defer tmp.Free()
					act := &Activations{counts: pm.Counts, rows: R, Perm: pm}
					ex := &experts{s: s, cfg: Config{Precision: prec, Layout: layout}, act: act, tmp: tmp}
					shape := wshape(layout, len(counts), K, N)
					got := alloc(t, s, device.F32, shape...)
					defer got.Free()
					// dy as Backward quantizes it for both its GEMMs.
					qdy := dt.Must(ex.newGrad(operand{t: dy}, quant.Both))
					defer qdy.free()
					dt.NoErr(t, ex.weightGrad(got, operand{t: x}, qdy, false))
					// The kept rows alone, in the experts' groups.
					want := alloc(t, s, device.F32, shape...)
					defer want.Free()
					xk, dyk := dt.Must(x.Rows(0, used)), dt.Must(dy.Rows(0, used))
					o := &gemm.Options{Layout: layout}
					if prec == PrecisionBlockwise {
						qx := dt.Must(quant.QuantizeBlockwise(s, xk, blockCols(pm.Counts, quant.Columnwise)))
						qdy := dt.Must(quant.QuantizeBlockwise(s, dyk, blockCols(pm.Counts, quant.Columnwise)))
						defer qx.Free()
						defer qdy.Free()
						dt.NoErr(t, gemm.RaggedDotBlockwiseWeightGrad(s, want, qx, qdy, pm.Counts, o))
					} else {
						qx := dt.Must(quant.Quantize(s, xk, mxCols(pm.Counts, quant.Columnwise)))
						qdy := dt.Must(quant.Quantize(s, dyk, mxCols(pm.Counts, quant.Columnwise)))
						defer qx.Free()
						defer qdy.Free()
						dt.NoErr(t, gemm.RaggedDotMXFP8WeightGrad(s, want, qx, qdy, pm.Counts, o))
					}
					wv, gv := down(t, s, want), down(t, s, got)
					if cmp.Equal(wv, make([]float32, len(wv))) {
						t.Fatal("weight gradient is all zeros")
					}
					if d.IsCUDA() {
						// The kernels may split the sums by the rows of the call.
						if e := relErr(gv, wv); !(e <= 1e-5) {
							t.Errorf("weight gradient over padded groups: relative error %.3g against the kept rows', want ≤ 1e-5", e)
						}
					} else if diff := cmp.Diff(wv, gv); diff != "" {
						t.Errorf("weight gradient over padded groups (-kept rows +padded):\n%s", diff)
					}
				})
			}
		}
	})
}
