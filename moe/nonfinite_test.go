package moe

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestRouteInfLogit checks softmax routing of +∞ logits: the +∞ entries share the
// whole score, and no score, weight or logit gradient is NaN.
func TestRouteInfLogit(t *testing.T) { dt.Run(t, testRouteInfLogit) }

func testRouteInfLogit(t *testing.T, d *device.Device) {
	s := d.Stream()
	const T, E, K = 3, 4, 2
	inf := float32(math.Inf(1))
	logits := up(t, s, device.F32, []float32{
		0, inf, 1, 2,
		inf, 0, inf, -1,
		inf, inf, inf, inf,
	}, T, E)
	defer logits.Free()
	bias := up(t, s, device.F32, make([]float32, E), E)
	defer bias.Free()
	wantScores := []float32{0, 1, 0, 0, 0.5, 0, 0.5, 0, 0.25, 0.25, 0.25, 0.25}
	for _, tc := range []struct {
		name   string
		cfg    RouterConfig
		bias   *device.Tensor
		index  []int32
		weight []float32
	}{
		{"logits", RouterConfig{Experts: E, TopK: K}, nil, []int32{1, 3, 0, 2, 0, 1}, []float32{1, 0, 0.5, 0.5, 0.25, 0.25}},
		{"renormalize", RouterConfig{Experts: E, TopK: K, Renormalize: true, AuxLoss: 1}, nil,
			[]int32{1, 3, 0, 2, 0, 1}, []float32{1, 0, 0.5, 0.5, 0.5, 0.5}},
		// Selection on the scores plus a zero bias: ties go to the lower expert.
		{"bias", RouterConfig{Experts: E, TopK: K}, bias, []int32{1, 0, 0, 2, 0, 1}, []float32{1, 0, 0.5, 0.5, 0.25, 0.25}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dt.Must(Route(s, tc.cfg, logits, tc.bias))
			defer r.Free()
			if d := cmp.Diff(wantScores, down(t, s, r.Scores)); d != "" {
				t.Errorf("Scores (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.index, downI32(t, s, r.Index)); d != "" {
				t.Errorf("Index (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tc.weight, down(t, s, r.Weight)); d != "" {
				t.Errorf("Weight (-want +got):\n%s", d)
			}
			dw := up(t, s, device.F32, []float32{1, -1, 2, 0.5, -0.5, 1}, T, K)
			defer dw.Free()
			dl := alloc(t, s, device.F32, T, E)
			defer dl.Free()
			dt.NoErr(t, RouteGrad(s, dl, dw, r))
			for i, v := range down(t, s, dl) {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					t.Errorf("dlogits[%d] = %v, want a finite value", i, v)
				}
			}
		})
	}
}

// TestSwiGLUInfGate checks SwiGLU and its gradient at gates of ±∞: silu and silu'
// take their limits (0 and 0 at −∞, +∞ and 1 at +∞) instead of NaN.
func TestSwiGLUInfGate(t *testing.T) { dt.Run(t, testSwiGLUInfGate) }

func testSwiGLUInfGate(t *testing.T, d *device.Device) {
	s := d.Stream()
	inf := float32(math.Inf(1))
	g := float32(1) // a finite gate for comparison
	sg := sigmoid(g)
	silu1, dsilu1 := g*sg, sg*(1+g*(1-sg))
	for _, typ := range dtypes() {
		t.Run(typ.String(), func(t *testing.T) {
			h := up(t, s, typ, []float32{-inf, inf, g, 2, 3, 4}, 1, 6) // gates | ups
			da := up(t, s, typ, []float32{1, 1, 1}, 1, 3)
			a, dh := alloc(t, s, typ, 1, 3), alloc(t, s, typ, 1, 6)
			defer device.FreeAll(h, da, a, dh)
			dt.NoErr(t, SwiGLU(s, a, h))
			dt.NoErr(t, SwiGLUGrad(s, dh, h, da))
			wantA := rounded(typ, []float32{0, inf, silu1 * 4})
			wantDh := rounded(typ, []float32{0, 3, dsilu1 * 4, 0, inf, silu1})
			// The limits exactly; the finite gate's values within the dtype's tolerance
			// (GPU kernels compute exp in f32).
			near := cmp.Comparer(func(x, y float32) bool {
				return x == y || math.Abs(float64(x-y)) <= tol(typ)*math.Abs(float64(x))
			})
			if d := cmp.Diff(wantA, down(t, s, a), near); d != "" {
				t.Errorf("SwiGLU (-want +got):\n%s", d)
			}
			if d := cmp.Diff(wantDh, down(t, s, dh), near); d != "" {
				t.Errorf("SwiGLUGrad (-want +got):\n%s", d)
			}
		})
	}
}
