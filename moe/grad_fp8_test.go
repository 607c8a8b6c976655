package moe

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompileGradFP8(t *testing.T) { dt.CheckCompiles(t, gradMXProg, gradBwProg) }

// TestFP8FusedGrad checks that quantizing dyp, dh and the permuted x as they are
// computed changes no result: the output and every gradient are bit for bit those of
// the layer that writes them in the activations' dtype and quantizes them
// (Layer.fusedGrad empty), on the cases of TestLayerFP8 (unused rows of a capacity
// layer, short blocks, a skewed expert, no tokens, bf16 and f32), with the default
// parts, all three or one fused, and with all three fused, with each incoming
// gradient quantized by two passes (gradTwoPass: the sources read twice) and with h
// offloaded or rebuilt, which the fused SwiGLU gradient reads after W1's input
// gradient.
func TestFP8FusedGrad(t *testing.T) {
	same := func(t *testing.T, want, got layerRun) {
		t.Helper()
		sameRun(t, "operands quantized as computed against written then quantized (-unfused +fused)", want, got)
	}
	policies := []string{"moe_mlpwi=offload", "moe_mlpwi=remat", "*=remat"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range fp8Cases {
			l, gy := tc.inputs(uint64(1300 + i))
			for _, prec := range fp8Precisions {
				t.Run(name(tc.name, "/", prec), func(t *testing.T) {
					old := withPrecision(l, prec)
					old.fusedGrad = 0
					want := runLayer(t, d, old, tc.typ, tc.rtyp, gy)
					if tc.T > 0 && (cmp.Equal(want.dw1, make([]float32, len(want.dw1))) || cmp.Equal(want.dx, make([]float32, len(want.dx)))) {
						t.Fatal("dw1 or dx is all zeros")
					}
					same(t, want, runLayer(t, d, withPrecision(l, prec), tc.typ, tc.rtyp, gy))
					all := withPrecision(l, prec)
					all.fusedGrad = allGradParts
					for _, f := range []gradParts{allGradParts, gradDyp, gradDh, gradXp} {
						one := *all
						one.fusedGrad = f
						same(t, want, runLayer(t, d, &one, tc.typ, tc.rtyp, gy))
					}
					two := *all
					two.gradTwoPass = true
					same(t, want, runLayer(t, d, &two, tc.typ, tc.rtyp, gy))
					sameOffloaded(t, d, all, tc, gy, want, policies, same)
				})
			}
		}
	})
}
