package moe

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestLayerFP8AtSize runs the FP8 layers, and the bf16 layer, at a training size (1024
// tokens, H=1024, F=512, 16 experts, top-2: groups of about 128 rows, several scale
// blocks along every dimension) on the GPU and on the CPU, forward and backward, and
// checks that the output and every gradient of the GPU agree with the CPU's in the
// same precision: the two differ only in the order of f32 sums and where a value near
// a rounding boundary of bf16 or E4M3 rounds the other way. It needs a GPU.
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
	cfg := Config{Hidden: 1024, FFN: 512, Router: RouterConfig{Experts: 16, TopK: 2, Renormalize: true, AuxLoss: 0.01}}
	const T = 1024
	r := dt.Rand(1400)
	l := newRef(r, cfg, T, false, device.BF16, device.F32)
	gy := randn(r, device.BF16, T*cfg.Hidden, 1)
	for _, prec := range []Precision{PrecisionMXFP8, PrecisionBlockwise, PrecisionBF16} {
		t.Run(prec.String(), func(t *testing.T) {
			lp := withPrecision(l, prec)
			want := runLayer(t, device.CPU(), lp, device.BF16, device.F32, gy)
			got := runLayer(t, gpu, lp, device.BF16, device.F32, gy)
			for _, v := range []struct {
				name      string
				got, want []float32
			}{{"y", got.y, want.y}, {"dx", got.dx, want.dx}, {"dW1", got.dw1, want.dw1}, {"dW2", got.dw2, want.dw2}, {"dRouter", got.dwr, want.dwr}} {
				e := relErr(v.got, v.want)
				t.Logf("%s: relative error %.3g, GPU against CPU", v.name, e)
				if !(e <= 2e-2) {
					t.Errorf("%s: relative error %.4g of the GPU against the CPU, want ≤ 0.02", v.name, e)
				}
			}
		})
	}
}
