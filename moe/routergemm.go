package moe

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// RouterLogits computes logits F32[T,E] = x·wrᵀ for x[T,H] and router weights
// wr[E,H] (the layout of a Linear(H, E) weight), each F32 or BF16, accumulating in
// f32, on s. logits must not alias x or wr.
func RouterLogits(s *device.Stream, logits, x, wr *device.Tensor) error {
	if err := checkStream(s, "RouterLogits"); err != nil {
		return err
	}
	if err := checkFloat(s, x, "RouterLogits x"); err != nil {
		return err
	}
	if err := checkFloat(s, wr, "RouterLogits wr"); err != nil {
		return err
	}
	T, H, E := x.Dim(0), x.Dim(1), wr.Dim(0)
	if wr.Dim(1) != H {
		return fmt.Errorf("moe: RouterLogits wr is %v, want [E %d] for x %v", wr, H, x)
	}
	if err := checkTensor(s, logits, "RouterLogits logits", device.F32, T, E); err != nil {
		return err
	}
	if T == 0 || E == 0 {
		return nil
	}
	if H == 0 {
		return device.Fill(s, logits, 0)
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			xs, ws := hostF32(x), hostF32(wr)
			out := device.Slice[float32](logits)
			par.For(T, 16, func(lo, hi int) {
				for t := lo; t < hi; t++ {
					xr := xs[t*H : (t+1)*H]
					for e := range E {
						var acc float64
						for h, w := range ws[e*H : (e+1)*H] {
							acc += float64(xr[h]) * float64(w)
						}
						out[t*E+e] = float32(acc)
					}
				}
			})
		})
	}
	bi, bj := (T+63)/64, (E+31)/32
	splits, chunk := splitK(s, bi*bj, H)
	name := fmt.Sprintf("dl_moe_logits_%s_%s", x.DType(), wr.DType())
	grid := device.Dim3{X: bi, Y: bj, Z: splits}
	if splits == 1 {
		return launch(s, routerProg, name, grid, device.D1(128), 0, logits, x, wr, int64(T), int64(E), int64(H), int64(chunk))
	}
	part, err := s.Alloc(device.F32, splits, T, E)
	if err != nil {
		return err
	}
	defer part.Free()
	if err := launch(s, routerProg, name, grid, device.D1(128), 0, part, x, wr, int64(T), int64(E), int64(H), int64(chunk)); err != nil {
		return err
	}
	return reduceSplits(s, logits, part, splits, false)
}

// splitK returns how many k-ranges of how many elements (a multiple of 32) a
// reduction of length n is split into, so that blocks·splits fill the GPU about 4
// times over while each range keeps at least 4 steps of 32.
func splitK(s *device.Stream, blocks, n int) (splits, chunk int) {
	steps := (n + 31) / 32
	want := (4*s.Device().Multiprocessors() + blocks - 1) / blocks
	splits = min(max(want, 1), max(steps/4, 1), 64)
	chunk = (steps + splits - 1) / splits * 32
	splits = (n + chunk - 1) / chunk
	return splits, chunk
}

// reduceSplits writes out = Σ_z part[z] (+ out when acc), converted to out's dtype.
func reduceSplits(s *device.Stream, out, part *device.Tensor, splits int, acc bool) error {
	n := out.Len()
	grid := min((n+255)/256, 32*s.Device().Multiprocessors())
	return launch(s, routerProg, "dl_moe_reduce_"+out.DType().String(), device.D1(grid), device.D1(256), 0,
		out, part, int64(n), int32(splits), acc)
}

// RouterWeightGrad computes the router weight gradient dwr[E,H] = dlogitsᵀ·x for
// dlogits F32[T,E] and x[T,H], or adds it to dwr when accumulate, on s. dwr is F32 or
// BF16, x F32 or BF16; sums are f32 and deterministic. dwr must not alias x or
// dlogits.
func RouterWeightGrad(s *device.Stream, dwr, x, dlogits *device.Tensor, accumulate bool) error {
	if err := checkStream(s, "RouterWeightGrad"); err != nil {
		return err
	}
	if err := checkFloat(s, x, "RouterWeightGrad x"); err != nil {
		return err
	}
	if err := checkFloat(s, dwr, "RouterWeightGrad dwr"); err != nil {
		return err
	}
	T, H, E := x.Dim(0), x.Dim(1), dwr.Dim(0)
	if dwr.Dim(1) != H {
		return fmt.Errorf("moe: RouterWeightGrad dwr is %v, want [E %d] for x %v", dwr, H, x)
	}
	if err := checkTensor(s, dlogits, "RouterWeightGrad dlogits", device.F32, T, E); err != nil {
		return err
	}
	if E == 0 || H == 0 {
		return nil
	}
	if T == 0 {
		if accumulate {
			return nil
		}
		return device.Fill(s, dwr, 0)
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			xs := hostF32(x)
			dl := device.Slice[float32](dlogits)
			out := hostF32(dwr)
			par.For(E*H, 256, func(lo, hi int) {
				for i := lo; i < hi; i++ {
					e, h := i/H, i%H
					var acc float64
					for t := range T {
						acc += float64(dl[t*E+e]) * float64(xs[t*H+h])
					}
					v := float32(acc)
					if accumulate {
						v += out[i]
					}
					out[i] = v
				}
			})
			storeF32(dwr, out)
		})
	}
	bi, bj := (E+31)/32, (H+63)/64
	splits, chunk := splitK(s, bi*bj, T)
	part, err := s.Alloc(device.F32, splits, E, H)
	if err != nil {
		return err
	}
	defer part.Free()
	grid := device.Dim3{X: bi, Y: bj, Z: splits}
	if err := launch(s, routerProg, "dl_moe_router_wgrad_"+x.DType().String(), grid, device.D1(128), 0,
		part, dlogits, x, int64(T), int64(E), int64(H), int64(chunk)); err != nil {
		return err
	}
	return reduceSplits(s, dwr, part, splits, accumulate)
}
