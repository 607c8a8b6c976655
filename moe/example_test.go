package moe_test

import (
	"fmt"
	"log"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/moe"
)

func ExampleRoute() {
	s := device.CPU().Stream()
	logits, err := device.FromFloat32(s, device.F32, []float32{
		2, 1, 0, -1, // token 0
		0, 3, 3, 1, // token 1: a tie, broken toward the lower index
	}, 2, 4)
	if err != nil {
		log.Fatal(err)
	}
	r, err := moe.Route(s, moe.RouterConfig{Experts: 4, TopK: 2, Renormalize: true}, logits, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer r.Free()
	idx := make([]int32, 4)
	if err := device.Download(s, r.Index, idx); err != nil {
		log.Fatal(err)
	}
	w, _ := r.Weight.Float32s(s)
	fmt.Println("experts:", idx)
	fmt.Printf("weights: %.3f\n", w)
	// Output:
	// experts: [0 1 1 2]
	// weights: [0.731 0.269 0.500 0.500]
}

// A layer whose router sends every token to experts 0 and 1: the dropless layer
// computes all assignments, the capacity layer drops half of them.
func ExampleLayer() {
	s := device.CPU().Stream()
	const T, H, F, E = 8, 4, 2, 4
	tensor := func(v float64, shape ...int) *device.Tensor {
		t, err := s.Alloc(device.F32, shape...)
		if err != nil {
			log.Fatal(err)
		}
		device.Fill(s, t, v)
		return t
	}
	x := tensor(1, T, H)
	p := &moe.Params{Router: tensor(0, E, H), W1: tensor(0.5, E, H, 2*F), W2: tensor(0.25, E, F, H)}
	for _, factor := range []float64{0, 1} {
		lay, err := moe.NewLayer(moe.Config{Hidden: H, FFN: F, CapacityFactor: factor,
			Router: moe.RouterConfig{Experts: E, TopK: 2, Renormalize: true}})
		if err != nil {
			log.Fatal(err)
		}
		y := tensor(0, T, H)
		act, err := lay.Forward(s, y, x, p)
		if err != nil {
			log.Fatal(err)
		}
		g := &moe.Grads{X: tensor(0, T, H), Router: tensor(0, E, H), W1: tensor(0, E, H, 2*F), W2: tensor(0, E, F, H)}
		if err := lay.Backward(s, g, y, act); err != nil {
			log.Fatal(err)
		}
		st, err := act.Stats(s)
		if err != nil {
			log.Fatal(err)
		}
		out, _ := y.Float32s(s)
		fmt.Printf("capacity factor %v: load %v, dropped %d, y[0] %.4f, y[T-1] %.4f\n", factor, st.Load, st.Dropped, out[0], out[(T-1)*H])
		act.Free()
	}
	// Output:
	// capacity factor 0: load [8 8 0 0], dropped 0, y[0] 1.7616, y[T-1] 1.7616
	// capacity factor 1: load [8 8 0 0], dropped 8, y[0] 1.7616, y[T-1] 0.0000
}

// A layer whose expert GEMMs run in DeepSeek-V3's blockwise FP8 recipe, beside the
// same layer in the parameters' dtype (f32 here, as are the gradients and activations of
// both): two training steps, an "optimizer" doubling W1 in place in between. The FP8
// layer quantizes W1 and W2 at its first Forward and keeps them until
// InvalidateWeights, which the loop calls after each change of the weights.
func ExampleLayer_fp8() {
	s := device.CPU().Stream()
	const T, H, F, E = 4, 32, 16, 2
	tensor := func(f func(i int) float32, shape ...int) *device.Tensor {
		n := 1
		for _, d := range shape {
			n *= d
		}
		v := make([]float32, n)
		for i := range v {
			v[i] = f(i)
		}
		t, err := device.FromFloat32(s, device.F32, v, shape...)
		if err != nil {
			log.Fatal(err)
		}
		return t
	}
	zeros := func(shape ...int) *device.Tensor { return tensor(func(int) float32 { return 0 }, shape...) }
	x := tensor(func(i int) float32 { return float32(i%7-3) / 4 }, T, H)
	for _, prec := range []moe.Precision{moe.PrecisionBF16, moe.PrecisionBlockwise} {
		lay, err := moe.NewLayer(moe.Config{Hidden: H, FFN: F, Precision: prec,
			Router: moe.RouterConfig{Experts: E, TopK: 1}})
		if err != nil {
			log.Fatal(err)
		}
		p := &moe.Params{
			Router: tensor(func(i int) float32 { return float32(i%3 - 1) }, E, H),
			W1:     tensor(func(i int) float32 { return float32(i%11-5) / 20 }, E, H, 2*F),
			W2:     tensor(func(i int) float32 { return float32(i%5-2) / 10 }, E, F, H),
		}
		y := zeros(T, H)
		for step := range 2 {
			act, err := lay.Forward(s, y, x, p)
			if err != nil {
				log.Fatal(err)
			}
			g := &moe.Grads{X: zeros(T, H), W1: zeros(E, H, 2*F), W2: zeros(E, F, H)}
			if err := lay.Backward(s, g, y, act); err != nil {
				log.Fatal(err)
			}
			act.Free()
			out, _ := y.Float32s(s)
			fmt.Printf("%-9v step %d: y[0][:4] = %.4f\n", prec, step, out[:4])
			// The optimizer step: W1 changes in place, so the FP8 copies must go.
			w1, _ := p.W1.Float32s(s)
			for i := range w1 {
				w1[i] *= 2
			}
			p.W1.SetFloat32(s, w1)
			if err := lay.InvalidateWeights(); err != nil {
				log.Fatal(err)
			}
		}
	}
	// Output:
	// bf16      step 0: y[0][:4] = [-0.0293 -0.0088 -0.0280 0.0549]
	// bf16      step 1: y[0][:4] = [-0.1290 -0.0198 -0.1224 0.2290]
	// blockwise step 0: y[0][:4] = [-0.0269 -0.0101 -0.0272 0.0537]
	// blockwise step 1: y[0][:4] = [-0.1180 -0.0263 -0.1207 0.2248]
}
