package main

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// adamHyper are AdamW's hyperparameters.
type adamHyper struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
}

// adamArgs mirrors struct tr_adam_hyper of kernels/train.cu.
type adamArgs struct {
	LR, Beta1, Beta2, Eps, Decay, C1, C2 float32
}

// adamChunk is TR_ADAM_CHUNK: the elements of a parameter each block takes at a time.
const adamChunk = 4096

// adamParam is one parameter of a multi-tensor AdamW step: the parameter p, its gradient
// g and moments m and v, all F32 of one length; c, when not nil, a BF16 copy of p of the
// same length that the step refreshes (the weights the compute reads).
type adamParam struct {
	p, g, m, v, c *device.Tensor
	decay         bool // weight decay applies
}

// adamTable steps a set of parameters with one kernel launch: on a GPU it holds a device
// table of their addresses and sizes (tr_adam_param of kernels/train.cu, 8 words each),
// so the tensors must outlive it.
type adamTable struct {
	ps     []adamParam
	tab    *device.Tensor // I64[len(ps), 8] on a GPU, nil on the CPU
	chunks int64
}

// newAdamTable returns the table of ps, uploaded on s.
func newAdamTable(s *device.Stream, ps []adamParam) (*adamTable, error) {
	if len(ps) == 0 {
		return nil, fmt.Errorf("adamw: no parameters")
	}
	t := &adamTable{ps: ps}
	words := make([]int64, 0, 8*len(ps))
	for i, q := range ps {
		n := q.p.Len()
		for _, c := range []struct {
			what string
			t    *device.Tensor
			dt   device.DType
		}{
			{"parameter", q.p, device.F32}, {"gradient", q.g, device.F32},
			{"first moment", q.m, device.F32}, {"second moment", q.v, device.F32}, {"compute copy", q.c, device.BF16},
		} {
			if c.t == nil && c.what == "compute copy" {
				continue // optional
			}
			what := fmt.Sprintf("adamw parameter %d's %s", i, c.what)
			if err := c.t.Check(s, what); err != nil {
				return nil, err
			}
			if c.t.DType() != c.dt || c.t.Len() != n {
				return nil, fmt.Errorf("%s is %v, want %v of %d elements", what, c.t, c.dt, n)
			}
		}
		var cp uintptr
		if q.c != nil {
			cp = q.c.Ptr()
		}
		decay := int64(0)
		if q.decay {
			decay = 1
		}
		words = append(words, int64(q.p.Ptr()), int64(q.g.Ptr()), int64(q.m.Ptr()), int64(q.v.Ptr()), int64(cp),
			int64(n), t.chunks, decay)
		t.chunks += int64((n + adamChunk - 1) / adamChunk)
	}
	if s.Device().IsCUDA() {
		var err error
		if t.tab, err = device.FromSlice(s, device.I64, words, len(ps), 8); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// Free releases the device table.
func (t *adamTable) Free() error {
	if t == nil || t.tab == nil {
		return nil
	}
	return t.tab.Free()
}

// step applies AdamW step n (1, 2, ...) to every parameter of the table, on s:
// decoupled weight decay p·(1 − lr·wd) for the parameters that take it, then the
// bias-corrected Adam update, and the compute copies refreshed.
func (t *adamTable) step(s *device.Stream, h adamHyper, n int) error {
	if n < 1 {
		return fmt.Errorf("adamw: step %d, want ≥ 1", n)
	}
	a := adamArgs{
		LR: float32(h.LR), Beta1: float32(h.Beta1), Beta2: float32(h.Beta2), Eps: float32(h.Eps),
		Decay: float32(1 - h.LR*h.WeightDecay),
		C1:    float32(1 / (1 - math.Pow(h.Beta1, float64(n)))),
		C2:    float32(1 / (1 - math.Pow(h.Beta2, float64(n)))),
	}
	if s.Device().IsCUDA() {
		grid := int(min(t.chunks, int64(8*s.Device().Multiprocessors())))
		return launch(s, "tr_adamw", device.D1(max(grid, 1)), 0, t.tab, int32(len(t.ps)), t.chunks, a)
	}
	return s.EnqueueCPU(func() {
		for _, q := range t.ps {
			decay := float32(1)
			if q.decay {
				decay = a.Decay
			}
			pv, gv, mv, vv := device.Slice[float32](q.p), device.Slice[float32](q.g), device.Slice[float32](q.m), device.Slice[float32](q.v)
			var cv []uint16
			if q.c != nil {
				cv = device.Slice[uint16](q.c)
			}
			b1, b2 := a.Beta1, a.Beta2
			par.For(len(pv), 1<<14, func(lo, hi int) {
				for i := lo; i < hi; i++ {
					gi := gv[i]
					mi := b1*mv[i] + (1-b1)*gi
					vi := b2*vv[i] + (1-b2)*gi*gi
					mv[i], vv[i] = mi, vi
					pv[i] = pv[i]*decay - a.LR*(mi*a.C1)/(float32(math.Sqrt(float64(vi*a.C2)))+a.Eps)
					if cv != nil {
						cv[i] = device.BF16FromFloat32(pv[i])
					}
				}
			})
		}
	})
}
