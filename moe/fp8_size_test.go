package moe

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestLayerFP8AtSize runs the FP8 layers, and the bf16 layer, at training sizes on the
// GPU and on the CPU, forward and backward, and checks that the output and every
// gradient of the GPU agree with the CPU's in the same precision: the two differ only
// in the order of f32 sums and where a value near a rounding boundary of bf16 or E4M3
// rounds the other way. It also checks that each FP8 recipe stays near the bf16 layer.
// The sizes: 1024 tokens, H=1024, F=512, 16 experts, top-2 (groups of about 128 rows,
// several scale blocks along every dimension); and examples/train's -hidden 1024 -ffn
// 1024 -experts 16 -batch 8192 (groups of about 1024 rows) with an output gradient of a
// mean loss's magnitude (2^-20). It needs a GPU.
func TestLayerFP8AtSize(t *testing.T) {
	var gpu *device.Device
	for _, d := range dt.Devices(t) {
		if d.IsCUDA() {
			gpu = d
		}
	}
	if gpu == nil {
		t.Skip("no GPU: the test compares a GPU's layer with the CPU's")
	}
	for _, tc := range []struct {
		name    string
		T, F    int
		gyScale float32
	}{
		{"T1024_F512", 1024, 512, 1},
		{"T8192_F1024_small_gy", 8192, 1024, 0x1p-20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Hidden: 1024, FFN: tc.F, Router: RouterConfig{Experts: 16, TopK: 2, Renormalize: true, AuxLoss: 0.01}}
			r := dt.Rand(1400)
			l := newRef(r, cfg, tc.T, false, device.BF16, device.F32)
			gy := randn(r, device.BF16, tc.T*cfg.Hidden, tc.gyScale)
			runs := map[Precision]layerRun{}
			for _, prec := range []Precision{PrecisionBF16, PrecisionMXFP8, PrecisionBlockwise} {
				t.Run(prec.String(), func(t *testing.T) {
					lp := withPrecision(l, prec)
					want := runLayer(t, device.CPU(), lp, device.BF16, device.F32, gy)
					got := runLayer(t, gpu, lp, device.BF16, device.F32, gy)
					runs[prec] = got
					for _, v := range layerOutputs(got, want) {
						e := relErr(v.got, v.want)
						t.Logf("%s: relative error %.3g, GPU against CPU", v.name, e)
						if !(e <= 2e-2) {
							t.Errorf("%s: relative error %.4g of the GPU against the CPU, want ≤ 0.02", v.name, e)
						}
					}
					if prec == PrecisionBF16 {
						return
					}
					for _, v := range layerOutputs(got, runs[PrecisionBF16]) {
						e := relErr(v.got, v.want)
						t.Logf("%s: relative error %.3g against the bf16 layer", v.name, e)
						if !(e <= 0.1) {
							t.Errorf("%s: relative error %.4g against the bf16 layer, want ≤ 0.1", v.name, e)
						}
					}
				})
			}
		})
	}
}

// layerOutputs pairs the output and the gradients of two runs, by name.
func layerOutputs(got, want layerRun) []struct {
	name      string
	got, want []float32
} {
	return []struct {
		name      string
		got, want []float32
	}{{"y", got.y, want.y}, {"dx", got.dx, want.dx}, {"dW1", got.dw1, want.dw1}, {"dW2", got.dw2, want.dw2}, {"dRouter", got.dwr, want.dwr}}
}
