package moe

import (
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestConfigErrors(t *testing.T) {
	ok := RouterConfig{Experts: 8, TopK: 2}
	for _, tc := range []struct {
		cfg  RouterConfig
		want string
	}{
		{RouterConfig{Experts: 0, TopK: 1}, "Experts = 0"},
		{RouterConfig{Experts: 2000, TopK: 1}, "Experts = 2000"},
		{RouterConfig{Experts: 8, TopK: 9}, "TopK = 9"},
		{RouterConfig{Experts: 64, TopK: 33}, "TopK = 33"},
		{RouterConfig{Experts: 8, TopK: 2, Score: 7}, "Score"},
		{RouterConfig{Experts: 8, TopK: 2, Groups: 3, TopKGroups: 1}, "does not divide"},
		{RouterConfig{Experts: 8, TopK: 2, Groups: 4, TopKGroups: 0}, "TopKGroups = 0"},
		{RouterConfig{Experts: 8, TopK: 5, Groups: 4, TopKGroups: 2}, "exceeds the 4 experts"},
		{RouterConfig{Experts: 8, TopK: 2, Scale: -1}, "Scale"},
		{RouterConfig{Experts: 8, TopK: 2, AuxLoss: -1}, "AuxLoss"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one about %q", tc.cfg, err, tc.want)
		}
	}
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Hidden: 0, FFN: 4, Router: ok}, "Hidden = 0"},
		{Config{Hidden: 4, FFN: 0, Router: ok}, "FFN = 0"},
		{Config{Hidden: 4, FFN: 4, SharedFFN: -1, Router: ok}, "SharedFFN"},
		{Config{Hidden: 4, FFN: 4, CapacityFactor: -1, Router: ok}, "CapacityFactor"},
		{Config{Hidden: 4, FFN: 4, Layout: 5, Router: ok}, "Layout"},
		{Config{Hidden: 4, FFN: 4}, "Experts = 0"},
		{Config{Hidden: 16, FFN: 16, Precision: 3, Router: ok}, "Config.Precision = Precision(3), want PrecisionBF16, PrecisionBlockwise or PrecisionMXFP8"},
		{Config{Hidden: 16, FFN: 16, Precision: -1, Router: ok}, "Config.Precision = Precision(-1)"},
		{Config{Hidden: 20, FFN: 16, Precision: PrecisionBlockwise, Router: ok}, "Config.Hidden = 20 with Config.Precision blockwise: want a multiple of 16"},
		{Config{Hidden: 16, FFN: 24, Precision: PrecisionMXFP8, Router: ok}, "Config.FFN = 24 with Config.Precision mxfp8: want a multiple of 16"},
	} {
		_, err := NewLayer(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one about %q", tc.cfg, err, tc.want)
		}
	}
}

func TestCallErrors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		f32 := func(shape ...int) *device.Tensor { return dt.Must(s.Alloc(device.F32, shape...)) }
		bf := func(shape ...int) *device.Tensor { return dt.Must(s.Alloc(device.BF16, shape...)) }
		i32 := func(shape ...int) *device.Tensor { return dt.Must(s.Alloc(device.I32, shape...)) }
		rc := RouterConfig{Experts: 4, TopK: 2}
		idx := upI32(t, s, []int32{0, 1, 2, 3, 1, 0}, 3, 2)
		p := dt.Must(Sort(s, idx, 4, 0))
		cfg := Config{Hidden: 8, FFN: 4, Router: rc}
		lay := dt.Must(NewLayer(cfg))
		params := func() *Params {
			return &Params{Router: f32(4, 8), W1: f32(4, 8, 8), W2: f32(4, 4, 8)}
		}
		for _, tc := range []struct {
			name string
			err  error
			want string
		}{
			{"route dtype", func() error { _, err := Route(s, rc, bf(3, 4), nil); return err }(), "Route logits"},
			{"route width", func() error { _, err := Route(s, rc, f32(3, 5), nil); return err }(), "Route logits"},
			{"route bias", func() error { _, err := Route(s, rc, f32(3, 4), f32(3)); return err }(), "Route bias"},
			{"sort dtype", func() error { _, err := Sort(s, f32(3, 2), 4, 0); return err }(), "Sort index"},
			{"sort K", func() error { _, err := Sort(s, i32(3, 33), 4, 0); return err }(), "K = 33"},
			{"sort experts", func() error { _, err := Sort(s, idx, 0, 0); return err }(), "experts = 0"},
			{"sort capacity", func() error { _, err := Sort(s, idx, 4, -1); return err }(), "capacity"},
			{"permute rows", Permute(s, f32(5, 8), f32(3, 8), p), "Permute xp"},
			{"permute dtype", Permute(s, bf(6, 8), f32(3, 8), p), "Permute xp"},
			{"permute tokens", Permute(s, f32(6, 8), f32(4, 8), p), "Permute x"},
			{"unpermute weight", Unpermute(s, f32(3, 8), f32(6, 8), f32(3, 3), p), "Unpermute weight"},
			{"unpermute grad", UnpermuteGrad(s, f32(6, 8), f32(3, 2), f32(3, 8), bf(6, 8), f32(3, 2), p), "UnpermuteGrad yp"},
			{"permute grad", PermuteGrad(s, f32(3, 8), f32(6, 7), p), "PermuteGrad dxp"},
			{"swiglu odd", SwiGLU(s, f32(3, 2), f32(3, 5)), "even"},
			{"swiglu out", SwiGLU(s, f32(3, 3), f32(3, 4)), "SwiGLU a"},
			{"logits shape", RouterLogits(s, f32(3, 4), f32(3, 8), f32(4, 7)), "RouterLogits wr"},
			{"wgrad shape", RouterWeightGrad(s, f32(4, 8), f32(3, 8), f32(3, 5), false), "RouterWeightGrad dlogits"},
			{"bias dtype", UpdateBias(s, bf(4), i32(4), 1), "UpdateBias bias"},
			{"layer x", func() error { _, err := lay.Forward(s, f32(3, 8), f32(3, 7), params()); return err }(), "Layer x"},
			{"layer y", func() error { _, err := lay.Forward(s, nil, f32(3, 8), params()); return err }(), "Layer y"},
			{"layer params", func() error { _, err := lay.Forward(s, f32(3, 8), f32(3, 8), nil); return err }(), "nil Params"},
			{"layer w1", func() error {
				p := params()
				p.W1 = f32(4, 8, 4)
				_, err := lay.Forward(s, f32(3, 8), f32(3, 8), p)
				return err
			}(), "Params.W1"},
			{"layer router dtype", func() error {
				p := params()
				p.Router = bf(4, 8)
				_, err := lay.Forward(s, f32(3, 8), f32(3, 8), p)
				return err
			}(), "Params.Router"},
			{"layer shared", func() error {
				p := params()
				p.SharedW1 = f32(8, 4)
				_, err := lay.Forward(s, f32(3, 8), f32(3, 8), p)
				return err
			}(), "SharedFFN is 0"},
			{"backward dy", func() error {
				act, err := lay.Forward(s, f32(3, 8), f32(3, 8), params())
				if err != nil {
					return err
				}
				defer act.Free()
				return lay.Backward(s, &Grads{X: f32(3, 8)}, f32(2, 8), act)
			}(), "Backward dy"},
			{"backward dx", func() error {
				act, err := lay.Forward(s, f32(3, 8), f32(3, 8), params())
				if err != nil {
					return err
				}
				defer act.Free()
				return lay.Backward(s, &Grads{}, f32(3, 8), act)
			}(), "Grads.X"},
		} {
			if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
				t.Errorf("%s: error %v, want one about %q", tc.name, tc.err, tc.want)
			}
		}
	})
}
