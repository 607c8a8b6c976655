package main

import (
	_ "embed"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

//go:embed kernels/train.cu
var kernelSrc string

// program holds the CUDA kernels of the dense parts of the model (kernels/train.cu).
var program = device.NewProgram("train.cu", kernelSrc)

const threads = 256

// rmsEps is the ε of the RMS normalization.
const rmsEps = 1e-6

func launch(s *device.Stream, name string, grid device.Dim3, args ...any) error {
	k, err := s.Device().Kernel(program, name)
	if err != nil {
		return err
	}
	return k.Launch(s, grid, device.D1(threads), 0, args...)
}

func checkF32(s *device.Stream, what string, t *device.Tensor, shape ...int) error {
	if err := t.Check(s, what); err != nil {
		return err
	}
	if t.DType() != device.F32 {
		return fmt.Errorf("%s: dtype %v, want f32", what, t.DType())
	}
	got := t.Shape()
	ok := len(got) == len(shape)
	for i := 0; ok && i < len(shape); i++ {
		ok = got[i] == shape[i]
	}
	if !ok {
		return fmt.Errorf("%s: shape %v, want %v", what, got, shape)
	}
	return nil
}

func checkTokens(s *device.Stream, tok *device.Tensor, B, W int) error {
	if err := tok.Check(s, "tokens"); err != nil {
		return err
	}
	if tok.DType() != device.I32 || tok.Rank() != 2 || tok.Dim(0) != B || tok.Dim(1) <= W {
		return fmt.Errorf("tokens: %v, want i32 [%d, >%d]", tok, B, W)
	}
	return nil
}

// embedForward computes h[b,:] = Σ_{w<W} emb[w·V + tok[b,w], :] for h F32[B,H],
// emb F32[W·V,H] and tok I32[B,ld] (ld > W; ids outside [0,V) add nothing), on s.
func embedForward(s *device.Stream, h, emb, tok *device.Tensor, W, V int) error {
	B, H := h.Dim(0), h.Dim(1)
	if err := checkF32(s, "embedding output", h, B, H); err != nil {
		return err
	}
	if err := checkF32(s, "embedding table", emb, W*V, H); err != nil {
		return err
	}
	if err := checkTokens(s, tok, B, W); err != nil {
		return err
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		return launch(s, "tr_embed_fwd", device.D1(max(B, 1)), h, emb, tok, int32(B), int32(W), int32(ld), int32(V), int32(H))
	}
	return s.EnqueueCPU(func() {
		hv, ev, tv := device.Slice[float32](h), device.Slice[float32](emb), device.Slice[int32](tok)
		par.For(B, 16, func(lo, hi int) {
			for b := lo; b < hi; b++ {
				out := hv[b*H : (b+1)*H]
				clear(out)
				for w := range W {
					v := int(tv[b*ld+w])
					if v < 0 || v >= V {
						continue
					}
					row := ev[(w*V+v)*H : (w*V+v+1)*H]
					for j, x := range row {
						out[j] += x
					}
				}
			}
		})
	})
}

// embedBackward computes demb[w·V+v, :] = Σ_{b: tok[b,w]=v} dh[b,:] (in order of b) for
// demb F32[W·V,H] and dh F32[B,H], on s.
func embedBackward(s *device.Stream, demb, dh, tok *device.Tensor, W, V int) error {
	B, H := dh.Dim(0), dh.Dim(1)
	if err := checkF32(s, "embedding gradient", demb, W*V, H); err != nil {
		return err
	}
	if err := checkF32(s, "embedding output gradient", dh, B, H); err != nil {
		return err
	}
	if err := checkTokens(s, tok, B, W); err != nil {
		return err
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		return launch(s, "tr_embed_bwd", device.Dim3{X: V, Y: W, Z: 1}, demb, dh, tok, int32(B), int32(W), int32(ld), int32(V), int32(H))
	}
	return s.EnqueueCPU(func() {
		dv, gv, tv := device.Slice[float32](demb), device.Slice[float32](dh), device.Slice[int32](tok)
		clear(dv)
		// Each position w owns its rows of demb: positions in parallel, rows b in order.
		par.Each(W, func(w int) {
			for b := range B {
				v := int(tv[b*ld+w])
				if v < 0 || v >= V {
					continue
				}
				out := dv[(w*V+v)*H : (w*V+v+1)*H]
				for j, x := range gv[b*H : (b+1)*H] {
					out[j] += x
				}
			}
		})
	})
}

// rmsForward computes xn[b,:] = x[b,:]·rstd[b], rstd[b] = 1/sqrt(mean(x[b,:]²) + ε), for
// x, xn F32[B,H] and rstd F32[B], on s.
func rmsForward(s *device.Stream, xn, rstd, x *device.Tensor) error {
	B, H := x.Dim(0), x.Dim(1)
	if err := checkF32(s, "norm input", x, B, H); err != nil {
		return err
	}
	if err := checkF32(s, "norm output", xn, B, H); err != nil {
		return err
	}
	if err := checkF32(s, "norm rstd", rstd, B); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_rms_fwd", device.D1(max(B, 1)), xn, rstd, x, int32(B), int32(H), float32(rmsEps))
	}
	return s.EnqueueCPU(func() {
		xv, yv, rv := device.Slice[float32](x), device.Slice[float32](xn), device.Slice[float32](rstd)
		par.For(B, 16, func(lo, hi int) {
			for b := lo; b < hi; b++ {
				row := xv[b*H : (b+1)*H]
				var ss float32
				for _, v := range row {
					ss += v * v
				}
				r := float32(1 / math.Sqrt(float64(ss/float32(H)+rmsEps)))
				for j, v := range row {
					yv[b*H+j] = v * r
				}
				rv[b] = r
			}
		})
	})
}

// rmsBackward computes the gradient of rmsForward, dx[b,:] = rstd[b]·(dxn[b,:] −
// xn[b,:]·mean(dxn[b,:]·xn[b,:])), into dx F32[B,H] or, when accumulate, added to it, on s.
func rmsBackward(s *device.Stream, dx, dxn, xn, rstd *device.Tensor, accumulate bool) error {
	B, H := xn.Dim(0), xn.Dim(1)
	for _, c := range []struct {
		what string
		t    *device.Tensor
	}{{"norm input gradient", dx}, {"norm output gradient", dxn}, {"norm output", xn}} {
		if err := checkF32(s, c.what, c.t, B, H); err != nil {
			return err
		}
	}
	if err := checkF32(s, "norm rstd", rstd, B); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_rms_bwd", device.D1(max(B, 1)), dx, dxn, xn, rstd, int32(B), int32(H), accumulate)
	}
	return s.EnqueueCPU(func() {
		ov, gv, yv, rv := device.Slice[float32](dx), device.Slice[float32](dxn), device.Slice[float32](xn), device.Slice[float32](rstd)
		par.For(B, 16, func(lo, hi int) {
			for b := lo; b < hi; b++ {
				g, y, o := gv[b*H:(b+1)*H], yv[b*H:(b+1)*H], ov[b*H:(b+1)*H]
				var dot float32
				for j := range g {
					dot += g[j] * y[j]
				}
				mean, r := dot/float32(H), rv[b]
				for j := range g {
					v := r * (g[j] - y[j]*mean)
					if accumulate {
						o[j] += v
					} else {
						o[j] = v
					}
				}
			}
		})
	})
}

// add computes out = a + b elementwise for three F32 tensors of one length (out may be
// a or b), on s.
func add(s *device.Stream, out, a, b *device.Tensor) error {
	n := out.Len()
	for _, c := range []struct {
		what string
		t    *device.Tensor
	}{{"sum", out}, {"addend a", a}, {"addend b", b}} {
		if err := checkF32(s, c.what, c.t, c.t.Shape()...); err != nil {
			return err
		}
		if c.t.Len() != n {
			return fmt.Errorf("%s: %d elements, want %d", c.what, c.t.Len(), n)
		}
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_add", device.D1(max(min((n+threads-1)/threads, 4096), 1)), out, a, b, int64(n))
	}
	return s.EnqueueCPU(func() {
		ov, av, bv := device.Slice[float32](out), device.Slice[float32](a), device.Slice[float32](b)
		par.For(n, 1<<14, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				ov[i] = av[i] + bv[i]
			}
		})
	})
}

// softmaxCE adds each row's cross-entropy log Σ exp(logits[b,:]) − logits[b,target] to
// loss F32[B], the target of row b being tok[b,col]; with dlogits (F32[B,V], or nil)
// it also writes the gradient (softmax − onehot(target))·scale. A target outside
// [0,V) adds nothing and gets a zero gradient. On s.
func softmaxCE(s *device.Stream, loss, dlogits, logits, tok *device.Tensor, col int, scale float32) error {
	B, V := logits.Dim(0), logits.Dim(1)
	if err := checkF32(s, "logits", logits, B, V); err != nil {
		return err
	}
	if err := checkF32(s, "loss", loss, B); err != nil {
		return err
	}
	if dlogits != nil {
		if err := checkF32(s, "logits gradient", dlogits, B, V); err != nil {
			return err
		}
	}
	if err := checkTokens(s, tok, B, col); err != nil {
		return err
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		// A nil dlogits is a null pointer: no gradient.
		return launch(s, "tr_softmax_ce", device.D1(max(B, 1)), loss, dlogits, logits, tok, int32(B), int32(V), int32(ld), int32(col), scale)
	}
	return s.EnqueueCPU(func() {
		lv, zv, tv := device.Slice[float32](loss), device.Slice[float32](logits), device.Slice[int32](tok)
		var dv []float32
		if dlogits != nil {
			dv = device.Slice[float32](dlogits)
		}
		par.For(B, 16, func(lo, hi int) {
			for b := lo; b < hi; b++ {
				z := zv[b*V : (b+1)*V]
				t := int(tv[b*ld+col])
				valid := t >= 0 && t < V
				m := float32(math.Inf(-1))
				for _, v := range z {
					m = max(m, v)
				}
				var se float32
				for _, v := range z {
					se += float32(math.Exp(float64(v - m)))
				}
				if valid {
					lv[b] += float32(math.Log(float64(se))) + m - z[t]
				}
				if dv == nil {
					continue
				}
				d := dv[b*V : (b+1)*V]
				for j, v := range z {
					p := float32(0)
					if valid {
						p = float32(math.Exp(float64(v-m))) / se
					}
					if j == t {
						p--
					}
					d[j] = p * scale
				}
			}
		})
	})
}

// adamHyper are AdamW's hyperparameters.
type adamHyper struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
}

// adamw applies AdamW step t (1, 2, ...) to the F32 parameters p with gradients g and
// moments m, v (all of one length): decoupled weight decay p·(1 − lr·wd) and the
// bias-corrected Adam update, on s.
func adamw(s *device.Stream, p, g, m, v *device.Tensor, h adamHyper, wd float64, t int) error {
	n := p.Len()
	for _, c := range []struct {
		what string
		t    *device.Tensor
	}{{"parameter", p}, {"gradient", g}, {"first moment", m}, {"second moment", v}} {
		if err := checkF32(s, c.what, c.t, c.t.Shape()...); err != nil {
			return err
		}
		if c.t.Len() != n {
			return fmt.Errorf("adamw %s: %d elements, want %d", c.what, c.t.Len(), n)
		}
	}
	if t < 1 {
		return fmt.Errorf("adamw: step %d, want ≥ 1", t)
	}
	c1 := 1 / (1 - math.Pow(h.Beta1, float64(t)))
	c2 := 1 / (1 - math.Pow(h.Beta2, float64(t)))
	lr, b1, b2, eps := float32(h.LR), float32(h.Beta1), float32(h.Beta2), float32(h.Eps)
	decay := float32(1 - h.LR*wd)
	if s.Device().IsCUDA() {
		return launch(s, "tr_adamw", device.D1(max(min((n+threads-1)/threads, 8192), 1)), p, g, m, v, int64(n),
			lr, b1, b2, eps, decay, float32(c1), float32(c2))
	}
	fc1, fc2 := float32(c1), float32(c2)
	return s.EnqueueCPU(func() {
		pv, gv, mv, vv := device.Slice[float32](p), device.Slice[float32](g), device.Slice[float32](m), device.Slice[float32](v)
		par.For(n, 1<<14, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				gi := gv[i]
				mi := b1*mv[i] + (1-b1)*gi
				vi := b2*vv[i] + (1-b2)*gi*gi
				mv[i], vv[i] = mi, vi
				pv[i] = pv[i]*decay - lr*(mi*fc1)/(float32(math.Sqrt(float64(vi*fc2)))+eps)
			}
		})
	})
}
