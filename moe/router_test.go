package moe

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

var routeCases = []struct {
	name string
	cfg  RouterConfig
	T    int
	bias bool
}{
	{"softmax_renorm", RouterConfig{Experts: 8, TopK: 2, Renormalize: true}, 100, false},
	{"softmax_bias", RouterConfig{Experts: 16, TopK: 4, Renormalize: true, AuxLoss: 0.01}, 77, true},
	{"softmax_top1_aux", RouterConfig{Experts: 5, TopK: 1, AuxLoss: 0.1}, 64, false},
	{"sigmoid_groups", RouterConfig{Experts: 16, TopK: 4, Score: Sigmoid, Groups: 4, TopKGroups: 2, Renormalize: true, Scale: 2.5, AuxLoss: 0.001}, 50, true},
	{"sigmoid_plain", RouterConfig{Experts: 64, TopK: 8, Score: Sigmoid, Groups: 8, TopKGroups: 4}, 40, false},
	{"dsv3", RouterConfig{Experts: 256, TopK: 8, Score: Sigmoid, Groups: 8, TopKGroups: 4, Renormalize: true, Scale: 2.5}, 33, true},
	{"singleton_groups", RouterConfig{Experts: 12, TopK: 3, Score: Sigmoid, Groups: 12, TopKGroups: 5, Renormalize: true}, 20, true},
	{"wide", RouterConfig{Experts: 1000, TopK: 32, Renormalize: true, AuxLoss: 0.01}, 9, false},
	{"max_experts", RouterConfig{Experts: 1024, TopK: 6, Score: Sigmoid, Renormalize: true}, 5, true},
	{"all_experts", RouterConfig{Experts: 4, TopK: 4, Renormalize: true}, 10, false},
	{"no_tokens", RouterConfig{Experts: 8, TopK: 2, AuxLoss: 0.01}, 0, false},
}

// routeInputs returns logits [T,E] and a bias [E] (nil unless withBias) whose
// selections are decided by margins of at least 1e-4.
func routeInputs(r *rand.Rand, cfg RouterConfig, T int, withBias bool) (logits, bias []float32) {
	E := cfg.Experts
	if withBias {
		bias = dt.Normal(r, E, 0.05)
	}
	logits = make([]float32, T*E)
	for t := range T {
		row := logits[t*E : (t+1)*E]
		for {
			copy(row, dt.Normal(r, E, 1))
			if choiceGap(cfg, 1, f64(row), f64orNil(bias)) >= 1e-4 {
				break
			}
		}
	}
	return logits, bias
}

func f64orNil(v []float32) []float64 {
	if v == nil {
		return nil
	}
	return f64(v)
}

func TestRoute(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, tc := range routeCases {
			t.Run(tc.name, func(t *testing.T) {
				r := dt.Rand(uint64(100 + i))
				E, K, T := tc.cfg.Experts, tc.cfg.TopK, tc.T
				logits, bias := routeInputs(r, tc.cfg, T, tc.bias)
				want := routeRef(tc.cfg, T, f64(logits), f64orNil(bias))
				lt := up(t, s, device.F32, logits, T, E)
				defer lt.Free()
				var bt *device.Tensor
				if bias != nil {
					bt = up(t, s, device.F32, bias, E)
					defer bt.Free()
				}
				rt := dt.Must(Route(s, tc.cfg, lt, bt))
				defer rt.Free()
				idx := downI32(t, s, rt.Index)
				if diff := cmp.Diff(want.idx, idx); diff != "" {
					t.Fatalf("Index (-want +got):\n%s", diff)
				}
				load := downI32(t, s, rt.Load)
				wantLoad := make([]int32, E)
				for e, v := range want.load {
					wantLoad[e] = int32(v)
				}
				if diff := cmp.Diff(wantLoad, load); diff != "" {
					t.Errorf("Load (-want +got):\n%s", diff)
				}
				w, sc := down(t, s, rt.Weight), down(t, s, rt.Scores)
				closeTo(t, "Weight", w, want.weight, 1e-5)
				closeTo(t, "Scores", sc, want.scores, 1e-5)
				if tc.cfg.AuxLoss > 0 {
					aux := down(t, s, rt.AuxLoss)
					if math.Abs(float64(aux[0])-want.aux) > 1e-5*math.Abs(want.aux)+1e-12 {
						t.Errorf("AuxLoss = %v, want %v", aux[0], want.aux)
					}
				} else if rt.AuxLoss != nil {
					t.Errorf("AuxLoss allocated with coefficient 0")
				}
				// Properties that hold whatever the reference says.
				scale := float64(tc.cfg.scale())
				for tok := range T {
					seen := map[int32]bool{}
					var sum, ssum float64
					for k := range K {
						e := idx[tok*K+k]
						if e < 0 || int(e) >= E || seen[e] {
							t.Fatalf("token %d: index %d out of range or repeated: %v", tok, e, idx[tok*K:(tok+1)*K])
						}
						seen[e] = true
						sum += float64(w[tok*K+k])
						ssum += float64(sc[tok*E+int(e)])
					}
					for k := range K {
						// The weight is the score (never score + bias), renormalized and scaled.
						s := float64(sc[tok*E+int(idx[tok*K+k])])
						if tc.cfg.Renormalize {
							s /= ssum
						}
						if d := math.Abs(float64(w[tok*K+k]) - s*scale); d > 1e-5*scale {
							t.Fatalf("token %d: weight %d = %v, want score-based %v", tok, k, w[tok*K+k], s*scale)
						}
					}
					if tc.cfg.Renormalize && math.Abs(sum-scale) > 1e-5*scale {
						t.Fatalf("token %d: weights sum to %v, want %v", tok, sum, scale)
					}
					if tc.cfg.Groups > 1 {
						checkGroups(t, tc.cfg, tok, idx[tok*K:(tok+1)*K], sc[tok*E:(tok+1)*E], bias)
					}
				}
			})
		}
	})
}

// checkGroups fails t unless every chosen expert lies in one of the TopKGroups groups
// of largest top-2 choice sums.
func checkGroups(t *testing.T, cfg RouterConfig, tok int, idx []int32, sc, bias []float32) {
	t.Helper()
	G, gsz := cfg.Groups, cfg.Experts/cfg.Groups
	type gs struct {
		g int
		v float64
	}
	var groups []gs
	for g := range G {
		m1, m2 := math.Inf(-1), math.Inf(-1)
		for e := g * gsz; e < (g+1)*gsz; e++ {
			v := float64(sc[e])
			if bias != nil {
				v += float64(bias[e])
			}
			if v > m1 {
				m1, m2 = v, m1
			} else if v > m2 {
				m2 = v
			}
		}
		if gsz == 1 {
			m2 = 0
		}
		groups = append(groups, gs{g, m1 + m2})
	}
	top := map[int]bool{}
	for range cfg.TopKGroups {
		best := -1
		for i, x := range groups {
			if !top[x.g] && (best < 0 || x.v > groups[best].v) {
				best = i
			}
		}
		top[groups[best].g] = true
	}
	for _, e := range idx {
		if !top[int(e)/gsz] {
			t.Fatalf("token %d: expert %d of group %d is outside the top %d groups %v", tok, e, int(e)/gsz, cfg.TopKGroups, top)
		}
	}
}

// TestRouteBias checks that the score-correction bias steers selection but never
// enters the weights, and that UpdateBias moves it toward balance.
func TestRouteBias(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(7)
		cfg := RouterConfig{Experts: 8, TopK: 2, Score: Sigmoid, Renormalize: true}
		const T = 64
		logits := dt.Normal(r, T*8, 1)
		lt := up(t, s, device.F32, logits, T, 8)
		defer lt.Free()
		plain := dt.Must(Route(s, cfg, lt, nil))
		defer plain.Free()
		b := make([]float32, 8)
		b[3] = 10 // expert 3 wins every token's first choice
		bt := up(t, s, device.F32, b, 8)
		defer bt.Free()
		biased := dt.Must(Route(s, cfg, lt, bt))
		defer biased.Free()
		pi, bi := downI32(t, s, plain.Index), downI32(t, s, biased.Index)
		if diff := cmp.Diff(pi, bi); diff == "" {
			t.Fatal("bias did not change the selection")
		}
		sc, w := down(t, s, biased.Scores), down(t, s, biased.Weight)
		for tok := range T {
			if bi[tok*2] != 3 {
				t.Fatalf("token %d: first choice %d, want the biased expert 3", tok, bi[tok*2])
			}
			s0, s1 := sc[tok*8+int(bi[tok*2])], sc[tok*8+int(bi[tok*2+1])]
			if math.Abs(float64(w[tok*2])-float64(s0/(s0+s1))) > 1e-6 {
				t.Fatalf("token %d: weight %v, want %v from the scores alone", tok, w[tok*2], s0/(s0+s1))
			}
		}
		load := downI32(t, s, biased.Load)
		if load[3] != T {
			t.Fatalf("load of expert 3 = %d, want %d", load[3], T)
		}
		// Expert 3 is overloaded: its bias drops by gamma, the underloaded rise, an
		// expert exactly at the mean keeps its bias.
		lv := []int32{32, 16, 0, 64, 16, 0, 0, 0} // mean 16
		lo := upI32(t, s, lv, 8)
		defer lo.Free()
		dt.NoErr(t, UpdateBias(s, bt, lo, 0.5))
		got := down(t, s, bt)
		want := []float32{-0.5, 0, 0.5, 9.5, 0, 0.5, 0.5, 0.5}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("UpdateBias (-want +got):\n%s", diff)
		}
	})
}

// routeLossRef is the loss Σ dw·weight + aux of routing logits in float64, with the
// selection frozen to idx (the selection is piecewise constant).
func routeLossRef(cfg RouterConfig, T int, logits, bias, dw []float64) (float64, []int32) {
	r := routeRef(cfg, T, logits, bias)
	var l float64
	for i, w := range r.weight {
		l += w * dw[i]
	}
	return l + r.aux, r.idx
}

func TestRouteGrad(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, tc := range routeCases {
			if tc.cfg.Experts > 64 {
				continue // finite differences over every logit: keep it small
			}
			t.Run(tc.name, func(t *testing.T) {
				r := dt.Rand(uint64(200 + i))
				E, K, T := tc.cfg.Experts, tc.cfg.TopK, min(tc.T, 12)
				logits, bias := routeInputs(r, tc.cfg, T, tc.bias)
				dw := dt.Normal(r, T*K, 1)
				lt := up(t, s, device.F32, logits, T, E)
				defer lt.Free()
				var bt *device.Tensor
				if bias != nil {
					bt = up(t, s, device.F32, bias, E)
					defer bt.Free()
				}
				rt := dt.Must(Route(s, tc.cfg, lt, bt))
				defer rt.Free()
				dwt := up(t, s, device.F32, dw, T, K)
				defer dwt.Free()
				dl := alloc(t, s, device.F32, T, E)
				defer dl.Free()
				dt.NoErr(t, RouteGrad(s, dl, dwt, rt))
				got := down(t, s, dl)
				z, b, g := f64(logits), f64orNil(bias), f64(dw)
				_, idx0 := routeLossRef(tc.cfg, T, z, b, g)
				want := make([]float64, T*E)
				const h = 1e-6
				for j := range z {
					v := z[j]
					z[j] = v + h
					lp, ip := routeLossRef(tc.cfg, T, z, b, g)
					z[j] = v - h
					lm, im := routeLossRef(tc.cfg, T, z, b, g)
					z[j] = v
					if cmp.Diff(idx0, ip) != "" || cmp.Diff(idx0, im) != "" {
						t.Fatalf("selection changed within ±%g of logit %d", h, j)
					}
					want[j] = (lp - lm) / (2 * h)
				}
				closeTo(t, "dlogits", got, want, 1e-4)
			})
		}
	})
}

// TestRouteBalanceOver splits each batch of the routing cases with the load-balancing
// loss into routings of a few tokens each (one of none), balances each over the whole
// batch, and checks that their losses add up to the whole batch's and that their
// RouteGrad gradients are the whole batch's rows, while each Load stays its own.
func TestRouteBalanceOver(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, tc := range routeCases {
			if tc.cfg.AuxLoss == 0 || tc.T == 0 {
				continue
			}
			t.Run(tc.name, func(t *testing.T) {
				r := dt.Rand(uint64(300 + i))
				E, K, T := tc.cfg.Experts, tc.cfg.TopK, tc.T
				logits, bias := routeInputs(r, tc.cfg, T, tc.bias)
				dw := dt.Normal(r, T*K, 1)
				var bt *device.Tensor
				if bias != nil {
					bt = up(t, s, device.F32, bias, E)
					defer bt.Free()
				}
				// grad routes logits rows [a, b) and, when whole is not nil, balances
				// the routing over the whole batch; it returns the routing, its loss and
				// its dlogits.
				grad := func(a, b int, whole *Routing) (*Routing, float32, []float32) {
					lt := up(t, s, device.F32, logits[a*E:b*E], b-a, E)
					defer lt.Free()
					rt := dt.Must(Route(s, tc.cfg, lt, bt))
					if whole != nil {
						for range 2 { // a second call replaces the first
							dt.NoErr(t, rt.BalanceOver(s, whole.Load, T))
						}
					}
					dwt := up(t, s, device.F32, dw[a*K:b*K], b-a, K)
					defer dwt.Free()
					dl := alloc(t, s, device.F32, b-a, E)
					defer dl.Free()
					dt.NoErr(t, RouteGrad(s, dl, dwt, rt))
					return rt, down(t, s, rt.AuxLoss)[0], down(t, s, dl)
				}
				whole, wantAux, wantDl := grad(0, T, nil)
				defer whole.Free()
				cuts := []int{0, T / 3, T / 3, T}
				var aux float64
				load := make([]int32, E)
				for p := range len(cuts) - 1 {
					a, b := cuts[p], cuts[p+1]
					rt, pa, dl := grad(a, b, whole)
					aux += float64(pa)
					for e, n := range downI32(t, s, rt.Load) {
						load[e] += n
					}
					if got := downI32(t, s, rt.AuxLoad); cmp.Diff(downI32(t, s, whole.Load), got) != "" {
						t.Errorf("tokens [%d, %d): AuxLoad %v, want the whole batch's load", a, b, got)
					}
					rt.Free()
					closeTo(t, "dlogits of the part", dl, f64(wantDl[a*E:b*E]), 1e-5)
				}
				if diff := cmp.Diff(downI32(t, s, whole.Load), load); diff != "" {
					t.Errorf("the parts' loads summed (-whole +parts):\n%s", diff)
				}
				if math.Abs(aux-float64(wantAux)) > 1e-5*float64(wantAux) {
					t.Errorf("the parts' losses sum to %v, want the whole batch's %v", aux, wantAux)
				}
			})
		}
	})
}
