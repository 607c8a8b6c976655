package main

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/offload"
)

// ModelConfig is the shape of the model. It is saved in checkpoints.
type ModelConfig struct {
	Vocab     int     // V: token ids are [0, V)
	Window    int     // W: tokens of context
	Hidden    int     // H: model width
	FFN       int     // F: each expert's intermediate width
	SharedFFN int     // intermediate width of a shared expert per layer; 0: none
	Experts   int     // E: experts per layer
	TopK      int     // K: experts per token
	Layers    int     // L: MoE blocks
	AuxLoss   float32 // coefficient of the load-balancing loss
	// CapacityFactor > 0 makes every MoE layer a capacity layer that drops the
	// assignments past ⌈factor·T·K/E⌉ per expert; 0 is dropless.
	CapacityFactor float64
}

func (c ModelConfig) validate() error {
	switch {
	case c.Vocab < 2 || c.Vocab > maxVocab:
		return fmt.Errorf("vocabulary of %d tokens, want 2 to %d", c.Vocab, maxVocab)
	case c.Window < 1:
		return fmt.Errorf("-window %d, want ≥ 1", c.Window)
	case c.Hidden < 1:
		return fmt.Errorf("-hidden %d, want ≥ 1", c.Hidden)
	case c.Layers < 1:
		return fmt.Errorf("-layers %d, want ≥ 1", c.Layers)
	case c.CapacityFactor < 0:
		return fmt.Errorf("capacity factor %v, want ≥ 0", c.CapacityFactor)
	}
	_, err := moe.NewLayer(c.layerConfig(nil, nil, moe.PrecisionBF16))
	return err
}

// validatePrecision reports whether the MoE layers of c can run in precision p (c being
// valid): FP8 precisions need -hidden and -ffn multiples of 16.
func (c ModelConfig) validatePrecision(p moe.Precision) error {
	if err := c.layerConfig(nil, nil, p).Validate(); err != nil {
		return fmt.Errorf("-precision %s with -hidden %d and -ffn %d: %w", precisionName(p), c.Hidden, c.FFN, err)
	}
	return nil
}

// layerConfig returns the configuration of the MoE layers, whose expert GEMMs run in
// precision p: expert-parallel over g when g is not nil, offloading to off when it is
// not. Over R ranks the group applies the capacity, and the load-balancing loss is over
// the global batch: each rank's layer computes its share of it (its tokens' part of P_e,
// f_e from the loads of all ranks), and the shares' gradients, summed over the ranks
// with the other replicated parameters', are those of -ep 1.
func (c ModelConfig) layerConfig(g *ep.Group, off *offload.Offloader, p moe.Precision) moe.Config {
	cf := c.CapacityFactor
	if g != nil {
		cf = 0
	}
	return moe.Config{
		Hidden: c.Hidden, FFN: c.FFN, SharedFFN: c.SharedFFN, CapacityFactor: cf,
		Router:    moe.RouterConfig{Experts: c.Experts, TopK: c.TopK, Renormalize: true, AuxLoss: c.AuxLoss},
		Precision: p, EP: g, Offload: off,
	}
}

// epConfig returns the expert-parallel configuration of the layers: dropless, or with
// CapacityFactor the group's Factor capacity per rank, dropping the rows past it.
func (c ModelConfig) epConfig() ep.Config {
	cfg := ep.Config{Experts: c.Experts, TopK: c.TopK}
	if c.CapacityFactor > 0 {
		cfg.Capacity, cfg.Overflow = ep.Factor(c.CapacityFactor), ep.DropOverflow
	}
	return cfg
}

// modelOptions say how a Model is trained, beside its shape.
type modelOptions struct {
	DType   device.DType // compute dtype of the MoE layers and the output projection: F32 or BF16
	Moments device.DType // dtype of AdamW's moments: F32 (also the zero value) or BF16
	// Grads is the dtype of the experts' weight gradients, which the MoE layers' weight
	// gradients write (their f32 sums rounded once) and AdamW reads: F32 (also the zero
	// value) or BF16. The other parameters' gradients, summed over the ranks, stay F32.
	Grads device.DType
	// Precision is the arithmetic of the MoE layers' expert GEMMs: moe.PrecisionBF16
	// (the zero value: in the compute dtype) or an FP8 recipe, whose layers cache their
	// W1 and W2 quantized until the model invalidates them (after each AdamW step).
	Precision moe.Precision
	Stream    *device.Stream     // the stream of every op but the embedding gradient's grouping and the experts' AdamW steps, on a second stream the model makes (nil: the device's default stream)
	Dist      *dist              // the ranks training the model together (nil: one)
	Offload   *offload.Offloader // where the MoE layers' activations go during training (nil: nowhere)
}

// Model is a window language model: the sum of position-specific embeddings of the
// previous W tokens, L pre-norm residual blocks h += MoE(rmsnorm(h)), and a linear
// output over the vocabulary after a last rmsnorm. Parameters and their gradients are
// F32 (the experts' gradients F32 or BF16, modelOptions.Grads), AdamW's moments F32 or
// BF16 (modelOptions.Moments); with a BF16 compute dtype the MoE layers and the output
// projection read BF16 copies of their weights, which AdamW refreshes; with an FP8 precision (modelOptions.Precision) the MoE layers quantize their
// experts' weights anew after each step. Every op is enqueued on the model's stream but
// two kinds, which go to a second stream that the model's stream waits for before the
// step ends: the embedding gradient's grouping of the batch's rows by token, at the start
// of the step (beside the forward), and the AdamW steps of the experts' weights, W2's and
// W1's each as soon as its layer's backward is done with it (moe.Grads' W2Ready and
// W1Ready). Over R ranks each holds E/R experts of every layer and a replica of every
// other parameter, whose gradients it sums with the other ranks'.
type Model struct {
	Config ModelConfig
	Step   int // optimizer steps taken

	s          *device.Stream
	dt         device.DType
	moments    device.DType  // of AdamW's moments
	grads      device.DType  // of the experts' weight gradients
	prec       moe.Precision // of the expert GEMMs
	dist       *dist
	groups     []*ep.Group // one per layer over R > 1 ranks
	layers     []*moe.Layer
	evalLayers []*moe.Layer // the layers without offloading
	off        *offload.Offloader
	params     []*param
	emb        *param // [W·V, H]
	out        *param // [1, H, V]: one group for gemm.RaggedDot
	moeP       []*moe.Params
	moeG       []*moe.Grads
	mem        *device.Temps   // the parameters' tensors
	dpGrad     *device.Tensor  // F32: the gradients of the replicated parameters, back to back (each at a multiple of gradAlign)
	dpRecv     *device.Tensor  // F32[R·len(dpGrad)]: the ranks' gradients, gathered (R > 1)
	adam       *adamTable      // the parameters but the experts'
	adamW1     []*adamTable    // each layer's experts' W1, stepped on side as soon as the layer's backward is done with it
	adamW2     []*adamTable    // each layer's experts' W2, likewise
	side       *device.Stream  // the embedding gradient's grouping and the experts' AdamW steps, beside s
	evBatch    *device.Event   // the step's batch on the device, on s: side's grouping waits for it
	evGroup    *device.Event   // the step's grouping done (on side, or on s with serialSide): the embedding's sums wait for it
	evW1       []*device.Event // each layer's backward done with W1, on s (moe.Grads.W1Ready)
	evW2       []*device.Event // and with W2 (moe.Grads.W2Ready)
	evSide     *device.Event   // side's work done
	serialSide bool            // the side stream's work on s instead, in order: the grouping before the forward, the experts' AdamW at the end (tests compare)
	stats      *device.Tensor  // I64[L, E+1]: each layer's load per expert, then dropped assignments
	epDropped  []int64         // rows each layer dropped for capacity (expert-parallel), since takeStats
	ws         *workspace
	tl         *stepMarks // where the step's stages are marked (nil: nowhere)
}

// param is a parameter with its gradient, F32 (an expert weight's of the model's expert
// gradient dtype), and AdamW moments, of the model's moment dtype, all of one shape, and
// the BF16 copy the compute reads when the compute dtype is BF16.
type param struct {
	name       string
	shape      []int // this rank's
	full       []int // over all ranks: experts are split along the first dimension
	decay      bool  // weight decay applies
	expert     bool  // split over the ranks
	w, g, m, v *device.Tensor
	c          *device.Tensor // BF16 copy of w, or nil
}

// cw returns the weights the compute reads: the BF16 copy, else w.
func (p *param) cw() *device.Tensor {
	if p.c != nil {
		return p.c
	}
	return p.w
}

// workspace holds the activations of a batch of B rows (on this rank).
type workspace struct {
	B                 int
	mem               *device.Temps
	sizes             *device.Tensor   // I32 [1] = {B}: the one group of the dense products
	h, xn, rstd       []*device.Tensor // L+1 each: block inputs (F32), their norms (compute dtype), 1/rms
	y                 *device.Tensor   // [B, H]: a block's MoE output
	logits            *device.Tensor   // F32 [B, V]
	dlogits           *device.Tensor   // [B, V]
	dh                *device.Tensor   // F32 [B, H]: gradient of the residual stream
	dhc               *device.Tensor   // its copy in the compute dtype (nil for F32: dh itself)
	dxn               *device.Tensor   // [B, H]: gradient of a norm's output
	perm, offs        *device.Tensor   // I32 [W, B], [W, V+1]: the embedding gradient's grouping (Model.groupEmbed)
	grouped           bool             // groupEmbed enqueued the grouping of the batch being trained, which backward's sums read (and clear)
	outSizes          *device.Tensor   // I32 [P]: the row parts of the output projection's weight gradient (nil for P = 1)
	outParts          *device.Tensor   // F32 [P, H, V]: each part's weight gradient, summed into out.g
	evTok             *device.Tensor   // I32 [B, W+1]: a held-out batch
	trainLoss, evLoss *device.Tensor   // F32 [B]: per-row loss sums
}

// initSpec describes a parameter: its name, shape over all ranks and initialization.
type initSpec struct {
	name    string
	std     float64 // of the normal initialization; 0: zeros
	full    []int
	decay   bool
	expert  bool
	compute bool // read by the compute: a BF16 copy when the compute dtype is BF16
	layer   int  // the MoE block it belongs to, -1 for none
}

func (c ModelConfig) specs() []initSpec {
	V, W, H, F, Fs, E := c.Vocab, c.Window, c.Hidden, c.FFN, c.SharedFFN, c.Experts
	specs := []initSpec{{name: "embed", std: 1 / math.Sqrt(float64(W)), full: []int{W * V, H}, layer: -1}}
	residual := 1 / math.Sqrt(float64(2*c.Layers))
	for l := range c.Layers {
		pre := fmt.Sprintf("layer%d.", l)
		specs = append(specs,
			initSpec{pre + "router", 1 / math.Sqrt(float64(H)), []int{E, H}, true, false, false, l},
			initSpec{pre + "w1", 1 / math.Sqrt(float64(H)), []int{E, H, 2 * F}, true, true, true, l},
			initSpec{pre + "w2", residual / math.Sqrt(float64(F)), []int{E, F, H}, true, true, true, l})
		if Fs > 0 {
			specs = append(specs,
				initSpec{pre + "shared_w1", 1 / math.Sqrt(float64(H)), []int{H, 2 * Fs}, true, false, true, l},
				initSpec{pre + "shared_w2", residual / math.Sqrt(float64(Fs)), []int{Fs, H}, true, false, true, l})
		}
	}
	// A zero output layer: the first prediction is uniform, with a loss of ln V.
	return append(specs, initSpec{name: "out", full: []int{1, H, V}, decay: true, compute: true, layer: -1})
}

// newModel returns a model of cfg with parameters drawn from seed (the same on every
// rank, each keeping its experts), trained as o says.
func newModel(d *device.Device, cfg ModelConfig, seed uint64, o modelOptions) (*Model, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := cfg.validatePrecision(o.Precision); err != nil {
		return nil, err
	}
	if err := computeType("compute dtype", o.DType); err != nil {
		return nil, err
	}
	moments := o.Moments
	if moments == device.Invalid {
		moments = device.F32
	}
	if err := computeType("AdamW's moment dtype", moments); err != nil {
		return nil, err
	}
	grads := o.Grads
	if grads == device.Invalid {
		grads = device.F32
	}
	if err := computeType("the experts' gradient dtype", grads); err != nil {
		return nil, err
	}
	s := o.Stream
	if s == nil {
		s = d.Stream()
	}
	R, rank := o.Dist.Size(), o.Dist.Rank()
	if cfg.Experts%R != 0 {
		return nil, fmt.Errorf("-experts %d over %d ranks: want a multiple of the ranks", cfg.Experts, R)
	}
	m := &Model{Config: cfg, s: s, dt: o.DType, moments: moments, grads: grads, prec: o.Precision, dist: o.Dist, off: o.Offload, mem: device.NewTemps(s)}
	for range cfg.Layers {
		var g *ep.Group
		if R > 1 {
			var err error
			if g, err = ep.NewGroup(o.Dist.tr, cfg.epConfig()); err != nil {
				return nil, m.freeAfter(err)
			}
			m.groups = append(m.groups, g)
		}
		lay, err := moe.NewLayer(cfg.layerConfig(g, o.Offload, o.Precision))
		if err != nil {
			return nil, m.freeAfter(err)
		}
		m.layers = append(m.layers, lay)
		if o.Offload != nil {
			if lay, err = moe.NewLayer(cfg.layerConfig(g, nil, o.Precision)); err != nil {
				return nil, m.freeAfter(err)
			}
		}
		m.evalLayers = append(m.evalLayers, lay)
	}
	specs := cfg.specs()
	ndp := 0
	for _, sp := range specs {
		if !sp.expert {
			ndp += alignUp(numel(sp.full), gradAlign)
		}
	}
	m.dpGrad = m.mem.Alloc(device.F32, ndp)
	if R > 1 {
		m.dpRecv = m.mem.Alloc(device.F32, R*ndp)
	}
	m.stats = m.mem.Alloc(device.I64, cfg.Layers, cfg.Experts+1)
	m.epDropped = make([]int64, cfg.Layers)
	if err := m.mem.Err(); err != nil {
		return nil, m.freeAfter(err)
	}
	for _, t := range []*device.Tensor{m.dpGrad, m.stats} {
		if err := device.Fill(s, t, 0); err != nil {
			return nil, m.freeAfter(err)
		}
	}
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	dpOff := 0
	var adam []adamParam
	adamW1, adamW2 := make([][]adamParam, cfg.Layers), make([][]adamParam, cfg.Layers)
	for _, sp := range specs {
		p := &param{name: sp.name, full: sp.full, shape: append([]int(nil), sp.full...), decay: sp.decay, expert: sp.expert}
		vals := make([]float32, numel(sp.full))
		if sp.std > 0 {
			for i := range vals {
				vals[i] = float32(r.NormFloat64() * sp.std)
			}
		}
		if sp.expert {
			p.shape[0] /= R
			n := len(vals) / R
			vals = vals[rank*n : (rank+1)*n]
		}
		var err error
		if p.w, err = device.FromFloat32(s, device.F32, vals, p.shape...); err != nil {
			return nil, m.freeAfter(err)
		}
		m.mem.Add(p.w)
		if sp.expert {
			p.g = m.mem.Alloc(grads, p.shape...)
		} else if p.g, err = m.dpGrad.View(dpOff, p.shape...); err != nil {
			return nil, m.freeAfter(err)
		} else {
			dpOff += alignUp(len(vals), gradAlign)
		}
		p.m, p.v = m.mem.Alloc(moments, p.shape...), m.mem.Alloc(moments, p.shape...)
		if sp.compute && o.DType == device.BF16 {
			p.c = m.mem.Alloc(device.BF16, p.shape...)
		}
		if err := m.mem.Err(); err != nil {
			return nil, m.freeAfter(err)
		}
		for _, t := range []*device.Tensor{p.g, p.m, p.v} {
			if err := device.Fill(s, t, 0); err != nil {
				return nil, m.freeAfter(err)
			}
		}
		m.params = append(m.params, p)
		q := adamParam{name: p.name, p: p.w, g: p.g, m: p.m, v: p.v, c: p.c, decay: p.decay}
		switch {
		case sp.expert && strings.HasSuffix(sp.name, ".w2"):
			adamW2[sp.layer] = append(adamW2[sp.layer], q) // not summed over the ranks: stepped as soon as the layer's backward makes it
		case sp.expert:
			adamW1[sp.layer] = append(adamW1[sp.layer], q) // likewise
		default:
			adam = append(adam, q)
		}
	}
	if err := m.syncCompute(); err != nil {
		return nil, m.freeAfter(err)
	}
	var err error
	if m.adam, err = newAdamTable(s, adam); err != nil {
		return nil, m.freeAfter(err)
	}
	if m.side, err = d.NewStream(); err != nil {
		return nil, m.freeAfter(err)
	}
	for _, e := range []**device.Event{&m.evSide, &m.evBatch, &m.evGroup} {
		if *e, err = d.NewEvent(); err != nil {
			return nil, m.freeAfter(err)
		}
	}
	for l := range cfg.Layers {
		for _, c := range []struct {
			tabs *[]*adamTable
			ps   []adamParam
			evs  *[]*device.Event
		}{{&m.adamW1, adamW1[l], &m.evW1}, {&m.adamW2, adamW2[l], &m.evW2}} {
			t, err := newAdamTable(s, c.ps)
			if err != nil {
				return nil, m.freeAfter(err)
			}
			t.spread()
			*c.tabs = append(*c.tabs, t)
			e, err := d.NewEvent()
			if err != nil {
				return nil, m.freeAfter(err)
			}
			*c.evs = append(*c.evs, e)
		}
	}
	byName := map[string]*param{}
	for _, p := range m.params {
		byName[p.name] = p
	}
	m.emb, m.out = byName["embed"], byName["out"]
	for l := range cfg.Layers {
		pre := fmt.Sprintf("layer%d.", l)
		ps := func(name string) *param { return byName[pre+name] }
		mp := &moe.Params{Router: ps("router").w, W1: ps("w1").cw(), W2: ps("w2").cw()}
		mg := &moe.Grads{Router: ps("router").g, W1: ps("w1").g, W2: ps("w2").g, W2Ready: m.evW2[l], W1Ready: m.evW1[l]}
		if cfg.SharedFFN > 0 {
			mp.SharedW1, mp.SharedW2 = ps("shared_w1").cw(), ps("shared_w2").cw()
			mg.SharedW1, mg.SharedW2 = ps("shared_w1").g, ps("shared_w2").g
		}
		m.moeP = append(m.moeP, mp)
		m.moeG = append(m.moeG, mg)
	}
	return m, nil
}

// gradAlign is the alignment, in elements, of each replicated parameter's gradient in
// Model.dpGrad: 256 bytes, so that AdamW moves it 16 bytes at a time, as it does the
// parameter and its moments (allocations of their own); the elements between the
// gradients stay 0.
const gradAlign = 64

// alignUp returns n rounded up to a multiple of a.
func alignUp(n, a int) int { return (n + a - 1) / a * a }

func numel(shape []int) int {
	n := 1
	for _, v := range shape {
		n *= v
	}
	return n
}

// syncCompute sets the BF16 copies of the weights from the weights.
func (m *Model) syncCompute() error {
	for _, p := range m.params {
		if p.c != nil {
			if err := device.Cast(m.s, p.c, p.w); err != nil {
				return err
			}
		}
	}
	return nil
}

// invalidateWeights tells the MoE layers that their weights changed in place, after an
// AdamW step: an FP8 layer drops its quantized W1 and W2 and quantizes them
// again at its next Forward. Each layer of the model has a cache of its own, the
// evaluation layers too when they are other layers (with offloading).
func (m *Model) invalidateWeights() error {
	var errs []error
	for l, lay := range m.layers {
		errs = append(errs, lay.InvalidateWeights())
		if l < len(m.evalLayers) && m.evalLayers[l] != lay {
			errs = append(errs, m.evalLayers[l].InvalidateWeights())
		}
	}
	return errors.Join(errs...)
}

func (m *Model) freeAfter(err error) error {
	return errors.Join(err, m.Free())
}

// Free releases the model's tensors, the FP8 layers' quantized weights included, and
// closes its expert-parallel groups (together with the other ranks).
func (m *Model) Free() error {
	errs := []error{m.invalidateWeights(), m.adam.Free(), m.freeWorkspace()}
	if m.side != nil {
		errs = append(errs, m.side.Synchronize(), m.side.Close())
	}
	for _, tabs := range [][]*adamTable{m.adamW1, m.adamW2} {
		for _, t := range tabs {
			errs = append(errs, t.Free())
		}
	}
	for _, evs := range [][]*device.Event{m.evW1, m.evW2, {m.evSide, m.evBatch, m.evGroup}} {
		for _, e := range evs {
			if e != nil {
				errs = append(errs, e.Close())
			}
		}
	}
	errs = append(errs, m.mem.Free())
	for _, g := range m.groups {
		errs = append(errs, g.Close())
	}
	m.params, m.groups, m.adam, m.adamW1, m.side, m.evW1, m.evSide = nil, nil, nil, nil, nil, nil, nil
	m.evBatch, m.evGroup, m.adamW2, m.evW2 = nil, nil, nil, nil
	return errors.Join(errs...)
}

func (m *Model) freeWorkspace() error {
	ws := m.ws
	if ws == nil {
		return nil
	}
	m.ws = nil
	return ws.mem.Free()
}

// mark ends the stage called name of the step being timed, if any.
func (m *Model) mark(name string) error {
	if m.tl == nil {
		return nil
	}
	return m.tl.mark(m.s, name)
}

// paramCounts returns the number of parameters of the model that are not experts, and
// of those that are, over all ranks.
func (c ModelConfig) paramCounts() (dense, expert int) {
	for _, sp := range c.specs() {
		if sp.expert {
			expert += numel(sp.full)
		} else {
			dense += numel(sp.full)
		}
	}
	return dense, expert
}

// loadKernels compiles and loads on d, concurrently, the CUDA programs a step runs: the
// MoE layers' (moe.Layer.Load; all layers share one Config) and the example's own.
// Without it they compile one after another inside the first steps. On the CPU it does
// nothing.
func (m *Model) loadKernels(d *device.Device) error {
	own := make(chan error, 1)
	go func() { own <- d.Load(program) }()
	var err error
	if len(m.layers) > 0 {
		err = m.layers[0].Load(d, m.dt)
	}
	return errors.Join(err, <-own)
}
