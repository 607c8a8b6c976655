package main

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/moe"
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
	case c.Vocab < 2:
		return fmt.Errorf("vocabulary of %d tokens, want ≥ 2", c.Vocab)
	case c.Window < 1:
		return fmt.Errorf("-window %d, want ≥ 1", c.Window)
	case c.Hidden < 1:
		return fmt.Errorf("-hidden %d, want ≥ 1", c.Hidden)
	case c.Layers < 1:
		return fmt.Errorf("-layers %d, want ≥ 1", c.Layers)
	case c.CapacityFactor < 0:
		return fmt.Errorf("capacity factor %v, want ≥ 0", c.CapacityFactor)
	}
	_, err := moe.NewLayer(c.layerConfig())
	return err
}

func (c ModelConfig) layerConfig() moe.Config {
	return moe.Config{
		Hidden: c.Hidden, FFN: c.FFN, SharedFFN: c.SharedFFN, CapacityFactor: c.CapacityFactor,
		Router: moe.RouterConfig{Experts: c.Experts, TopK: c.TopK, Renormalize: true, AuxLoss: c.AuxLoss},
	}
}

// Model is a window language model: the sum of position-specific embeddings of the
// previous W tokens, L pre-norm residual blocks h += MoE(rmsnorm(h)), and a linear
// output over the vocabulary after a last rmsnorm. All tensors are F32 on one device
// and every op is enqueued on the model's stream.
type Model struct {
	Config ModelConfig
	Step   int // optimizer steps taken

	s      *device.Stream
	layers []*moe.Layer
	params []*param
	emb    *param // [W·V, H]
	out    *param // [1, H, V]: one group for gemm.RaggedDot
	moeP   []*moe.Params
	moeG   []*moe.Grads
	ws     *workspace
}

// param is a parameter with its gradient and AdamW moments, all F32 of one shape.
type param struct {
	name       string
	shape      []int
	decay      bool // weight decay applies
	w, g, m, v *device.Tensor
}

// workspace holds the activations of a batch of B rows.
type workspace struct {
	B                 int
	tok               *device.Tensor   // I32 [B, W+1]: context, then target
	sizes             *device.Tensor   // I32 [1] = {B}: the one group of the dense products
	h, xn, rstd       []*device.Tensor // L+1 each: block inputs, their norms, 1/rms
	y                 *device.Tensor   // [B, H]: a block's MoE output
	logits, dlogits   *device.Tensor   // [B, V]
	dh, dxn           *device.Tensor   // [B, H]
	trainLoss, evLoss *device.Tensor   // [B]: per-row loss sums
}

// newModel returns a model of cfg on d with parameters drawn from seed.
func newModel(d *device.Device, cfg ModelConfig, seed uint64) (*Model, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m := &Model{Config: cfg, s: d.Stream()}
	V, W, H, F, Fs, E := cfg.Vocab, cfg.Window, cfg.Hidden, cfg.FFN, cfg.SharedFFN, cfg.Experts
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	normal := func(std float64) func(int) float32 {
		return func(int) float32 { return float32(r.NormFloat64() * std) }
	}
	zero := func(int) float32 { return 0 }
	newParam := func(name string, decay bool, init func(int) float32, shape ...int) (*param, error) {
		p := &param{name: name, shape: shape, decay: decay}
		n := 1
		for _, v := range shape {
			n *= v
		}
		vals := make([]float32, n)
		for i := range vals {
			vals[i] = init(i)
		}
		var err error
		if p.w, err = device.FromFloat32(m.s, device.F32, vals, shape...); err != nil {
			return nil, err
		}
		for _, t := range []**device.Tensor{&p.g, &p.m, &p.v} {
			if *t, err = m.s.Alloc(device.F32, shape...); err != nil {
				return nil, err
			}
			if err := device.Fill(m.s, *t, 0); err != nil {
				return nil, err
			}
		}
		m.params = append(m.params, p)
		return p, nil
	}
	var err error
	if m.emb, err = newParam("embed", false, normal(1/math.Sqrt(float64(W))), W*V, H); err != nil {
		return nil, m.freeAfter(err)
	}
	residual := 1 / math.Sqrt(float64(2*cfg.Layers))
	for l := range cfg.Layers {
		lay, err := moe.NewLayer(cfg.layerConfig())
		if err != nil {
			return nil, m.freeAfter(err)
		}
		m.layers = append(m.layers, lay)
		pre := fmt.Sprintf("layer%d.", l)
		var ps [5]*param
		for i, spec := range []struct {
			name  string
			std   float64
			shape []int
		}{
			{"router", 1 / math.Sqrt(float64(H)), []int{E, H}},
			{"w1", 1 / math.Sqrt(float64(H)), []int{E, H, 2 * F}},
			{"w2", residual / math.Sqrt(float64(F)), []int{E, F, H}},
			{"shared_w1", 1 / math.Sqrt(float64(H)), []int{H, 2 * Fs}},
			{"shared_w2", residual / math.Sqrt(float64(max(Fs, 1))), []int{Fs, H}},
		} {
			if i >= 3 && Fs == 0 {
				break
			}
			if ps[i], err = newParam(pre+spec.name, true, normal(spec.std), spec.shape...); err != nil {
				return nil, m.freeAfter(err)
			}
		}
		mp := &moe.Params{Router: ps[0].w, W1: ps[1].w, W2: ps[2].w}
		mg := &moe.Grads{Router: ps[0].g, W1: ps[1].g, W2: ps[2].g}
		if Fs > 0 {
			mp.SharedW1, mp.SharedW2 = ps[3].w, ps[4].w
			mg.SharedW1, mg.SharedW2 = ps[3].g, ps[4].g
		}
		m.moeP = append(m.moeP, mp)
		m.moeG = append(m.moeG, mg)
	}
	// A zero output layer: the first prediction is uniform, with a loss of ln V.
	if m.out, err = newParam("out", true, zero, 1, H, V); err != nil {
		return nil, m.freeAfter(err)
	}
	return m, nil
}

func (m *Model) freeAfter(err error) error {
	return errors.Join(err, m.Free())
}

// Free releases the model's tensors.
func (m *Model) Free() error {
	var errs []error
	for _, p := range m.params {
		for _, t := range []*device.Tensor{p.w, p.g, p.m, p.v} {
			if t != nil {
				errs = append(errs, t.Free())
			}
		}
	}
	m.params = nil
	errs = append(errs, m.freeWorkspace())
	return errors.Join(errs...)
}

func (m *Model) freeWorkspace() error {
	ws := m.ws
	if ws == nil {
		return nil
	}
	m.ws = nil
	ts := []*device.Tensor{ws.tok, ws.sizes, ws.y, ws.logits, ws.dlogits, ws.dh, ws.dxn, ws.trainLoss, ws.evLoss}
	ts = append(append(append(ts, ws.h...), ws.xn...), ws.rstd...)
	var errs []error
	for _, t := range ts {
		if t != nil {
			errs = append(errs, t.Free())
		}
	}
	return errors.Join(errs...)
}

// workspace returns the activations for batches of B rows, allocating them at the
// first call or when B changes.
func (m *Model) workspace(B int) (*workspace, error) {
	if m.ws != nil && m.ws.B == B {
		return m.ws, nil
	}
	if err := m.freeWorkspace(); err != nil {
		return nil, err
	}
	c := m.Config
	ws := &workspace{B: B}
	m.ws = ws
	s := m.s
	// The tensors belong to ws: freeWorkspace frees them, also after a failure here.
	ts := device.NewTemps(s)
	ws.tok = ts.Alloc(device.I32, B, c.Window+1)
	ws.sizes = ts.Alloc(device.I32, 1)
	for range c.Layers + 1 {
		ws.h = append(ws.h, ts.Alloc(device.F32, B, c.Hidden))
		ws.xn = append(ws.xn, ts.Alloc(device.F32, B, c.Hidden))
		ws.rstd = append(ws.rstd, ts.Alloc(device.F32, B))
	}
	ws.y = ts.Alloc(device.F32, B, c.Hidden)
	ws.logits = ts.Alloc(device.F32, B, c.Vocab)
	ws.dlogits = ts.Alloc(device.F32, B, c.Vocab)
	ws.dh = ts.Alloc(device.F32, B, c.Hidden)
	ws.dxn = ts.Alloc(device.F32, B, c.Hidden)
	ws.trainLoss = ts.Alloc(device.F32, B)
	ws.evLoss = ts.Alloc(device.F32, B)
	err := ts.Err()
	if err == nil {
		err = device.Upload(s, ws.sizes, []int32{int32(B)})
	}
	for _, t := range []*device.Tensor{ws.trainLoss, ws.evLoss} {
		if err == nil {
			err = device.Fill(s, t, 0)
		}
	}
	if err != nil {
		return nil, m.freeAfterWS(err)
	}
	return ws, nil
}

func (m *Model) freeAfterWS(err error) error { return errors.Join(err, m.freeWorkspace()) }

// forward runs the model on the batch in ws.tok and adds each row's loss to loss; with
// grad it also writes dlogits, the gradient of the batch's mean loss. It returns the
// MoE layers' activations (to free, or to pass to backward).
func (m *Model) forward(ws *workspace, loss *device.Tensor, grad bool) ([]*moe.Activations, error) {
	s, c := m.s, m.Config
	acts := make([]*moe.Activations, 0, c.Layers)
	fail := func(err error) ([]*moe.Activations, error) {
		for _, a := range acts {
			err = errors.Join(err, a.Free())
		}
		return nil, err
	}
	if err := embedForward(s, ws.h[0], m.emb.w, ws.tok, c.Window, c.Vocab); err != nil {
		return fail(err)
	}
	for l, lay := range m.layers {
		if err := rmsForward(s, ws.xn[l], ws.rstd[l], ws.h[l]); err != nil {
			return fail(err)
		}
		act, err := lay.Forward(s, ws.y, ws.xn[l], m.moeP[l])
		if err != nil {
			return fail(err)
		}
		acts = append(acts, act)
		if err := add(s, ws.h[l+1], ws.h[l], ws.y); err != nil {
			return fail(err)
		}
	}
	L := c.Layers
	if err := rmsForward(s, ws.xn[L], ws.rstd[L], ws.h[L]); err != nil {
		return fail(err)
	}
	if err := gemm.RaggedDot(s, ws.logits, ws.xn[L], m.out.w, ws.sizes, nil); err != nil {
		return fail(err)
	}
	var dlogits *device.Tensor
	if grad {
		dlogits = ws.dlogits
	}
	if err := softmaxCE(s, loss, dlogits, ws.logits, ws.tok, c.Window, 1/float32(ws.B)); err != nil {
		return fail(err)
	}
	return acts, nil
}

// backward computes every parameter's gradient from ws.dlogits and the activations of
// forward, and frees the activations.
func (m *Model) backward(ws *workspace, acts []*moe.Activations) error {
	s, c := m.s, m.Config
	L := c.Layers
	err := gemm.RaggedDotWeightGrad(s, m.out.g, ws.xn[L], ws.dlogits, ws.sizes, nil)
	if err == nil {
		err = gemm.RaggedDotInputGrad(s, ws.dxn, ws.dlogits, m.out.w, ws.sizes, nil)
	}
	if err == nil {
		err = rmsBackward(s, ws.dh, ws.dxn, ws.xn[L], ws.rstd[L], false)
	}
	// Block l: h[l+1] = h[l] + MoE(rmsnorm(h[l])), so dh[l] = dh[l+1] + rmsnorm'(MoE'(dh[l+1])).
	for l := L - 1; l >= 0 && err == nil; l-- {
		g := *m.moeG[l]
		g.X = ws.dxn
		err = m.layers[l].Backward(s, &g, ws.dh, acts[l])
		if err == nil {
			err = rmsBackward(s, ws.dh, ws.dxn, ws.xn[l], ws.rstd[l], true)
		}
	}
	if err == nil {
		err = embedBackward(s, m.emb.g, ws.dh, ws.tok, c.Window, c.Vocab)
	}
	for _, a := range acts {
		err = errors.Join(err, a.Free())
	}
	return err
}

// update applies one AdamW step with learning rate lr to every parameter; weight decay
// applies to all but the embeddings.
func (m *Model) update(h adamHyper, lr float64) error {
	m.Step++
	h.LR = lr
	for _, p := range m.params {
		wd := 0.0
		if p.decay {
			wd = h.WeightDecay
		}
		if err := adamw(m.s, p.w, p.g, p.m, p.v, h, wd, m.Step); err != nil {
			return err
		}
	}
	return nil
}

// trainStep runs forward, backward and an AdamW step on one batch (tok: B rows of W+1
// ids, context then target) and returns the MoE layers' routing statistics. The batch's
// loss is added to the running sum that takeTrainLoss returns.
func (m *Model) trainStep(tok []int32, h adamHyper, lr float64) ([]moe.Stats, error) {
	B := len(tok) / (m.Config.Window + 1)
	ws, err := m.workspace(B)
	if err != nil {
		return nil, err
	}
	if err := device.Upload(m.s, ws.tok, tok); err != nil {
		return nil, err
	}
	acts, err := m.forward(ws, ws.trainLoss, true)
	if err != nil {
		return nil, err
	}
	stats := make([]moe.Stats, len(acts))
	for l, a := range acts {
		if stats[l], err = a.Stats(m.s); err != nil {
			for _, a := range acts {
				a.Free()
			}
			return nil, err
		}
	}
	if err := m.backward(ws, acts); err != nil {
		return nil, err
	}
	return stats, m.update(h, lr)
}

// takeTrainLoss returns the sum of the row losses of the training steps since the last
// call, and clears it.
func (m *Model) takeTrainLoss() (float64, error) {
	if m.ws == nil {
		return 0, nil
	}
	return takeSum(m.s, m.ws.trainLoss)
}

func takeSum(s *device.Stream, t *device.Tensor) (float64, error) {
	v, err := t.Float32s(s)
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, x := range v {
		sum += float64(x)
	}
	return sum, device.Fill(s, t, 0)
}

// evalLoss returns the mean loss, in nats per token, over the batches (each B rows of
// W+1 ids), without changing the parameters.
func (m *Model) evalLoss(batches [][]int32) (float64, error) {
	rows := 0
	for _, tok := range batches {
		B := len(tok) / (m.Config.Window + 1)
		ws, err := m.workspace(B)
		if err != nil {
			return 0, err
		}
		if err := device.Upload(m.s, ws.tok, tok); err != nil {
			return 0, err
		}
		acts, err := m.forward(ws, ws.evLoss, false)
		if err != nil {
			return 0, err
		}
		for _, a := range acts {
			if err := a.Free(); err != nil {
				return 0, err
			}
		}
		rows += B
	}
	if rows == 0 {
		return math.NaN(), nil
	}
	sum, err := takeSum(m.s, m.ws.evLoss)
	return sum / float64(rows), err
}
