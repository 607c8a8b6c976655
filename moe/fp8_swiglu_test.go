package moe

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/offload"
)

// TestFP8FusedSwiGLU checks that the fused SwiGLU and quantization of an FP8 layer
// changes no result: the output and every gradient are bit for bit those of the layer
// that computes SwiGLU in the activations' dtype, keeps it, and quantizes it before each
// GEMM that reads it (unfusedSwiGLU), on the cases of TestLayerFP8 (unused rows of a
// capacity layer, short blocks, a skewed expert, no tokens), expert-parallel (the
// columnwise form over the kept rows only), and with the kept FP8 form offloaded, or
// dropped and rebuilt from h by the same kernel (also together with the expert outputs,
// which recompute W2's GEMM from the fused kernel's rowwise form, and with h).
func TestFP8FusedSwiGLU(t *testing.T) {
	same := func(t *testing.T, want, got layerRun) {
		t.Helper()
		sameRun(t, "fused SwiGLU against SwiGLU then quantized (-unfused +fused)", want, got)
	}
	policies := []string{"moe_mlp_swiglu=offload", "moe_mlp_swiglu=remat", "moe_mlp_swiglu=remat,moe_mlpwo=remat",
		"moe_mlp_swiglu=offload,moe_mlpwo=remat", "*=remat"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range fp8Cases {
			l, gy := tc.inputs(uint64(1100 + i))
			for _, prec := range fp8Precisions {
				t.Run(name(tc.name, "/", prec), func(t *testing.T) {
					old := withPrecision(l, prec)
					old.unfusedSwiGLU = true
					want := runLayer(t, d, old, tc.typ, tc.rtyp, gy)
					if tc.T > 0 && cmp.Equal(want.dw2, make([]float32, len(want.dw2))) {
						t.Fatal("dw2 is all zeros")
					}
					same(t, want, runLayer(t, d, withPrecision(l, prec), tc.typ, tc.rtyp, gy))
					sameOffloaded(t, d, withPrecision(l, prec), tc, gy, want, policies, same)
				})
			}
		}
		cfg := Config{Hidden: 32, FFN: 16, SharedFFN: 16, Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}
		tokens := []int{40, 0, 70, 18}
		T := 0
		for _, n := range tokens {
			T += n
		}
		r := dt.Rand(1199)
		base := newRef(r, cfg, T, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, T*cfg.Hidden, 1)
		for _, prec := range fp8Precisions {
			t.Run(name("ep_4ranks/", prec), func(t *testing.T) {
				old := withPrecision(base, prec)
				old.unfusedSwiGLU = true
				want := runRanks(t, d, old, tokens, device.BF16, gy)
				got := runRanks(t, d, withPrecision(base, prec), tokens, device.BF16, gy)
				for rk := range tokens {
					t.Run(name("rank", rk), func(t *testing.T) { same(t, want[rk], got[rk]) })
				}
			})
		}
	})
}

// TestFP8SwiGLUOffloadBytes checks that an FP8 layer offloads its SwiGLU output as FP8:
// its codes and scales, of the columnwise layout's bytes, instead of the bf16 tensor.
func TestFP8SwiGLUOffloadBytes(t *testing.T) {
	cfg := Config{Hidden: 32, FFN: 32, Router: RouterConfig{Experts: 4, TopK: 2}}
	const T = 512
	R, F, E := T*cfg.Router.TopK, cfg.FFN, cfg.Router.Experts
	mp := 128 * (R/128 + min(E, R)) // the token columns of the columnwise layout
	dt.Run(t, func(t *testing.T, d *device.Device) {
		r := dt.Rand(1200)
		l := newRef(r, cfg, T, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, T*cfg.Hidden, 1)
		for _, tc := range []struct {
			prec  Precision
			bytes int
		}{
			{PrecisionBF16, 2 * R * F},
			{PrecisionBlockwise, F*mp + 4*(mp/128)*F},
			{PrecisionMXFP8, F*mp + (mp/32)*128*((F+127)/128)},
		} {
			t.Run(tc.prec.String(), func(t *testing.T) {
				o := dt.Must(offload.New(d, offload.Config{PoolBytes: 1 << 22, Policy: offload.MustParsePolicy(ActSwiGLU + "=offload")}))
				defer o.Close()
				lo := *withPrecision(l, tc.prec)
				lo.cfg.Offload = o
				runLayer(t, d, &lo, device.BF16, device.F32, gy)
				dt.NoErr(t, o.Synchronize())
				if st := o.Stats(); st.Offloaded != int64(tc.bytes) || st.Kept != 0 {
					t.Errorf("offloaded %d bytes (%d kept), want %d", st.Offloaded, st.Kept, tc.bytes)
				}
			})
		}
	})
}
