package moe

import (
	"errors"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// Forward computes y[T,H] = Σ_k weight[t,k]·expert_{e_tk}(x[t]) (+ shared(x[t])) for
// x[T,H] (F32 or BF16; y the same), with expert(x) = (silu(x·W1_gate)·(x·W1_up))·W2, on
// s. Everything is enqueued on s; nothing waits for the device, except the count
// exchange of Config.EP. It returns the activations Backward needs; they reference x
// and p, which must stay unchanged until Backward. Free them when done. y must not
// alias x or a parameter. With an FP8 Config.Precision the expert GEMMs use the layer's
// quantized W1 and W2, quantized now unless cached for these tensors: call
// InvalidateWeights after changing them in place, or Forward uses the old values.
func (l *Layer) Forward(s *device.Stream, y, x *device.Tensor, p *Params) (*Activations, error) {
	if l == nil {
		return nil, errors.New("moe: Layer.Forward: nil Layer")
	}
	if err := checkStream(s, "Layer.Forward"); err != nil {
		return nil, err
	}
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
	// The shared expert, which needs x alone. With Config.EP it runs, and an FP8 layer
	// quantizes its weights, while the dispatch moves x's rows.
	var ys *device.Tensor
	defer func() {
		if ys != nil {
			ys.Free()
		}
	}()
	sharedDone := c.SharedFFN == 0
	shared := func() error {
		sharedDone = true
		var err error
		if ys, err = l.sharedForward(s, act); err == nil {
			l.mark(s, "shared")
		}
		return err
	}
	var xp *device.Tensor
	var qxp fp8Rows // FP8 without Config.EP: x's rows quantized and gathered (xp stays nil)
	if c.EP == nil {
		capacity, err := Capacity(c.CapacityFactor, T, c.Router.TopK, E)
		if err != nil {
			return fail(err)
		}
		if act.Perm, err = Sort(s, act.Routing.Index, E, capacity); err != nil {
			return fail(err)
		}
		pm := act.Perm
		act.counts, act.rows = pm.Counts, pm.Rows
		if act.used, err = pm.Offsets.View(E, 1); err != nil {
			return fail(err)
		}
		l.mark(s, "sort")
		if c.Precision.fp8() {
			// W1's GEMM reads x's quantized rows, gathered; Backward permutes x
			// again for W1's weight gradient.
			if qxp, err = l.gatherX(s, x, pm); err != nil {
				return fail(err)
			}
			defer func() { qxp.free() }() // on the paths that fail before W1's GEMM frees it
			act.xp.lazy = true
		} else {
			if xp, err = s.Alloc(dt, pm.Rows, H); err != nil {
				return fail(err)
			}
			act.xp.t = xp // owned from here on
			if err := Permute(s, xp, x, pm); err != nil {
				return fail(err)
			}
		}
		l.mark(s, "permute")
	} else {
		if act.Layout, err = c.EP.Layout(s, act.Routing.Index); err != nil {
			return fail(err)
		}
		if c.Router.AuxLoss > 0 {
			// The load-balancing loss over the group's batch: this rank's share.
			n := 0
			for _, t := range act.Layout.RankTokens() {
				n += t
			}
			if err := act.Routing.BalanceOver(s, act.Layout.GroupLoad(), n); err != nil {
				return fail(err)
			}
		}
		var during []func() error
		if !l.serialEP {
			if !sharedDone {
				during = append(during, shared)
			}
			if c.Precision.fp8() {
				during = append(during, func() error { _, err := l.weights(s, p); return err })
			}
		}
		if c.Precision.fp8() {
			// x's rows dispatched quantized, kept so for Backward (xp stays nil).
			act.xq, act.weights, act.counts, err = l.dispatchFP8(s, act.Layout, x, act.Routing.Weight, during...)
			if err != nil {
				return fail(err)
			}
			act.xpFP8 = true
		} else {
			d, err := act.Layout.Dispatch(s, x, act.Routing.Weight, during...)
			if err != nil {
				return fail(err)
			}
			xp, act.weights, act.counts = d.X, d.Weights, d.Counts
			act.xp.t = xp
		}
		act.rows = act.Layout.Capacity()
		l.mark(s, "dispatch")
	}
	R := act.rows
	// An FP8 layer's SwiGLU writes a quantized (experts.swigluFP8): no a in bf16.
	act.aFP8 = c.Precision.fp8() && !l.unfusedSwiGLU
	ts := device.NewTemps(s)
	h, yp := ts.Alloc(dt, R, 2*F), ts.Alloc(dt, R, H)
	var a *device.Tensor
	if !act.aFP8 {
		a = ts.Alloc(dt, R, F)
	}
	if err := ts.Err(); err != nil {
		ts.Free()
		return fail(err)
	}
	act.h.t, act.a.t, act.yp.t = h, a, yp
	tmp := device.NewTemps(s) // the weight gradients' groups for the fused SwiGLU
	defer tmp.Free()
	ex, err := l.experts(s, act, tmp)
	if err != nil {
		return fail(err)
	}
	switch {
	case act.xpFP8:
		err = ex.dotRows(h, act.xq, false)
	case xp == nil:
		// The gathered rows are not needed past W1's GEMM: freed in stream order now.
		err = errors.Join(ex.dotRows(h, qxp, false), qxp.free())
		qxp = fp8Rows{}
	default:
		err = ex.dot(h, xp, false)
	}
	if err != nil {
		return fail(err)
	}
	l.mark(s, "gemm")
	if act.xpFP8 {
		// The slots own the codes and scales; act.xq the layout, for Backward.
		codes, scales := act.xq.detachRows()
		act.xp.t, act.xpScale.t = codes, scales
		err = act.keep(s, &act.xp, ActPermuted, codes)
		if err == nil {
			err = act.keep(s, &act.xpScale, ActPermuted, scales)
		}
	} else {
		err = act.keep(s, &act.xp, ActPermuted, xp) // lazy, without xp
	}
	if err != nil {
		return fail(err)
	}
	if act.aFP8 {
		if err := l.swigluW2(s, act, ex, h, yp); err != nil {
			return fail(err)
		}
	} else {
		if err := swiglu(s, a, h, act.used); err != nil {
			return fail(err)
		}
		l.mark(s, "swiglu")
		if err := act.keep(s, &act.h, ActWi, h); err != nil {
			return fail(err)
		}
		if err := ex.dot(yp, a, true); err != nil {
			return fail(err)
		}
		l.mark(s, "gemm")
		if err := act.keep(s, &act.a, ActSwiGLU, a); err != nil {
			return fail(err)
		}
	}
	if !sharedDone {
		if err := shared(); err != nil {
			return fail(err)
		}
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

// swigluW2 is Forward's SwiGLU and W2's GEMM for an FP8 layer that keeps a quantized:
// one pass computes a = SwiGLU(h) and quantizes it in both forms (experts.swigluFP8),
// W2's GEMM reads the rowwise form into yp, freed after it, and the columnwise form, its
// codes and scales, is kept for Backward as ActSwiGLU (in act.a and act.aScale). h is
// kept (ActWi) once the pass has read it.
func (l *Layer) swigluW2(s *device.Stream, act *Activations, ex *experts, h, yp *device.Tensor) error {
	q, err := ex.swigluFP8(h, quant.Both)
	if err != nil {
		return err
	}
	l.mark(s, "swiglu")
	err = act.keep(s, &act.h, ActWi, h)
	if err == nil {
		err = ex.dotRows(yp, q, true)
	}
	if err == nil {
		l.mark(s, "gemm")
		// The rowwise form is freed after the GEMM in stream order.
		err = q.dropRows()
	}
	if err != nil {
		return errors.Join(err, q.free())
	}
	// The slots own the codes and scales; act.aq the layout, for Backward.
	codes, scales := q.detachCols()
	act.aq, act.a.t, act.aScale.t = q, codes, scales
	err = act.keep(s, &act.a, ActSwiGLU, codes)
	if err == nil {
		err = act.keep(s, &act.aScale, ActSwiGLU, scales)
	}
	return err
}
