package moe

import (
	"math"
	"sort"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// The float64 reference of the layer: written from the definitions, sharing no code
// with the package, and used both as the oracle of forward results and as the
// function finite differences differentiate.

// refRoute is the routing of one token set in float64.
type refRoute struct {
	idx    []int32   // [T*K]
	weight []float64 // [T*K]
	scores []float64 // [T*E]
	load   []int     // [E]
	aux    float64
}

// routeRef routes logits [T*E] (and bias [E] or nil) by cfg.
func routeRef(cfg RouterConfig, T int, logits, bias []float64) refRoute {
	E, K := cfg.Experts, cfg.TopK
	scale := float64(cfg.Scale)
	if scale == 0 {
		scale = 1
	}
	r := refRoute{idx: make([]int32, T*K), weight: make([]float64, T*K), scores: make([]float64, T*E), load: make([]int, E)}
	P := make([]float64, E)
	for t := range T {
		z := logits[t*E : (t+1)*E]
		sc := r.scores[t*E : (t+1)*E]
		if cfg.Score == Sigmoid {
			for e := range E {
				sc[e] = 1 / (1 + math.Exp(-z[e]))
			}
		} else {
			m := math.Inf(-1)
			for _, v := range z {
				m = math.Max(m, v)
			}
			var sum float64
			for _, v := range z {
				sum += math.Exp(v - m)
			}
			for e := range E {
				sc[e] = math.Exp(z[e]-m) / sum
			}
		}
		choice := choiceRef(cfg, z, sc, bias)
		eligible := make([]bool, E)
		for e := range eligible {
			eligible[e] = true
		}
		if cfg.Groups > 1 {
			gsz := E / cfg.Groups
			gs := groupScoresRef(choice, cfg.Groups)
			keep := topIdx(gs, cfg.TopKGroups)
			for e := range eligible {
				eligible[e] = false
			}
			for _, g := range keep {
				for e := g * gsz; e < (g+1)*gsz; e++ {
					eligible[e] = true
				}
			}
		}
		masked := make([]float64, E)
		for e := range E {
			masked[e] = math.NaN()
			if eligible[e] {
				masked[e] = choice[e]
			}
		}
		sel := topIdx(masked, K)
		var sum float64
		for _, e := range sel {
			sum += sc[e]
		}
		for k, e := range sel {
			r.idx[t*K+k] = int32(e)
			w := sc[e]
			if cfg.Renormalize {
				w /= sum + 1e-20
			}
			r.weight[t*K+k] = w * scale
			r.load[e]++
		}
		norm := 1.0
		if cfg.Score == Sigmoid {
			norm = 0
			for _, v := range sc {
				norm += v
			}
		}
		for e := range E {
			P[e] += sc[e] / norm
		}
	}
	if cfg.AuxLoss > 0 && T > 0 {
		var s float64
		for e := range E {
			s += float64(r.load[e]) / float64(T*K) * P[e] / float64(T)
		}
		r.aux = float64(cfg.AuxLoss) * float64(E) * s
	}
	return r
}

// topIdx returns the indices of the k largest non-NaN values, largest first, ties to
// the lower index.
// choiceRef returns the values that select a token's experts from its logits z and
// scores sc: scores plus the bias when there is one, else the logits for softmax scores
// (the same order), else the scores.
func choiceRef(cfg RouterConfig, z, sc, bias []float64) []float64 {
	choice := make([]float64, len(z))
	for e := range choice {
		switch {
		case bias != nil:
			choice[e] = sc[e] + bias[e]
		case cfg.Score == Softmax:
			choice[e] = z[e]
		default:
			choice[e] = sc[e]
		}
	}
	return choice
}

// groupScoresRef returns each of the groups' score: the sum of its two largest choice
// values (the one value of a group of one expert).
func groupScoresRef(choice []float64, groups int) []float64 {
	gsz := len(choice) / groups
	gs := make([]float64, groups)
	for g := range gs {
		v := append([]float64(nil), choice[g*gsz:(g+1)*gsz]...)
		sort.Sort(sort.Reverse(sort.Float64Slice(v)))
		gs[g] = v[0]
		if gsz > 1 {
			gs[g] += v[1]
		}
	}
	return gs
}

func topIdx(v []float64, k int) []int {
	ix := make([]int, 0, len(v))
	for i, x := range v {
		if !math.IsNaN(x) {
			ix = append(ix, i)
		}
	}
	sort.SliceStable(ix, func(a, b int) bool { return v[ix[a]] > v[ix[b]] })
	return ix[:k]
}

// choiceGap returns the smallest margin, over tokens, between the values that decide
// selection: the K-th and (K+1)-th eligible choice, and the TG-th and (TG+1)-th group.
func choiceGap(cfg RouterConfig, T int, logits, bias []float64) float64 {
	E, K := cfg.Experts, cfg.TopK
	r := routeRef(cfg, T, logits, bias)
	gap := math.Inf(1)
	for t := range T {
		z, sc := logits[t*E:(t+1)*E], r.scores[t*E:(t+1)*E]
		choice := choiceRef(cfg, z, sc, bias)
		eligible := make([]float64, 0, E)
		if cfg.Groups > 1 {
			gsz := E / cfg.Groups
			gs := groupScoresRef(choice, cfg.Groups)
			sorted := append([]float64(nil), gs...)
			sort.Sort(sort.Reverse(sort.Float64Slice(sorted)))
			if cfg.TopKGroups < cfg.Groups {
				gap = math.Min(gap, sorted[cfg.TopKGroups-1]-sorted[cfg.TopKGroups])
			}
			for _, g := range topIdx(gs, cfg.TopKGroups) {
				eligible = append(eligible, choice[g*gsz:(g+1)*gsz]...)
			}
		} else {
			eligible = append(eligible, choice...)
		}
		sort.Sort(sort.Reverse(sort.Float64Slice(eligible)))
		if K < len(eligible) {
			gap = math.Min(gap, eligible[K-1]-eligible[K])
		}
	}
	return gap
}

// refLayer is a layer's parameters in float64, layout KN.
type refLayer struct {
	cfg      Config
	T        int
	x        []float64 // [T,H]
	wr       []float64 // [E,H]
	bias     []float64 // [E] or nil
	w1, w2   []float64 // [E,H,2F], [E,F,H]
	sw1, sw2 []float64 // [H,2Fs], [Fs,H]
	// gradTwoPass sets the Layer's gradTwoPass in runLayer.
	gradTwoPass bool
	// unfusedSwiGLU sets the Layer's unfusedSwiGLU in runLayer.
	unfusedSwiGLU bool
	// fusedGrad sets the Layer's fusedGrad in runLayer (newRef: defaultFusedGrad).
	fusedGrad gradParts
	// backTwice makes runLayer run Backward a second time on the same activations, with
	// Grads.W2Ready and W1Ready, and fail unless every gradient is the first's, bit for bit.
	backTwice bool
	// serialEP sets the Layer's serialEP in runLayer.
	serialEP bool
	// trace sets the Layer's trace in runLayer.
	trace func(s *device.Stream, stage string)
	// rankPolicy gives each rank of runRanks an offloader of this policy (with room for
	// every activation), checked to hold nothing after the step.
	rankPolicy string
}

type refResult struct {
	y       []float64
	route   refRoute
	row     []int32 // [T*K]: kept assignment's order within its expert, -1 dropped
	dropped int
}

func silu(g float64) float64 { return g / (1 + math.Exp(-g)) }

// swigluRef maps x[in] through w1[in,2f] and w2[f,out] with SwiGLU.
func swigluRef(x, w1, w2 []float64, in, f, out int) []float64 {
	a := make([]float64, f)
	for j := range f {
		var g, u float64
		for i := range in {
			g += x[i] * w1[i*2*f+j]
			u += x[i] * w1[i*2*f+f+j]
		}
		a[j] = silu(g) * u
	}
	y := make([]float64, out)
	for j := range f {
		for o := range out {
			y[o] += a[j] * w2[j*out+o]
		}
	}
	return y
}

// forward computes the layer in float64.
func (l *refLayer) forward() refResult {
	c := l.cfg
	T, H, F, E, K := l.T, c.Hidden, c.FFN, c.Router.Experts, c.Router.TopK
	logits := make([]float64, T*E)
	for t := range T {
		for e := range E {
			var s float64
			for h := range H {
				s += l.x[t*H+h] * l.wr[e*H+h]
			}
			logits[t*E+e] = s
		}
	}
	res := refResult{route: routeRef(c.Router, T, logits, l.bias), y: make([]float64, T*H), row: make([]int32, T*K)}
	capacity := dt.Must(Capacity(c.CapacityFactor, T, K, E))
	taken := make([]int, E)
	for a := range T * K {
		e := res.route.idx[a]
		if capacity > 0 && taken[e] >= capacity {
			res.row[a] = -1
			res.dropped++
			continue
		}
		res.row[a] = int32(taken[e])
		taken[e]++
		t := a / K
		out := swigluRef(l.x[t*H:(t+1)*H], l.w1[int(e)*H*2*F:(int(e)+1)*H*2*F], l.w2[int(e)*F*H:(int(e)+1)*F*H], H, F, H)
		for h := range H {
			res.y[t*H+h] += res.route.weight[a] * out[h]
		}
	}
	if c.SharedFFN > 0 {
		for t := range T {
			out := swigluRef(l.x[t*H:(t+1)*H], l.sw1, l.sw2, H, c.SharedFFN, H)
			for h := range H {
				res.y[t*H+h] += out[h]
			}
		}
	}
	return res
}

// loss is Σ y·gy + aux.
func (l *refLayer) loss(gy []float64) (float64, refResult) {
	r := l.forward()
	var s float64
	for i, v := range r.y {
		s += v * gy[i]
	}
	return s + r.route.aux, r
}

func exp(x float64) float64 { return math.Exp(x) }
