package moe

import (
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// Sizes of the bad-argument fixtures: T tokens of width H, E experts, top-K, FFN width F,
// R = T·K permuted rows.
const (
	baT, baH, baE, baK, baF, baR = 3, 8, 4, 2, 4, 6
	baFs                         = 2 // shared expert width
)

// argFixture makes the fresh, valid arguments the bad-argument cases start from, on the CPU.
type argFixture struct {
	t  testing.TB
	s  *device.Stream
	ts []*device.Tensor
}

func (f *argFixture) alloc(typ device.DType, shape ...int) *device.Tensor {
	x := dt.Must(f.s.Alloc(typ, shape...))
	f.ts = append(f.ts, x)
	return x
}

func (f *argFixture) f32(shape ...int) *device.Tensor { return f.alloc(device.F32, shape...) }
func (f *argFixture) bf(shape ...int) *device.Tensor  { return f.alloc(device.BF16, shape...) }
func (f *argFixture) i32(shape ...int) *device.Tensor { return f.alloc(device.I32, shape...) }

// freed frees x and returns it.
func freed(x *device.Tensor) *device.Tensor {
	x.Free()
	return x
}

func (f *argFixture) routerConfig() RouterConfig { return RouterConfig{Experts: baE, TopK: baK} }

// routing routes zero logits: every token to experts 0 and 1.
func (f *argFixture) routing() *Routing {
	return dt.Must(Route(f.s, f.routerConfig(), f.f32(baT, baE), nil))
}

// index returns expert indices I32[T,K] that use every expert.
func (f *argFixture) index() *device.Tensor {
	idx := dt.Must(device.FromSlice(f.s, device.I32, []int32{0, 1, 2, 3, 1, 0}, baT, baK))
	f.ts = append(f.ts, idx)
	return idx
}

// perm sorts index(): Rows = R.
func (f *argFixture) perm() *Permutation { return dt.Must(Sort(f.s, f.index(), baE, 0)) }

func freedPerm(p *Permutation) *Permutation {
	p.Free()
	return p
}

func freedRouting(r *Routing) *Routing {
	r.Free()
	return r
}

func (f *argFixture) layer(shared int) *Layer {
	return dt.Must(NewLayer(Config{Hidden: baH, FFN: baF, SharedFFN: shared, Router: f.routerConfig()}))
}

func (f *argFixture) params(shared bool) *Params {
	p := &Params{Router: f.f32(baE, baH), W1: f.f32(baE, baH, 2*baF), W2: f.f32(baE, baF, baH)}
	if shared {
		p.SharedW1, p.SharedW2 = f.f32(baH, 2*baFs), f.f32(baFs, baH)
	}
	return p
}

func (f *argFixture) grads(shared bool) *Grads {
	g := &Grads{X: f.f32(baT, baH), Router: f.f32(baE, baH), W1: f.f32(baE, baH, 2*baF), W2: f.f32(baE, baF, baH)}
	if shared {
		g.SharedW1, g.SharedW2 = f.f32(baH, 2*baFs), f.f32(baFs, baH)
	}
	return g
}

// forward runs a Forward of l on fresh arguments and returns its parameters and
// activations, freed when the test ends.
func (f *argFixture) forward(l *Layer) (*Params, *Activations) {
	p := f.params(l.Config().SharedFFN > 0)
	act := dt.Must(l.Forward(f.s, f.f32(baT, baH), f.f32(baT, baH), p))
	f.t.Cleanup(func() { act.Free() })
	return p, act
}

// backward runs l.Backward on the activations of a fresh Forward with gradients g
// changed by edit.
func (f *argFixture) backward(l *Layer, edit func(g *Grads, p *Params)) error {
	p, act := f.forward(l)
	g := f.grads(l.Config().SharedFFN > 0)
	edit(g, p)
	return l.Backward(f.s, g, f.f32(baT, baH), act)
}

// forwardWith runs l.Forward on fresh valid arguments changed by edit.
func (f *argFixture) forwardWith(l *Layer, edit func(y, x **device.Tensor, p *Params)) error {
	y, x, p := f.f32(baT, baH), f.f32(baT, baH), f.params(l.Config().SharedFFN > 0)
	edit(&y, &x, p)
	act, err := l.Forward(f.s, y, x, p)
	act.Free()
	return err
}

type badArg struct {
	name string
	want string // in the error's text: the function and the argument
	call func() error
}

// TestBadArgs feeds every exported function and method of the package nil, freed,
// wrong-shape, wrong-dtype and out-of-range arguments on the CPU and checks that each
// returns an error that names the argument, without panicking.
func TestBadArgs(t *testing.T) {
	f := &argFixture{t: t, s: device.CPU().Stream()}
	t.Cleanup(func() { device.FreeAll(f.ts...) })
	var cases []badArg
	for _, group := range [][]badArg{
		f.routerCases(), f.sortCases(), f.permuteCases(), f.swigluCases(), f.swigluFP8Cases(), f.forwardCases(), f.backwardCases(),
	} {
		cases = append(cases, group...)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { dt.WantError(t, tc.call, tc.want) })
	}
}

func (f *argFixture) routerCases() []badArg {
	s, nan, inf := f.s, float32(math.NaN()), float32(math.Inf(1))
	logits := func(x, wr, out *device.Tensor) func() error {
		return func() error { return RouterLogits(s, out, x, wr) }
	}
	wgrad := func(dwr, x, dl *device.Tensor) func() error {
		return func() error { return RouterWeightGrad(s, dwr, x, dl, false) }
	}
	route := func(cfg RouterConfig, logits, bias *device.Tensor) func() error {
		return func() error {
			r, err := Route(s, cfg, logits, bias)
			r.Free()
			return err
		}
	}
	rc := f.routerConfig()
	routeGrad := func(dl, dw *device.Tensor, r *Routing) func() error {
		return func() error { return RouteGrad(s, dl, dw, r) }
	}
	bias := func(b, load *device.Tensor, gamma float32) func() error {
		return func() error { return UpdateBias(s, b, load, gamma) }
	}
	badCfg := rc
	badCfg.TopK = 0
	r := f.routing()
	mismatched := *r
	mismatched.Config.Experts = baE + 1
	auxShape, auxTokens, auxAlone := *r, *r, *r
	auxShape.AuxLoad, auxShape.AuxTokens = f.i32(baE+1), baT
	auxTokens.AuxLoad, auxTokens.AuxTokens = f.i32(baE), baT-1
	auxAlone.AuxTokens = baT
	ac := rc
	ac.AuxLoss = 0.1
	noSums := *dt.Must(Route(s, ac, f.f32(baT, baE), nil))
	f.ts = append(f.ts, noSums.Index, noSums.Weight, noSums.Scores, noSums.Load, noSums.AuxLoss, noSums.probSum)
	noSums.probSum = nil
	balance := func(r *Routing, load *device.Tensor, tokens int) func() error {
		return func() error { return r.BalanceOver(s, load, tokens) }
	}
	return []badArg{
		{"RouterLogits/nil_stream", "RouterLogits: nil stream", func() error { return RouterLogits(nil, f.f32(baT, baE), f.f32(baT, baH), f.f32(baE, baH)) }},
		{"RouterLogits/nil_logits", "RouterLogits logits", logits(f.f32(baT, baH), f.f32(baE, baH), nil)},
		{"RouterLogits/freed_logits", "RouterLogits logits", logits(f.f32(baT, baH), f.f32(baE, baH), freed(f.f32(baT, baE)))},
		{"RouterLogits/logits_dtype", "RouterLogits logits", logits(f.f32(baT, baH), f.f32(baE, baH), f.bf(baT, baE))},
		{"RouterLogits/logits_shape", "RouterLogits logits", logits(f.f32(baT, baH), f.f32(baE, baH), f.f32(baT, baE+1))},
		{"RouterLogits/nil_x", "RouterLogits x", logits(nil, f.f32(baE, baH), f.f32(baT, baE))},
		{"RouterLogits/x_dtype", "RouterLogits x", logits(f.i32(baT, baH), f.f32(baE, baH), f.f32(baT, baE))},
		{"RouterLogits/x_rank", "RouterLogits x", logits(f.f32(baT*baH), f.f32(baE, baH), f.f32(baT, baE))},
		{"RouterLogits/freed_wr", "RouterLogits wr", logits(f.f32(baT, baH), freed(f.f32(baE, baH)), f.f32(baT, baE))},
		{"RouterLogits/wr_shape", "RouterLogits wr", logits(f.f32(baT, baH), f.f32(baE, baH-1), f.f32(baT, baE))},

		{"RouterWeightGrad/nil_stream", "RouterWeightGrad: nil stream", func() error {
			return RouterWeightGrad(nil, f.f32(baE, baH), f.f32(baT, baH), f.f32(baT, baE), false)
		}},
		{"RouterWeightGrad/nil_dwr", "RouterWeightGrad dwr", wgrad(nil, f.f32(baT, baH), f.f32(baT, baE))},
		{"RouterWeightGrad/dwr_shape", "RouterWeightGrad dwr", wgrad(f.f32(baE, baH+1), f.f32(baT, baH), f.f32(baT, baE))},
		{"RouterWeightGrad/dwr_dtype", "RouterWeightGrad dwr", wgrad(f.i32(baE, baH), f.f32(baT, baH), f.f32(baT, baE))},
		{"RouterWeightGrad/freed_x", "RouterWeightGrad x", wgrad(f.f32(baE, baH), freed(f.f32(baT, baH)), f.f32(baT, baE))},
		{"RouterWeightGrad/dlogits_dtype", "RouterWeightGrad dlogits", wgrad(f.f32(baE, baH), f.f32(baT, baH), f.bf(baT, baE))},
		{"RouterWeightGrad/dlogits_shape", "RouterWeightGrad dlogits", wgrad(f.f32(baE, baH), f.f32(baT, baH), f.f32(baT+1, baE))},

		{"Route/nil_stream", "Route: nil stream", func() error { _, err := Route(nil, rc, f.f32(baT, baE), nil); return err }},
		{"Route/config", "RouterConfig.Experts", route(RouterConfig{TopK: 1}, f.f32(baT, baE), nil)},
		{"Route/nil_logits", "Route logits", route(rc, nil, nil)},
		{"Route/freed_logits", "Route logits", route(rc, freed(f.f32(baT, baE)), nil)},
		{"Route/logits_dtype", "Route logits", route(rc, f.bf(baT, baE), nil)},
		{"Route/logits_shape", "Route logits", route(rc, f.f32(baT, baE+1), nil)},
		{"Route/bias_shape", "Route bias", route(rc, f.f32(baT, baE), f.f32(baE+1))},
		{"Route/bias_dtype", "Route bias", route(rc, f.f32(baT, baE), f.bf(baE))},
		{"Route/freed_bias", "Route bias", route(rc, f.f32(baT, baE), freed(f.f32(baE)))},

		{"RouteGrad/nil_stream", "RouteGrad: nil stream", func() error { return RouteGrad(nil, f.f32(baT, baE), nil, r) }},
		{"RouteGrad/nil_routing", "RouteGrad r", routeGrad(f.f32(baT, baE), nil, nil)},
		{"RouteGrad/freed_routing", "RouteGrad r", routeGrad(f.f32(baT, baE), nil, freedRouting(f.routing()))},
		{"RouteGrad/routing_config", "RouteGrad r", routeGrad(f.f32(baT, baE), nil, &mismatched)},
		{"RouteGrad/nil_dlogits", "RouteGrad dlogits", routeGrad(nil, nil, r)},
		{"RouteGrad/dlogits_shape", "RouteGrad dlogits", routeGrad(f.f32(baT, baE+1), nil, r)},
		{"RouteGrad/dlogits_dtype", "RouteGrad dlogits", routeGrad(f.bf(baT, baE), nil, r)},
		{"RouteGrad/dweight_shape", "RouteGrad dweight", routeGrad(f.f32(baT, baE), f.f32(baT, baK+1), r)},
		{"RouteGrad/freed_dweight", "RouteGrad dweight", routeGrad(f.f32(baT, baE), freed(f.f32(baT, baK)), r)},
		{"RouteGrad/aux_load_shape", "RouteGrad r.AuxLoad", routeGrad(f.f32(baT, baE), nil, &auxShape)},
		{"RouteGrad/aux_tokens_below", "RouteGrad r.AuxTokens", routeGrad(f.f32(baT, baE), nil, &auxTokens)},
		{"RouteGrad/aux_tokens_alone", "RouteGrad r.AuxTokens", routeGrad(f.f32(baT, baE), nil, &auxAlone)},

		{"BalanceOver/nil_stream", "Routing.BalanceOver: nil stream", func() error { return r.BalanceOver(nil, f.i32(baE), baT) }},
		{"BalanceOver/nil_routing", "Routing.BalanceOver r", balance(nil, f.i32(baE), baT)},
		{"BalanceOver/freed_routing", "Routing.BalanceOver r", balance(freedRouting(f.routing()), f.i32(baE), baT)},
		{"BalanceOver/nil_load", "Routing.BalanceOver load", balance(r, nil, baT)},
		{"BalanceOver/freed_load", "Routing.BalanceOver load", balance(r, freed(f.i32(baE)), baT)},
		{"BalanceOver/load_shape", "Routing.BalanceOver load", balance(r, f.i32(baE+1), baT)},
		{"BalanceOver/load_dtype", "Routing.BalanceOver load", balance(r, f.f32(baE), baT)},
		{"BalanceOver/tokens_below", "Routing.BalanceOver tokens", balance(r, f.i32(baE), baT-1)},
		{"BalanceOver/tokens_overflow", "Routing.BalanceOver tokens", balance(r, f.i32(baE), math.MaxInt32)},
		{"BalanceOver/not_routed", "make it with Route", balance(&noSums, f.i32(baE), baT)},

		{"UpdateBias/nil_stream", "UpdateBias: nil stream", func() error { return UpdateBias(nil, f.f32(baE), f.i32(baE), 1) }},
		{"UpdateBias/nil_bias", "UpdateBias bias", bias(nil, f.i32(baE), 1)},
		{"UpdateBias/bias_dtype", "UpdateBias bias", bias(f.bf(baE), f.i32(baE), 1)},
		{"UpdateBias/bias_rank", "UpdateBias bias", bias(f.f32(1, baE), f.i32(baE), 1)},
		{"UpdateBias/bias_empty", "UpdateBias bias", bias(f.f32(0), f.i32(0), 1)},
		{"UpdateBias/freed_load", "UpdateBias load", bias(f.f32(baE), freed(f.i32(baE)), 1)},
		{"UpdateBias/load_shape", "UpdateBias load", bias(f.f32(baE), f.i32(baE+1), 1)},
		{"UpdateBias/load_dtype", "UpdateBias load", bias(f.f32(baE), f.f32(baE), 1)},
		{"UpdateBias/gamma_nan", "UpdateBias gamma", bias(f.f32(baE), f.i32(baE), nan)},
		{"UpdateBias/gamma_inf", "UpdateBias gamma", bias(f.f32(baE), f.i32(baE), -inf)},

		{"RouterConfig/scale_nan", "RouterConfig.Scale", func() error { c := rc; c.Scale = nan; return c.Validate() }},
		{"Config/capacity_nan", "Config.CapacityFactor", func() error {
			_, err := NewLayer(Config{Hidden: baH, FFN: baF, CapacityFactor: math.NaN(), Router: rc})
			return err
		}},
		{"Config/router", "RouterConfig.TopK", func() error { return Config{Hidden: baH, FFN: baF, Router: badCfg}.Validate() }},
	}
}

func (f *argFixture) sortCases() []badArg {
	s := f.s
	sort := func(index *device.Tensor, experts, capacity int) func() error {
		return func() error {
			p, err := Sort(s, index, experts, capacity)
			p.Free()
			return err
		}
	}
	capacity := func(factor float64, tokens, topk, experts int) func() error {
		return func() error { _, err := Capacity(factor, tokens, topk, experts); return err }
	}
	idx := f.index
	bad := dt.Must(device.FromSlice(s, device.I32, []int32{0, 1, 2, baE, 1, 0}, baT, baK))
	f.ts = append(f.ts, bad)
	dropped := func(s *device.Stream, p *Permutation) func() error {
		return func() error { _, err := p.DroppedCount(s); return err }
	}
	return []badArg{
		{"Sort/nil_stream", "Sort: nil stream", func() error { _, err := Sort(nil, idx(), baE, 0); return err }},
		{"Sort/nil_index", "Sort index", sort(nil, baE, 0)},
		{"Sort/freed_index", "Sort index", sort(freed(idx()), baE, 0)},
		{"Sort/index_dtype", "Sort index", sort(f.f32(baT, baK), baE, 0)},
		{"Sort/index_rank", "Sort index", sort(f.i32(baT*baK), baE, 0)},
		{"Sort/index_topk", "Sort index", sort(f.i32(baT, MaxTopK+1), baE, 0)},
		{"Sort/index_value", ErrBadIndex.Error(), sort(bad, baE, 0)},
		{"Sort/experts_zero", "Sort experts", sort(idx(), 0, 0)},
		{"Sort/experts_large", "Sort experts", sort(idx(), MaxExperts+1, 0)},
		{"Sort/capacity", "Sort capacity", sort(idx(), baE, -1)},

		{"Capacity/factor_nan", "Capacity factor", capacity(math.NaN(), baT, baK, baE)},
		{"Capacity/factor_inf", "Capacity factor", capacity(math.Inf(1), baT, baK, baE)},
		{"Capacity/factor_neg_inf", "Capacity factor", capacity(math.Inf(-1), baT, baK, baE)},
		{"Capacity/factor_negative", "Capacity factor", capacity(-1, baT, baK, baE)},
		{"Capacity/tokens", "Capacity tokens", capacity(1, -1, baK, baE)},
		{"Capacity/topk", "Capacity topk", capacity(1, baT, 0, baE)},
		{"Capacity/experts", "Capacity experts", capacity(1, baT, baK, 0)},

		{"DroppedCount/nil_stream", "DroppedCount: nil stream", dropped(nil, f.perm())},
		{"DroppedCount/nil_permutation", "DroppedCount p", dropped(s, nil)},
		{"DroppedCount/freed_permutation", "DroppedCount p", dropped(s, freedPerm(f.perm()))},
	}
}

func (f *argFixture) permuteCases() []badArg {
	s := f.s
	permute := func(xp, x *device.Tensor, p *Permutation) func() error {
		return func() error { return Permute(s, xp, x, p) }
	}
	permuteGrad := func(dx, dxp *device.Tensor, p *Permutation) func() error {
		return func() error { return PermuteGrad(s, dx, dxp, p) }
	}
	unpermute := func(y, yp, w *device.Tensor, p *Permutation) func() error {
		return func() error { return Unpermute(s, y, yp, w, p) }
	}
	unpermuteGrad := func(dyp, dw, dy, yp, w *device.Tensor, p *Permutation) func() error {
		return func() error { return UnpermuteGrad(s, dyp, dw, dy, yp, w, p) }
	}
	p := f.perm()
	x, xp, w := func() *device.Tensor { return f.f32(baT, baH) }, func() *device.Tensor { return f.f32(baR, baH) },
		func() *device.Tensor { return f.f32(baT, baK) }
	var cases []badArg
	// The permutation argument, nil and freed, of each of the four ops.
	for _, pc := range []struct {
		name string
		p    func() *Permutation
	}{{"nil", func() *Permutation { return nil }}, {"freed", func() *Permutation { return freedPerm(f.perm()) }}} {
		cases = append(cases,
			badArg{"Permute/" + pc.name + "_permutation", "Permute p", permute(xp(), x(), pc.p())},
			badArg{"PermuteGrad/" + pc.name + "_permutation", "PermuteGrad p", permuteGrad(x(), xp(), pc.p())},
			badArg{"Unpermute/" + pc.name + "_permutation", "Unpermute p", unpermute(x(), xp(), w(), pc.p())},
			badArg{"UnpermuteGrad/" + pc.name + "_permutation", "UnpermuteGrad p", unpermuteGrad(xp(), w(), x(), xp(), w(), pc.p())},
		)
	}
	broken := *p
	broken.Tokens = baT + 1
	return append(cases, []badArg{
		{"Permute/nil_stream", "Permute: nil stream", func() error { return Permute(nil, xp(), x(), p) }},
		{"Permute/permutation_sizes", "Permute p", permute(f.f32(baR, baH), f.f32(baT+1, baH), &broken)},
		{"Permute/nil_x", "Permute x", permute(xp(), nil, p)},
		{"Permute/freed_x", "Permute x", permute(xp(), freed(x()), p)},
		{"Permute/x_dtype", "Permute x", permute(xp(), f.i32(baT, baH), p)},
		{"Permute/x_tokens", "Permute x", permute(xp(), f.f32(baT+1, baH), p)},
		{"Permute/nil_xp", "Permute xp", permute(nil, x(), p)},
		{"Permute/xp_rows", "Permute xp", permute(f.f32(baR-1, baH), x(), p)},
		{"Permute/xp_dtype", "Permute xp", permute(f.bf(baR, baH), x(), p)},

		{"PermuteGrad/nil_stream", "PermuteGrad: nil stream", func() error { return PermuteGrad(nil, x(), xp(), p) }},
		{"PermuteGrad/nil_dx", "PermuteGrad dx", permuteGrad(nil, xp(), p)},
		{"PermuteGrad/dx_tokens", "PermuteGrad dx", permuteGrad(f.f32(baT-1, baH), xp(), p)},
		{"PermuteGrad/nil_dxp", "PermuteGrad dxp", permuteGrad(x(), nil, p)},
		{"PermuteGrad/dxp_shape", "PermuteGrad dxp", permuteGrad(x(), f.f32(baR, baH-1), p)},
		{"PermuteGrad/dxp_dtype", "PermuteGrad dxp", permuteGrad(x(), f.bf(baR, baH), p)},

		{"Unpermute/nil_stream", "Unpermute: nil stream", func() error { return Unpermute(nil, x(), xp(), w(), p) }},
		{"Unpermute/nil_y", "Unpermute y", unpermute(nil, xp(), w(), p)},
		{"Unpermute/y_tokens", "Unpermute y", unpermute(f.f32(baT+1, baH), xp(), w(), p)},
		{"Unpermute/freed_yp", "Unpermute yp", unpermute(x(), freed(xp()), w(), p)},
		{"Unpermute/yp_rows", "Unpermute yp", unpermute(x(), f.f32(baR+1, baH), w(), p)},
		{"Unpermute/nil_weight", "Unpermute weight", unpermute(x(), xp(), nil, p)},
		{"Unpermute/weight_shape", "Unpermute weight", unpermute(x(), xp(), f.f32(baT, baK+1), p)},
		{"Unpermute/weight_dtype", "Unpermute weight", unpermute(x(), xp(), f.bf(baT, baK), p)},

		{"UnpermuteGrad/nil_stream", "UnpermuteGrad: nil stream", func() error { return UnpermuteGrad(nil, xp(), w(), x(), xp(), w(), p) }},
		{"UnpermuteGrad/nil_dyp", "UnpermuteGrad dyp", unpermuteGrad(nil, w(), x(), xp(), w(), p)},
		{"UnpermuteGrad/dyp_rows", "UnpermuteGrad dyp", unpermuteGrad(f.f32(baR-1, baH), w(), x(), xp(), w(), p)},
		{"UnpermuteGrad/nil_dweight", "UnpermuteGrad dweight", unpermuteGrad(xp(), nil, x(), xp(), w(), p)},
		{"UnpermuteGrad/dweight_dtype", "UnpermuteGrad dweight", unpermuteGrad(xp(), f.bf(baT, baK), x(), xp(), w(), p)},
		{"UnpermuteGrad/nil_dy", "UnpermuteGrad dy", unpermuteGrad(xp(), w(), nil, xp(), w(), p)},
		{"UnpermuteGrad/dy_tokens", "UnpermuteGrad dy", unpermuteGrad(xp(), w(), f.f32(baT+1, baH), xp(), w(), p)},
		{"UnpermuteGrad/freed_yp", "UnpermuteGrad yp", unpermuteGrad(xp(), w(), x(), freed(xp()), w(), p)},
		{"UnpermuteGrad/yp_dtype", "UnpermuteGrad yp", unpermuteGrad(xp(), w(), x(), f.bf(baR, baH), w(), p)},
		{"UnpermuteGrad/weight_shape", "UnpermuteGrad weight", unpermuteGrad(xp(), w(), x(), xp(), f.f32(baT+1, baK), p)},
	}...)
}

func (f *argFixture) swigluCases() []badArg {
	s := f.s
	fwd := func(a, h *device.Tensor) func() error { return func() error { return SwiGLU(s, a, h) } }
	bwd := func(dh, h, da *device.Tensor) func() error { return func() error { return SwiGLUGrad(s, dh, h, da) } }
	h, a := func() *device.Tensor { return f.f32(baR, 2*baF) }, func() *device.Tensor { return f.f32(baR, baF) }
	return []badArg{
		{"SwiGLU/nil_stream", "SwiGLU: nil stream", func() error { return SwiGLU(nil, a(), h()) }},
		{"SwiGLU/nil_h", "SwiGLU h", fwd(a(), nil)},
		{"SwiGLU/freed_h", "SwiGLU h", fwd(a(), freed(h()))},
		{"SwiGLU/h_dtype", "SwiGLU h", fwd(a(), f.i32(baR, 2*baF))},
		{"SwiGLU/h_odd", "SwiGLU h", fwd(a(), f.f32(baR, 2*baF-1))},
		{"SwiGLU/nil_a", "SwiGLU a", fwd(nil, h())},
		{"SwiGLU/a_shape", "SwiGLU a", fwd(f.f32(baR, baF+1), h())},
		{"SwiGLU/a_dtype", "SwiGLU a", fwd(f.bf(baR, baF), h())},

		{"SwiGLUGrad/nil_stream", "SwiGLUGrad: nil stream", func() error { return SwiGLUGrad(nil, h(), h(), a()) }},
		{"SwiGLUGrad/nil_h", "SwiGLUGrad h", bwd(h(), nil, a())},
		{"SwiGLUGrad/h_odd", "SwiGLUGrad h", bwd(h(), f.f32(baR, 3), a())},
		{"SwiGLUGrad/freed_da", "SwiGLUGrad da", bwd(h(), h(), freed(a()))},
		{"SwiGLUGrad/da_shape", "SwiGLUGrad da", bwd(h(), h(), f.f32(baR+1, baF))},
		{"SwiGLUGrad/nil_dh", "SwiGLUGrad dh", bwd(nil, h(), a())},
		{"SwiGLUGrad/dh_dtype", "SwiGLUGrad dh", bwd(f.bf(baR, 2*baF), h(), a())},
	}
}

func (f *argFixture) swigluFP8Cases() []badArg {
	s := f.s
	h := func() *device.Tensor { return f.f32(baR, 2*baF) }
	bq := dt.Must(quant.AllocBlockwise(s, baR, baF, quant.BlockOptions{}))
	mq := dt.Must(quant.Alloc(s, baR, baF, quant.Options{}))
	f.t.Cleanup(func() { bq.Free(); mq.Free() })
	bgone := dt.Must(quant.AllocBlockwise(s, baR, baF, quant.BlockOptions{}))
	mgone := dt.Must(quant.Alloc(s, baR, baF, quant.Options{}))
	bgone.Free()
	mgone.Free()
	bw := func(q *quant.Blockwise, h *device.Tensor, opt quant.BlockOptions) func() error {
		return func() error { return SwiGLUBlockwise(s, q, h, opt) }
	}
	mx := func(q *quant.MXFP8, h *device.Tensor, opt quant.Options) func() error {
		return func() error { return SwiGLUMXFP8(s, q, h, opt) }
	}
	return []badArg{
		{"SwiGLUBlockwise/nil_stream", "SwiGLUBlockwise: nil stream", func() error { return SwiGLUBlockwise(nil, bq, h(), quant.BlockOptions{}) }},
		{"SwiGLUBlockwise/nil_q", "SwiGLUBlockwise: q is nil", bw(nil, h(), quant.BlockOptions{})},
		{"SwiGLUBlockwise/freed_q", "SwiGLUBlockwise: quant: QuantizeBlockwiseSource: device: q.Row", bw(bgone, h(), quant.BlockOptions{})},
		{"SwiGLUBlockwise/nil_h", "SwiGLUBlockwise h", bw(bq, nil, quant.BlockOptions{})},
		{"SwiGLUBlockwise/freed_h", "SwiGLUBlockwise h", bw(bq, freed(h()), quant.BlockOptions{})},
		{"SwiGLUBlockwise/h_dtype", "SwiGLUBlockwise h", bw(bq, f.i32(baR, 2*baF), quant.BlockOptions{})},
		{"SwiGLUBlockwise/h_odd", "SwiGLUBlockwise h", bw(bq, f.f32(baR, 2*baF-1), quant.BlockOptions{})},
		{"SwiGLUBlockwise/h_rows", "SwiGLUBlockwise h", bw(bq, f.f32(baR+1, 2*baF), quant.BlockOptions{})},
		{"SwiGLUBlockwise/h_rank", "SwiGLUBlockwise h", bw(bq, f.f32(baR, 2*baF, 1), quant.BlockOptions{})},
		{"SwiGLUBlockwise/opt_dir", "SwiGLUBlockwise: quant: QuantizeBlockwiseSource: opt.Dir", bw(bq, h(), quant.BlockOptions{Dir: quant.Both})},
		{"SwiGLUBlockwise/opt_groups", "SwiGLUBlockwise: quant: QuantizeBlockwiseSource: opt.GroupSizes", bw(bq, h(), quant.BlockOptions{GroupSizes: f.i32(2)})},

		{"SwiGLUMXFP8/nil_stream", "SwiGLUMXFP8: nil stream", func() error { return SwiGLUMXFP8(nil, mq, h(), quant.Options{}) }},
		{"SwiGLUMXFP8/nil_q", "SwiGLUMXFP8: q is nil", mx(nil, h(), quant.Options{})},
		{"SwiGLUMXFP8/freed_q", "SwiGLUMXFP8: quant: QuantizeSource: device: q.Row", mx(mgone, h(), quant.Options{})},
		{"SwiGLUMXFP8/nil_h", "SwiGLUMXFP8 h", mx(mq, nil, quant.Options{})},
		{"SwiGLUMXFP8/freed_h", "SwiGLUMXFP8 h", mx(mq, freed(h()), quant.Options{})},
		{"SwiGLUMXFP8/h_dtype", "SwiGLUMXFP8 h", mx(mq, f.i32(baR, 2*baF), quant.Options{})},
		{"SwiGLUMXFP8/h_odd", "SwiGLUMXFP8 h", mx(mq, f.f32(baR, 2*baF+1), quant.Options{})},
		{"SwiGLUMXFP8/h_rows", "SwiGLUMXFP8 h", mx(mq, f.f32(baR-1, 2*baF), quant.Options{})},
		{"SwiGLUMXFP8/opt_transpose", "SwiGLUMXFP8: quant: QuantizeSource: opt.Transpose", mx(mq, h(), quant.Options{Transpose: true})},
		{"SwiGLUMXFP8/opt_format", "SwiGLUMXFP8: quant: QuantizeSource: opt.Format", mx(mq, h(), quant.Options{Format: quant.E5M2})},
	}
}

func (f *argFixture) forwardCases() []badArg {
	s, l, ls := f.s, f.layer(0), f.layer(baFs)
	edit := func(l *Layer, fn func(y, x **device.Tensor, p *Params)) func() error {
		return func() error { return f.forwardWith(l, fn) }
	}
	stats := func(s *device.Stream, act *Activations) func() error {
		return func() error { _, err := act.Stats(s); return err }
	}
	_, act := f.forward(l)
	_, gone := f.forward(l)
	gone.Free()
	return []badArg{
		{"Forward/nil_stream", "Forward: nil stream", func() error {
			_, err := l.Forward(nil, f.f32(baT, baH), f.f32(baT, baH), f.params(false))
			return err
		}},
		{"Forward/nil_layer", "nil Layer", func() error {
			_, err := (*Layer)(nil).Forward(s, f.f32(baT, baH), f.f32(baT, baH), f.params(false))
			return err
		}},
		{"Forward/nil_y", "Layer y", edit(l, func(y, x **device.Tensor, p *Params) { *y = nil })},
		{"Forward/y_shape", "Layer y", edit(l, func(y, x **device.Tensor, p *Params) { *y = f.f32(baT+1, baH) })},
		{"Forward/y_dtype", "Layer y", edit(l, func(y, x **device.Tensor, p *Params) { *y = f.bf(baT, baH) })},
		{"Forward/nil_x", "Layer x", edit(l, func(y, x **device.Tensor, p *Params) { *x = nil })},
		{"Forward/freed_x", "Layer x", edit(l, func(y, x **device.Tensor, p *Params) { freed(*x) })},
		{"Forward/x_width", "Layer x", edit(l, func(y, x **device.Tensor, p *Params) { *x = f.f32(baT, baH+1) })},
		{"Forward/x_dtype", "Layer x", edit(l, func(y, x **device.Tensor, p *Params) { *x = f.i32(baT, baH) })},
		{"Forward/nil_params", "nil Params", func() error { _, err := l.Forward(s, f.f32(baT, baH), f.f32(baT, baH), nil); return err }},
		{"Forward/nil_router", "Params.Router", edit(l, func(y, x **device.Tensor, p *Params) { p.Router = nil })},
		{"Forward/router_shape", "Params.Router", edit(l, func(y, x **device.Tensor, p *Params) { p.Router = f.f32(baE+1, baH) })},
		{"Forward/router_dtype", "Params.Router", edit(l, func(y, x **device.Tensor, p *Params) { p.Router = f.bf(baE, baH) })},
		{"Forward/bias_shape", "Params.Bias", edit(l, func(y, x **device.Tensor, p *Params) { p.Bias = f.f32(baE - 1) })},
		{"Forward/freed_bias", "Params.Bias", edit(l, func(y, x **device.Tensor, p *Params) { p.Bias = freed(f.f32(baE)) })},
		{"Forward/freed_w1", "Params.W1", edit(l, func(y, x **device.Tensor, p *Params) { freed(p.W1) })},
		{"Forward/w1_shape", "Params.W1", edit(l, func(y, x **device.Tensor, p *Params) { p.W1 = f.f32(baE, baH, baF) })},
		{"Forward/w2_dtype", "Params.W2", edit(l, func(y, x **device.Tensor, p *Params) { p.W2 = f.bf(baE, baF, baH) })},
		{"Forward/nil_w2", "Params.W2", edit(l, func(y, x **device.Tensor, p *Params) { p.W2 = nil })},
		{"Forward/shared_unwanted", "SharedFFN is 0", edit(l, func(y, x **device.Tensor, p *Params) { p.SharedW1 = f.f32(baH, 2*baFs) })},
		{"Forward/nil_shared_w1", "Params.SharedW1", edit(ls, func(y, x **device.Tensor, p *Params) { p.SharedW1 = nil })},
		{"Forward/shared_w2_shape", "Params.SharedW2", edit(ls, func(y, x **device.Tensor, p *Params) { p.SharedW2 = f.f32(baFs, baH+1) })},

		{"Stats/nil_stream", "Stats: nil stream", stats(nil, act)},
		{"Stats/nil_activations", "Stats: nil Activations", stats(s, nil)},
		{"Stats/freed_activations", "Stats", stats(s, gone)},
	}
}

func (f *argFixture) backwardCases() []badArg {
	s, l, ls := f.s, f.layer(0), f.layer(baFs)
	edit := func(l *Layer, fn func(g *Grads, p *Params)) func() error {
		return func() error { return f.backward(l, fn) }
	}
	call := func(l *Layer, s *device.Stream, g *Grads, dy *device.Tensor, act *Activations) func() error {
		return func() error { return l.Backward(s, g, dy, act) }
	}
	_, act := f.forward(l)
	_, gone := f.forward(l)
	gone.Free()
	_, other := f.forward(ls)
	g, dy := f.grads(false), f.f32(baT, baH)
	closed := dt.Must(s.Device().NewEvent())
	dt.NoErr(f.t, closed.Close())
	return []badArg{
		{"Backward/nil_stream", "Backward: nil stream", call(l, nil, g, dy, act)},
		{"Backward/nil_layer", "nil Layer", call(nil, s, g, dy, act)},
		{"InvalidateWeights/nil_layer", "nil Layer", func() error { return (*Layer)(nil).InvalidateWeights() }},
		{"Backward/nil_grads", "nil Grads", call(l, s, nil, dy, act)},
		{"Backward/nil_activations", "Activations", call(l, s, g, dy, nil)},
		{"Backward/freed_activations", "freed", call(l, s, g, dy, gone)},
		{"Backward/other_layer", "another layer", call(l, s, g, dy, other)},
		{"Backward/nil_dy", "Backward dy", call(l, s, g, nil, act)},
		{"Backward/dy_shape", "Backward dy", call(l, s, g, f.f32(baT-1, baH), act)},
		{"Backward/nil_dx", "Grads.X", edit(l, func(g *Grads, p *Params) { g.X = nil })},
		{"Backward/dx_dtype", "Grads.X", edit(l, func(g *Grads, p *Params) { g.X = f.bf(baT, baH) })},
		{"Backward/router_shape", "Grads.Router", edit(l, func(g *Grads, p *Params) { g.Router = f.f32(baE, baH-1) })},
		{"Backward/router_dtype", "Grads.Router", edit(l, func(g *Grads, p *Params) { g.Router = f.i32(baE, baH) })},
		{"Backward/w1_shape", "Grads.W1", edit(l, func(g *Grads, p *Params) { g.W1 = f.f32(baE, baH, baF) })},
		{"Backward/w1_dtype", "Grads.W1", edit(l, func(g *Grads, p *Params) { g.W1 = f.i32(baE, baH, 2*baF) })},
		{"Backward/freed_w1", "Grads.W1", edit(l, func(g *Grads, p *Params) { freed(g.W1) })},
		{"Backward/w2_shape", "Grads.W2", edit(l, func(g *Grads, p *Params) { g.W2 = f.f32(baE, baH, baF) })},
		{"Backward/shared_unwanted", "SharedFFN is 0", edit(l, func(g *Grads, p *Params) { g.SharedW2 = f.f32(baFs, baH) })},
		{"Backward/shared_w1_shape", "Grads.SharedW1", edit(ls, func(g *Grads, p *Params) { g.SharedW1 = f.f32(baH, baFs) })},
		{"Backward/shared_w2_dtype", "Grads.SharedW2", edit(ls, func(g *Grads, p *Params) { g.SharedW2 = f.i32(baFs, baH) })},
		{"Backward/closed_w2ready", "Grads.W2Ready", edit(l, func(g *Grads, p *Params) { g.W2Ready = closed })},
		{"Backward/closed_w1ready", "Grads.W1Ready", edit(l, func(g *Grads, p *Params) { g.W1Ready = closed })},
		{"Backward/freed_param", "Params.W2", edit(l, func(g *Grads, p *Params) { freed(p.W2) })},
		{"Backward/freed_shared_param", "Params.SharedW1", edit(ls, func(g *Grads, p *Params) { freed(p.SharedW1) })},
	}
}

// TestFree checks that the Free methods accept a nil receiver and a second call.
func TestFree(t *testing.T) {
	f := &argFixture{t: t, s: device.CPU().Stream()}
	t.Cleanup(func() { device.FreeAll(f.ts...) })
	_, act := f.forward(f.layer(baFs))
	r, p := f.routing(), f.perm()
	for _, tc := range []struct {
		name string
		free func() error
	}{
		{"Routing", r.Free}, {"Permutation", p.Free}, {"Activations", act.Free},
		{"nil_Routing", (*Routing)(nil).Free}, {"nil_Permutation", (*Permutation)(nil).Free},
		{"nil_Activations", (*Activations)(nil).Free},
	} {
		for i := range 2 {
			if pv, err := dt.Recover(tc.free); pv != nil || err != nil {
				t.Errorf("%s: Free #%d: error %v, panic %v", tc.name, i+1, err, pv)
			}
		}
	}
}
