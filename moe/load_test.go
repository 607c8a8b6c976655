package moe

import (
	"slices"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// TestLayerLoadErrors checks Layer.Load's bad arguments, and that it does nothing on
// the CPU.
func TestLayerLoadErrors(t *testing.T) {
	var nilL *Layer
	l := dt.Must(NewLayer(Config{Hidden: 16, FFN: 16, Router: RouterConfig{Experts: 4, TopK: 2}}))
	c := device.CPU()
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"nil Layer", func() error { return nilL.Load(c, device.BF16) }, "Layer.Load: nil Layer"},
		{"nil Device", func() error { return l.Load(nil, device.BF16) }, "Layer.Load: nil Device"},
		{"I32 activations", func() error { return l.Load(c, device.I32) }, "dtype i32: want f32 or bf16"},
	} {
		t.Run(tc.name, func(t *testing.T) { dt.WantError(t, tc.call, tc.want) })
	}
	dt.NoErr(t, l.Load(c, device.BF16))
}

// TestLayerLoad checks that Layer.Load compiles every program a Forward and Backward
// then run, in each precision, with and without Config.EP: the step loads no program
// that Load left out.
func TestLayerLoad(t *testing.T) {
	d := dt.GPU(t)
	for _, prec := range []Precision{PrecisionBF16, PrecisionBlockwise, PrecisionMXFP8} {
		for _, ranks := range []int{1, 2} {
			t.Run(name(prec, "_", ranks, "ranks"), func(t *testing.T) {
				cfg := Config{Hidden: 64, FFN: 32, SharedFFN: 16, Precision: prec,
					Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}
				want := cfg
				if ranks > 1 {
					want.EP = new(ep.Group) // Load reads only whether it is set
				}
				dt.NoErr(t, (&Layer{cfg: want}).Load(d, device.BF16))
				before := d.Loaded()
				r := dt.Rand(uint64(40 + ranks))
				const T = 96
				base := newRef(r, cfg, T, false, device.BF16, device.F32)
				gy := randn(r, device.BF16, T*cfg.Hidden, 1)
				if ranks == 1 {
					runLayer(t, d, base, device.BF16, device.F32, gy)
				} else {
					runRanks(t, d, base, []int{T / 2, T / 2}, device.BF16, gy)
				}
				for _, p := range d.Loaded() {
					if !slices.Contains(before, p) {
						t.Errorf("the step loaded %s %v, which Load left out", p.Name, p.Options)
					}
				}
			})
		}
	}
}
