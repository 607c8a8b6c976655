package main

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/moe"
)

func (b *bench) moe(o options) ([]row, error) {
	s := b.s
	ts := newTensors(s)
	defer ts.Free()
	T, H, F, E, K := o.MoeT, o.MoeH, o.MoeF, o.MoeE, o.MoeK
	lay, err := moe.NewLayer(moe.Config{Hidden: H, FFN: F, Router: moe.RouterConfig{Experts: E, TopK: K, Renormalize: true}})
	if err != nil {
		return nil, err
	}
	typ := device.BF16
	x := ts.random(1, 1, typ, T, H)
	dy := ts.random(2, 1, typ, T, H)
	p := &moe.Params{Router: ts.random(3, 0.02, typ, E, H), W1: ts.random(4, 0.02, typ, E, H, 2*F), W2: ts.random(5, 0.02, typ, E, F, H)}
	g := &moe.Grads{X: ts.Alloc(typ, T, H), Router: ts.Alloc(device.F32, E, H), W1: ts.Alloc(typ, E, H, 2*F), W2: ts.Alloc(typ, E, F, H)}
	y := ts.Alloc(typ, T, H)
	if err := ts.Err(); err != nil {
		return nil, err
	}
	flops := 6 * float64(T) * float64(K) * float64(H) * float64(F) // expert GEMMs, forward
	name := fmt.Sprintf("T=%d H=%d F=%d E=%d K=%d bf16", T, H, F, E, K)
	var rows []row
	for _, pass := range []struct {
		name, base string
		bwd        bool
	}{{"moe layer forward", "29.9 ms (eager PyTorch)", false}, {"moe layer fwd+bwd", "76.5 ms (eager PyTorch)", true}} {
		t, err := b.time(func() error {
			act, err := lay.Forward(s, y, x, p)
			if err != nil {
				return err
			}
			if pass.bwd {
				err = lay.Backward(s, g, dy, act)
			}
			return errors.Join(err, act.Free())
		})
		if err != nil {
			return rows, err
		}
		f := flops
		if pass.bwd {
			f *= 3
		}
		rows = append(rows, row{pass.name, name, t, f / t.Seconds() / 1e12, "TFLOP/s (expert GEMMs)", pass.base})
	}
	return rows, gemm.CheckStatus(s)
}
