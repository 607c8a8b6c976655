package moe

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/offload"
	"github.com/dropless/dropless/quant"
)

// Names of the activations the layer keeps for Backward, as an offload.Policy names
// them.
const (
	ActPermuted  = "moe_permuted"   // the permuted (dispatched) input, [R,H]
	ActWi        = "moe_mlpwi"      // gate and up projections, [R,2F]
	ActSwiGLU    = "moe_mlp_swiglu" // their SwiGLU, [R,F] (FP8 layers: its columnwise FP8 form, codes and scales)
	ActWo        = "moe_mlpwo"      // expert outputs, [R,H]
	ActSharedWi  = "mlpwi"          // the shared expert's gate and up, [T,2Fs]
	ActSharedAct = "mlp_swiglu"     // its SwiGLU, [T,Fs]
)

// saved is an activation Backward needs: held here, or by the offloader.
type saved struct {
	name   string
	t      *device.Tensor
	h      offload.Handle
	inOff  bool // h is live: the offloader holds the activation
	loaned bool // t came back from the offloader or was recomputed: Backward releases it
	gone   bool // released after its last use in Backward
	lazy   bool // not kept by Forward: Backward recomputes it (the permuted x of an FP8 layer)
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

	// aFP8: a is kept as its columnwise FP8 form (an FP8 layer's fused SwiGLU), the
	// codes in a and their scales in aScale, both saved as ActSwiGLU, and the rest of
	// the form (its layout and tables) in aq, which takes the two back for the GEMM.
	aFP8   bool
	aScale saved
	aq     fp8Rows

	// xpFP8: with Config.EP an FP8 layer dispatches x's rows quantized and keeps them so,
	// the codes in xp and their scales in xpScale, both saved as ActPermuted, and the rest
	// of the form in xq, which takes the two back for the GEMMs.
	xpFP8   bool
	xpScale saved
	xq      fp8Rows
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
	for _, sl := range []*saved{&a.xp, &a.xpScale, &a.h, &a.a, &a.aScale, &a.yp, &a.hs, &a.as} {
		errs = append(errs, a.release(sl, true))
	}
	errs = append(errs, freeOn(a.s, a.weights, a.all), a.aq.freeOn(a.s), a.xq.freeOn(a.s))
	a.weights, a.all, a.aq, a.xq = nil, nil, fp8Rows{}, fp8Rows{}
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
	var t *device.Tensor
	var err error
	switch {
	case sl.inOff:
		t, err = a.cfg.Offload.Load(s, sl.h)
		sl.inOff, sl.h = false, offload.Handle{}
		if errors.Is(err, offload.ErrRecompute) {
			t, err = recompute()
		}
	case sl.t != nil:
		return sl.t, nil
	case sl.lazy:
		// Recomputed for each Backward that needs it, released after its last use there.
		t, err = recompute()
	default:
		return nil, fmt.Errorf("moe: activation %s is missing: activations freed?", sl.name)
	}
	if err != nil {
		return nil, fmt.Errorf("moe: activation %s: %w", sl.name, err)
	}
	sl.t, sl.loaned = t, true
	return t, nil
}

// adopt gives sl the tensor t, recomputed with another activation (the codes and the
// scales of a kept FP8 form are rebuilt together), to be released after its last use
// in Backward as a recomputed one: instead of what the offloader holds of it, which is
// dropped; when sl holds its own tensor, t is freed and that one is kept.
func (a *Activations) adopt(s *device.Stream, sl *saved, t *device.Tensor) error {
	if sl.t != nil {
		return t.FreeOn(s)
	}
	var err error
	if sl.inOff {
		err = a.cfg.Offload.Drop(s, sl.h)
		sl.inOff, sl.h = false, offload.Handle{}
	}
	sl.t, sl.loaned = t, true
	return err
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
		if !all && !sl.lazy {
			sl.gone = true
		}
	}
	return err
}

// Stats are a step's routing statistics.
type Stats struct {
	Load    []int   // assignments of this call's tokens routed to each expert (before capacity)
	Dropped int     // assignments dropped for capacity (with Config.EP: rows dropped on this rank)
	AuxLoss float32 // the load-balancing loss, 0 when RouterConfig.AuxLoss is 0 (with Config.EP: this rank's share)
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
	if err := checkStream(s, "Activations.Stats"); err != nil {
		return st, err
	}
	if a == nil {
		return st, errors.New("moe: Activations.Stats: nil Activations")
	}
	if err := a.Routing.check(s, "Activations.Stats a.Routing"); err != nil {
		return st, err
	}
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

// recompute returns the functions that rebuild each activation the offloader dropped
// (aScale: the scales of a kept in FP8; xpScale: those of the dispatched rows kept in
// FP8). The dispatch, the expert GEMMs and the fused SwiGLU run as in Forward, in ex's
// precision, so that what they rebuild is bit for bit what Forward computed.
func (l *Layer) recompute(s *device.Stream, act *Activations, ex *experts) (xp, xpScale, h, a, aScale, yp, hs, as func() (*device.Tensor, error)) {
	c := l.cfg
	T, H, F, Fs, dt, R := act.x.Dim(0), c.Hidden, c.FFN, c.SharedFFN, act.x.DType(), act.rows
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
	// rows dispatches x's rows in FP8 again, which replace act.xq's layout, and returns
	// their codes (or, with scales, their scales), handing the other tensor to its slot:
	// the two are rebuilt together.
	rows := func(scales bool) (*device.Tensor, error) {
		q, _, _, err := l.dispatchFP8(s, act.Layout, act.x, nil)
		if err != nil {
			return nil, err
		}
		codes, sc := q.detachRows()
		return act.rebuilt(s, &act.xq, q, &act.xp, &act.xpScale, codes, sc, scales)
	}
	xpScale = func() (*device.Tensor, error) { return rows(true) }
	xp = func() (*device.Tensor, error) {
		if act.xpFP8 {
			return rows(false)
		}
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
		if act.xpFP8 {
			q, err := act.fp8Xp(s, xp, xpScale)
			if err != nil {
				return nil, err
			}
			defer q.setRows(nil, nil) // the slots hold them
			return build([]int{R, 2 * F}, func(t *device.Tensor) error { return ex.dotRows(t, q, false) })
		}
		in, err := act.get(s, &act.xp, xp)
		if err != nil {
			return nil, err
		}
		return build([]int{R, 2 * F}, func(t *device.Tensor) error { return ex.dot(t, in, false) })
	}
	// cols rebuilds a's columnwise FP8 form from h by the fused kernel, which replaces
	// act.aq's layout, and returns its codes (or, with scales, its scales), handing the
	// other tensor to its slot: the two are rebuilt together.
	cols := func(scales bool) (*device.Tensor, error) {
		in, err := act.get(s, &act.h, h)
		if err != nil {
			return nil, err
		}
		q, err := ex.swigluFP8(in, quant.Columnwise)
		if err != nil {
			return nil, err
		}
		// The new form replaces the kept one's layout (the same: the same groups).
		codes, sc := q.detachCols()
		return act.rebuilt(s, &act.aq, q, &act.a, &act.aScale, codes, sc, scales)
	}
	a = func() (*device.Tensor, error) {
		if act.aFP8 {
			return cols(false)
		}
		in, err := act.get(s, &act.h, h)
		if err != nil {
			return nil, err
		}
		return build([]int{R, F}, func(t *device.Tensor) error { return swiglu(s, t, in, act.used) })
	}
	aScale = func() (*device.Tensor, error) { return cols(true) }
	yp = func() (*device.Tensor, error) {
		if act.aFP8 {
			// W2's GEMM from the rowwise form of the fused pass, as in Forward.
			in, err := act.get(s, &act.h, h)
			if err != nil {
				return nil, err
			}
			return build([]int{R, H}, func(t *device.Tensor) error {
				q, err := ex.swigluFP8(in, quant.Both)
				if err != nil {
					return err
				}
				return errors.Join(ex.dotRows(t, q, true), q.free())
			})
		}
		in, err := act.get(s, &act.a, a)
		if err != nil {
			return nil, err
		}
		return build([]int{R, H}, func(t *device.Tensor) error { return ex.dot(t, in, true) })
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

// rebuilt takes an FP8 form rebuilt for Backward, q without its codes and scales,
// which replaces *kept's layout, and returns its codes (or, with wantScales, its scales)
// for the slot being got, handing the other tensor to its slot (codesSl or scalesSl):
// the two are rebuilt together.
func (a *Activations) rebuilt(s *device.Stream, kept *fp8Rows, q fp8Rows, codesSl, scalesSl *saved, codes, scales *device.Tensor, wantScales bool) (*device.Tensor, error) {
	err := kept.freeOn(s)
	*kept = q
	if wantScales {
		codes, scales = scales, codes
		err = errors.Join(err, a.adopt(s, codesSl, scales))
	} else {
		err = errors.Join(err, a.adopt(s, scalesSl, scales))
	}
	if err != nil {
		return nil, errors.Join(err, codes.FreeOn(s))
	}
	return codes, nil
}

// fp8Xp returns the dispatched rows kept in FP8 (xpFP8), their codes and scales from
// their slots (reloaded, or rebuilt by recodes and rescales), in the form act.xq: the
// caller gives them back to the slots with setRows(nil, nil) once its GEMMs are
// enqueued.
func (a *Activations) fp8Xp(s *device.Stream, recodes, rescales func() (*device.Tensor, error)) (fp8Rows, error) {
	codes, err := a.get(s, &a.xp, recodes)
	if err != nil {
		return fp8Rows{}, err
	}
	scales, err := a.get(s, &a.xpScale, rescales)
	if err != nil {
		return fp8Rows{}, err
	}
	a.xq.setRows(codes, scales)
	return a.xq, nil
}
