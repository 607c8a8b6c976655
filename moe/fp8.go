package moe

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// The FP8 expert GEMMs (see Precision). Without Config.EP, Forward quantizes x's T rows
// and gathers each token's quantized row to its expert rows (gatherX) for W1's GEMM,
// instead of permuting x in bf16 and quantizing the T·K expert rows: K times less
// quantization and half the bytes moved; it keeps no permuted x for Backward, which
// permutes x again where the weight gradient of W1 needs it. SwiGLU writes its output a
// already quantized (swigluFP8): rowwise for W2's GEMM, freed after it, and columnwise
// in the experts' groups, transposed, which the layer keeps for W2's weight gradient
// instead of a in bf16 (ActSwiGLU: its codes and its scales, two tensors, offloaded or
// recomputed from h by the same kernel). Each incoming gradient of Backward, dyp and
// dh, is quantized once for its two GEMMs: rowwise and columnwise (in the experts'
// groups, transposed) from one pass, before its input gradient, and freed after its
// weight gradient (see experts.newGrad); without Config.EP dyp's pass computes it as it
// reads it, from dy and the routing weights, and the columnwise form of the permuted x
// for W1's weight gradient is quantized from x through the permutation (grad_fp8.go),
// so that neither is written in the activations' dtype (dh could be too, from h and da,
// but that ran slower than SwiGLU's gradient pass and a quantization of dh). With
// Config.EP, x's T rows are quantized rowwise and dispatched in FP8 (dispatchFP8), kept
// so for Backward (ActPermuted: codes and scales), and W1's weight gradient quantizes
// their dequantized values columnwise (fp8RowsSource). Every other activation operand
// (with Config.EP the combine's gradient too) is quantized by its own pass right before
// its GEMM, from the tensor the layer has, and freed after it. Future work: keeping
// ActWi and ActWo in FP8.

// The quantizations of the operands: rowwise for the forwards and input gradients;
// columnwise, transposed, in the experts' groups for the weight gradients, with dir
// Both for a gradient that both its GEMMs read (see experts.newGrad).
var (
	blockRows = quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32, Dir: quant.Rowwise}
	mxRows    = quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: quant.Rowwise}
)

func blockCols(sizes *device.Tensor, dir quant.Direction) quant.BlockOptions {
	return quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32, Dir: dir, GroupSizes: sizes}
}

func mxCols(sizes *device.Tensor, dir quant.Direction) quant.Options {
	return quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: dir, Transpose: true, GroupSizes: sizes}
}

// fp8Weights are W1 and W2 quantized in both orientations for an FP8 precision: the
// Layer's cache.
type fp8Weights struct {
	w1, w2 *device.Tensor // the parameters they were quantized from
	s      *device.Stream // the stream of the last call that read them, where they are freed
	b1, b2 *quant.BlockwiseWeights
	m1, m2 *quant.MXFP8Weights
}

// free releases q's tensors in stream order on the stream of their last use.
func (q *fp8Weights) free() error {
	var ts []*device.Tensor
	for _, b := range []*quant.BlockwiseWeights{q.b1, q.b2} {
		if b != nil {
			ts = append(ts, b.KMajor, b.NMajor, b.Scales)
		}
	}
	for _, m := range []*quant.MXFP8Weights{q.m1, q.m2} {
		if m != nil {
			ts = append(ts, m.KMajor, m.KScale, m.NMajor, m.NScale)
		}
	}
	return freeOn(q.s, ts...)
}

// InvalidateWeights drops the layer's quantized copies of W1 and W2, freeing them in
// stream order on the stream of the last call that read them; the next Forward
// quantizes the weights again. It does nothing for PrecisionBF16.
//
// An FP8 layer (Config.Precision PrecisionBlockwise or PrecisionMXFP8) quantizes W1 and
// W2 at its first Forward and reuses the copies, in Forward and Backward, for as long
// as Params.W1 and Params.W2 are the same tensors: it cannot see their contents change.
// After every change of W1 or W2 in place, such as each optimizer step or loading a
// checkpoint, call InvalidateWeights before the next Forward; otherwise that Forward
// and its Backward silently compute with the old weights. (Passing other tensors as W1
// or W2 quantizes them anew without it.) Call it also to release the copies when done
// with the layer. It must not run while a call of the layer is in progress on another
// goroutine, nor before the work that read the copies has been ordered on their stream.
func (l *Layer) InvalidateWeights() error {
	if l == nil {
		return errors.New("moe: Layer.InvalidateWeights: nil Layer")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dropWeights()
}

// dropWeights frees the cached weights; l.mu is held.
func (l *Layer) dropWeights() error {
	if l.q == nil {
		return nil
	}
	err := l.q.free()
	l.q = nil
	return err
}

// weights returns W1 and W2 of p quantized for the layer's FP8 precision, on s: the
// cached copies when they are of p's tensors, else new ones, quantized on s, which
// replace them. It returns nil for PrecisionBF16.
func (l *Layer) weights(s *device.Stream, p *Params) (*fp8Weights, error) {
	c := l.cfg
	if !c.Precision.fp8() {
		return nil, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if q := l.q; q != nil && q.w1 == p.W1 && q.w2 == p.W2 {
		q.s = s
		return q, nil
	}
	if err := l.dropWeights(); err != nil {
		return nil, err
	}
	q := &fp8Weights{w1: p.W1, w2: p.W2, s: s}
	nk := c.Layout == gemm.NK
	var err error
	switch c.Precision {
	case PrecisionBlockwise:
		opt := quant.BlockOptions{Format: quant.E4M3, Scale: quant.ScaleF32, NK: nk}
		if q.b1, err = quant.QuantizeWeights(s, p.W1, opt); err == nil {
			q.b2, err = quant.QuantizeWeights(s, p.W2, opt)
		}
	case PrecisionMXFP8:
		opt := quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, NK: nk}
		if q.m1, err = quant.QuantizeMXFP8Weights(s, p.W1, opt); err == nil {
			q.m2, err = quant.QuantizeMXFP8Weights(s, p.W2, opt)
		}
	}
	if err != nil {
		q.free()
		return nil, fmt.Errorf("moe: Layer: quantizing W1 and W2 (%v): %w", c.Precision, err)
	}
	l.q = q
	return q, nil
}

// experts runs the routed experts' GEMMs of one Forward or Backward, on s, in the
// layer's precision, over the expert rows of act.
type experts struct {
	s       *device.Stream
	cfg     Config
	p       *Params
	q       *fp8Weights    // W1 and W2 quantized (FP8 precisions)
	act     *Activations   // the rows: act.counts, act.rows, act.Perm or act.Layout
	tmp     *device.Temps  // where colGroups allocates
	sizes   *device.Tensor // colGroups' sizes, once made
	colRow  int            // colGroups' rows
	twoPass bool           // Layer.gradTwoPass
	layer   *Layer         // whose trace marks the backward's quantizations and GEMMs (nil: none)
	weight  string         // the weight of the backward's GEMMs, w1 or w2, in the marks
}

// mark marks the end of a stage of the backward's work through e.weight on the layer's
// trace.
func (e *experts) mark(stage string) {
	if e.layer != nil {
		e.layer.mark(e.s, e.weight+"_"+stage)
	}
}

// experts returns the GEMMs of act's rows on s, with the weights of act.p (quantized
// now unless cached); tmp holds what colGroups allocates (the groups of the weight
// gradients' and the fused SwiGLU's columnwise forms).
func (l *Layer) experts(s *device.Stream, act *Activations, tmp *device.Temps) (*experts, error) {
	q, err := l.weights(s, act.p)
	if err != nil {
		return nil, err
	}
	return &experts{s: s, cfg: l.cfg, p: act.p, q: q, act: act, tmp: tmp, twoPass: l.gradTwoPass, layer: l}, nil
}

// fp8Rows is an operand quantized in the layer's FP8 recipe: the form of that recipe is
// set (b for PrecisionBlockwise, m for PrecisionMXFP8), the other nil.
type fp8Rows struct {
	b *quant.Blockwise
	m *quant.MXFP8
}

func (q fp8Rows) free() error { return errors.Join(q.b.Free(), q.m.Free()) }

// rows returns the rows q quantizes.
func (q fp8Rows) rows() int {
	if q.b != nil {
		return q.b.M
	}
	return q.m.M
}

// freeOn releases q's tensors in stream order on s.
func (q fp8Rows) freeOn(s *device.Stream) error { return errors.Join(q.b.FreeOn(s), q.m.FreeOn(s)) }

// dropRows frees q's rowwise form, keeping the columnwise one.
func (q fp8Rows) dropRows() error {
	if q.b != nil {
		return q.b.DropRows()
	}
	return q.m.DropRows()
}

// form returns where q holds the codes and the scales of its rowwise form (rows) or of
// its columnwise one (ColT and its scales); nil pointers for an empty q.
func (q fp8Rows) form(rows bool) (codes, scales **device.Tensor) {
	switch {
	case q.b != nil && rows:
		return &q.b.Row, &q.b.RowScale
	case q.b != nil:
		return &q.b.ColT, &q.b.ColTScale
	case q.m != nil && rows:
		return &q.m.Row, &q.m.RowScale
	case q.m != nil:
		return &q.m.ColT, &q.m.ColScale
	}
	return nil, nil
}

// detach returns the codes and scales of q's rowwise form (rows) or columnwise one,
// which the caller now owns (the slots of a kept activation), and leaves q without
// them: q keeps its layout, tables and Status, and takes them back with set for a GEMM.
func (q fp8Rows) detach(rows bool) (codes, scales *device.Tensor) {
	c, sc := q.form(rows)
	if c == nil {
		return nil, nil
	}
	codes, scales = *c, *sc
	*c, *sc = nil, nil
	return codes, scales
}

// set sets the codes and scales of q's rowwise form (rows) or columnwise one.
func (q fp8Rows) set(rows bool, codes, scales *device.Tensor) {
	if c, sc := q.form(rows); c != nil {
		*c, *sc = codes, scales
	}
}

// The forms' two kinds: the rowwise form of the dispatched rows, the columnwise one of
// SwiGLU's output.
func (q fp8Rows) detachCols() (codes, scales *device.Tensor) { return q.detach(false) }
func (q fp8Rows) setCols(codes, scales *device.Tensor)       { q.set(false, codes, scales) }
func (q fp8Rows) detachRows() (codes, scales *device.Tensor) { return q.detach(true) }
func (q fp8Rows) setRows(codes, scales *device.Tensor)       { q.set(true, codes, scales) }

// dispatchFP8 quantizes x[T,H] rowwise in the layer's recipe, its T rows, and dispatches
// the FP8 rows with their scales and the routing weights w (F32[T,TopK], or nil) over
// lay (ep's DispatchBlockwise or DispatchMXFP8), on s: bit for bit the rowwise
// quantization of the rows that a dispatch of x delivers, quantizing T rows instead of
// the Capacity expert rows and moving about half the bytes. It returns the Capacity
// rows, their weights (nil without w) and the rows of each local expert (the layout's).
// The during functions run while the rows move (ep's Overlap).
func (l *Layer) dispatchFP8(s *device.Stream, lay *ep.Layout, x, w *device.Tensor, during ...func() error) (q fp8Rows, weights, counts *device.Tensor, err error) {
	qx, err := quantizeFP8(s, l.cfg.Precision, x, blockRows, mxRows)
	if err != nil {
		return fp8Rows{}, nil, nil, err
	}
	if qx.b != nil {
		var d *ep.DispatchedBlockwise
		if d, err = lay.DispatchBlockwise(s, qx.b, w, during...); err == nil {
			q.b, weights, counts = d.X, d.Weights, d.Counts
		}
	} else {
		var d *ep.DispatchedMXFP8
		if d, err = lay.DispatchMXFP8(s, qx.m, w, during...); err == nil {
			q.m, weights, counts = d.X, d.Weights, d.Counts
		}
	}
	// The dispatch has read qx on s (its packing runs there).
	return q, weights, counts, errors.Join(err, qx.free())
}

// quantizeFP8 quantizes x on s in precision p's recipe, with bo (blockwise) or mo (MXFP8).
func quantizeFP8(s *device.Stream, p Precision, x *device.Tensor, bo quant.BlockOptions, mo quant.Options) (fp8Rows, error) {
	var q fp8Rows
	var err error
	if p == PrecisionBlockwise {
		q.b, err = quant.QuantizeBlockwise(s, x, bo)
	} else {
		q.m, err = quant.Quantize(s, x, mo)
	}
	return q, err
}

// gatherX quantizes x[T,H] rowwise, T rows instead of the T·K expert rows, and moves
// each token's codes and scales to its rows of p (quant's gathers), on s: bit for bit
// the rowwise quantization of the permuted rows (a row's blocks depend on the row
// alone; the unused rows are zero rows either way).
func (l *Layer) gatherX(s *device.Stream, x *device.Tensor, p *Permutation) (fp8Rows, error) {
	qx, err := quantizeFP8(s, l.cfg.Precision, x, blockRows, mxRows)
	if err != nil {
		return fp8Rows{}, err
	}
	var q fp8Rows
	if qx.b != nil {
		q.b, err = quant.GatherBlockwise(s, qx.b, p.Source, p.TopK, p.Status)
	} else {
		q.m, err = quant.GatherMXFP8(s, qx.m, p.Source, p.TopK, p.Status)
	}
	return q, errors.Join(err, qx.free())
}

// swigluFP8 computes a[rows,F] = SwiGLU(h) over the rows of colGroups (rows past
// act.used zeros, as swiglu writes them) and quantizes it by the same pass, in the
// layer's recipe, into a new fp8Rows of dir: Both for Forward (the rowwise form for W2's
// GEMM, the columnwise one in colGroups' groups, transposed, for W2's weight gradient),
// Columnwise to rebuild the kept form. Bit for bit SwiGLU's output quantized: the same
// codes and scales as quantizing a by a pass per form (the rowwise ones as over all
// rows without groups, see newGrad), so that the layer's results are those of that path.
func (e *experts) swigluFP8(h *device.Tensor, dir quant.Direction) (fp8Rows, error) {
	sizes, rows, err := e.colGroups()
	if err != nil {
		return fp8Rows{}, err
	}
	if h, err = h.Rows(0, rows); err != nil {
		return fp8Rows{}, err
	}
	F, used := e.cfg.FFN, e.act.used
	var q fp8Rows
	if e.cfg.Precision == PrecisionBlockwise {
		opt := blockCols(sizes, dir)
		if q.b, err = quant.AllocBlockwise(e.s, rows, F, opt); err == nil {
			err = swigluBlockwise("Layer SwiGLU", e.s, q.b, h, used, opt)
		}
	} else {
		opt := mxCols(sizes, dir)
		if q.m, err = quant.Alloc(e.s, rows, F, opt); err == nil {
			err = swigluMXFP8("Layer SwiGLU", e.s, q.m, h, used, opt)
		}
	}
	if err != nil {
		return fp8Rows{}, errors.Join(err, q.free())
	}
	return q, nil
}

// keptRows returns the first rows rows of y, a GEMM's output over fewer rows than its
// tensor's, and sets the rows past them to zeros, as the GEMM over all rows writes them.
func keptRows(s *device.Stream, y *device.Tensor, rows int) (*device.Tensor, error) {
	n := y.Dim(0)
	if rows >= n {
		return y, nil
	}
	rest, err := y.Rows(rows, n)
	if err == nil {
		err = device.Fill(s, rest, 0)
	}
	if err != nil {
		return nil, err
	}
	return y.Rows(0, rows)
}

// dotRows computes, for the rows of each expert, h[R,2F] = xp·W1, or with second
// yp[R,H] = a·W2, into y from the rows quantized rowwise in q; when q quantizes fewer
// rows than y's (swigluFP8's over the kept rows of Config.EP), the rows past them are
// zeros.
func (e *experts) dotRows(y *device.Tensor, q fp8Rows, second bool) error {
	y, err := keptRows(e.s, y, q.rows())
	if err != nil {
		return err
	}
	if q.b != nil {
		return gemm.RaggedDotBlockwise(e.s, y, q.b, pick(second, e.q.b1, e.q.b2), e.act.counts, nil)
	}
	return gemm.RaggedDotMXFP8(e.s, y, q.m, pick(second, e.q.m1, e.q.m2), e.act.counts, nil)
}

// dot computes, for the rows of each expert, h[R,2F] = xp·W1 (x = xp), or with second
// yp[R,H] = a·W2 (x = a), into y. An FP8 precision quantizes x rowwise first.
func (e *experts) dot(y, x *device.Tensor, second bool) error {
	if !e.cfg.Precision.fp8() {
		return gemm.RaggedDot(e.s, y, x, pick(second, e.p.W1, e.p.W2), e.act.counts, &gemm.Options{Layout: e.cfg.Layout})
	}
	q, err := quantizeFP8(e.s, e.cfg.Precision, x, blockRows, mxRows)
	if err != nil {
		return err
	}
	return errors.Join(e.dotRows(y, q, second), q.free())
}

// operand is an operand of the experts' GEMMs other than the weights: a tensor t in
// the activations' dtype; for an FP8 layer also src, the source of such a tensor that
// its quantizations compute as they read it (see rowsSource), or, for the SwiGLU output
// the layer keeps quantized, q, its columnwise form.
type operand struct {
	t   *device.Tensor
	src rowsSource
	q   fp8Rows
}

// backward computes the gradients through one of the experts' GEMMs from its incoming
// gradient dy: with second, da[R,F] = dyp·W2ᵀ into dx and dW2 = aᵀ·dyp into dw
// (dy = dyp, x = a), else dxp[R,H] = dh·W1ᵀ and dW1 = xpᵀ·dh (dy = dh, x = xp). dw nil
// skips the weight gradient; otherwise x comes from getX, called once the input
// gradient is enqueued, and the weight gradient is added to dw with acc. An FP8
// precision quantizes dy (its tensor, or its source) once for both GEMMs (see newGrad)
// and frees it after them.
func (e *experts) backward(dx, dw *device.Tensor, dy operand, getX func() (operand, error), acc, second bool) error {
	wgrad, err := e.backwardSplit(dx, dw, dy, getX, acc, second)
	if err != nil {
		return err
	}
	return wgrad()
}

// backwardSplit is backward in two parts: it enqueues dy's quantization and the input
// gradient now and returns the rest, the weight gradient (nothing when dw is nil) and the
// release of dy's quantized forms, for the caller to enqueue later, once: the caller
// must call it also when it fails in between, to free them.
func (e *experts) backwardSplit(dx, dw *device.Tensor, dy operand, getX func() (operand, error), acc, second bool) (func() error, error) {
	dir := quant.Rowwise
	if dw != nil && !e.twoPass {
		dir = quant.Both
	}
	e.weight = pick(second, "w1", "w2")
	q, err := e.newGrad(dy, dir)
	if err != nil {
		return nil, err
	}
	e.mark("grad_quant")
	if err := e.inputGrad(dx, q, second); err != nil {
		return nil, errors.Join(err, q.free())
	}
	e.mark("dx")
	return func() error {
		var err error
		if dw != nil {
			var x operand
			if x, err = getX(); err == nil {
				err = e.weightGrad(dw, x, q, acc)
			}
			e.mark("dw")
		}
		return errors.Join(err, q.free())
	}, nil
}

// grad is an incoming gradient of Backward, dyp or dh, as its GEMMs read it: its tensor
// with PrecisionBF16; with an FP8 precision its tensor or its source (x) quantized by
// newGrad.
type grad struct {
	x       operand
	dir     quant.Direction // the forms quantized
	rows    int             // the rows quantized: the first rows of x
	fp8Rows                 // x's forms (FP8 precisions; free releases them)
}

// newGrad returns dy [R,N], a tensor or (FP8 precisions) a source, as its GEMMs read it.
// An FP8 precision quantizes it now, by one pass, in the directions of dir: Rowwise, all R rows, for the input gradient
// alone; Columnwise, the rows of colGroups in its groups, transposed, for the weight
// gradient alone; Both, both forms over those rows and groups, for the two GEMMs.
//
// Both's rowwise form holds what Rowwise gives on the same rows: a rowwise block lies
// within a row, and quant quantizes each block from the source alone, so its codes
// and scale depend neither on the groups nor on the columnwise form made in the same
// pass. Only MXFP8 stores the scales elsewhere, in the scale rows of the tiles of the
// row's group (row r of group g at 128·P_g + r − start_g, P_g = Σ_{h<g}
// ceil(M_h/128)), where the input gradient's GEMM, given a grouped operand, finds
// them from the experts' counts. colGroups' sizes are those counts but for the last
// expert's, which takes a capacity layer's unused rows: every group starts at the same
// scale row either way, and the GEMM reads only the experts' rows.
func (e *experts) newGrad(dy operand, dir quant.Direction) (*grad, error) {
	q := &grad{x: dy, dir: dir, rows: e.act.rows}
	if dy.t != nil {
		q.rows = dy.t.Dim(0)
	}
	if !e.cfg.Precision.fp8() {
		return q, nil
	}
	bo, mo := blockRows, mxRows
	if dir != quant.Rowwise {
		sizes, rows, err := e.colGroups()
		if err != nil {
			return nil, err
		}
		q.rows, bo, mo = rows, blockCols(sizes, dir), mxCols(sizes, dir)
	}
	var err error
	if q.fp8Rows, err = e.quantize(dy, q.rows, bo, mo); err != nil {
		return nil, err
	}
	return q, nil
}

// inputGrad computes, for the rows of each expert, dxp[R,H] = dh·W1ᵀ (dy = dh), or with
// second da[R,F] = dyp·W2ᵀ (dy = dyp), into dx, from dy's rowwise form for an FP8
// precision. When that covers fewer rows than dx (the kept rows of Config.EP), the rows
// past them are zeros, as the GEMM over all rows writes them.
func (e *experts) inputGrad(dx *device.Tensor, dy *grad, second bool) error {
	s, counts := e.s, e.act.counts
	if !e.cfg.Precision.fp8() {
		return gemm.RaggedDotInputGrad(s, dx, dy.x.t, pick(second, e.p.W1, e.p.W2), counts, &gemm.Options{Layout: e.cfg.Layout})
	}
	dx, err := keptRows(s, dx, dy.rows)
	if err != nil {
		return err
	}
	if dy.b != nil {
		return gemm.RaggedDotBlockwiseInputGrad(s, dx, dy.b, pick(second, e.q.b1, e.q.b2), counts, nil)
	}
	return gemm.RaggedDotMXFP8InputGrad(s, dx, dy.m, pick(second, e.q.m1, e.q.m2), counts, nil)
}

// weightGrad computes dw[e] = x_eᵀ·dy_e for each expert e, dW1 from xp and dh or dW2
// from a and dyp, in the layer's layout, added to dw with acc. An FP8 precision reads
// x's columnwise form, kept (x.q) or quantized now, transposed, in blocks of tokens that
// restart at each expert (the groups of colGroups), and dy's columnwise form, made by
// its own pass when dy has none.
func (e *experts) weightGrad(dw *device.Tensor, x operand, dy *grad, acc bool) error {
	s := e.s
	o := &gemm.Options{Layout: e.cfg.Layout, Accumulate: acc}
	if !e.cfg.Precision.fp8() {
		return gemm.RaggedDotWeightGrad(s, dw, x.t, dy.x.t, e.act.counts, o)
	}
	if dy.dir == quant.Rowwise {
		c, err := e.newGrad(dy.x, quant.Columnwise)
		if err != nil {
			return err
		}
		defer c.free()
		dy = c
		e.mark("grad_quant")
	}
	qx, own := x.q, x.q.b == nil && x.q.m == nil
	if own {
		sizes, rows, err := e.colGroups()
		if err != nil {
			return err
		}
		if qx, err = e.quantize(x, rows, blockCols(sizes, quant.Columnwise), mxCols(sizes, quant.Columnwise)); err != nil {
			return err
		}
		e.mark("x_quant")
	}
	var err error
	if qx.b != nil {
		err = gemm.RaggedDotBlockwiseWeightGrad(s, dw, qx.b, dy.b, e.act.counts, o)
	} else {
		err = gemm.RaggedDotMXFP8WeightGrad(s, dw, qx.m, dy.m, e.act.counts, o)
	}
	if own {
		err = errors.Join(err, qx.free())
	}
	return err
}

// colGroups returns the groups of the weight gradients' columnwise quantizations, which
// need sizes that sum to the rows they quantize: the first rows rows of the expert-row
// tensors, in groups of sizes (I32[E]). With Config.EP those are the kept rows (rows
// past them are not written) and the experts' counts. Without it they are all R rows
// and the counts with the unused rows [Offsets[E], R) added to the last expert's: those
// rows are zeros in every tensor a weight gradient reads (the permutation, SwiGLU and
// their gradients zero them). The GEMM still gets the experts' counts: an expert's
// blocks start at the same token column either way (128·Σ ceil(size/128) over the
// experts before it), its rows' codes and scales are the same (zeros change no amax),
// and the GEMM reads only the blocks of its rows, leaving the unused ones alone.
func (e *experts) colGroups() (*device.Tensor, int, error) {
	if e.sizes != nil {
		return e.sizes, e.colRow, nil
	}
	act := e.act
	if act.Layout != nil {
		e.sizes, e.colRow = act.counts, e.colRows()
		return e.sizes, e.colRow, nil
	}
	if e.tmp == nil {
		return nil, 0, errors.New("moe: internal error: columnwise groups without temporaries")
	}
	sizes := e.tmp.Alloc(device.I32, act.Perm.Experts)
	if err := e.tmp.Err(); err != nil {
		return nil, 0, err
	}
	if err := padSizes(e.s, sizes, act.Perm); err != nil {
		return nil, 0, err
	}
	e.sizes, e.colRow = sizes, e.colRows()
	return sizes, e.colRow, nil
}

// colRows returns the rows of colGroups: with Config.EP the kept rows, else all.
func (e *experts) colRows() int {
	if e.act.Layout != nil {
		return e.act.Layout.Rows()
	}
	return e.act.Perm.Rows
}

// padSizes writes into out, I32[E], the sizes of groups that cover all p.Rows rows of
// p's expert rows: p.Counts, with the unused rows [Offsets[E], Rows) added to the last
// expert's, on s.
func padSizes(s *device.Stream, out *device.Tensor, p *Permutation) error {
	E := p.Experts
	if s.Device().IsCUDA() {
		return launch(s, sortProg, "dl_moe_pad_sizes", device.D1(1), device.D1(blockFor(E)), 0,
			out, p.Counts, p.Offsets, int32(E), int32(p.Rows))
	}
	return s.EnqueueCPU(func() {
		o, off := device.Slice[int32](out), device.Slice[int32](p.Offsets)
		copy(o, device.Slice[int32](p.Counts))
		o[E-1] = int32(p.Rows) - off[E-1]
	})
}

// pick returns a, or b when second.
func pick[T any](second bool, a, b T) T {
	if second {
		return b
	}
	return a
}
