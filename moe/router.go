package moe

import (
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// Score is the function that turns router logits into expert scores.
type Score int

const (
	// Softmax scores p = softmax(z) over the experts (Mixtral, Qwen, DeepSeek-V2).
	Softmax Score = iota
	// Sigmoid scores s = 1/(1+exp(-z)) per expert (DeepSeek-V3).
	Sigmoid
)

// String returns "softmax" or "sigmoid".
func (f Score) String() string {
	switch f {
	case Softmax:
		return "softmax"
	case Sigmoid:
		return "sigmoid"
	}
	return fmt.Sprintf("Score(%d)", int(f))
}

// Limits of the router and of the permutation kernels.
const (
	MaxExperts = 1024 // E
	MaxTopK    = 32   // K
)

// RouterConfig describes top-k routing.
//
// Selection takes the TopK experts of largest choice value, ties to the lower index:
// the logit (Softmax without bias) or the score plus the score-correction bias. With
// Groups > 1 (DeepSeek-V3's group-limited routing) the experts form Groups equal
// groups of consecutive indices, a group's value is the sum of its two largest
// choice values, and only experts of the TopKGroups best groups are eligible. The
// bias steers selection only: an expert's weight is its score, divided by the sum of
// the selected scores (+1e-20) when Renormalize, times Scale.
type RouterConfig struct {
	Experts     int     // E, 1 to MaxExperts
	TopK        int     // K, 1 to min(E, MaxTopK)
	Score       Score   // Softmax or Sigmoid
	Groups      int     // expert groups; 0 or 1: no group limit
	TopKGroups  int     // groups kept when Groups > 1
	Renormalize bool    // weights of a token sum to Scale
	Scale       float32 // route scaling factor; 0 means 1
	// AuxLoss is the coefficient α of the load-balancing loss α·E·Σ_e f_e·P_e
	// (Switch/GShard), f_e = tokens routed to e / (T·K), P_e = mean over tokens of
	// the probability of e (softmax p, or s/Σs for Sigmoid); 1·α when balanced.
	// 0: no loss. T is the tokens of the batch the loss balances: the routing's own,
	// or those Routing.BalanceOver gives (an expert-parallel layer's whole group).
	AuxLoss float32
}

// Validate reports whether c is usable.
func (c RouterConfig) Validate() error {
	switch {
	case c.Experts < 1 || c.Experts > MaxExperts:
		return fmt.Errorf("moe: RouterConfig.Experts = %d, want 1 to %d", c.Experts, MaxExperts)
	case c.TopK < 1 || c.TopK > min(c.Experts, MaxTopK):
		return fmt.Errorf("moe: RouterConfig.TopK = %d, want 1 to min(Experts, %d) = %d", c.TopK, MaxTopK, min(c.Experts, MaxTopK))
	case c.Score != Softmax && c.Score != Sigmoid:
		return fmt.Errorf("moe: RouterConfig.Score = %v, want Softmax or Sigmoid", c.Score)
	case c.Groups < 0 || c.Groups > c.Experts:
		return fmt.Errorf("moe: RouterConfig.Groups = %d, want 0 to Experts (%d)", c.Groups, c.Experts)
	case c.Scale < 0 || math.IsNaN(float64(c.Scale)) || math.IsInf(float64(c.Scale), 0):
		return fmt.Errorf("moe: RouterConfig.Scale = %v, want a finite value ≥ 0", c.Scale)
	case c.AuxLoss < 0 || math.IsNaN(float64(c.AuxLoss)) || math.IsInf(float64(c.AuxLoss), 0):
		return fmt.Errorf("moe: RouterConfig.AuxLoss = %v, want a finite value ≥ 0", c.AuxLoss)
	}
	if c.Groups > 1 {
		if c.Experts%c.Groups != 0 {
			return fmt.Errorf("moe: RouterConfig.Groups = %d does not divide Experts = %d", c.Groups, c.Experts)
		}
		if c.TopKGroups < 1 || c.TopKGroups > c.Groups {
			return fmt.Errorf("moe: RouterConfig.TopKGroups = %d, want 1 to Groups (%d)", c.TopKGroups, c.Groups)
		}
		if c.TopK > c.TopKGroups*(c.Experts/c.Groups) {
			return fmt.Errorf("moe: RouterConfig.TopK = %d exceeds the %d experts of %d groups of %d",
				c.TopK, c.TopKGroups*(c.Experts/c.Groups), c.TopKGroups, c.Experts/c.Groups)
		}
	}
	return nil
}

func (c RouterConfig) scale() float32 {
	if c.Scale == 0 {
		return 1
	}
	return c.Scale
}

func (c RouterConfig) groups() (g, tg int) {
	if c.Groups > 1 {
		return c.Groups, c.TopKGroups
	}
	return 1, 1
}

// Routing is the result of Route for T tokens, on the device of its logits.
type Routing struct {
	Tokens, Experts, TopK int
	Index                 *device.Tensor // I32[T,K]: chosen experts, in selection order
	Weight                *device.Tensor // F32[T,K]: their weights
	Scores                *device.Tensor // F32[T,E]: softmax p or sigmoid s of every expert
	Load                  *device.Tensor // I32[E]: this routing's tokens routed to each expert
	AuxLoss               *device.Tensor // F32[1]: the load-balancing loss; nil when AuxLoss is 0
	Config                RouterConfig   // the configuration that made it

	// AuxLoad (I32[E], owned by the routing) and AuxTokens are the loads and the token
	// count of the batch the load-balancing loss balances, when that batch is larger
	// than the routing's own tokens; BalanceOver sets them. nil and 0: Load and Tokens.
	// RouteGrad reads them.
	AuxLoad   *device.Tensor
	AuxTokens int

	probSum *device.Tensor // F32[E]: Σ over the tokens of the probability of each expert (with AuxLoss)
}

// Free releases the routing's tensors.
func (r *Routing) Free() error {
	if r == nil {
		return nil
	}
	return device.FreeAll(r.Index, r.Weight, r.Scores, r.Load, r.AuxLoss, r.AuxLoad, r.probSum)
}

// auxBatch returns the loads I32[E] and the token count of the batch the auxiliary loss
// balances.
func (r *Routing) auxBatch() (*device.Tensor, int) {
	if r.AuxLoad != nil {
		return r.AuxLoad, r.AuxTokens
	}
	return r.Load, r.Tokens
}

// check returns an error unless r is a live routing on s's device whose tensors match
// its sizes and configuration; what names r.
func (r *Routing) check(s *device.Stream, what string) error {
	if r == nil {
		return fmt.Errorf("moe: %s is nil", what)
	}
	if r.Index != nil && r.Index.Freed() {
		return fmt.Errorf("moe: %s was freed", what)
	}
	if err := r.Config.Validate(); err != nil {
		return fmt.Errorf("moe: %s.Config: %s", what, strings.TrimPrefix(err.Error(), "moe: "))
	}
	T, E, K := r.Tokens, r.Experts, r.TopK
	if r.Config.Experts != E || r.Config.TopK != K {
		return fmt.Errorf("moe: %s has %d experts, top-%d; its Config %d, top-%d", what, E, K, r.Config.Experts, r.Config.TopK)
	}
	if err := checkTensor(s, r.Index, what+".Index", device.I32, T, K); err != nil {
		return err
	}
	if err := checkTensor(s, r.Scores, what+".Scores", device.F32, T, E); err != nil {
		return err
	}
	if err := checkTensor(s, r.Load, what+".Load", device.I32, E); err != nil {
		return err
	}
	switch {
	case r.AuxLoad != nil:
		if err := checkTensor(s, r.AuxLoad, what+".AuxLoad", device.I32, E); err != nil {
			return err
		}
		if r.AuxTokens < T || r.AuxTokens >= math.MaxInt32 {
			return fmt.Errorf("moe: %s.AuxTokens = %d, want %d (its tokens) to 2^31-1", what, r.AuxTokens, T)
		}
	case r.AuxTokens != 0:
		return fmt.Errorf("moe: %s.AuxTokens = %d without AuxLoad", what, r.AuxTokens)
	}
	return nil
}

// Route selects cfg.TopK experts per token from logits F32[T,E] (E = cfg.Experts)
// and the score-correction bias F32[E] (nil: none; it changes the selection, not the
// weights), on s. With Softmax, a token's +∞ logits share its whole score equally
// and the others get 0. The result's tensors are allocated on s, so they alias
// nothing; free them with Free. Nothing waits for the device.
func Route(s *device.Stream, cfg RouterConfig, logits, bias *device.Tensor) (*Routing, error) {
	if err := checkStream(s, "Route"); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	E, K := cfg.Experts, cfg.TopK
	if err := logits.Check(s, "moe: Route logits"); err != nil {
		return nil, err
	}
	if logits.DType() != device.F32 || logits.Rank() != 2 || logits.Dim(1) != E {
		return nil, fmt.Errorf("moe: Route logits is %v, want f32[T %d]", logits, E)
	}
	if bias != nil {
		if err := checkTensor(s, bias, "Route bias", device.F32, E); err != nil {
			return nil, err
		}
	}
	T := logits.Dim(0)
	if int64(T)*int64(max(K, E)) >= math.MaxInt32 {
		return nil, fmt.Errorf("moe: Route logits %v: T·E must be below 2^31", logits)
	}
	ts := device.NewTemps(s) // only for the first error: r owns the tensors
	r := &Routing{Tokens: T, Experts: E, TopK: K, Config: cfg, Index: ts.Alloc(device.I32, T, K),
		Weight: ts.Alloc(device.F32, T, K), Scores: ts.Alloc(device.F32, T, E), Load: ts.Alloc(device.I32, E)}
	if cfg.AuxLoss > 0 {
		r.AuxLoss, r.probSum = ts.Alloc(device.F32, 1), ts.Alloc(device.F32, E)
	}
	err := ts.Err()
	switch {
	case err != nil:
	case s.Device().IsCUDA():
		err = routeGPU(s, r, logits, bias)
	default:
		err = s.EnqueueCPU(func() { routeCPU(r, logits, bias) })
	}
	if err != nil {
		r.Free()
		return nil, err
	}
	return r, nil
}

func (c RouterConfig) args(T int) routeArgs {
	g, tg := c.groups()
	return routeArgs{T: int32(T), E: int32(c.Experts), K: int32(c.TopK), Sigmoid: c.Score == Sigmoid,
		G: int32(g), TG: int32(tg), Renorm: c.Renormalize, Aux: c.AuxLoss > 0, Scale: c.scale()}
}

// routeWarps is the number of warps per block of dl_moe_route: as many as fit 40 KiB
// of shared memory, at most 8.
func routeWarps(E int) int { return min(max((40960-4*E)/(16*E), 1), 8) }

func routeGPU(s *device.Stream, r *Routing, logits, bias *device.Tensor) error {
	T, E := r.Tokens, r.Experts
	if T == 0 {
		return launch(s, routerProg, "dl_moe_route_finalize", device.D1(1), device.D1(blockFor(E)), 0,
			(*device.Tensor)(nil), (*device.Tensor)(nil), int32(0), int32(0), int32(E), int32(r.TopK), r.Config.AuxLoss,
			r.Config.AuxLoss > 0, r.Load, r.AuxLoss, r.probSum)
	}
	nw := routeWarps(E)
	const tpw = 8
	nb := (T + nw*tpw - 1) / (nw * tpw)
	a := r.Config.args(T)
	a.TPW = tpw
	ts := device.NewTemps(s)
	defer ts.Free()
	pcnt, psum := ts.Alloc(device.I32, nb, E), ts.Alloc(device.F32, nb, E)
	if err := ts.Err(); err != nil {
		return err
	}
	smem := (nw*4*E + E) * 4
	if err := launch(s, routerProg, "dl_moe_route", device.D1(nb), device.D1(32*nw), smem,
		logits, bias, a, r.Index, r.Weight, r.Scores, pcnt, psum); err != nil {
		return err
	}
	return launch(s, routerProg, "dl_moe_route_finalize", device.D1(1), device.D1(blockFor(E)), 0,
		pcnt, psum, int32(nb), int32(T), int32(E), int32(r.TopK), r.Config.AuxLoss, a.Aux, r.Load, r.AuxLoss, r.probSum)
}

// routeCPU mirrors dl_moe_route and dl_moe_route_finalize.
func routeCPU(r *Routing, logits, bias *device.Tensor) {
	c := r.Config
	T, E, K := r.Tokens, r.Experts, r.TopK
	z := device.Slice[float32](logits)
	var b []float32
	if bias != nil {
		b = device.Slice[float32](bias)
	}
	idx := device.Slice[int32](r.Index)
	wt := device.Slice[float32](r.Weight)
	sc := device.Slice[float32](r.Scores)
	scale := c.scale()
	G, TG := c.groups()
	par.For(T, 64, func(lo, hi int) {
		choice := make([]float32, E)
		gsc := make([]float32, G)
		for t := lo; t < hi; t++ {
			zt, st := z[t*E:(t+1)*E], sc[t*E:(t+1)*E]
			scoreRow(c.Score, st, zt)
			for e := range E {
				v := st[e]
				switch {
				case b != nil:
					v += b[e]
				case c.Score == Softmax:
					v = zt[e]
				}
				if v != v {
					v = float32(math.Inf(-1))
				}
				choice[e] = v
			}
			if G > 1 {
				selectGroups(choice, gsc, TG)
			}
			var vsum float32
			for k := range K {
				e := argmax(choice)
				idx[t*K+k] = int32(e)
				if e >= 0 {
					choice[e] = float32(math.NaN())
					vsum += st[e]
				}
			}
			for k := range K {
				e := idx[t*K+k]
				switch {
				case e < 0:
					wt[t*K+k] = 0
				case c.Renormalize:
					wt[t*K+k] = st[e] / (vsum + 1e-20) * scale
				default:
					wt[t*K+k] = st[e] * scale
				}
			}
		}
	})
	load := device.Slice[int32](r.Load)
	clear(load)
	for _, e := range idx {
		if e >= 0 {
			load[e]++
		}
	}
	if r.AuxLoss != nil {
		P, ps := probSums(c, sc, T), device.Slice[float32](r.probSum)
		for e, v := range P {
			ps[e] = float32(v)
		}
		aux := device.Slice[float32](r.AuxLoss)
		aux[0] = float32(auxLoss(c, P, load, T))
	}
}

// scoreRow writes the scores of logits z into s.
func scoreRow(f Score, s, z []float32) {
	if f == Sigmoid {
		for e, v := range z {
			s[e] = float32(1 / (1 + math.Exp(-float64(v))))
		}
		return
	}
	m := math.Inf(-1)
	for _, v := range z {
		if float64(v) > m {
			m = float64(v)
		}
	}
	if math.IsInf(m, 1) {
		// The limit of the softmax: the +∞ logits share the weight, the others get none.
		var n float64
		for _, v := range z {
			if float64(v) == m {
				n++
			}
		}
		for e, v := range z {
			s[e] = 0
			if float64(v) == m {
				s[e] = float32(1 / n)
			}
		}
		return
	}
	var sum float64
	for _, v := range z {
		sum += math.Exp(float64(v) - m)
	}
	for e, v := range z {
		s[e] = float32(math.Exp(float64(v)-m) / sum)
	}
}

// selectGroups masks (with NaN) the choices of experts outside the tg best groups.
func selectGroups(choice, gsc []float32, tg int) {
	G := len(gsc)
	gsz := len(choice) / G
	ninf := float32(math.Inf(-1))
	for g := range G {
		m1, m2 := ninf, ninf
		for _, v := range choice[g*gsz : (g+1)*gsz] {
			if v > m1 {
				m1, m2 = v, m1
			} else if v > m2 {
				m2 = v
			}
		}
		v := m1
		if gsz > 1 {
			v = m1 + m2
		}
		if v != v {
			v = ninf
		}
		gsc[g] = v
	}
	for range tg {
		if g := argmax(gsc); g >= 0 {
			gsc[g] = float32(math.NaN())
		}
	}
	for e := range choice {
		if g := gsc[e/gsz]; g == g {
			choice[e] = float32(math.NaN())
		}
	}
}

// argmax returns the index of the largest non-NaN value, ties to the lower index,
// or -1 when all are NaN.
func argmax(v []float32) int {
	best, bi := float32(math.Inf(-1)), -1
	for i, x := range v {
		if x > best || (x == best && bi < 0) {
			best, bi = x, i
		}
	}
	return bi
}

// probSums returns the sum over the T tokens of the scores sc [T,E] of each expert's
// probability: softmax p, or s/Σs for Sigmoid.
func probSums(c RouterConfig, sc []float32, T int) []float64 {
	E := c.Experts
	P := make([]float64, E)
	for t := range T {
		st := sc[t*E : (t+1)*E]
		norm := 1.0
		if c.Score == Sigmoid {
			norm = 0
			for _, v := range st {
				norm += float64(v)
			}
		}
		for e, v := range st {
			P[e] += float64(v) / norm
		}
	}
	return P
}

// auxLoss returns α·E·Σ_e f_e·P_e over a batch of T tokens with loads load, P being the
// sums of probabilities of (some of) its tokens: α·E·Σ_e load[e]·P[e] / (T·K·T).
func auxLoss[F float32 | float64](c RouterConfig, P []F, load []int32, T int) float64 {
	if T == 0 {
		return 0
	}
	var sum float64
	for e := range c.Experts {
		sum += float64(load[e]) * float64(P[e])
	}
	return float64(c.AuxLoss) * float64(c.Experts) * sum / (float64(T) * float64(c.TopK) * float64(T))
}

// BalanceOver makes r's load-balancing loss its share of the loss over a larger batch
// that holds r's tokens: tokens tokens in all (at least r.Tokens), whose loads per
// expert are load (I32[E] on s's device: the sum of the Load of the batch's routings).
// Then f_e = load[e]/(tokens·K) and P_e = (Σ over r's tokens of the probability of
// e)/tokens, so that the shares of routings that split the batch add up to the loss
// over it, and their RouteGrad gradients to its gradient. It copies load into
// r.AuxLoad, sets r.AuxTokens and, when r.Config.AuxLoss > 0, recomputes r.AuxLoss, on
// s; r.Load stays r's own. Nothing waits for the device. Layer.Forward with Config.EP
// calls it with the loads of the group's batch (ep.Layout.GroupLoad). r must be made
// by Route.
func (r *Routing) BalanceOver(s *device.Stream, load *device.Tensor, tokens int) error {
	if err := checkStream(s, "Routing.BalanceOver"); err != nil {
		return err
	}
	if err := r.check(s, "Routing.BalanceOver r"); err != nil {
		return err
	}
	E := r.Experts
	if err := checkTensor(s, load, "Routing.BalanceOver load", device.I32, E); err != nil {
		return err
	}
	if tokens < r.Tokens || tokens >= math.MaxInt32 {
		return fmt.Errorf("moe: Routing.BalanceOver tokens = %d, want %d (the routing's) to 2^31-1", tokens, r.Tokens)
	}
	if r.AuxLoss != nil && (r.probSum == nil || r.probSum.Freed()) {
		return errors.New("moe: Routing.BalanceOver r has no probability sums: make it with Route")
	}
	if r.AuxLoad == nil {
		var err error
		if r.AuxLoad, err = s.Alloc(device.I32, E); err != nil {
			return err
		}
	}
	if err := device.Copy(s, r.AuxLoad, load); err != nil {
		return err
	}
	r.AuxTokens = tokens
	if r.AuxLoss == nil {
		return nil
	}
	c := r.Config
	if s.Device().IsCUDA() {
		return launch(s, routerProg, "dl_moe_aux_loss", device.D1(1), device.D1(blockFor(E)), 0,
			r.probSum, r.AuxLoad, int32(tokens), int32(E), int32(r.TopK), c.AuxLoss, r.AuxLoss)
	}
	return s.EnqueueCPU(func() {
		device.Slice[float32](r.AuxLoss)[0] = float32(auxLoss(c, device.Slice[float32](r.probSum),
			device.Slice[int32](r.AuxLoad), tokens))
	})
}

// RouteGrad computes dlogits F32[T,E], the gradient of the loss with respect to the
// logits Route was given, from dweight F32[T,K] (the gradient with respect to
// r.Weight; nil: zero) and, when r.Config.AuxLoss > 0, the auxiliary loss (as if its
// upstream gradient were 1; over the batch of r.AuxLoad and r.AuxTokens when set, see
// BalanceOver), on s. dlogits must not alias dweight or r's tensors.
func RouteGrad(s *device.Stream, dlogits, dweight *device.Tensor, r *Routing) error {
	if err := checkStream(s, "RouteGrad"); err != nil {
		return err
	}
	if err := r.check(s, "RouteGrad r"); err != nil {
		return err
	}
	T, E, K := r.Tokens, r.Experts, r.TopK
	if err := checkTensor(s, dlogits, "RouteGrad dlogits", device.F32, T, E); err != nil {
		return err
	}
	if dweight != nil {
		if err := checkTensor(s, dweight, "RouteGrad dweight", device.F32, T, K); err != nil {
			return err
		}
	}
	if T == 0 {
		return nil
	}
	c := r.Config
	auxc := float32(0)
	load, n := r.auxBatch()
	if c.AuxLoss > 0 {
		auxc = float32(float64(c.AuxLoss) * float64(E) / (float64(n) * float64(K) * float64(n)))
	}
	if s.Device().IsCUDA() {
		nw := min(max(8192/E, 1), 8)
		return launch(s, routerProg, "dl_moe_route_bwd", device.D1((T+nw-1)/nw), device.D1(32*nw), nw*E*4,
			dweight, r.Index, r.Scores, load, c.args(T), auxc, dlogits)
	}
	return s.EnqueueCPU(func() { routeGradCPU(r, dlogits, dweight, load, auxc) })
}

// routeGradCPU mirrors dl_moe_route_bwd; loadT is the loads of the auxiliary loss.
func routeGradCPU(r *Routing, dlogits, dweight, loadT *device.Tensor, auxc float32) {
	c := r.Config
	T, E, K := r.Tokens, r.Experts, r.TopK
	idx := device.Slice[int32](r.Index)
	sc := device.Slice[float32](r.Scores)
	load := device.Slice[int32](loadT)
	dl := device.Slice[float32](dlogits)
	var dw []float32
	if dweight != nil {
		dw = device.Slice[float32](dweight)
	}
	scale := c.scale()
	par.For(T, 64, func(lo, hi int) {
		ds := make([]float32, E)
		for t := lo; t < hi; t++ {
			s := sc[t*E : (t+1)*E]
			switch {
			case auxc == 0:
				clear(ds)
			case c.Score == Sigmoid:
				var S, gs float32
				for e := range E {
					S += s[e]
					gs += auxc * float32(load[e]) * s[e]
				}
				gs /= S
				for e := range E {
					ds[e] = (auxc*float32(load[e]) - gs) / S
				}
			default:
				for e := range E {
					ds[e] = auxc * float32(load[e])
				}
			}
			var S, cs float32
			for k := range K {
				if e := idx[t*K+k]; e >= 0 {
					S += s[e]
					if dw != nil {
						cs += dw[t*K+k] * s[e]
					}
				}
			}
			S += 1e-20
			for k := range K {
				e := idx[t*K+k]
				if e < 0 {
					continue
				}
				var d float32
				if dw != nil {
					d = dw[t*K+k]
				}
				if c.Renormalize {
					ds[e] += scale * (d - cs/S) / S
				} else {
					ds[e] += scale * d
				}
			}
			out := dl[t*E : (t+1)*E]
			if c.Score == Sigmoid {
				for e := range E {
					out[e] = ds[e] * s[e] * (1 - s[e])
				}
				continue
			}
			var dot float32
			for e := range E {
				dot += ds[e] * s[e]
			}
			for e := range E {
				out[e] = s[e] * (ds[e] - dot)
			}
		}
	})
}

// UpdateBias applies the auxiliary-loss-free balancing update to the score-correction
// bias F32[E] from the load I32[E] of a step: bias[e] += gamma·sign(mean(load) −
// load[e]), on s, for a finite rate gamma. Underloaded experts gain, overloaded ones
// lose. bias is updated in place; load must not alias it.
func UpdateBias(s *device.Stream, bias, load *device.Tensor, gamma float32) error {
	if err := checkStream(s, "UpdateBias"); err != nil {
		return err
	}
	if g := float64(gamma); math.IsNaN(g) || math.IsInf(g, 0) {
		return fmt.Errorf("moe: UpdateBias gamma = %v, want a finite value", gamma)
	}
	if err := bias.Check(s, "moe: UpdateBias bias"); err != nil {
		return err
	}
	if bias.DType() != device.F32 || bias.Rank() != 1 || bias.Dim(0) < 1 || bias.Dim(0) > MaxExperts {
		return fmt.Errorf("moe: UpdateBias bias is %v, want f32[E], 1 ≤ E ≤ %d", bias, MaxExperts)
	}
	E := bias.Dim(0)
	if err := checkTensor(s, load, "UpdateBias load", device.I32, E); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return launch(s, routerProg, "dl_moe_update_bias", device.D1(1), device.D1(blockFor(E)), 0, bias, load, int32(E), gamma)
	}
	return s.EnqueueCPU(func() {
		b, l := device.Slice[float32](bias), device.Slice[int32](load)
		var total int64
		for _, v := range l {
			total += int64(v)
		}
		for e := range E {
			switch d := total - int64(l[e])*int64(E); {
			case d > 0:
				b[e] += gamma
			case d < 0:
				b[e] -= gamma
			}
		}
	})
}
