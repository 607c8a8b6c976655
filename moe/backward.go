package moe

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// Backward computes the gradients of the loss from dy[T,H] (the gradient of Forward's
// y) and the activations of that Forward, into g, on s; nothing waits for the device.
// With RouterConfig.AuxLoss > 0 the gradient of the auxiliary loss (upstream gradient
// 1) is included in g.X and g.Router. Free the activations after. The gradients must
// not alias each other, dy, the input or a parameter. With an FP8 Config.Precision the
// expert GEMMs use the quantized W1 and W2 that Forward used (quantized again from the
// unchanged Params after an InvalidateWeights since) and quantize their other operands
// as Precision says.
func (l *Layer) Backward(s *device.Stream, g *Grads, dy *device.Tensor, act *Activations) error {
	if l == nil {
		return errors.New("moe: Layer.Backward: nil Layer")
	}
	if err := checkStream(s, "Layer.Backward"); err != nil {
		return err
	}
	if g == nil || act == nil {
		return errors.New("moe: Backward: nil Grads or Activations")
	}
	c := l.cfg
	x, p, r := act.x, act.p, act.Routing
	if act.cfg != c || r == nil || r.Index.Freed() {
		return errors.New("moe: Backward: activations of another layer, or freed")
	}
	T, H, F, E, K, dt := x.Dim(0), c.Hidden, c.FFN, c.Router.Experts, c.Router.TopK, x.DType()
	if err := l.checkParams(s, dt, p); err != nil {
		return err
	}
	if err := checkRows(s, dy, "Backward dy", dt, T, H); err != nil {
		return err
	}
	if err := checkRows(s, g.X, "Grads.X", dt, T, H); err != nil {
		return err
	}
	for _, e := range []struct {
		ev   *device.Event
		name string
	}{{g.W1Ready, "Grads.W1Ready"}, {g.W2Ready, "Grads.W2Ready"}} {
		if e.ev != nil && e.ev.Device() != s.Device() {
			return fmt.Errorf("moe: %s: closed, or an event of another device (want one of %v)", e.name, s.Device())
		}
	}
	if c.SharedFFN == 0 && (g.SharedW1 != nil || g.SharedW2 != nil) {
		return errors.New("moe: Grads.SharedW1 and SharedW2 given but Config.SharedFFN is 0")
	}
	L, Fs := c.localExperts(), c.SharedFFN
	for _, w := range []struct {
		t     *device.Tensor
		name  string
		shape []int
	}{
		{g.Router, "Grads.Router", []int{E, H}},
		{g.W1, "Grads.W1", wshape(c.Layout, L, H, 2*F)},
		{g.W2, "Grads.W2", wshape(c.Layout, L, F, H)},
		{g.SharedW1, "Grads.SharedW1", wshape(c.Layout, 1, H, 2*Fs)[1:]},
		{g.SharedW2, "Grads.SharedW2", wshape(c.Layout, 1, Fs, H)[1:]},
	} {
		if w.t != nil {
			if err := checkWeight(s, w.t, w.name, w.shape...); err != nil {
				return err
			}
		}
	}
	act.s = s
	R := act.rows
	tmp := device.NewTemps(s)
	defer tmp.Free()
	ex, err := l.experts(s, act, tmp)
	if err != nil {
		return err
	}
	reXp, reXpSc, reH, reA, reASc, reYp, reHs, reAs := l.recompute(s, act, ex)
	// Reloads in order of use, one ahead.
	for _, sl := range []*saved{&act.yp, &act.a, &act.aScale} {
		if err := act.prefetch(sl); err != nil {
			return err
		}
	}
	yp, err := act.get(s, &act.yp, reYp)
	if err != nil {
		return err
	}
	// The operands quantized as they are computed (grad_fp8.go).
	var fused gradParts
	if c.Precision.fp8() && c.EP == nil {
		fused = l.fusedGrad
	}
	// The shared expert's backward, which needs dy alone. With Config.EP it runs while
	// CombineBackward moves dy's rows.
	var dxs *device.Tensor
	sharedDone := c.SharedFFN == 0
	shared := func() error {
		sharedDone = true
		var err error
		if dxs, err = l.sharedBackward(s, g, dy, act, tmp, reHs, reAs); err != nil {
			return err
		}
		l.mark(s, "shared")
		return nil
	}
	var dyp operand
	var dw *device.Tensor
	switch {
	case fused&gradDyp != 0: // fused is empty with Config.EP
		dw = tmp.Alloc(device.F32, T, K)
		if err := tmp.Err(); err != nil {
			return err
		}
		err = unpermuteGrad(s, nil, dw, dy, yp, r.Weight, act.Perm, true)
		dyp.src = ex.gatherSource(dy, r.Weight)
	case c.EP == nil:
		dyp.t, dw = tmp.Alloc(dt, R, H), tmp.Alloc(device.F32, T, K)
		if err := tmp.Err(); err != nil {
			return err
		}
		err = UnpermuteGrad(s, dyp.t, dw, dy, yp, r.Weight, act.Perm)
	default:
		var dwRow *device.Tensor
		var during []func() error
		if !sharedDone && !l.serialEP {
			during = append(during, shared)
		}
		dyp.t, dwRow, err = act.Layout.CombineBackward(s, dy, yp, act.weights, during...)
		if err == nil {
			tmp.Add(dyp.t, dwRow)
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
	da := tmp.Alloc(dt, R, F)
	if err := tmp.Err(); err != nil {
		return err
	}
	getA := func() (operand, error) {
		a, err := act.get(s, &act.a, reA)
		if err != nil || !act.aFP8 {
			return operand{t: a}, err
		}
		scales, err := act.get(s, &act.aScale, reASc)
		if err != nil {
			return operand{}, err
		}
		act.aq.setCols(a, scales)
		return operand{q: act.aq}, nil
	}
	err = ex.backward(da, g.W2, dyp, getA, g.Accumulate, true)
	if act.aFP8 {
		act.aq.setCols(nil, nil) // the slots hold them
	}
	if err != nil {
		return err
	}
	if err := ready(s, g.W2, g.W2Ready, "Grads.W2Ready"); err != nil {
		return err
	}
	if err := errors.Join(act.done(&act.a), act.done(&act.aScale)); err != nil {
		return err
	}
	l.mark(s, "gemm")
	if err := errors.Join(act.prefetch(&act.xp), act.prefetch(&act.xpScale)); err != nil {
		return err
	}
	h, err := act.get(s, &act.h, reH)
	if err != nil {
		return err
	}
	var dh operand
	if fused&gradDh != 0 {
		dh.src = ex.swigluGradSource(h, da) // h is done after W1's GEMMs read it
	} else {
		dh.t = tmp.Alloc(dt, R, 2*F)
		if err := tmp.Err(); err != nil {
			return err
		}
		if err := swigluGrad(s, dh.t, h, da, act.used); err != nil {
			return err
		}
		if err := act.done(&act.h); err != nil {
			return err
		}
	}
	l.mark(s, "swiglu_bwd")
	dxp := tmp.Alloc(dt, R, H)
	if err := tmp.Err(); err != nil {
		return err
	}
	getXp := func() (operand, error) {
		if fused&gradXp != 0 {
			return operand{src: ex.gatherSource(x, nil)}, nil
		}
		if act.xpFP8 {
			// The dispatched FP8 rows, dequantized as the columnwise quantization reads
			// them.
			q, err := act.fp8Xp(s, reXp, reXpSc)
			if err != nil {
				return operand{}, err
			}
			src := ex.fp8RowsSource(q)
			q.setRows(nil, nil) // the slots hold them
			return operand{src: src}, nil
		}
		xp, err := act.get(s, &act.xp, reXp)
		return operand{t: xp}, err
	}
	wgrad, err := ex.backwardSplit(dxp, g.W1, dh, getXp, g.Accumulate, false)
	if err != nil {
		return err
	}
	// W1's weight gradient, and what is done with once it is enqueued. With Config.EP
	// it runs while DispatchBackward moves dxp's rows (see ep's Overlap).
	w1Done := false
	w1 := func() error {
		w1Done = true
		if err := wgrad(); err != nil {
			return err
		}
		if fused&gradDh != 0 {
			if err := act.done(&act.h); err != nil {
				return err
			}
		}
		if err := ready(s, g.W1, g.W1Ready, "Grads.W1Ready"); err != nil {
			return err
		}
		if err := errors.Join(act.done(&act.xp), act.done(&act.xpScale)); err != nil {
			return err
		}
		l.mark(s, "gemm")
		return nil
	}
	if c.EP == nil || l.serialEP {
		if err := w1(); err != nil {
			return err
		}
	}
	// The token-side gradients: dxt[T,H] from the expert rows, and the routing weights'.
	dxt, drow, K1, rows := dxp, act.Perm.rowOrNil(), K, R
	if c.EP != nil {
		var during []func() error
		if !w1Done {
			during = append(during, w1)
		}
		dx2, dw2, err := act.Layout.DispatchBackward(s, dxp, dw, during...)
		if !w1Done { // DispatchBackward failed before its transfers
			err = errors.Join(err, w1())
		}
		if err != nil {
			return err
		}
		tmp.Add(dx2, dw2)
		dxt, dw, drow, K1, rows = dx2, dw2, nil, 1, T
		l.mark(s, "dispatch_bwd")
	}
	dl := tmp.Alloc(device.F32, T, E)
	if err := tmp.Err(); err != nil {
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
	if !sharedDone {
		if err := shared(); err != nil {
			return err
		}
	}
	if err := permuteGrad(s, g.X, dxt, drow, K1, rows, dxs, dl, p.Router); err != nil {
		return err
	}
	l.mark(s, "permute_bwd")
	return nil
}

// ready records ev (the Grads field name) on s, once the backward is done with an expert
// weight (its gradient dw written and its input gradient's read of it enqueued); nothing
// when ev or dw is nil.
func ready(s *device.Stream, dw *device.Tensor, ev *device.Event, name string) error {
	if dw == nil || ev == nil {
		return nil
	}
	if err := ev.Record(s); err != nil {
		return fmt.Errorf("moe: %s: %w", name, err)
	}
	return nil
}

// rowOrNil returns p.Row, or nil for a nil permutation.
func (p *Permutation) rowOrNil() *device.Tensor {
	if p == nil {
		return nil
	}
	return p.Row
}
