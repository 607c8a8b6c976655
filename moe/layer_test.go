package moe

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// newRef returns random parameters and input for cfg, rounded to typ (the router
// weights to rtyp), with routing margins of at least 1e-4 for every token.
func newRef(r *rand.Rand, cfg Config, T int, withBias bool, typ, rtyp device.DType) *refLayer {
	c := cfg
	H, F, E, Fs := c.Hidden, c.FFN, c.Router.Experts, c.SharedFFN
	l := &refLayer{cfg: c, T: T, fusedGrad: defaultFusedGrad}
	sh, sf := float32(1/math.Sqrt(float64(H))), float32(1/math.Sqrt(float64(F)))
	l.wr = f64(randn(r, rtyp, E*H, sh))
	if withBias {
		l.bias = f64(dt.Normal(r, E, 0.05))
	}
	l.w1 = f64(randn(r, typ, E*H*2*F, sh))
	l.w2 = f64(randn(r, typ, E*F*H, sf))
	if Fs > 0 {
		l.sw1 = f64(randn(r, typ, H*2*Fs, sh))
		l.sw2 = f64(randn(r, typ, Fs*H, float32(1/math.Sqrt(float64(Fs)))))
	}
	l.x = make([]float64, T*H)
	for t := range T {
		xr := l.x[t*H : (t+1)*H]
		for {
			copy(xr, f64(randn(r, typ, H, 1)))
			z := make([]float64, E)
			for e := range E {
				for h := range H {
					z[e] += xr[h] * l.wr[e*H+h]
				}
			}
			if choiceGap(c.Router, 1, z, l.bias) >= 1e-4 {
				break
			}
		}
	}
	return l
}

func f32s(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// toLayout returns w [g, k, n] in layout l; fromLayout inverts it.
func toLayout(l gemm.WeightLayout, w []float64, g, k, n int) []float64 {
	if l == gemm.KN {
		return w
	}
	out := make([]float64, len(w))
	for a := range g {
		for i := range k {
			for j := range n {
				out[a*k*n+j*k+i] = w[a*k*n+i*n+j]
			}
		}
	}
	return out
}

func fromLayout(l gemm.WeightLayout, w []float64, g, k, n int) []float64 {
	if l == gemm.KN {
		return w
	}
	out := make([]float64, len(w))
	for a := range g {
		for i := range k {
			for j := range n {
				out[a*k*n+i*n+j] = w[a*k*n+j*k+i]
			}
		}
	}
	return out
}

// layerRun is one Forward and Backward on a device, results in KN layout.
type layerRun struct {
	y                             []float32
	stats                         Stats
	dx, dwr, dw1, dw2, dsw1, dsw2 []float32
	row                           []int32
}

// runLayer uploads l to d (dtype typ, router rtyp), runs Forward and, when gy is not
// nil, Backward with dy = gy.
func runLayer(t testing.TB, d *device.Device, l *refLayer, typ, rtyp device.DType, gy []float32) layerRun {
	t.Helper()
	return runLayerOn(t, d.Stream(), l, typ, rtyp, gy)
}

// runLayerOn is runLayer on stream s.
func runLayerOn(t testing.TB, s *device.Stream, l *refLayer, typ, rtyp device.DType, gy []float32) layerRun {
	t.Helper()
	c := l.cfg
	T, H, F, E, Fs, L := l.T, c.Hidden, c.FFN, c.Router.Experts, c.SharedFFN, c.localExperts()
	lay := dt.Must(NewLayer(c))
	lay.gradTwoPass = l.gradTwoPass
	lay.unfusedSwiGLU = l.unfusedSwiGLU
	lay.fusedGrad = l.fusedGrad
	lay.serialEP = l.serialEP
	lay.trace = l.trace
	defer lay.InvalidateWeights() // an FP8 layer's cached weights
	var ts []*device.Tensor
	defer func() { device.FreeAll(ts...) }()
	mk := func(typ device.DType, v []float64, shape ...int) *device.Tensor {
		x := up(t, s, typ, f32s(v), shape...)
		ts = append(ts, x)
		return x
	}
	mk0 := func(typ device.DType, shape ...int) *device.Tensor {
		x := alloc(t, s, typ, shape...)
		ts = append(ts, x)
		return x
	}
	x := mk(typ, l.x, T, H)
	p := &Params{
		Router: mk(rtyp, l.wr, E, H),
		W1:     mk(typ, toLayout(c.Layout, l.w1, L, H, 2*F), wshape(c.Layout, L, H, 2*F)...),
		W2:     mk(typ, toLayout(c.Layout, l.w2, L, F, H), wshape(c.Layout, L, F, H)...),
	}
	if l.bias != nil {
		p.Bias = mk(device.F32, l.bias, E)
	}
	if Fs > 0 {
		p.SharedW1 = mk(typ, toLayout(c.Layout, l.sw1, 1, H, 2*Fs), wshape(c.Layout, 1, H, 2*Fs)[1:]...)
		p.SharedW2 = mk(typ, toLayout(c.Layout, l.sw2, 1, Fs, H), wshape(c.Layout, 1, Fs, H)[1:]...)
	}
	y := mk0(typ, T, H)
	act := dt.Must(lay.Forward(s, y, x, p))
	defer act.Free()
	var res layerRun
	res.y = down(t, s, y)
	res.stats = dt.Must(act.Stats(s))
	if act.Perm != nil {
		res.row = downI32(t, s, act.Perm.Row)
	}
	if gy == nil {
		return res
	}
	g := &Grads{X: mk0(typ, T, H), Router: mk0(rtyp, E, H),
		W1: mk0(typ, wshape(c.Layout, L, H, 2*F)...), W2: mk0(typ, wshape(c.Layout, L, F, H)...)}
	if Fs > 0 {
		g.SharedW1 = mk0(typ, wshape(c.Layout, 1, H, 2*Fs)[1:]...)
		g.SharedW2 = mk0(typ, wshape(c.Layout, 1, Fs, H)[1:]...)
	}
	dy := up(t, s, typ, gy, T, H)
	ts = append(ts, dy)
	dt.NoErr(t, lay.Backward(s, g, dy, act))
	if l.backTwice {
		g2 := &Grads{X: mk0(typ, T, H), Router: mk0(rtyp, E, H),
			W1: mk0(typ, wshape(c.Layout, L, H, 2*F)...), W2: mk0(typ, wshape(c.Layout, L, F, H)...),
			SharedW1: g.SharedW1, SharedW2: g.SharedW2}
		if Fs > 0 {
			g2.SharedW1, g2.SharedW2 = mk0(typ, wshape(c.Layout, 1, H, 2*Fs)[1:]...), mk0(typ, wshape(c.Layout, 1, Fs, H)[1:]...)
		}
		g2.W1Ready, g2.W2Ready = dt.Must(s.Device().NewEvent()), dt.Must(s.Device().NewEvent())
		defer g2.W1Ready.Close()
		defer g2.W2Ready.Close()
		dt.NoErr(t, lay.Backward(s, g2, dy, act))
		for _, e := range []*device.Event{g2.W2Ready, g2.W1Ready} {
			if d, err := e.Since(g2.W2Ready); err != nil || d < 0 {
				t.Errorf("Grads.W1Ready or W2Ready after Backward: %v, %v; want both recorded, W2's first", d, err)
			}
		}
		for i, w := range [][2]*device.Tensor{{g.X, g2.X}, {g.Router, g2.Router}, {g.W1, g2.W1}, {g.W2, g2.W2}, {g.SharedW1, g2.SharedW1}, {g.SharedW2, g2.SharedW2}} {
			if w[0] == nil {
				continue
			}
			if diff := cmp.Diff(down(t, s, w[0]), down(t, s, w[1])); diff != "" {
				t.Errorf("gradient %d of a second Backward on the same activations differs (-first +second):\n%s", i, diff)
			}
		}
	}
	kn := func(w *device.Tensor, gr, k, n int) []float32 {
		return f32s(fromLayout(c.Layout, f64(down(t, s, w)), gr, k, n))
	}
	res.dx, res.dwr = down(t, s, g.X), down(t, s, g.Router)
	res.dw1, res.dw2 = kn(g.W1, L, H, 2*F), kn(g.W2, L, F, H)
	if Fs > 0 {
		res.dsw1, res.dsw2 = kn(g.SharedW1, 1, H, 2*Fs), kn(g.SharedW2, 1, Fs, H)
	}
	return res
}

var fdCases = []struct {
	name string
	cfg  Config
	T    int
	bias bool
}{
	{"softmax_shared_aux", Config{Hidden: 8, FFN: 6, SharedFFN: 4,
		Router: RouterConfig{Experts: 6, TopK: 2, Renormalize: true, AuxLoss: 1}}, 12, false},
	{"sigmoid_groups_bias", Config{Hidden: 8, FFN: 5,
		Router: RouterConfig{Experts: 6, TopK: 2, Score: Sigmoid, Groups: 3, TopKGroups: 2, Renormalize: true, Scale: 2.5, AuxLoss: 1}}, 10, true},
	{"capacity_nk", Config{Hidden: 6, FFN: 4, SharedFFN: 3, CapacityFactor: 0.5, Layout: gemm.NK,
		Router: RouterConfig{Experts: 4, TopK: 2}}, 12, false},
}

// TestLayerGradFD checks Backward of a small f32 layer on the CPU against central
// finite differences of the float64 reference, for the input, the router and every
// expert weight.
func TestLayerGradFD(t *testing.T) {
	for i, tc := range fdCases {
		t.Run(tc.name, func(t *testing.T) {
			r := dt.Rand(uint64(500 + i))
			l := newRef(r, tc.cfg, tc.T, tc.bias, device.F32, device.F32)
			gy := dt.Normal(r, tc.T*tc.cfg.Hidden, 1)
			got := runLayer(t, device.CPU(), l, device.F32, device.F32, gy)
			_, base := l.loss(f64(gy))
			closeTo(t, "y", got.y, base.y, 1e-5)
			if tc.cfg.CapacityFactor > 0 && base.dropped == 0 {
				t.Fatal("capacity case drops nothing")
			}
			if got.stats.Dropped != base.dropped {
				t.Errorf("Stats.Dropped = %d, want %d", got.stats.Dropped, base.dropped)
			}
			for _, p := range []struct {
				name string
				v    []float64
				g    []float32
			}{{"x", l.x, got.dx}, {"router", l.wr, got.dwr}, {"w1", l.w1, got.dw1}, {"w2", l.w2, got.dw2},
				{"shared_w1", l.sw1, got.dsw1}, {"shared_w2", l.sw2, got.dsw2}} {
				if len(p.v) == 0 {
					continue
				}
				want := make([]float64, len(p.v))
				const h = 1e-5
				for j := range p.v {
					v := p.v[j]
					p.v[j] = v + h
					lp, rp := l.loss(f64(gy))
					p.v[j] = v - h
					lm, rm := l.loss(f64(gy))
					p.v[j] = v
					if cmp.Diff(base.route.idx, rp.route.idx) != "" || cmp.Diff(base.route.idx, rm.route.idx) != "" {
						t.Fatalf("%s[%d]: routing changed within ±%g", p.name, j, h)
					}
					want[j] = (lp - lm) / (2 * h)
				}
				closeTo(t, "d"+p.name, p.g, want, 1e-3)
			}
		})
	}
}

var layerCases = []struct {
	name       string
	cfg        Config
	T          int
	bias       bool
	typ, rtyp  device.DType
	skewExpert []int // experts given a large bias so every token picks them
}{
	{"bf16_softmax_shared", Config{Hidden: 64, FFN: 32, SharedFFN: 32,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.01}}, 256, false, device.BF16, device.BF16, nil},
	{"f32_sigmoid_groups_nk", Config{Hidden: 48, FFN: 24, Layout: gemm.NK,
		Router: RouterConfig{Experts: 16, TopK: 4, Score: Sigmoid, Groups: 4, TopKGroups: 2, Renormalize: true, Scale: 2.5, AuxLoss: 0.001}},
		200, true, device.F32, device.F32, nil},
	{"bf16_capacity", Config{Hidden: 32, FFN: 16, CapacityFactor: 0.75,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true}}, 128, false, device.BF16, device.F32, nil},
	{"bf16_odd_sizes", Config{Hidden: 20, FFN: 12, SharedFFN: 6,
		Router: RouterConfig{Experts: 5, TopK: 3}}, 77, false, device.BF16, device.F32, nil},
	// Every token routed to experts 2 and 5: the dropless layer computes all T·K
	// assignments exactly once however skewed.
	{"skew_dropless", Config{Hidden: 16, FFN: 8,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true}}, 2048, true, device.F32, device.F32, []int{2, 5}},
	{"skew_capacity", Config{Hidden: 16, FFN: 8, CapacityFactor: 1,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true}}, 512, true, device.BF16, device.F32, []int{2, 5}},
	{"no_tokens", Config{Hidden: 16, FFN: 8, SharedFFN: 8,
		Router: RouterConfig{Experts: 4, TopK: 2, AuxLoss: 0.01}}, 0, false, device.BF16, device.F32, nil},
}

// TestLayer runs the layer's forward and backward on every device: the forward output,
// loads, drops and auxiliary loss against the float64 reference, the gradients against
// the CPU's (themselves checked by TestLayerGradFD), and token conservation.
func TestLayer(t *testing.T) {
	type prepared struct {
		l   *refLayer
		gy  []float32
		ref refResult
		cpu layerRun
	}
	preps := make([]prepared, len(layerCases))
	for i, tc := range layerCases {
		r := dt.Rand(uint64(600 + i))
		l := newRef(r, tc.cfg, tc.T, tc.bias, tc.typ, tc.rtyp)
		for _, e := range tc.skewExpert {
			l.bias[e] = 10
		}
		gy := randn(r, tc.typ, tc.T*tc.cfg.Hidden, 1)
		preps[i] = prepared{l: l, gy: gy, ref: l.forward(), cpu: runLayer(t, device.CPU(), l, tc.typ, tc.rtyp, gy)}
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range layerCases {
			t.Run(tc.name, func(t *testing.T) {
				p := preps[i]
				c := tc.cfg
				T, K, E := tc.T, c.Router.TopK, c.Router.Experts
				got := p.cpu
				if d.IsCUDA() {
					got = runLayer(t, d, p.l, tc.typ, tc.rtyp, p.gy)
				}
				closeTo(t, "y", got.y, p.ref.y, tol(tc.typ))
				wantLoad := p.ref.route.load
				if diff := cmp.Diff(wantLoad, got.stats.Load); diff != "" {
					t.Errorf("Stats.Load (-want +got):\n%s", diff)
				}
				if got.stats.Dropped != p.ref.dropped {
					t.Errorf("Stats.Dropped = %d, want %d", got.stats.Dropped, p.ref.dropped)
				}
				if c.Router.AuxLoss > 0 && math.Abs(float64(got.stats.AuxLoss)-p.ref.route.aux) > 1e-3*p.ref.route.aux {
					t.Errorf("Stats.AuxLoss = %v, want %v", got.stats.AuxLoss, p.ref.route.aux)
				}
				// Conservation: kept assignments map one to one onto rows [0, kept),
				// in expert order and, within an expert, in assignment order.
				kept := T*K - p.ref.dropped
				seen := make([]bool, kept)
				for a, r := range got.row {
					if (r < 0) != (p.ref.row[a] < 0) {
						t.Fatalf("assignment %d: row %d, reference keeps it: %v", a, r, p.ref.row[a] >= 0)
					}
					if r < 0 {
						continue
					}
					if int(r) >= kept || seen[r] {
						t.Fatalf("assignment %d: row %d out of [0, %d) or taken twice", a, r, kept)
					}
					seen[r] = true
				}
				if tc.skewExpert != nil {
					for e := range E {
						want := 0
						for _, s := range tc.skewExpert {
							if s == e {
								want = T
							}
						}
						if got.stats.Load[e] != want {
							t.Fatalf("skewed routing: load %v", got.stats.Load)
						}
					}
				}
				if !d.IsCUDA() {
					return
				}
				gt, ct := tol(tc.typ), p.cpu
				closeTo(t, "dx", got.dx, f64(ct.dx), gt)
				closeTo(t, "drouter", got.dwr, f64(ct.dwr), gt)
				closeTo(t, "dw1", got.dw1, f64(ct.dw1), gt)
				closeTo(t, "dw2", got.dw2, f64(ct.dw2), gt)
				if c.SharedFFN > 0 {
					closeTo(t, "dshared_w1", got.dsw1, f64(ct.dsw1), gt)
					closeTo(t, "dshared_w2", got.dsw2, f64(ct.dsw2), gt)
				}
			})
		}
	})
}
