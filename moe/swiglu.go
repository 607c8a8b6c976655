package moe

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// SwiGLU computes a[M,F] = silu(h[:, :F])·h[:, F:] for h[M,2F] (gate and up halves
// side by side, as one fused ragged_dot produces them), silu(g) = g·sigmoid(g) (0 at
// g = −∞), in f32, on s. a and h share a dtype, F32 or BF16. a must not alias h.
func SwiGLU(s *device.Stream, a, h *device.Tensor) error { return swiglu(s, a, h, nil) }

// SwiGLUGrad computes dh[M,2F] = [da·up·silu'(gate) | da·silu(gate)] for h[M,2F] and
// da[M,F], on s, with silu' and silu at ±∞ their limits (0 and 0 at −∞, 1 and +∞ at
// +∞). All three share a dtype, F32 or BF16. dh must not alias h or da.
func SwiGLUGrad(s *device.Stream, dh, h, da *device.Tensor) error {
	return swigluGrad(s, dh, h, da, nil)
}

// swiglu is SwiGLU over the first *used rows (a device I32; nil: all), zeroing the rest.
func swiglu(s *device.Stream, a, h, used *device.Tensor) error {
	if err := checkStream(s, "SwiGLU"); err != nil {
		return err
	}
	if err := checkFloat(s, h, "SwiGLU h"); err != nil {
		return err
	}
	M, F2, dt := h.Dim(0), h.Dim(1), h.DType()
	if F2%2 != 0 {
		return fmt.Errorf("moe: SwiGLU h is %v: want an even number of columns [gate | up]", h)
	}
	F := F2 / 2
	if err := checkRows(s, a, "SwiGLU a", dt, M, F); err != nil {
		return err
	}
	if M == 0 || F == 0 {
		return nil
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			hv, out := hostF32(h), make([]float32, M*F)
			n := usedRows(used, M)
			par.For(n, 64, func(lo, hi int) {
				for r := lo; r < hi; r++ {
					for f := range F {
						g, u := hv[r*F2+f], hv[r*F2+F+f]
						out[r*F+f] = silu32(g) * u
					}
				}
			})
			storeF32(a, out)
		})
	}
	v := vecWidth(dt, []int{F}, a, h)
	return launch(s, swigluProg, "dl_moe_swiglu_"+rowKernel(dt, v), device.D1(rowGrid(s, M)), device.D1(rowThreads(int64(F/v))), 0,
		a, h, used, int64(M), int64(F))
}

func swigluGrad(s *device.Stream, dh, h, da, used *device.Tensor) error {
	if err := checkStream(s, "SwiGLUGrad"); err != nil {
		return err
	}
	if err := checkFloat(s, h, "SwiGLUGrad h"); err != nil {
		return err
	}
	M, F2, dt := h.Dim(0), h.Dim(1), h.DType()
	if F2%2 != 0 {
		return fmt.Errorf("moe: SwiGLUGrad h is %v: want an even number of columns [gate | up]", h)
	}
	F := F2 / 2
	if err := checkRows(s, da, "SwiGLUGrad da", dt, M, F); err != nil {
		return err
	}
	if err := checkRows(s, dh, "SwiGLUGrad dh", dt, M, F2); err != nil {
		return err
	}
	if M == 0 || F == 0 {
		return nil
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			out := make([]float32, M*F2)
			swigluGradCPU(out, hostF32(h), hostF32(da), usedRows(used, M), F)
			storeF32(dh, out)
		})
	}
	v := vecWidth(dt, []int{F}, dh, h, da)
	return launch(s, swigluProg, "dl_moe_swiglu_bwd_"+rowKernel(dt, v), device.D1(rowGrid(s, M)), device.D1(rowThreads(int64(F/v))), 0,
		dh, h, da, used, int64(M), int64(F))
}

// swigluGradCPU writes into out the first n rows of dh = [da·up·silu'(gate) |
// da·silu(gate)] of h[·,2F] and da[·,F] (as f32 values), in f32, in parallel.
func swigluGradCPU(out, h, da []float32, n, F int) {
	F2 := 2 * F
	par.For(n, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			for f := range F {
				g, u, dd := h[r*F2+f], h[r*F2+F+f], da[r*F+f]
				ds, sv := siluGrad32(g)
				out[r*F2+f] = dd * u * ds
				out[r*F2+F+f] = dd * sv
			}
		}
	})
}

// sigmoid is 1/(1+exp(-g)) in f32 (exp in float64, rounded).
func sigmoid(g float32) float32 { return 1 / (1 + float32(math.Exp(-float64(g)))) }

// silu32 is g·sigmoid(g) in f32, and its limit 0 at g = −∞.
func silu32(g float32) float32 {
	if math.IsInf(float64(g), -1) {
		return 0
	}
	return g * sigmoid(g)
}

// siluGrad32 returns silu'(g) = s·(1 + g·(1 − s)), s = sigmoid(g), and silu(g) in f32,
// and their limits at ±∞: 0 and 0 at −∞, 1 and +∞ at +∞.
func siluGrad32(g float32) (d, v float32) {
	switch {
	case math.IsInf(float64(g), -1):
		return 0, 0
	case math.IsInf(float64(g), 1):
		return 1, g
	}
	sg := sigmoid(g)
	return sg * (1 + g*(1-sg)), g * sg
}

// usedRows reads the CPU I32 scalar used, clamped to [0, rows]; nil means rows.
func usedRows(used *device.Tensor, rows int) int {
	if used == nil {
		return rows
	}
	return min(max(int(device.Slice[int32](used)[0]), 0), rows)
}

// rowGrid is the grid of a kernel with one block per row, grid-stride.
func rowGrid(s *device.Stream, rows int) int {
	return min(max(rows, 1), 64*s.Device().Multiprocessors())
}
