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
	gpu := dt.GPU(t)
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
			var bf16 *layerRun
			for _, prec := range []Precision{PrecisionBF16, PrecisionMXFP8, PrecisionBlockwise} {
				t.Run(prec.String(), func(t *testing.T) {
					lp := withPrecision(l, prec)
					want := runLayer(t, device.CPU(), lp, device.BF16, device.F32, gy)
					got := runLayer(t, gpu, lp, device.BF16, device.F32, gy)
					closeRuns(t, "the CPU", got, want, 2e-2)
					switch {
					case prec == PrecisionBF16:
						bf16 = &got
					case bf16 == nil:
						t.Error("no bf16 run to compare with")
					default:
						closeRuns(t, "the bf16 layer", got, *bf16, 0.1)
					}
				})
			}
		})
	}
}
