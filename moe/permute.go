package moe

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// Permute copies each token's row of x[T,H] to the rows of its assignments:
// xp[p.Row[t,k]] = x[t], into xp[p.Rows, H] of x's dtype (F32 or BF16), on s. Rows
// past the used ones (Offsets[E]) are zeroed. xp must not alias x.
func Permute(s *device.Stream, xp, x *device.Tensor, p *Permutation) error {
	if err := checkStream(s, "Permute"); err != nil {
		return err
	}
	if err := p.check(s, "Permute p"); err != nil {
		return err
	}
	if err := checkFloat(s, x, "Permute x"); err != nil {
		return err
	}
	T, H := x.Dim(0), x.Dim(1)
	if T != p.Tokens {
		return fmt.Errorf("moe: Permute x is %v, the permutation has %d tokens", x, p.Tokens)
	}
	if err := checkRows(s, xp, "Permute xp", x.DType(), p.Rows, H); err != nil {
		return err
	}
	if T == 0 || H == 0 {
		return nil
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			es := x.DType().Size()
			rb := H * es
			xb, pb := x.HostBytes(), xp.HostBytes()
			row := device.Slice[int32](p.Row)
			par.For(T, 64, func(lo, hi int) {
				for a := lo * p.TopK; a < hi*p.TopK; a++ {
					if r := int(row[a]); r >= 0 {
						t := a / p.TopK
						copy(pb[r*rb:(r+1)*rb], xb[t*rb:(t+1)*rb])
					}
				}
			})
			used := int(device.Slice[int32](p.Offsets)[p.Experts])
			clear(pb[used*rb:])
		})
	}
	rb := H * x.DType().Size()
	word, ws := "w2", 2
	switch {
	case rb%16 == 0 && device.Aligned(16, x, xp):
		word, ws = "w16", 16
	case rb%4 == 0 && device.Aligned(4, x, xp):
		word, ws = "w4", 4
	}
	nw := int64(rb / ws)
	if err := launch(s, permuteProg, "dl_moe_gather_"+word, device.D1(T), device.D1(rowThreads(nw)), 0,
		xp, x, p.Row, int32(p.TopK), nw); err != nil {
		return err
	}
	return zeroUnused(s, xp, p)
}

// rowThreads is the block size of a kernel that moves n words per row.
func rowThreads(n int64) int { return int(min(max((n+31)/32*32, 64), 256)) }

// zeroUnused zeroes rows [p.Offsets[E], p.Rows) of t[p.Rows, ...] on the GPU.
func zeroUnused(s *device.Stream, t *device.Tensor, p *Permutation) error {
	if p.Rows == 0 || t.Len() == 0 {
		return nil
	}
	rb := t.Bytes() / p.Rows
	word, ws := "w2", 2
	switch {
	case rb%16 == 0 && device.Aligned(16, t):
		word, ws = "w16", 16
	case rb%4 == 0 && device.Aligned(4, t):
		word, ws = "w4", 4
	}
	used, err := p.Offsets.View(p.Experts, 1)
	if err != nil {
		return err
	}
	nw := int64(rb / ws)
	// Enough blocks for the dropless case (no rows to zero) to cost nothing, and for a
	// capacity layer's unused tail to stream at full rate.
	grid := min(max(int(int64(p.Rows)*nw/1024), 1), 8*s.Device().Multiprocessors())
	return launch(s, permuteProg, "dl_moe_zero_rows_"+word, device.D1(grid), device.D1(256), 0, t, used, int64(p.Rows), nw)
}

// PermuteGrad is the gradient of Permute: dx[t] = Σ_k dxp[p.Row[t,k]] (f32 sums in
// order of k), for dxp[p.Rows, H] and dx[T,H] of one dtype (F32 or BF16), on s. dx
// must not alias dxp.
func PermuteGrad(s *device.Stream, dx, dxp *device.Tensor, p *Permutation) error {
	if err := checkStream(s, "PermuteGrad"); err != nil {
		return err
	}
	if err := p.check(s, "PermuteGrad p"); err != nil {
		return err
	}
	if err := checkFloat(s, dx, "PermuteGrad dx"); err != nil {
		return err
	}
	if dx.Dim(0) != p.Tokens {
		return fmt.Errorf("moe: PermuteGrad dx is %v, the permutation has %d tokens", dx, p.Tokens)
	}
	return permuteGrad(s, dx, dxp, p.Row, p.TopK, p.Rows, nil, nil, nil)
}

// permuteGrad computes dx[t] = Σ_k dxp[row[t,k]] (+ add[t]) (+ dl[t]·wr) for row
// I32[T,K] (nil: row[t] = t, K = 1) into dxp[rows, H], add[T,H] of dx's dtype or nil,
// and the router's input gradient dl F32[T,E]·wr[E,H] when dl is not nil.
func permuteGrad(s *device.Stream, dx, dxp, row *device.Tensor, K, rows int, add, dl, wr *device.Tensor) error {
	if err := checkFloat(s, dx, "PermuteGrad dx"); err != nil {
		return err
	}
	T, H, dt := dx.Dim(0), dx.Dim(1), dx.DType()
	if err := checkRows(s, dxp, "PermuteGrad dxp", dt, rows, H); err != nil {
		return err
	}
	if add != nil {
		if err := checkRows(s, add, "PermuteGrad add", dt, T, H); err != nil {
			return err
		}
	}
	E := 0
	if dl != nil {
		E = dl.Dim(1)
		if err := checkFloat(s, wr, "router weight"); err != nil {
			return err
		}
		if err := checkShape(wr, "router weight", E, H); err != nil {
			return err
		}
	}
	if T == 0 || H == 0 {
		return nil
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			g, out := hostF32(dxp), make([]float32, T*H)
			var ad, dls, ws []float32
			if add != nil {
				ad = hostF32(add)
			}
			if dl != nil {
				dls, ws = device.Slice[float32](dl), hostF32(wr)
			}
			rowOf := identity
			if row != nil {
				rowOf = device.Slice[int32](row)
			}
			par.For(T, 16, func(lo, hi int) {
				acc := make([]float32, H)
				for t := lo; t < hi; t++ {
					clear(acc)
					for e := 0; e < E; e++ {
						d := dls[t*E+e]
						for h, w := range ws[e*H : (e+1)*H] {
							acc[h] += d * w
						}
					}
					for k := range K {
						if r := int(rowAt(rowOf, t*K+k)); r >= 0 {
							for h, v := range g[r*H : (r+1)*H] {
								acc[h] += v
							}
						}
					}
					if ad != nil {
						for h, v := range ad[t*H : (t+1)*H] {
							acc[h] += v
						}
					}
					copy(out[t*H:], acc)
				}
			})
			storeF32(dx, out)
		})
	}
	v := vecWidth(dt, []int{H}, dx, dxp, add, wr)
	wname := "wf32"
	if wr != nil && wr.DType() == device.BF16 {
		wname = "wbf16"
	}
	const tb = 8 // DL_TB
	return launch(s, permuteProg, "dl_moe_permute_bwd_"+rowKernel(dt, v)+"_"+wname, device.D1((T+tb-1)/tb),
		device.D1(rowThreads(int64(H/v))), tb*E*4, dx, dxp, row, add, dl, wr, int64(T), int32(K), int32(E), int64(H))
}

// identity stands for a nil row map: rowAt(identity, a) = a.
var identity []int32

func rowAt(row []int32, a int) int32 {
	if row == nil {
		return int32(a)
	}
	return row[a]
}

// Unpermute sums each token's expert rows back: y[t] = Σ_k weight[t,k]·yp[p.Row[t,k]]
// (f32 sums in order of k; dropped assignments add nothing), for yp[p.Rows, H],
// y[T,H] of one dtype (F32 or BF16) and weight F32[T,K], on s. y must not alias yp or
// weight.
func Unpermute(s *device.Stream, y, yp, weight *device.Tensor, p *Permutation) error {
	if err := checkStream(s, "Unpermute"); err != nil {
		return err
	}
	if err := p.check(s, "Unpermute p"); err != nil {
		return err
	}
	if err := checkFloat(s, y, "Unpermute y"); err != nil {
		return err
	}
	if y.Dim(0) != p.Tokens {
		return fmt.Errorf("moe: Unpermute y is %v, the permutation has %d tokens", y, p.Tokens)
	}
	if err := checkTensor(s, weight, "Unpermute weight", device.F32, p.Tokens, p.TopK); err != nil {
		return err
	}
	return unpermute(s, y, yp, weight, p.Row, p.TopK, p.Rows, nil)
}

// unpermute computes y[t] = Σ_k weight[t,k]·yp[row[t,k]] (+ add[t]) for row I32[T,K]
// (nil: row[t] = t, K = 1) into yp[rows, H], weight F32[T,K] (nil: ones) and add[T,H]
// of y's dtype or nil.
func unpermute(s *device.Stream, y, yp, weight, row *device.Tensor, K, rows int, add *device.Tensor) error {
	if err := checkFloat(s, y, "Unpermute y"); err != nil {
		return err
	}
	T, H, dt := y.Dim(0), y.Dim(1), y.DType()
	if err := checkRows(s, yp, "Unpermute yp", dt, rows, H); err != nil {
		return err
	}
	if add != nil {
		if err := checkRows(s, add, "Unpermute add", dt, T, H); err != nil {
			return err
		}
	}
	if T == 0 || H == 0 {
		return nil
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			g, out := hostF32(yp), make([]float32, T*H)
			var ad, w []float32
			if add != nil {
				ad = hostF32(add)
			}
			if weight != nil {
				w = device.Slice[float32](weight)
			}
			rowOf := identity
			if row != nil {
				rowOf = device.Slice[int32](row)
			}
			par.For(T, 16, func(lo, hi int) {
				for t := lo; t < hi; t++ {
					acc := out[t*H : (t+1)*H]
					for k := range K {
						if r := int(rowAt(rowOf, t*K+k)); r >= 0 {
							wk := float32(1)
							if w != nil {
								wk = w[t*K+k]
							}
							for h, v := range g[r*H : (r+1)*H] {
								acc[h] += wk * v
							}
						}
					}
					if ad != nil {
						for h, v := range ad[t*H : (t+1)*H] {
							acc[h] += v
						}
					}
				}
			})
			storeF32(y, out)
		})
	}
	v := vecWidth(dt, []int{H}, y, yp, add)
	return launch(s, permuteProg, "dl_moe_combine_"+rowKernel(dt, v), device.D1(T), device.D1(rowThreads(int64(H/v))), 0,
		y, yp, weight, row, add, int32(K), int64(H))
}

// UnpermuteGrad is the gradient of Unpermute: dyp[p.Row[t,k]] = weight[t,k]·dy[t] and
// dweight[t,k] = ⟨dy[t], yp[p.Row[t,k]]⟩ (0 for dropped assignments), for dy[T,H],
// yp and dyp [p.Rows, H] of one dtype and weight, dweight F32[T,K], on s. Unused rows
// of dyp are zeroed. dyp and dweight must not alias each other or an input.
func UnpermuteGrad(s *device.Stream, dyp, dweight, dy, yp, weight *device.Tensor, p *Permutation) error {
	return unpermuteGrad(s, dyp, dweight, dy, yp, weight, p, false)
}

// unpermuteGrad is UnpermuteGrad, or with weightsOnly the routing weights' gradient
// dweight alone (dyp nil).
func unpermuteGrad(s *device.Stream, dyp, dweight, dy, yp, weight *device.Tensor, p *Permutation, weightsOnly bool) error {
	if err := checkStream(s, "UnpermuteGrad"); err != nil {
		return err
	}
	if err := p.check(s, "UnpermuteGrad p"); err != nil {
		return err
	}
	if err := checkFloat(s, dy, "UnpermuteGrad dy"); err != nil {
		return err
	}
	T, H, dt, K := dy.Dim(0), dy.Dim(1), dy.DType(), p.TopK
	if T != p.Tokens {
		return fmt.Errorf("moe: UnpermuteGrad dy is %v, the permutation has %d tokens", dy, p.Tokens)
	}
	if err := checkRows(s, yp, "UnpermuteGrad yp", dt, p.Rows, H); err != nil {
		return err
	}
	if weightsOnly {
		dyp = nil
	} else if err := checkRows(s, dyp, "UnpermuteGrad dyp", dt, p.Rows, H); err != nil {
		return err
	}
	if err := checkTensor(s, weight, "UnpermuteGrad weight", device.F32, T, K); err != nil {
		return err
	}
	if err := checkTensor(s, dweight, "UnpermuteGrad dweight", device.F32, T, K); err != nil {
		return err
	}
	if T == 0 {
		return nil
	}
	if H == 0 {
		return device.Fill(s, dweight, 0)
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			d, u := hostF32(dy), hostF32(yp)
			var out []float32
			if dyp != nil {
				out = make([]float32, p.Rows*H)
			}
			row, w, dw := device.Slice[int32](p.Row), device.Slice[float32](weight), device.Slice[float32](dweight)
			par.For(T, 16, func(lo, hi int) {
				for t := lo; t < hi; t++ {
					dt := d[t*H : (t+1)*H]
					for k := range K {
						r := int(row[t*K+k])
						if r < 0 {
							dw[t*K+k] = 0
							continue
						}
						wk := w[t*K+k]
						var dot float64
						for h, v := range u[r*H : (r+1)*H] {
							dot += float64(dt[h]) * float64(v)
						}
						dw[t*K+k] = float32(dot)
						if out != nil {
							for h, v := range dt {
								out[r*H+h] = wk * v
							}
						}
					}
				}
			})
			if dyp != nil {
				storeF32(dyp, out)
			}
		})
	}
	ts := []*device.Tensor{dy, yp}
	if dyp != nil {
		ts = append(ts, dyp)
	}
	v := vecWidth(dt, []int{H}, ts...)
	if err := launch(s, permuteProg, "dl_moe_combine_bwd_"+rowKernel(dt, v), device.D1(T), device.D1(rowThreads(int64(H/v))), 0,
		dyp, dweight, dy, yp, weight, p.Row, int32(K), int64(H)); err != nil {
		return err
	}
	if dyp == nil {
		return nil
	}
	return zeroUnused(s, dyp, p)
}
