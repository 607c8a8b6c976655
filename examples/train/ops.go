package main

import (
	_ "embed"
	"errors"
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

// embVec is TR_EMB_VEC of kernels/train.cu: the groups of 4 columns a thread of
// tr_embed_norm keeps with its vectorized loads.
const embVec = 4

// embParts is TR_EMB_PARTS of kernels/train.cu: the parts, summed one by one and then
// added in order, that embedBackward cuts each table row's contributions into; embCols is
// TR_EMB_COLS, the columns of a block of tr_embed_bwd.
const (
	embParts = 8
	embCols  = 128
)

// rmsEps is the ε of the RMS normalization.
const rmsEps = 1e-6

// maxVocab bounds the vocabulary: tr_embed_sort (embedGroup) keeps 9 ints per token id in
// shared memory.
const maxVocab = 4096

func launch(s *device.Stream, name string, grid device.Dim3, smem int, args ...any) error {
	k, err := s.Device().Kernel(program, name)
	if err != nil {
		return err
	}
	return k.Launch(s, grid, device.D1(threads), smem, args...)
}

// rowVec reports whether the row kernels (tr_embed_norm, tr_add_norm, tr_norm_bwd) can
// move rows of H elements of ts in groups of 4, each thread keeping up to embVec groups:
// H a multiple of 4 and at most 4·embVec·threads, every tensor's start aligned to 4 of its
// elements (16 bytes of f32, 8 of bf16), so every row's is.
func rowVec(H int, ts ...*device.Tensor) bool {
	if H%4 != 0 || H > 4*embVec*threads {
		return false
	}
	for _, t := range ts {
		if !device.Aligned(4*t.DType().Size(), t) {
			return false
		}
	}
	return true
}

// computeType returns an error unless dt is a compute dtype of the model: F32 or BF16.
func computeType(what string, dt device.DType) error {
	if dt != device.F32 && dt != device.BF16 {
		return fmt.Errorf("%s is %v, want f32 or bf16", what, dt)
	}
	return nil
}

func checkTokens(s *device.Stream, what string, tok *device.Tensor, B, W int) error {
	if err := tok.CheckShape(s, what, device.I32, B, -1); err != nil {
		return err
	}
	if tok.Dim(1) <= W {
		return fmt.Errorf("%s is %v, want i32[%d >%d]", what, tok, B, W)
	}
	return nil
}

// rowIO reads and writes rows of an F32 or BF16 CPU tensor as float32.
type rowIO struct {
	f []float32
	h []uint16
}

func rowsOf(t *device.Tensor) rowIO {
	if t.DType() == device.BF16 {
		return rowIO{h: device.Slice[uint16](t)}
	}
	return rowIO{f: device.Slice[float32](t)}
}

// load fills dst with the elements at off.
func (r rowIO) load(dst []float32, off int) {
	if r.f != nil {
		copy(dst, r.f[off:])
		return
	}
	for i, v := range r.h[off : off+len(dst)] {
		dst[i] = device.BF16ToFloat32(v)
	}
}

// store writes src, rounded to the tensor's dtype, at off.
func (r rowIO) store(off int, src []float32) {
	if r.f != nil {
		copy(r.f[off:], src)
		return
	}
	for i, v := range src {
		r.h[off+i] = device.BF16FromFloat32(v)
	}
}

// rmsOf returns 1/sqrt(mean(x²) + ε) of a row, summed in order.
func rmsOf(x []float32) float32 {
	var ss float32
	for _, v := range x {
		ss += v * v
	}
	return float32(1 / math.Sqrt(float64(ss/float32(len(x))+rmsEps)))
}

// normRow writes x·r into buf and stores it in xn at off.
func normRow(xn rowIO, off int, x, buf []float32, r float32) {
	for j, v := range x {
		buf[j] = v * r
	}
	xn.store(off, buf)
}

// embedNorm computes the embedding h[b,:] = Σ_{w<W} emb[w·V + tok[b,w], :] (ids outside
// [0,V) add nothing) and its RMS norm xn[b,:] = h[b,:]·rstd[b], rstd[b] =
// 1/sqrt(mean(h[b,:]²) + ε), for h F32[B,H], xn F32 or BF16 [B,H] (rounded once),
// rstd F32[B], emb F32[W·V,H] and tok I32[B,ld] (ld > W), on s.
func embedNorm(s *device.Stream, h, xn, rstd, emb, tok *device.Tensor, W, V int) error {
	if err := h.CheckShape(s, "embedNorm h", device.F32, -1, -1); err != nil {
		return err
	}
	B, H := h.Dim(0), h.Dim(1)
	if err := computeType("embedNorm xn", xn.DType()); err != nil {
		return err
	}
	for _, c := range []struct {
		what  string
		t     *device.Tensor
		dt    device.DType
		shape []int
	}{
		{"embedNorm xn", xn, xn.DType(), []int{B, H}},
		{"embedNorm rstd", rstd, device.F32, []int{B}},
		{"embedNorm emb", emb, device.F32, []int{W * V, H}},
	} {
		if err := c.t.CheckShape(s, c.what, c.dt, c.shape...); err != nil {
			return err
		}
	}
	if err := checkTokens(s, "embedNorm tok", tok, B, W); err != nil {
		return err
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		// The block lists the row's W table rows in shared memory, 4 bytes each.
		if d := s.Device(); 4*W > d.MaxSharedMemory() {
			return fmt.Errorf("embedNorm: a window of %d bytes needs %d bytes of shared memory per block, %v allows %d", W, 4*W, d, d.MaxSharedMemory())
		}
		// Groups of 4 columns, each thread keeping up to embVec of them, where every row is
		// aligned and the table's byte offsets fit an int32.
		vec := rowVec(H, h, emb, xn) && int64(emb.Bytes()) <= math.MaxInt32
		return launch(s, "tr_embed_norm_"+xn.DType().String(), device.D1(max(B, 1)), 4*W,
			h, xn, rstd, emb, tok, int32(B), int32(W), int32(ld), int32(V), int32(H), float32(rmsEps), vec)
	}
	return s.EnqueueCPU(func() {
		hv, ev, tv, rv, xo := device.Slice[float32](h), device.Slice[float32](emb), device.Slice[int32](tok), device.Slice[float32](rstd), rowsOf(xn)
		par.For(B, 16, func(lo, hi int) {
			buf := make([]float32, H)
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
				rv[b] = rmsOf(out)
				normRow(xo, b*H, out, buf, rv[b])
			}
		})
	})
}

// addNorm computes the residual add ho = hi + y and its RMS norm, xn[b,:] =
// ho[b,:]·rstd[b] as embedNorm's, for ho, hi F32[B,H], y and xn of one dtype (F32 or
// BF16) [B,H] and rstd F32[B], on s. ho must not alias hi or y.
func addNorm(s *device.Stream, ho, xn, rstd, hi, y *device.Tensor) error {
	if err := hi.CheckShape(s, "addNorm hi", device.F32, -1, -1); err != nil {
		return err
	}
	B, H := hi.Dim(0), hi.Dim(1)
	dt := y.DType()
	if err := computeType("addNorm y", dt); err != nil {
		return err
	}
	for _, c := range []struct {
		what string
		t    *device.Tensor
		dt   device.DType
	}{{"addNorm ho", ho, device.F32}, {"addNorm y", y, dt}, {"addNorm xn", xn, dt}} {
		if err := c.t.CheckShape(s, c.what, c.dt, B, H); err != nil {
			return err
		}
	}
	if err := rstd.CheckShape(s, "addNorm rstd", device.F32, B); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_add_norm_"+dt.String(), device.D1(max(B, 1)), 0, ho, xn, rstd, hi, y, int32(B), int32(H), float32(rmsEps),
			rowVec(H, ho, xn, hi, y))
	}
	return s.EnqueueCPU(func() {
		ov, iv, rv, yi, xo := device.Slice[float32](ho), device.Slice[float32](hi), device.Slice[float32](rstd), rowsOf(y), rowsOf(xn)
		par.For(B, 16, func(lo, hi int) {
			yb, buf := make([]float32, H), make([]float32, H)
			for b := lo; b < hi; b++ {
				out := ov[b*H : (b+1)*H]
				yi.load(yb, b*H)
				for j, v := range iv[b*H : (b+1)*H] {
					out[j] = v + yb[j]
				}
				rv[b] = rmsOf(out)
				normRow(xo, b*H, out, buf, rv[b])
			}
		})
	})
}

// normBackward computes the gradient of the RMS norm of x F32[B,H] whose 1/rms is
// rstd F32[B]: with xn = x·rstd, v[b,:] = rstd[b]·(dxn[b,:] − xn[b,:]·mean(dxn[b,:]·xn[b,:]))
// for dxn F32 or BF16 [B,H]; dx F32[B,H] = v, or dx += v when accumulate. When dxc (of
// dxn's dtype, [B,H]) is not nil it receives dx rounded to its dtype; with copyOnly as
// well, dx is left as it was (read when accumulate) and dxc alone receives the result.
// On s.
func normBackward(s *device.Stream, dx, dxc, dxn, x, rstd *device.Tensor, accumulate, copyOnly bool) error {
	if err := x.CheckShape(s, "normBackward x", device.F32, -1, -1); err != nil {
		return err
	}
	B, H := x.Dim(0), x.Dim(1)
	dt := dxn.DType()
	if err := computeType("normBackward dxn", dt); err != nil {
		return err
	}
	for _, c := range []struct {
		what string
		t    *device.Tensor
		dt   device.DType
	}{{"normBackward dx", dx, device.F32}, {"normBackward dxn", dxn, dt}} {
		if err := c.t.CheckShape(s, c.what, c.dt, B, H); err != nil {
			return err
		}
	}
	if dxc != nil {
		if err := dxc.CheckShape(s, "normBackward dxc", dt, B, H); err != nil {
			return err
		}
	}
	if err := rstd.CheckShape(s, "normBackward rstd", device.F32, B); err != nil {
		return err
	}
	if copyOnly && dxc == nil {
		return errors.New("normBackward: copyOnly without dxc: the result would go nowhere")
	}
	if s.Device().IsCUDA() {
		vec := rowVec(H, dx, dxn, x) && (dxc == nil || rowVec(H, dxc))
		return launch(s, "tr_norm_bwd_"+dt.String(), device.D1(max(B, 1)), 0, dx, dxc, dxn, x, rstd, int32(B), int32(H), accumulate, vec, copyOnly)
	}
	return s.EnqueueCPU(func() {
		ov, xv, rv, gi := device.Slice[float32](dx), device.Slice[float32](x), device.Slice[float32](rstd), rowsOf(dxn)
		var co rowIO
		if dxc != nil {
			co = rowsOf(dxc)
		}
		par.For(B, 16, func(lo, hi int) {
			g := make([]float32, H)
			var tmp []float32
			if copyOnly {
				tmp = make([]float32, H)
			}
			for b := lo; b < hi; b++ {
				gi.load(g, b*H)
				xr, o, r := xv[b*H:(b+1)*H], ov[b*H:(b+1)*H], rv[b]
				if copyOnly {
					copy(tmp, o)
					o = tmp
				}
				var dot float32
				for j := range g {
					dot += g[j] * (xr[j] * r)
				}
				mean := dot / float32(H)
				for j := range g {
					v := r * (g[j] - (xr[j]*r)*mean)
					if accumulate {
						o[j] += v
					} else {
						o[j] = v
					}
				}
				if dxc != nil {
					co.store(b*H, o)
				}
			}
		})
	})
}

// softmaxCE adds each row's cross-entropy log Σ exp(logits[b,:]) − logits[b,target] to
// loss F32[B], the target of row b being tok[b,col], for logits F32[B,V]; with dlogits
// (F32 or BF16 [B,V], or nil) it also writes the gradient (softmax − onehot(target))·scale,
// rounded once. A target outside [0,V) adds nothing and gets a zero gradient. On s.
func softmaxCE(s *device.Stream, loss, dlogits, logits, tok *device.Tensor, col int, scale float32) error {
	if err := logits.CheckShape(s, "softmaxCE logits", device.F32, -1, -1); err != nil {
		return err
	}
	B, V := logits.Dim(0), logits.Dim(1)
	if err := loss.CheckShape(s, "softmaxCE loss", device.F32, B); err != nil {
		return err
	}
	dt := device.F32
	if dlogits != nil {
		dt = dlogits.DType()
		if err := computeType("softmaxCE dlogits", dt); err != nil {
			return err
		}
		if err := dlogits.CheckShape(s, "softmaxCE dlogits", dt, B, V); err != nil {
			return err
		}
	}
	if err := checkTokens(s, "softmaxCE tok", tok, B, col); err != nil {
		return err
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		// A warp per row; a nil dlogits is a null pointer: no gradient.
		return launch(s, "tr_softmax_ce_"+dt.String(), device.D1(max((B+threads/32-1)/(threads/32), 1)), 0,
			loss, dlogits, logits, tok, int32(B), int32(V), int32(ld), int32(col), scale)
	}
	return s.EnqueueCPU(func() {
		lv, zv, tv := device.Slice[float32](loss), device.Slice[float32](logits), device.Slice[int32](tok)
		var do rowIO
		if dlogits != nil {
			do = rowsOf(dlogits)
		}
		par.For(B, 16, func(lo, hi int) {
			d := make([]float32, V)
			for b := lo; b < hi; b++ {
				z := zv[b*V : (b+1)*V]
				t := int(tv[b*ld+col])
				valid := t >= 0 && t < V
				m := float32(math.Inf(-1))
				for _, v := range z {
					m = max(m, v)
				}
				var se float32
				for j, v := range z {
					d[j] = float32(math.Exp(float64(v - m)))
					se += d[j]
				}
				if valid {
					lv[b] += float32(math.Log(float64(se))) + m - z[t]
				}
				if dlogits == nil {
					continue
				}
				inv := 1 / se
				for j := range z {
					p := float32(0)
					if valid {
						p = d[j] * inv
					}
					if j == t {
						p--
					}
					d[j] = p * scale
				}
				do.store(b*V, d)
			}
		})
	})
}

// embedGroup groups the rows of each embedding position by token, the stable counting sort
// that embedBackward's sums read: for perm I32[W,B], offs I32[W,V+1] and tok I32[B,ld]
// (ld > W), perm[w·B + i] for i in [offs[w·(V+1) + v], offs[w·(V+1) + v + 1]) are the rows
// b with tok[b,w] = v in increasing b; ids outside [0,V) are left out, and perm[w·B + i] for
// i ≥ offs[w·(V+1) + V] is left as it was. On s; it reads tok alone, so it can run beside
// the forward, on a stream of its own.
func embedGroup(s *device.Stream, perm, offs, tok *device.Tensor, W, V int) error {
	if err := perm.CheckShape(s, "embedGroup perm", device.I32, W, -1); err != nil {
		return err
	}
	B := perm.Dim(1)
	if err := offs.CheckShape(s, "embedGroup offs", device.I32, W, V+1); err != nil {
		return err
	}
	if err := checkTokens(s, "embedGroup tok", tok, B, W); err != nil {
		return err
	}
	if V > maxVocab {
		return fmt.Errorf("embedGroup: vocabulary of %d, want at most %d", V, maxVocab)
	}
	ld := tok.Dim(1)
	if s.Device().IsCUDA() {
		if W == 0 {
			return nil
		}
		// One block of 256 threads per position.
		return launch(s, "tr_embed_sort", device.D1(W), (9*V+1)*4, perm, offs, tok, int32(B), int32(ld), int32(V))
	}
	return s.EnqueueCPU(func() {
		pv, ov, tv := device.Slice[int32](perm), device.Slice[int32](offs), device.Slice[int32](tok)
		par.Each(W, func(w int) {
			base := ov[w*(V+1) : (w+1)*(V+1)]
			clear(base)
			for b := range B {
				if v := int(tv[b*ld+w]); v >= 0 && v < V {
					base[v+1]++
				}
			}
			for v := range V {
				base[v+1] += base[v]
			}
			next := append([]int32(nil), base[:V]...) // each token's next place
			for b := range B {
				if v := int(tv[b*ld+w]); v >= 0 && v < V {
					pv[w*B+int(next[v])] = int32(b)
					next[v]++
				}
			}
		})
	})
}

// embedBackward computes the embedding table's gradient demb[w·V+v, :] = Σ_{b: tok[b,w]=v}
// dh[b,:] from embedGroup's grouping of tok, perm I32[W,B] and offs I32[W,V+1], for demb
// F32[W·V,H] and dh F32 or BF16 [B,H] (bf16 widened to f32 exactly; the sums are f32), on
// s. The n rows b of an entry, in increasing b, are cut into embParts parts of
// ceil(n/embParts) rows (the last ones shorter or empty); each part is summed in order from
// zero, and the parts' sums are added in order: the GPU's warps add up the parts at once,
// with the CPU's result bit for bit.
func embedBackward(s *device.Stream, demb, dh, perm, offs *device.Tensor, W, V int) error {
	dt := dh.DType()
	if err := computeType("embedBackward dh", dt); err != nil {
		return err
	}
	if err := dh.CheckShape(s, "embedBackward dh", dt, -1, -1); err != nil {
		return err
	}
	B, H := dh.Dim(0), dh.Dim(1)
	for _, c := range []struct {
		what  string
		t     *device.Tensor
		dt    device.DType
		shape []int
	}{
		{"embedBackward demb", demb, device.F32, []int{W * V, H}},
		{"embedBackward perm", perm, device.I32, []int{W, B}},
		{"embedBackward offs", offs, device.I32, []int{W, V + 1}},
	} {
		if err := c.t.CheckShape(s, c.what, c.dt, c.shape...); err != nil {
			return err
		}
	}
	if s.Device().IsCUDA() {
		if W*V == 0 || H == 0 {
			return nil
		}
		// A block of tr_embed_bwd is embParts warps: threads = 32·embParts.
		return launch(s, "tr_embed_bwd_"+dt.String(), device.Dim3{X: W * V, Y: (H + embCols - 1) / embCols, Z: 1}, 0,
			demb, dh, perm, offs, int32(B), int32(V), int32(H))
	}
	return s.EnqueueCPU(func() {
		dv, pv, ov := device.Slice[float32](demb), device.Slice[int32](perm), device.Slice[int32](offs)
		var gf []float32
		var gh []uint16
		if dt == device.BF16 {
			gh = device.Slice[uint16](dh)
		} else {
			gf = device.Slice[float32](dh)
		}
		// Each position w owns its rows of demb: positions in parallel.
		par.Each(W, func(w int) {
			part := make([]float32, H)
			for v := range V {
				lo, hi := int(ov[w*(V+1)+v]), int(ov[w*(V+1)+v+1])
				bs := pv[w*B+lo : w*B+hi]          // the token's rows b at w, in increasing b
				out := dv[(w*V+v)*H : (w*V+v+1)*H] // part 0 is copied over it, the others added
				q := (len(bs) + embParts - 1) / embParts
				for p := range embParts {
					clear(part)
					for _, b := range bs[min(p*q, len(bs)):min((p+1)*q, len(bs))] {
						if gf != nil {
							for j, x := range gf[int(b)*H : (int(b)+1)*H] {
								part[j] += x
							}
							continue
						}
						for j, x := range gh[int(b)*H : (int(b)+1)*H] {
							part[j] += device.BF16ToFloat32(x)
						}
					}
					if p == 0 {
						copy(out, part)
						continue
					}
					for j, x := range part {
						out[j] += x
					}
				}
			}
		})
	})
}

// rankSum computes out[i] = Σ_r in[r·n + i] over R vectors side by side (the ranks'
// gathered gradients, or the output projection's row parts), in order, for out F32[n] and
// in F32[R·n], on s. out must not alias in.
func rankSum(s *device.Stream, out, in *device.Tensor, R int) error {
	if err := out.CheckShape(s, "rankSum out", device.F32, -1); err != nil {
		return err
	}
	n := out.Len()
	if err := in.CheckShape(s, "rankSum in", device.F32, R*n); err != nil {
		return err
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_rank_sum", device.D1(max(min((n+threads-1)/threads, 8192), 1)), 0, out, in, int64(n), int32(R))
	}
	return s.EnqueueCPU(func() {
		ov, iv := device.Slice[float32](out), device.Slice[float32](in)
		par.For(n, 1<<14, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				var sum float32
				for r := range R {
					sum += iv[r*n+i]
				}
				ov[i] = sum
			}
		})
	})
}

// statsAdd adds a step's routing statistics to the running ones: acc[e] += load[e] for
// acc I64[E+1] and load I32[E], and acc[E] += dropped[0] for dropped I32[1] (nil: none),
// on s.
func statsAdd(s *device.Stream, acc, load, dropped *device.Tensor) error {
	if err := load.CheckShape(s, "statsAdd load", device.I32, -1); err != nil {
		return err
	}
	E := load.Len()
	if err := acc.CheckShape(s, "statsAdd acc", device.I64, E+1); err != nil {
		return err
	}
	if dropped != nil {
		if err := dropped.CheckShape(s, "statsAdd dropped", device.I32, 1); err != nil {
			return err
		}
	}
	if s.Device().IsCUDA() {
		return launch(s, "tr_stats_add", device.D1(1), 0, acc, load, dropped, int32(E))
	}
	return s.EnqueueCPU(func() {
		av, lv := device.Slice[int64](acc), device.Slice[int32](load)
		for e, n := range lv {
			av[e] += int64(n)
		}
		if dropped != nil {
			av[E] += int64(device.Slice[int32](dropped)[0])
		}
	})
}
