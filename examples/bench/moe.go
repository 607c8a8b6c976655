package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/moe"
)

// moe times the MoE layer's forward and forward+backward in each precision of precs,
// counting the expert GEMMs' flops (bf16's count in every precision). An FP8 layer
// quantizes W1 and W2 again in every timed pass, as after an optimizer step, and its
// rows say so.
func (b *bench) moe(o options, precs []moe.Precision) ([]row, error) {
	s := b.s
	ts := newTensors(s)
	defer ts.Free()
	T, H, F, E, K := o.MoeT, o.MoeH, o.MoeF, o.MoeE, o.MoeK
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
	var rows []row
	for _, prec := range precs {
		lay, err := moe.NewLayer(moe.Config{Hidden: H, FFN: F, Router: moe.RouterConfig{Experts: E, TopK: K, Renormalize: true}, Precision: prec})
		if err != nil {
			return rows, err
		}
		name := fmt.Sprintf("T=%d H=%d F=%d E=%d K=%d %v", T, H, F, E, K, prec)
		if prec != moe.PrecisionBF16 {
			name += ", weights requantized"
		}
		for _, pass := range []struct {
			name, base string
			bwd        bool
		}{{"moe layer forward", "29.9 ms (eager PyTorch)", false}, {"moe layer fwd+bwd", "76.5 ms (eager PyTorch)", true}} {
			t, err := b.time(func() error {
				// As after an optimizer step: an FP8 layer's Forward quantizes W1 and W2
				// again (bf16: nothing to drop).
				if err := lay.InvalidateWeights(); err != nil {
					return err
				}
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
				return rows, errors.Join(err, lay.InvalidateWeights())
			}
			f := flops
			if pass.bwd {
				f *= 3
			}
			base := ""
			if prec == moe.PrecisionBF16 && T == gpuMoeT && H == gpuMoeH && F == gpuMoeF && E == gpuMoeE && K == gpuMoeK {
				base = pass.base // the peer's layer is bf16, of this shape
			}
			rows = append(rows, row{pass.name, name, t, f / t.Seconds() / 1e12, "TFLOP/s (expert GEMMs)", base})
		}
		if err := lay.InvalidateWeights(); err != nil {
			return rows, err
		}
	}
	return rows, gemm.CheckStatus(s)
}

// precisions are the precisions of -moe-precision, in their order by default.
var precisions = []moe.Precision{moe.PrecisionBF16, moe.PrecisionBlockwise, moe.PrecisionMXFP8}

// precisionNames returns the names of precisions joined by sep.
func precisionNames(sep string) string {
	var n []string
	for _, p := range precisions {
		n = append(n, p.String())
	}
	return strings.Join(n, sep)
}

// moePrecisions returns the precisions that -moe-precision lists, in its order.
func moePrecisions(list string) ([]moe.Precision, error) {
	var out []moe.Precision
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		found := false
		for _, p := range precisions {
			if p.String() != name {
				continue
			}
			for _, q := range out {
				if q == p {
					return nil, fmt.Errorf("-moe-precision: %s given twice", name)
				}
			}
			out, found = append(out, p), true
		}
		if !found {
			return nil, fmt.Errorf("-moe-precision: unknown precision %q; known: %s", name, precisionNames(", "))
		}
	}
	return out, nil
}

// moeCheck returns an error for a layer shape that an FP8 precision of precs cannot
// run: Hidden and FFN must be multiples of 16.
func moeCheck(precs []moe.Precision, H, F int) error {
	for _, p := range precs {
		if p != moe.PrecisionBF16 && (H%16 != 0 || F%16 != 0) {
			return fmt.Errorf("-moe-precision %v: -moe-hidden %d and -moe-ffn %d must be multiples of 16 (or -moe-precision bf16)", p, H, F)
		}
	}
	return nil
}
