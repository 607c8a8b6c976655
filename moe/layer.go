package moe

import (
	"errors"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/offload"
)

// Names of the activations the layer keeps for Backward, as an offload.Policy names
// them.
const (
	ActPermuted  = "moe_permuted"   // the permuted (dispatched) input, [R,H]
	ActWi        = "moe_mlpwi"      // gate and up projections, [R,2F]
	ActSwiGLU    = "moe_mlp_swiglu" // their SwiGLU, [R,F]
	ActWo        = "moe_mlpwo"      // expert outputs, [R,H]
	ActSharedWi  = "mlpwi"          // the shared expert's gate and up, [T,2Fs]
	ActSharedAct = "mlp_swiglu"     // its SwiGLU, [T,Fs]
)

// Config describes an MoE layer of SwiGLU experts.
type Config struct {
	Hidden    int          // H: model width
	FFN       int          // F: each expert's intermediate width
	SharedFFN int          // intermediate width of the shared expert applied to every token; 0: none
	Router    RouterConfig // E, K and the routing rule
	// CapacityFactor > 0 makes a capacity layer: each expert takes at most
	// Capacity(CapacityFactor, T, K, E) rows, the first assignments in token order,
	// and the others are dropped (they add nothing to the output; see Stats.Dropped).
	// 0: dropless, every assignment is computed.
	CapacityFactor float64
	Layout         gemm.WeightLayout // layout of W1, W2, SharedW1, SharedW2 and their gradients
	TF32           bool              // allow tf32 tensor cores in the GEMMs of f32 layers

	// EP, when set, runs the experts in parallel over the group's ranks: each rank
	// routes its own tokens, dispatches them to the ranks of their experts, runs its
	// E/R local experts (W1, W2 hold those: [E/R, ...]) and combines the results back.
	// Every rank calls Forward and Backward together. The group's Capacity and Overflow
	// replace CapacityFactor (which must be 0), and its Layout waits once per Forward
	// for the exchange of counts.
	EP *ep.Group
	// Offload, when set, receives the activations Backward needs (named by the Act
	// constants) as soon as Forward is done with them; its policy keeps, offloads or
	// drops each, and Backward loads or recomputes them, releasing each after its last
	// use (so Backward runs once per Forward).
	Offload *offload.Offloader
}

// Validate reports whether c is usable.
func (c Config) Validate() error {
	if err := c.Router.Validate(); err != nil {
		return err
	}
	switch {
	case c.Hidden < 1:
		return fmt.Errorf("moe: Config.Hidden = %d, want ≥ 1", c.Hidden)
	case c.FFN < 1:
		return fmt.Errorf("moe: Config.FFN = %d, want ≥ 1", c.FFN)
	case c.SharedFFN < 0:
		return fmt.Errorf("moe: Config.SharedFFN = %d, want ≥ 0", c.SharedFFN)
	case c.CapacityFactor < 0 || math.IsNaN(c.CapacityFactor) || math.IsInf(c.CapacityFactor, 0):
		return fmt.Errorf("moe: Config.CapacityFactor = %v, want a finite value ≥ 0", c.CapacityFactor)
	case c.Layout != gemm.KN && c.Layout != gemm.NK:
		return fmt.Errorf("moe: Config.Layout = %v, want KN or NK", c.Layout)
	}
	if c.EP != nil {
		g := c.EP.Config()
		switch {
		case g.Experts != c.Router.Experts || g.TopK != c.Router.TopK:
			return fmt.Errorf("moe: Config.EP has %d experts, top-%d; the router %d, top-%d", g.Experts, g.TopK, c.Router.Experts, c.Router.TopK)
		case c.CapacityFactor != 0:
			return errors.New("moe: Config.CapacityFactor must be 0 with Config.EP (the group's Capacity applies)")
		}
	}
	if c.EP != nil && c.Offload != nil && c.EP.Transport().Device() != c.Offload.Device() {
		return fmt.Errorf("moe: Config.EP is on %v, Config.Offload on %v", c.EP.Transport().Device(), c.Offload.Device())
	}
	return nil
}

// localExperts returns the experts whose weights this layer holds.
func (c Config) localExperts() int {
	if c.EP != nil {
		return c.EP.LocalExperts()
	}
	return c.Router.Experts
}

// Params are the layer's parameters, on one device. Expert weights share the input's
// dtype (F32 or BF16). Shapes are for Layout KN; NK swaps the last two dimensions.
// With Config.EP, W1 and W2 hold the rank's E/R experts.
type Params struct {
	Router   *device.Tensor // [E,H], F32 or the input's dtype
	Bias     *device.Tensor // F32[E] score-correction bias, or nil
	W1       *device.Tensor // [E,H,2F]: gate columns [0,F), up columns [F,2F)
	W2       *device.Tensor // [E,F,H]
	SharedW1 *device.Tensor // [H,2Fs] for SharedFFN = Fs > 0, else nil
	SharedW2 *device.Tensor // [Fs,H]
}

// Grads receives the gradients of Backward, each shaped as its parameter (X as the
// input). Weight gradients are F32 or BF16 (the router's: F32 or its dtype); nil ones
// are not computed, but X must be given. With Config.EP, Router and the shared
// expert's gradients are this rank's share (sum them over ranks as for data
// parallelism); W1 and W2 are complete for the local experts.
type Grads struct {
	X        *device.Tensor
	Router   *device.Tensor
	W1, W2   *device.Tensor
	SharedW1 *device.Tensor
	SharedW2 *device.Tensor
	// Accumulate adds the weight gradients to the tensors instead of overwriting them
	// (X is always overwritten).
	Accumulate bool
}

// Layer is an MoE layer: router, permutation (or expert-parallel dispatch), SwiGLU
// experts through ragged_dot, the weighted combine and an optional shared expert. It
// holds no tensors; one Layer may serve many calls.
type Layer struct {
	cfg Config
	// trace, when set (by benchmarks), is called on the stream after each stage of
	// Forward and Backward with the stage's name.
	trace func(s *device.Stream, stage string)
}

func (l *Layer) mark(s *device.Stream, stage string) {
	if l.trace != nil {
		l.trace(s, stage)
	}
}

// NewLayer returns the layer of cfg.
func NewLayer(cfg Config) (*Layer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Layer{cfg: cfg}, nil
}

// Config returns the layer's configuration.
func (l *Layer) Config() Config { return l.cfg }

// saved is an activation Backward needs: held here, or by the offloader.
type saved struct {
	name   string
	t      *device.Tensor
	h      offload.Handle
	inOff  bool // h is live: the offloader holds the activation
	loaned bool // t came back from the offloader or was recomputed: Backward releases it
	gone   bool // released after its last use in Backward
}

// Activations is what Forward keeps for Backward, on the device of the call. Free it
// after Backward (or instead of it, for inference).
type Activations struct {
	Routing *Routing     // the routing of the step
	Perm    *Permutation // its permutation (nil with Config.EP)
	Layout  *ep.Layout   // its expert-parallel layout (nil without Config.EP)

	cfg     Config
	s       *device.Stream // the stream of the last call, where Free releases tensors
	x       *device.Tensor // the input (the caller's)
	p       *Params        // the parameters (the caller's)
	counts  *device.Tensor // I32 group sizes of the expert rows
	used    *device.Tensor // I32[1] rows in use (nil: all)
	weights *device.Tensor // EP: F32 routing weight of each expert row
	rows    int            // expert rows R

	xp, h, a, yp saved // [R,H], [R,2F], [R,F], [R,H]
	hs, as       saved // shared expert: [T,2Fs], [T,Fs]
	all          *device.Tensor
}

// Free releases the activations' tensors, in stream order on the stream of the last
// Forward or Backward that used them.
func (a *Activations) Free() error {
	if a == nil {
		return nil
	}
	errs := []error{a.Routing.Free(), a.Perm.Free()}
	if a.Layout != nil {
		errs = append(errs, a.Layout.Free())
	}
	for _, sl := range []*saved{&a.xp, &a.h, &a.a, &a.yp, &a.hs, &a.as} {
		errs = append(errs, a.release(sl, true))
	}
	errs = append(errs, freeOn(a.s, a.weights, a.all))
	a.weights, a.all = nil, nil
	return errors.Join(errs...)
}

func freeOn(s *device.Stream, ts ...*device.Tensor) error {
	var errs []error
	for _, t := range ts {
		if t != nil {
			errs = append(errs, t.FreeOn(s))
		}
	}
	return errors.Join(errs...)
}

// keep hands t, which Forward is done with, to sl: to the offloader when there is one.
func (a *Activations) keep(s *device.Stream, sl *saved, name string, t *device.Tensor) error {
	sl.name, sl.t = name, t
	if a.cfg.Offload == nil || t == nil {
		return nil
	}
	h, err := a.cfg.Offload.Save(s, name, t)
	if err != nil {
		return err // t stays with sl
	}
	sl.t, sl.h, sl.inOff = nil, h, true
	return nil
}

// prefetch starts reloading sl from the offloader.
func (a *Activations) prefetch(sl *saved) error {
	if !sl.inOff {
		return nil
	}
	return a.cfg.Offload.Prefetch(sl.h)
}

// get returns sl's tensor for Backward on s: held, reloaded, or recomputed by
// recompute when the policy dropped it.
func (a *Activations) get(s *device.Stream, sl *saved, recompute func() (*device.Tensor, error)) (*device.Tensor, error) {
	if sl.gone {
		return nil, fmt.Errorf("moe: activation %s was released by an earlier Backward (with Config.Offload, Backward runs once)", sl.name)
	}
	if !sl.inOff {
		if sl.t == nil {
			return nil, fmt.Errorf("moe: activation %s is missing: activations freed?", sl.name)
		}
		return sl.t, nil
	}
	t, err := a.cfg.Offload.Load(s, sl.h)
	sl.inOff, sl.h = false, offload.Handle{}
	if errors.Is(err, offload.ErrRecompute) {
		t, err = recompute()
	}
	if err != nil {
		return nil, fmt.Errorf("moe: activation %s: %w", sl.name, err)
	}
	sl.t, sl.loaned = t, true
	return t, nil
}

// done releases sl after its last use in Backward when it came from the offloader.
func (a *Activations) done(sl *saved) error {
	if !sl.loaned {
		return nil
	}
	return a.release(sl, false)
}

// release frees sl's tensor (or drops its handle) on a.s; all: also tensors the layer
// holds itself.
func (a *Activations) release(sl *saved, all bool) error {
	var err error
	switch {
	case sl.inOff:
		err = a.cfg.Offload.Drop(a.s, sl.h)
		sl.inOff, sl.h = false, offload.Handle{}
	case sl.t != nil && (all || sl.loaned):
		err = sl.t.FreeOn(a.s)
		sl.t = nil
		if !all {
			sl.gone = true
		}
	}
	return err
}

// Stats are a step's routing statistics.
type Stats struct {
	Load    []int   // assignments of this call's tokens routed to each expert (before capacity)
	Dropped int     // assignments dropped for capacity (with Config.EP: rows dropped on this rank)
	AuxLoss float32 // the load-balancing loss (0 when RouterConfig.AuxLoss is 0)
}

// Imbalance returns the largest load over the mean load (1: balanced); 0 without tokens.
func (st Stats) Imbalance() float64 {
	var sum, mx int
	for _, v := range st.Load {
		sum += v
		mx = max(mx, v)
	}
	if sum == 0 {
		return 0
	}
	return float64(mx) * float64(len(st.Load)) / float64(sum)
}

// Stats waits for s and returns the step's routing statistics.
func (a *Activations) Stats(s *device.Stream) (Stats, error) {
	var st Stats
	load := make([]int32, a.Routing.Experts)
	if err := device.Download(s, a.Routing.Load, load); err != nil {
		return st, err
	}
	st.Load = make([]int, len(load))
	for i, v := range load {
		st.Load[i] = int(v)
	}
	if a.Perm != nil {
		var err error
		if st.Dropped, err = a.Perm.DroppedCount(s); err != nil {
			return st, err
		}
	} else if a.Layout != nil {
		st.Dropped = a.Layout.Dropped()
	}
	if a.Routing.AuxLoss != nil {
		v, err := a.Routing.AuxLoss.Float32s(s)
		if err != nil {
			return st, err
		}
		st.AuxLoss = v[0]
	}
	return st, nil
}

// wshape returns the shape of a [g, k, n] weight in layout l.
func wshape(l gemm.WeightLayout, g, k, n int) []int {
	if l == gemm.NK {
		return []int{g, n, k}
	}
	return []int{g, k, n}
}

// check validates x[T,H], y and the parameters.
func (l *Layer) check(s *device.Stream, y, x *device.Tensor, p *Params) error {
	c := l.cfg
	H, F, E, L := c.Hidden, c.FFN, c.Router.Experts, c.localExperts()
	if err := checkFloat(s, x, "Layer x"); err != nil {
		return err
	}
	T, dt := x.Dim(0), x.DType()
	if x.Dim(1) != H {
		return fmt.Errorf("moe: Layer x is %v, want [T %d]", x, H)
	}
	if err := checkRows(s, y, "Layer y", dt, T, H); err != nil {
		return err
	}
	if c.EP != nil && c.EP.Transport().Device() != s.Device() {
		return fmt.Errorf("moe: Config.EP is on %v, the stream on %v", c.EP.Transport().Device(), s.Device())
	}
	if c.Offload != nil && c.Offload.Device() != s.Device() {
		return fmt.Errorf("moe: Config.Offload is on %v, the stream on %v", c.Offload.Device(), s.Device())
	}
	if p == nil {
		return errors.New("moe: Layer: nil Params")
	}
	if err := checkFloat(s, p.Router, "Params.Router"); err != nil {
		return err
	}
	if rd := p.Router.DType(); rd != device.F32 && rd != dt {
		return fmt.Errorf("moe: Params.Router is %v, want f32 or %v", p.Router, dt)
	}
	if err := checkShape(p.Router, "Params.Router", E, H); err != nil {
		return err
	}
	if p.Bias != nil {
		if err := checkTensor(s, p.Bias, "Params.Bias", device.F32, E); err != nil {
			return err
		}
	}
	if err := checkTensor(s, p.W1, "Params.W1", dt, wshape(c.Layout, L, H, 2*F)...); err != nil {
		return err
	}
	if err := checkTensor(s, p.W2, "Params.W2", dt, wshape(c.Layout, L, F, H)...); err != nil {
		return err
	}
	if c.SharedFFN > 0 {
		Fs := c.SharedFFN
		if err := checkTensor(s, p.SharedW1, "Params.SharedW1", dt, wshape(c.Layout, 1, H, 2*Fs)[1:]...); err != nil {
			return err
		}
		if err := checkTensor(s, p.SharedW2, "Params.SharedW2", dt, wshape(c.Layout, 1, Fs, H)[1:]...); err != nil {
			return err
		}
	} else if p.SharedW1 != nil || p.SharedW2 != nil {
		return errors.New("moe: Params.SharedW1 and SharedW2 given but Config.SharedFFN is 0")
	}
	return nil
}

func (l *Layer) gemmOpt(acc bool) *gemm.Options {
	return &gemm.Options{Layout: l.cfg.Layout, TF32: l.cfg.TF32, Accumulate: acc}
}

// as3 returns the 2-D shared-expert weight w as a [1, ...] view for ragged_dot.
func as3(w *device.Tensor) (*device.Tensor, error) { return w.Reshape(1, w.Dim(0), w.Dim(1)) }

// Forward computes y[T,H] = Σ_k weight[t,k]·expert_{e_tk}(x[t]) (+ shared(x[t])) for
// x[T,H] (F32 or BF16; y the same), with expert(x) = (silu(x·W1_gate)·(x·W1_up))·W2, on
// s. Everything is enqueued on s; nothing waits for the device, except the count
// exchange of Config.EP. It returns the activations Backward needs; they reference x
// and p, which must stay unchanged until Backward. Free them when done.
func (l *Layer) Forward(s *device.Stream, y, x *device.Tensor, p *Params) (*Activations, error) {
	if err := l.check(s, y, x, p); err != nil {
		return nil, err
	}
	c := l.cfg
	T, H, F, E, dt := x.Dim(0), c.Hidden, c.FFN, c.Router.Experts, x.DType()
	act := &Activations{cfg: c, s: s, x: x, p: p}
	fail := func(err error) (*Activations, error) {
		act.Free()
		return nil, err
	}
	logits, err := s.Alloc(device.F32, T, E)
	if err != nil {
		return nil, err
	}
	err = RouterLogits(s, logits, x, p.Router)
	if err == nil {
		act.Routing, err = Route(s, c.Router, logits, p.Bias)
	}
	logits.Free()
	if err != nil {
		return fail(err)
	}
	l.mark(s, "router")
	var xp *device.Tensor
	if c.EP == nil {
		capacity := Capacity(c.CapacityFactor, T, c.Router.TopK, E)
		if act.Perm, err = Sort(s, act.Routing.Index, E, capacity); err != nil {
			return fail(err)
		}
		pm := act.Perm
		act.counts, act.rows = pm.Counts, pm.Rows
		if act.used, err = pm.Offsets.View(E, 1); err != nil {
			return fail(err)
		}
		l.mark(s, "sort")
		if xp, err = s.Alloc(dt, pm.Rows, H); err != nil {
			return fail(err)
		}
		act.xp.t = xp // owned from here on
		if err := Permute(s, xp, x, pm); err != nil {
			return fail(err)
		}
		l.mark(s, "permute")
	} else {
		if act.Layout, err = c.EP.Layout(s, act.Routing.Index); err != nil {
			return fail(err)
		}
		d, err := act.Layout.Dispatch(s, x, act.Routing.Weight)
		if err != nil {
			return fail(err)
		}
		xp, act.weights, act.counts, act.rows = d.X, d.Weights, d.Counts, act.Layout.Capacity()
		act.xp.t = xp
		l.mark(s, "dispatch")
	}
	R := act.rows
	ts, err := allocAll(s, spec(dt, R, 2*F), spec(dt, R, F), spec(dt, R, H))
	if err != nil {
		return fail(err)
	}
	h, a, yp := ts[0], ts[1], ts[2]
	act.h.t, act.a.t, act.yp.t = h, a, yp
	o := l.gemmOpt(false)
	if err := gemm.RaggedDot(s, h, xp, p.W1, act.counts, o); err != nil {
		return fail(err)
	}
	l.mark(s, "gemm")
	if err := act.keep(s, &act.xp, ActPermuted, xp); err != nil {
		return fail(err)
	}
	if err := swiglu(s, a, h, act.used); err != nil {
		return fail(err)
	}
	l.mark(s, "swiglu")
	if err := act.keep(s, &act.h, ActWi, h); err != nil {
		return fail(err)
	}
	if err := gemm.RaggedDot(s, yp, a, p.W2, act.counts, o); err != nil {
		return fail(err)
	}
	l.mark(s, "gemm")
	if err := act.keep(s, &act.a, ActSwiGLU, a); err != nil {
		return fail(err)
	}
	var ys *device.Tensor
	if c.SharedFFN > 0 {
		if ys, err = l.sharedForward(s, act); err != nil {
			return fail(err)
		}
		defer ys.Free()
		l.mark(s, "shared")
	}
	if c.EP == nil {
		pm := act.Perm
		err = unpermute(s, y, yp, act.Routing.Weight, pm.Row, pm.TopK, pm.Rows, ys)
	} else {
		var out *device.Tensor
		if out, err = act.Layout.Combine(s, yp, act.weights); err == nil {
			err = unpermute(s, y, out, nil, nil, 1, T, ys)
			out.Free()
		}
	}
	if err != nil {
		return fail(err)
	}
	l.mark(s, "combine")
	if err := act.keep(s, &act.yp, ActWo, yp); err != nil {
		return fail(err)
	}
	return act, nil
}

// sharedForward runs the shared expert on every token and returns its output [T,H].
func (l *Layer) sharedForward(s *device.Stream, act *Activations) (*device.Tensor, error) {
	x := act.x
	T, H, Fs, dt := x.Dim(0), l.cfg.Hidden, l.cfg.SharedFFN, x.DType()
	var err error
	if act.all, err = s.Alloc(device.I32, 1); err != nil {
		return nil, err
	}
	if err := device.Fill(s, act.all, float64(T)); err != nil {
		return nil, err
	}
	ts, err := allocAll(s, spec(dt, T, 2*Fs), spec(dt, T, Fs), spec(dt, T, H))
	if err != nil {
		return nil, err
	}
	hs, as, ys := ts[0], ts[1], ts[2]
	act.hs.t, act.as.t = hs, as
	fail := func(err error) (*device.Tensor, error) {
		ys.Free()
		return nil, err
	}
	o := l.gemmOpt(false)
	if err := l.sharedWi(s, act, hs); err != nil {
		return fail(err)
	}
	if err := swiglu(s, as, hs, nil); err != nil {
		return fail(err)
	}
	if err := act.keep(s, &act.hs, ActSharedWi, hs); err != nil {
		return fail(err)
	}
	w2, err := as3(act.p.SharedW2)
	if err != nil {
		return fail(err)
	}
	if err := gemm.RaggedDot(s, ys, as, w2, act.all, o); err != nil {
		return fail(err)
	}
	if err := act.keep(s, &act.as, ActSharedAct, as); err != nil {
		return fail(err)
	}
	return ys, nil
}

// sharedWi computes hs = x·SharedW1.
func (l *Layer) sharedWi(s *device.Stream, act *Activations, hs *device.Tensor) error {
	w1, err := as3(act.p.SharedW1)
	if err != nil {
		return err
	}
	return gemm.RaggedDot(s, hs, act.x, w1, act.all, l.gemmOpt(false))
}

// recompute returns the functions that rebuild each activation the offloader dropped.
func (l *Layer) recompute(s *device.Stream, act *Activations) (xp, h, a, yp, hs, as func() (*device.Tensor, error)) {
	c, p := l.cfg, act.p
	T, H, F, Fs, dt, R := act.x.Dim(0), c.Hidden, c.FFN, c.SharedFFN, act.x.DType(), act.rows
	o := l.gemmOpt(false)
	build := func(shape []int, fn func(out *device.Tensor) error) (*device.Tensor, error) {
		t, err := s.Alloc(dt, shape...)
		if err != nil {
			return nil, err
		}
		if err := fn(t); err != nil {
			t.Free()
			return nil, err
		}
		return t, nil
	}
	xp = func() (*device.Tensor, error) {
		if c.EP != nil {
			d, err := act.Layout.Dispatch(s, act.x, nil)
			if err != nil {
				return nil, err
			}
			return d.X, nil
		}
		return build([]int{R, H}, func(t *device.Tensor) error { return Permute(s, t, act.x, act.Perm) })
	}
	h = func() (*device.Tensor, error) {
		in, err := act.get(s, &act.xp, xp)
		if err != nil {
			return nil, err
		}
		return build([]int{R, 2 * F}, func(t *device.Tensor) error { return gemm.RaggedDot(s, t, in, p.W1, act.counts, o) })
	}
	a = func() (*device.Tensor, error) {
		in, err := act.get(s, &act.h, h)
		if err != nil {
			return nil, err
		}
		return build([]int{R, F}, func(t *device.Tensor) error { return swiglu(s, t, in, act.used) })
	}
	yp = func() (*device.Tensor, error) {
		in, err := act.get(s, &act.a, a)
		if err != nil {
			return nil, err
		}
		return build([]int{R, H}, func(t *device.Tensor) error { return gemm.RaggedDot(s, t, in, p.W2, act.counts, o) })
	}
	hs = func() (*device.Tensor, error) {
		return build([]int{T, 2 * Fs}, func(t *device.Tensor) error { return l.sharedWi(s, act, t) })
	}
	as = func() (*device.Tensor, error) {
		in, err := act.get(s, &act.hs, hs)
		if err != nil {
			return nil, err
		}
		return build([]int{T, Fs}, func(t *device.Tensor) error { return swiglu(s, t, in, nil) })
	}
	return
}

// Backward computes the gradients of the loss from dy[T,H] (the gradient of Forward's
// y) and the activations of that Forward, into g, on s; nothing waits for the device.
// With RouterConfig.AuxLoss > 0 the gradient of the auxiliary loss (upstream gradient
// 1) is included in g.X and g.Router. Free the activations after.
func (l *Layer) Backward(s *device.Stream, g *Grads, dy *device.Tensor, act *Activations) error {
	if g == nil || act == nil {
		return errors.New("moe: Backward: nil Grads or Activations")
	}
	c := l.cfg
	x, p, r := act.x, act.p, act.Routing
	if act.cfg != c || r == nil || r.Index.Freed() {
		return errors.New("moe: Backward: activations of another layer, or freed")
	}
	T, H, F, E, K, dt := x.Dim(0), c.Hidden, c.FFN, c.Router.Experts, c.Router.TopK, x.DType()
	if err := checkRows(s, dy, "Backward dy", dt, T, H); err != nil {
		return err
	}
	if err := checkRows(s, g.X, "Grads.X", dt, T, H); err != nil {
		return err
	}
	if g.Router != nil {
		if err := checkFloat(s, g.Router, "Grads.Router"); err != nil {
			return err
		}
		if err := checkShape(g.Router, "Grads.Router", E, H); err != nil {
			return err
		}
	}
	if c.SharedFFN == 0 && (g.SharedW1 != nil || g.SharedW2 != nil) {
		return errors.New("moe: Grads.SharedW1 and SharedW2 given but Config.SharedFFN is 0")
	}
	// Weight gradient shapes and dtypes are checked by gemm.
	act.s = s
	R := act.rows
	var tmp []*device.Tensor
	defer func() { freeAll(tmp...) }()
	alloc := func(dt device.DType, shape ...int) (*device.Tensor, error) {
		t, err := s.Alloc(dt, shape...)
		if err == nil {
			tmp = append(tmp, t)
		}
		return t, err
	}
	reXp, reH, reA, reYp, reHs, reAs := l.recompute(s, act)
	// Reloads in order of use, one ahead.
	for _, sl := range []*saved{&act.yp, &act.a} {
		if err := act.prefetch(sl); err != nil {
			return err
		}
	}
	yp, err := act.get(s, &act.yp, reYp)
	if err != nil {
		return err
	}
	var dyp, dw *device.Tensor
	if c.EP == nil {
		pm := act.Perm
		if dyp, err = alloc(dt, R, H); err != nil {
			return err
		}
		if dw, err = alloc(device.F32, T, K); err != nil {
			return err
		}
		err = UnpermuteGrad(s, dyp, dw, dy, yp, r.Weight, pm)
	} else {
		var dwRow *device.Tensor
		dyp, dwRow, err = act.Layout.CombineBackward(s, dy, yp, act.weights)
		if err == nil {
			tmp = append(tmp, dyp, dwRow)
			dw = dwRow // the row weight gradients, sent back with DispatchBackward
		}
	}
	if err != nil {
		return err
	}
	if err := act.done(&act.yp); err != nil {
		return err
	}
	l.mark(s, "combine_bwd")
	if err := act.prefetch(&act.h); err != nil {
		return err
	}
	da, err := alloc(dt, R, F)
	if err != nil {
		return err
	}
	o, ow := l.gemmOpt(false), l.gemmOpt(g.Accumulate)
	if err := gemm.RaggedDotInputGrad(s, da, dyp, p.W2, act.counts, o); err != nil {
		return err
	}
	if g.W2 != nil {
		a, err := act.get(s, &act.a, reA)
		if err != nil {
			return err
		}
		if err := gemm.RaggedDotWeightGrad(s, g.W2, a, dyp, act.counts, ow); err != nil {
			return err
		}
	}
	if err := act.done(&act.a); err != nil {
		return err
	}
	l.mark(s, "gemm")
	if err := act.prefetch(&act.xp); err != nil {
		return err
	}
	h, err := act.get(s, &act.h, reH)
	if err != nil {
		return err
	}
	dh, err := alloc(dt, R, 2*F)
	if err != nil {
		return err
	}
	if err := swigluGrad(s, dh, h, da, act.used); err != nil {
		return err
	}
	if err := act.done(&act.h); err != nil {
		return err
	}
	l.mark(s, "swiglu_bwd")
	dxp, err := alloc(dt, R, H)
	if err != nil {
		return err
	}
	if err := gemm.RaggedDotInputGrad(s, dxp, dh, p.W1, act.counts, o); err != nil {
		return err
	}
	if g.W1 != nil {
		xp, err := act.get(s, &act.xp, reXp)
		if err != nil {
			return err
		}
		if err := gemm.RaggedDotWeightGrad(s, g.W1, xp, dh, act.counts, ow); err != nil {
			return err
		}
	}
	if err := act.done(&act.xp); err != nil {
		return err
	}
	l.mark(s, "gemm")
	// The token-side gradients: dxt[T,H] from the expert rows, and the routing weights'.
	dxt, drow, K1, rows := dxp, act.Perm.rowOrNil(), K, R
	if c.EP != nil {
		dx2, dw2, err := act.Layout.DispatchBackward(s, dxp, dw)
		if err != nil {
			return err
		}
		tmp = append(tmp, dx2, dw2)
		dxt, dw, drow, K1, rows = dx2, dw2, nil, 1, T
		l.mark(s, "dispatch_bwd")
	}
	dl, err := alloc(device.F32, T, E)
	if err != nil {
		return err
	}
	if err := RouteGrad(s, dl, dw, r); err != nil {
		return err
	}
	if g.Router != nil {
		if err := RouterWeightGrad(s, g.Router, x, dl, g.Accumulate); err != nil {
			return err
		}
	}
	l.mark(s, "router_bwd")
	var dxs *device.Tensor
	if c.SharedFFN > 0 {
		if dxs, err = l.sharedBackward(s, g, dy, act, alloc, reHs, reAs); err != nil {
			return err
		}
		l.mark(s, "shared")
	}
	if err := permuteGrad(s, g.X, dxt, drow, K1, rows, dxs, dl, p.Router); err != nil {
		return err
	}
	l.mark(s, "permute_bwd")
	return nil
}

// rowOrNil returns p.Row, or nil for a nil permutation.
func (p *Permutation) rowOrNil() *device.Tensor {
	if p == nil {
		return nil
	}
	return p.Row
}

// sharedBackward computes the shared expert's weight gradients and returns its input
// gradient [T,H].
func (l *Layer) sharedBackward(s *device.Stream, g *Grads, dy *device.Tensor, act *Activations,
	alloc func(device.DType, ...int) (*device.Tensor, error), reHs, reAs func() (*device.Tensor, error)) (*device.Tensor, error) {
	x, p := act.x, act.p
	T, H, Fs, dt := x.Dim(0), l.cfg.Hidden, l.cfg.SharedFFN, x.DType()
	w1, err := as3(p.SharedW1)
	if err != nil {
		return nil, err
	}
	w2, err := as3(p.SharedW2)
	if err != nil {
		return nil, err
	}
	for _, sl := range []*saved{&act.as, &act.hs} {
		if err := act.prefetch(sl); err != nil {
			return nil, err
		}
	}
	o, ow := l.gemmOpt(false), l.gemmOpt(g.Accumulate)
	das, err := alloc(dt, T, Fs)
	if err != nil {
		return nil, err
	}
	if err := gemm.RaggedDotInputGrad(s, das, dy, w2, act.all, o); err != nil {
		return nil, err
	}
	if g.SharedW2 != nil {
		as, err := act.get(s, &act.as, reAs)
		if err != nil {
			return nil, err
		}
		dw2, err := as3(g.SharedW2)
		if err != nil {
			return nil, err
		}
		if err := gemm.RaggedDotWeightGrad(s, dw2, as, dy, act.all, ow); err != nil {
			return nil, err
		}
	}
	if err := act.done(&act.as); err != nil {
		return nil, err
	}
	hs, err := act.get(s, &act.hs, reHs)
	if err != nil {
		return nil, err
	}
	dhs, err := alloc(dt, T, 2*Fs)
	if err != nil {
		return nil, err
	}
	if err := swigluGrad(s, dhs, hs, das, nil); err != nil {
		return nil, err
	}
	if err := act.done(&act.hs); err != nil {
		return nil, err
	}
	dxs, err := alloc(dt, T, H)
	if err != nil {
		return nil, err
	}
	if err := gemm.RaggedDotInputGrad(s, dxs, dhs, w1, act.all, o); err != nil {
		return nil, err
	}
	if g.SharedW1 != nil {
		dw1, err := as3(g.SharedW1)
		if err != nil {
			return nil, err
		}
		if err := gemm.RaggedDotWeightGrad(s, dw1, x, dhs, act.all, ow); err != nil {
			return nil, err
		}
	}
	return dxs, nil
}
