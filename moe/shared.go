package moe

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
)

// as3 returns the 2-D shared-expert weight w as a [1, ...] view for ragged_dot.
func as3(w *device.Tensor) (*device.Tensor, error) { return w.Reshape(1, w.Dim(0), w.Dim(1)) }

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
	ts := device.NewTemps(s)
	hs, as, ys := ts.Alloc(dt, T, 2*Fs), ts.Alloc(dt, T, Fs), ts.Alloc(dt, T, H)
	if err := ts.Err(); err != nil {
		ts.Free()
		return nil, err
	}
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

// sharedBackward computes the shared expert's weight gradients and returns its input
// gradient [T,H]; its temporaries and result are allocated in tmp.
func (l *Layer) sharedBackward(s *device.Stream, g *Grads, dy *device.Tensor, act *Activations,
	tmp *device.Temps, reHs, reAs func() (*device.Tensor, error)) (*device.Tensor, error) {
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
	das := tmp.Alloc(dt, T, Fs)
	if err := tmp.Err(); err != nil {
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
	dhs := tmp.Alloc(dt, T, 2*Fs)
	if err := tmp.Err(); err != nil {
		return nil, err
	}
	if err := swigluGrad(s, dhs, hs, das, nil); err != nil {
		return nil, err
	}
	if err := act.done(&act.hs); err != nil {
		return nil, err
	}
	dxs := tmp.Alloc(dt, T, H)
	if err := tmp.Err(); err != nil {
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
