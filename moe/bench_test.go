package moe

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// benchShape is the benchmark layer: DeepSeek-V3-like experts (H 7168, F 2048,
// E 32 of them per GPU, top-8) over 16384 tokens in bf16 on a GPU; a tiny one on the CPU.
func benchShape(d *device.Device) (cfg Config, T int) {
	if d.IsCUDA() {
		return Config{Hidden: 7168, FFN: 2048, Router: RouterConfig{Experts: 32, TopK: 8, Renormalize: true}}, 16384
	}
	return Config{Hidden: 64, FFN: 32, Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true}}, 256
}

// fillRandom fills t with N(0, scale²) values: a random block uploaded once and tiled.
func fillRandom(b *testing.B, s *device.Stream, t *device.Tensor, seed uint64, scale float32) {
	const block = 1 << 22
	n := min(t.Len(), block)
	src := up(b, s, t.DType(), dt.Normal(dt.Rand(seed), n, scale), n)
	defer src.Free()
	flat := dt.Must(t.Reshape(t.Len()))
	for off := 0; off < t.Len(); off += n {
		m := min(n, t.Len()-off)
		dt.NoErr(b, device.Copy(s, dt.Must(flat.View(off, m)), dt.Must(src.View(0, m))))
	}
}

// stageTimes records an event after each traced stage and sums the times per stage.
type stageTimes struct {
	d      *device.Device
	start  *device.Event
	events []*device.Event
	names  []string
	used   int
}

func (st *stageTimes) begin(s *device.Stream) {
	if st.start == nil {
		st.start = dt.Must(st.d.NewEvent())
	}
	st.start.Record(s)
	st.used = 0
}

func (st *stageTimes) trace(s *device.Stream, stage string) {
	if st.used == len(st.events) {
		st.events = append(st.events, dt.Must(st.d.NewEvent()))
		st.names = append(st.names, "")
	}
	st.events[st.used].Record(s)
	st.names[st.used] = stage
	st.used++
}

// add adds this pass's stage times to sums (after the stream finished).
func (st *stageTimes) add(sums map[string]time.Duration) {
	prev := st.start
	for i := range st.used {
		d, _ := st.events[i].Since(prev)
		sums[st.names[i]] += d
		prev = st.events[i]
	}
}

// TestTraceStages checks the stages a layer marks on its trace for BenchmarkLayer: the
// backward's GEMMs and quantizations named by their weight, in the order they run.
func TestTraceStages(t *testing.T) {
	cfg := Config{Hidden: 32, FFN: 16, Router: RouterConfig{Experts: 4, TopK: 2, Renormalize: true}}
	r := dt.Rand(840)
	base := newRef(r, cfg, 24, false, device.BF16, device.F32)
	gy := randn(r, device.BF16, 24*cfg.Hidden, 1)
	for _, tc := range []struct {
		prec Precision
		want []string
	}{
		{PrecisionBF16, []string{"w2_grad_quant", "w2_dx", "w2_dw", "w1_grad_quant", "w1_dx", "w1_dw"}},
		// W1's weight gradient quantizes x's permuted rows (with the default fused parts).
		{PrecisionBlockwise, []string{"w2_grad_quant", "w2_dx", "w2_dw", "w1_grad_quant", "w1_dx", "w1_x_quant", "w1_dw"}},
	} {
		t.Run(tc.prec.String(), func(t *testing.T) {
			l := withPrecision(base, tc.prec)
			var got []string
			l.trace = func(_ *device.Stream, stage string) {
				if strings.HasPrefix(stage, "w1_") || strings.HasPrefix(stage, "w2_") {
					got = append(got, stage)
				}
			}
			runLayer(t, device.CPU(), l, device.BF16, device.F32, gy)
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("the backward's stages (-want +got):\n%s", diff)
			}
		})
	}
}

// BenchmarkLayer times the layer's forward and forward+backward passes in each precision
// (the sub-benchmarks' names end in /bf16, /blockwise and /mxfp8) and, in the same run,
// its grouped GEMMs alone: the same ragged_dot calls on the same tensors, or for an FP8
// precision the same FP8 GEMMs on operands quantized once beforehand. An FP8 pass starts
// with InvalidateWeights, as after an optimizer step, so that it includes quantizing W1
// and W2; the stage breakdown reports that as weights_ms. Metrics: ms per pass, the
// expert GEMMs' TFLOP/s over the pass (bf16's FLOP count in every precision),
// gemm_alone_ms and gemm_alone_TFLOP/s, layer/gemm (the pass over the GEMMs alone; the
// target is ≤ 1.15 in bf16; an FP8 pass adds the quantizations) and the time of each
// stage within the pass (_ms): the forward's GEMMs are gemm_ms, the backward's are
// w2_dx, w2_dw, w1_dx and w1_dw, beside the quantizations of their incoming gradients
// (w2_grad_quant, w1_grad_quant: with the fused SwiGLU gradient, its computation too)
// and of W1's weight gradient's x (w1_x_quant) where it has none kept.
func BenchmarkLayer(b *testing.B) {
	for _, d := range dt.Devices(b) {
		cfg, T := benchShape(d)
		typ := device.BF16
		s := d.Stream()
		H, F, E, K := cfg.Hidden, cfg.FFN, cfg.Router.Experts, cfg.Router.TopK
		x := dt.Must(s.Alloc(typ, T, H))
		p := &Params{Router: dt.Must(s.Alloc(typ, E, H)), W1: dt.Must(s.Alloc(typ, E, H, 2*F)), W2: dt.Must(s.Alloc(typ, E, F, H))}
		g := &Grads{X: dt.Must(s.Alloc(typ, T, H)), Router: dt.Must(s.Alloc(device.F32, E, H)),
			W1: dt.Must(s.Alloc(typ, E, H, 2*F)), W2: dt.Must(s.Alloc(typ, E, F, H))}
		y, dy := dt.Must(s.Alloc(typ, T, H)), dt.Must(s.Alloc(typ, T, H))
		fillRandom(b, s, x, 1, 1)
		fillRandom(b, s, dy, 2, 1)
		fillRandom(b, s, p.Router, 3, 0.02)
		fillRandom(b, s, p.W1, 4, 0.02)
		fillRandom(b, s, p.W2, 5, 0.02)
		flops := 6 * float64(T) * float64(K) * float64(H) * float64(F) // expert GEMMs, forward
		for _, pass := range []string{"forward", "forward_backward"} {
			bwd := pass == "forward_backward"
			// The precisions, and for the backward blockwise with other parts of it fused
			// (Layer.fusedGrad; "fused_" and the parts, or "unfused").
			type variant struct {
				prec  Precision
				fused gradParts
			}
			variants := []variant{{PrecisionBF16, defaultFusedGrad}, {PrecisionBlockwise, defaultFusedGrad}, {PrecisionMXFP8, defaultFusedGrad}}
			if bwd {
				for _, f := range []gradParts{0, gradDyp, gradDh, gradXp, allGradParts} {
					if f != defaultFusedGrad {
						variants = append(variants, variant{PrecisionBlockwise, f})
					}
				}
			}
			for _, v := range variants {
				prec := v.prec
				c := cfg
				c.Precision = prec
				lay := dt.Must(NewLayer(c))
				lay.fusedGrad = v.fused
				name := prec.String()
				if v.fused != defaultFusedGrad {
					name += "_" + v.fused.String()
				}
				b.Run(fmt.Sprintf("%v/%s/T=%d,H=%d,F=%d,E=%d,K=%d/%s", d, pass, T, H, F, E, K, name), func(b *testing.B) {
					st := &stageTimes{d: d}
					sums := map[string]time.Duration{}
					step := func(traced bool) {
						if traced {
							lay.trace = st.trace
							st.begin(s)
						}
						if prec.fp8() {
							// As after an optimizer step: W1 and W2 are quantized again.
							dt.NoErr(b, lay.InvalidateWeights())
							if traced {
								dt.Must(lay.weights(s, p))
								st.trace(s, "weights")
							}
						}
						act := dt.Must(lay.Forward(s, y, x, p))
						if bwd {
							dt.NoErr(b, lay.Backward(s, g, dy, act))
						}
						lay.trace = nil
						dt.NoErr(b, act.Free())
					}
					step(false) // compile the kernels, warm the pool
					dt.NoErr(b, s.Synchronize())
					b.ResetTimer()
					t0 := time.Now()
					for range b.N {
						step(false)
					}
					dt.NoErr(b, s.Synchronize())
					layer := time.Since(t0) / time.Duration(b.N)
					b.StopTimer()
					// Stage breakdown: traced passes, timed by events on the stream.
					const traced = 3
					for range traced {
						step(true)
						dt.NoErr(b, s.Synchronize())
						st.add(sums)
					}
					gemms := timeGEMMs(b, lay, s, x, p, g, dy, bwd, b.N)
					f := flops
					if bwd {
						f *= 3
					}
					b.ReportMetric(float64(layer)/1e6, "ms")
					b.ReportMetric(f/layer.Seconds()/1e12, "TFLOP/s")
					b.ReportMetric(float64(gemms)/1e6, "gemm_alone_ms")
					b.ReportMetric(f/gemms.Seconds()/1e12, "gemm_alone_TFLOP/s")
					b.ReportMetric(float64(layer)/float64(gemms), "layer/gemm")
					names := make([]string, 0, len(sums))
					for n := range sums {
						names = append(names, n)
					}
					sort.Strings(names)
					for _, n := range names {
						b.ReportMetric(float64(sums[n])/traced/1e6, n+"_ms")
					}
				})
				dt.NoErr(b, lay.InvalidateWeights())
			}
		}
		for _, t := range []*device.Tensor{x, y, dy, p.Router, p.W1, p.W2, g.X, g.Router, g.W1, g.W2} {
			t.Free()
		}
	}
}

// timeGEMMs returns the time of the layer's ragged_dot calls alone (forward: 2;
// with bwd: 6), on the activations of one forward pass, averaged over n repetitions: in
// an FP8 precision those of fp8GEMMs.
func timeGEMMs(b *testing.B, lay *Layer, s *device.Stream, x *device.Tensor, p *Params, g *Grads, dy *device.Tensor, bwd bool, n int) time.Duration {
	y := dt.Must(s.Alloc(x.DType(), x.Dim(0), x.Dim(1)))
	defer y.Free()
	act := dt.Must(lay.Forward(s, y, x, p))
	defer act.Free()
	R, H, F := act.rows, lay.cfg.Hidden, lay.cfg.FFN
	typ := x.DType()
	var tmp []*device.Tensor
	mk := func(shape ...int) *device.Tensor {
		t := dt.Must(s.Alloc(typ, shape...))
		tmp = append(tmp, t)
		return t
	}
	dyp, da, dh, dxp := mk(R, H), mk(R, F), mk(R, 2*F), mk(R, H)
	defer func() { device.FreeAll(tmp...) }()
	// Gradients of a realistic size: the forward's own outputs stand in for them.
	dt.NoErr(b, device.Copy(s, dyp, act.yp.t))
	dt.NoErr(b, device.Copy(s, dh, act.h.t))
	counts := act.counts
	o := lay.gemmOpt(false)
	run := func() {
		dt.NoErr(b, gemm.RaggedDot(s, act.h.t, act.xp.t, p.W1, counts, o))
		dt.NoErr(b, gemm.RaggedDot(s, act.yp.t, act.a.t, p.W2, counts, o))
		if bwd {
			dt.NoErr(b, gemm.RaggedDotInputGrad(s, da, dyp, p.W2, counts, o))
			dt.NoErr(b, gemm.RaggedDotWeightGrad(s, g.W2, act.a.t, dyp, counts, o))
			dt.NoErr(b, gemm.RaggedDotInputGrad(s, dxp, dh, p.W1, counts, o))
			dt.NoErr(b, gemm.RaggedDotWeightGrad(s, g.W1, act.xp.t, dh, counts, o))
		}
	}
	if lay.cfg.Precision.fp8() {
		xp := act.xp.t
		if xp == nil {
			// The FP8 layer keeps no permuted x (see gatherX): the GEMMs get their own.
			xp = mk(R, H)
			dt.NoErr(b, Permute(s, xp, x, act.Perm))
		}
		// Nor a in bf16 (SwiGLU quantizes it as it computes it): the GEMMs quantize their own.
		a := mk(R, F)
		dt.NoErr(b, swiglu(s, a, act.h.t, act.used))
		var free func()
		run, free = fp8GEMMs(b, lay, s, act, xp, a, g, dyp, da, dh, dxp, bwd)
		defer free()
	}
	run()
	dt.NoErr(b, s.Synchronize())
	t0 := time.Now()
	for range n {
		run()
	}
	dt.NoErr(b, s.Synchronize())
	return time.Since(t0) / time.Duration(n)
}

// fp8GEMMs returns the FP8 GEMMs of an FP8 layer's pass on the rows of act, the
// permuted input xp and the SwiGLU output a (forward: 2; with bwd: 6) as Forward and
// Backward call them, with the gradients dyp and dh, their operands quantized once,
// now, as the layer quantizes them, and the weights the layer cached; and the function
// that frees those operands.
func fp8GEMMs(b *testing.B, lay *Layer, s *device.Stream, act *Activations, xp, a *device.Tensor, g *Grads, dyp, da, dh, dxp *device.Tensor, bwd bool) (run, free func()) {
	q := dt.Must(lay.weights(s, act.p))
	ts := device.NewTemps(s)
	var frees []func() error
	free = func() {
		for _, f := range frees {
			dt.NoErr(b, f())
		}
		dt.NoErr(b, ts.Free())
	}
	o := lay.gemmOpt(false)
	// The weight gradients' operands: columnwise, in the groups the layer uses.
	var sizes *device.Tensor
	cols := func(t *device.Tensor) *device.Tensor { return t }
	if bwd {
		var rows int
		var err error
		sizes, rows, err = dt.Must(lay.experts(s, act, ts)).colGroups()
		dt.NoErr(b, err)
		cols = func(t *device.Tensor) *device.Tensor { return dt.Must(t.Rows(0, rows)) }
	}
	if lay.cfg.Precision == PrecisionBlockwise {
		r := fp8Recipe[*quant.Blockwise, *quant.BlockwiseWeights, quant.BlockOptions]{
			quantize: quant.QuantizeBlockwise, rows: blockRows, cols: blockCols,
			fwd: gemm.RaggedDotBlockwise, dgrad: gemm.RaggedDotBlockwiseInputGrad, wgrad: gemm.RaggedDotBlockwiseWeightGrad,
			w1: q.b1, w2: q.b2,
		}
		return r.gemms(b, s, act, xp, a, g, dyp, da, dh, dxp, sizes, cols, o, &frees, bwd), free
	}
	r := fp8Recipe[*quant.MXFP8, *quant.MXFP8Weights, quant.Options]{
		quantize: quant.Quantize, rows: mxRows, cols: mxCols,
		fwd: gemm.RaggedDotMXFP8, dgrad: gemm.RaggedDotMXFP8InputGrad, wgrad: gemm.RaggedDotMXFP8WeightGrad,
		w1: q.m1, w2: q.m2,
	}
	return r.gemms(b, s, act, xp, a, g, dyp, da, dh, dxp, sizes, cols, o, &frees, bwd), free
}

// fp8Recipe is one FP8 recipe's quantization and GEMMs, for fp8GEMMs: operands Q of
// quantization options O, weights W.
type fp8Recipe[Q interface{ Free() error }, W, O any] struct {
	quantize   func(*device.Stream, *device.Tensor, O) (Q, error)
	rows       O
	cols       func(sizes *device.Tensor, dir quant.Direction) O
	fwd, dgrad func(*device.Stream, *device.Tensor, Q, W, *device.Tensor, *gemm.Options) error
	wgrad      func(*device.Stream, *device.Tensor, Q, Q, *device.Tensor, *gemm.Options) error
	w1, w2     W
}

// gemms quantizes the operands of the pass once, now (adding their frees to frees),
// and returns the pass's GEMMs on them; colRows cuts an operand or result of the
// backward to the rows the weight gradients' groups cover.
func (r fp8Recipe[Q, W, O]) gemms(b *testing.B, s *device.Stream, act *Activations, xp, a *device.Tensor, g *Grads, dyp, da, dh, dxp, sizes *device.Tensor,
	colRows func(*device.Tensor) *device.Tensor, o *gemm.Options, frees *[]func() error, bwd bool) func() {
	qz := func(t *device.Tensor, opt O) Q {
		qt := dt.Must(r.quantize(s, t, opt))
		*frees = append(*frees, qt.Free)
		return qt
	}
	counts := act.counts
	qxp, qa := qz(xp, r.rows), qz(a, r.rows)
	var qdyp, qdh, cxp, ca Q
	if bwd {
		// The gradients in both directions from one pass, over the rows of the groups.
		c, both := r.cols(sizes, quant.Columnwise), r.cols(sizes, quant.Both)
		qdyp, qdh = qz(colRows(dyp), both), qz(colRows(dh), both)
		cxp, ca = qz(colRows(xp), c), qz(colRows(a), c)
		da, dxp = colRows(da), colRows(dxp)
	}
	return func() {
		dt.NoErr(b, r.fwd(s, act.h.t, qxp, r.w1, counts, nil))
		dt.NoErr(b, r.fwd(s, act.yp.t, qa, r.w2, counts, nil))
		if bwd {
			dt.NoErr(b, r.dgrad(s, da, qdyp, r.w2, counts, nil))
			dt.NoErr(b, r.wgrad(s, g.W2, ca, qdyp, counts, o))
			dt.NoErr(b, r.dgrad(s, dxp, qdh, r.w1, counts, nil))
			dt.NoErr(b, r.wgrad(s, g.W1, cxp, qdh, counts, o))
		}
	}
}
