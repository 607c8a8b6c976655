package main

import (
	"errors"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/moe"
)

// workspace returns the activations for batches of B rows, allocating them at the
// first call or when B changes.
func (m *Model) workspace(B int) (*workspace, error) {
	if m.ws != nil && m.ws.B == B {
		return m.ws, nil
	}
	if err := m.freeWorkspace(); err != nil {
		return nil, err
	}
	c, s, dt := m.Config, m.s, m.dt
	ts := device.NewTemps(s)
	ws := &workspace{B: B, mem: ts}
	m.ws = ws // freeWorkspace frees its tensors, also after a failure here
	ws.sizes = ts.Alloc(device.I32, 1)
	for range c.Layers + 1 {
		ws.h = append(ws.h, ts.Alloc(device.F32, B, c.Hidden))
		ws.xn = append(ws.xn, ts.Alloc(dt, B, c.Hidden))
		ws.rstd = append(ws.rstd, ts.Alloc(device.F32, B))
	}
	ws.y = ts.Alloc(dt, B, c.Hidden)
	ws.logits = ts.Alloc(device.F32, B, c.Vocab)
	ws.dlogits = ts.Alloc(dt, B, c.Vocab)
	ws.dh = ts.Alloc(device.F32, B, c.Hidden)
	if dt != device.F32 {
		ws.dhc = ts.Alloc(dt, B, c.Hidden)
	}
	ws.dxn = ts.Alloc(dt, B, c.Hidden)
	ws.perm = ts.Alloc(device.I32, c.Window, B)
	ws.offs = ts.Alloc(device.I32, c.Window, c.Vocab+1)
	ws.evTok = ts.Alloc(device.I32, B, c.Window+1)
	P := outSplit(B, c.Hidden, c.Vocab)
	if P > 1 {
		ws.outSizes = ts.Alloc(device.I32, P)
		ws.outParts = ts.Alloc(device.F32, P, c.Hidden, c.Vocab)
	}
	ws.trainLoss = ts.Alloc(device.F32, B)
	ws.evLoss = ts.Alloc(device.F32, B)
	err := ts.Err()
	if err == nil {
		err = device.Upload(s, ws.sizes, []int32{int32(B)})
	}
	if err == nil && P > 1 {
		parts := make([]int32, P)
		for i := range parts {
			parts[i] = int32(B/P + min(max(B%P-i, 0), 1)) // the first B mod P parts a row longer
		}
		err = device.Upload(s, ws.outSizes, parts)
	}
	for _, t := range []*device.Tensor{ws.trainLoss, ws.evLoss} {
		if err == nil {
			err = device.Fill(s, t, 0)
		}
	}
	if err != nil {
		return nil, errors.Join(err, m.freeWorkspace())
	}
	return ws, nil
}

// forward runs the model through layers on the batch tok (I32 [B, W+1]: context, then
// target) and adds each row's loss to loss; with grad it also writes dlogits, the
// gradient of the mean loss over the global batch (B rows on each rank). It returns the
// MoE layers' activations (to free, or to pass to backward).
func (m *Model) forward(ws *workspace, tok, loss *device.Tensor, grad bool, layers []*moe.Layer) ([]*moe.Activations, error) {
	s, c := m.s, m.Config
	acts := make([]*moe.Activations, 0, c.Layers)
	fail := func(err error) ([]*moe.Activations, error) {
		for _, a := range acts {
			err = errors.Join(err, a.Free())
		}
		return nil, err
	}
	if err := embedNorm(s, ws.h[0], ws.xn[0], ws.rstd[0], m.emb.w, tok, c.Window, c.Vocab); err != nil {
		return fail(err)
	}
	if err := m.mark(stageEmbed); err != nil {
		return fail(err)
	}
	for l, lay := range layers {
		act, err := lay.Forward(s, ws.y, ws.xn[l], m.moeP[l])
		if err != nil {
			return fail(err)
		}
		acts = append(acts, act)
		if err := m.mark(layerStage(l, stageMoEFwd)); err != nil {
			return fail(err)
		}
		if err := addNorm(s, ws.h[l+1], ws.xn[l+1], ws.rstd[l+1], ws.h[l], ws.y); err != nil {
			return fail(err)
		}
		if err := m.mark(layerStage(l, stageAddNorm)); err != nil {
			return fail(err)
		}
	}
	L := c.Layers
	if err := gemm.RaggedDot(s, ws.logits, ws.xn[L], m.out.cw(), ws.sizes, nil); err != nil {
		return fail(err)
	}
	var dlogits *device.Tensor
	if grad {
		dlogits = ws.dlogits
	}
	scale := 1 / float32(ws.B*m.dist.Size())
	if err := softmaxCE(s, loss, dlogits, ws.logits, tok, c.Window, scale); err != nil {
		return fail(err)
	}
	if err := m.mark(stageOutput); err != nil {
		return fail(err)
	}
	return acts, nil
}

// backward computes every parameter's gradient from ws.dlogits and the activations of
// forward on a batch that groupEmbed grouped into ws.perm and ws.offs (the embedding's
// sums wait for m.evGroup on the model's stream), and frees the activations. Over several
// ranks the gradients of the replicated parameters are this rank's share; sumGrads adds
// the ranks' shares.
func (m *Model) backward(ws *workspace, acts []*moe.Activations, layerDone func(l int) error) error {
	s, c := m.s, m.Config
	L := c.Layers
	var err error
	if !ws.grouped {
		err = errors.New("backward: the batch's rows were not grouped for the embedding's gradient (groupEmbed)")
	}
	if err == nil {
		err = m.outputWeightGrad(ws)
	}
	if err == nil {
		err = gemm.RaggedDotInputGrad(s, ws.dxn, ws.dlogits, m.out.cw(), ws.sizes, nil)
	}
	if err == nil {
		err = normBackward(s, ws.dh, ws.dhc, ws.dxn, ws.h[L], ws.rstd[L], false, false)
	}
	if err == nil {
		err = m.mark(stageOutputBwd)
	}
	// Block l: h[l+1] = h[l] + MoE(rmsnorm(h[l])), so dh[l] = dh[l+1] + rmsnorm'(MoE'(dh[l+1])).
	for l := L - 1; l >= 0 && err == nil; l-- {
		g := *m.moeG[l]
		g.X = ws.dxn
		dy := ws.dh
		if ws.dhc != nil {
			dy = ws.dhc
		}
		err = m.layers[l].Backward(s, &g, dy, acts[l])
		if err == nil {
			err = m.mark(layerStage(l, stageMoEBwd))
		}
		if err == nil && layerDone != nil {
			err = layerDone(l)
		}
		if err == nil {
			// The compute copy at l = 0 too: the embedding's gradient reads it, and only it
			// when there is one (copyOnly: dh's f32 is not written).
			err = normBackward(s, ws.dh, ws.dhc, ws.dxn, ws.h[l], ws.rstd[l], true, l == 0 && ws.dhc != nil)
		}
		if err == nil {
			err = m.mark(layerStage(l, stageNormBwd))
		}
	}
	if err == nil {
		err = s.Wait(m.evGroup)
	}
	if err == nil {
		dh := ws.dh
		if ws.dhc != nil {
			dh = ws.dhc
		}
		err = embedBackward(s, m.emb.g, dh, ws.perm, ws.offs, c.Window, c.Vocab)
		ws.grouped = false
	}
	if err == nil {
		err = m.mark(stageEmbedBwd)
	}
	for _, a := range acts {
		err = errors.Join(err, a.Free())
	}
	return err
}

// outSplit returns the row parts P of the output projection's weight gradient at a batch
// of B rows and an H×V projection: up to 8, of at least 1,024 rows each, while P times
// the product's 128×128 tiles stay within 132 (the multiprocessors of an H100 or H200).
// The H×V output is a few tiles of the weight-gradient kernel (16 at H=1024, V=256), so
// one product over all B rows keeps a few multiprocessors busy with long sums; P products
// over B/P rows each keep P times as many, and their sum costs a pass over P·H·V floats.
// The partition depends on the shapes alone, the same on every device.
func outSplit(B, H, V int) int {
	tiles := max(((H+127)/128)*((V+127)/128), 1)
	return max(min(B/1024, 8, 132/tiles), 1)
}

// outputWeightGrad writes the output projection's weight gradient out.g = xnᵀ·dlogits
// over the batch: as P = outSplit(B, H, V) products over consecutive parts of the rows
// (one ragged_dot weight gradient of P groups), summed in part order.
func (m *Model) outputWeightGrad(ws *workspace) error {
	s, L := m.s, m.Config.Layers
	if ws.outParts == nil {
		return gemm.RaggedDotWeightGrad(s, m.out.g, ws.xn[L], ws.dlogits, ws.sizes, nil)
	}
	if err := gemm.RaggedDotWeightGrad(s, ws.outParts, ws.xn[L], ws.dlogits, ws.outSizes, nil); err != nil {
		return err
	}
	g, err := m.out.g.Reshape(m.out.g.Len())
	if err != nil {
		return err
	}
	parts, err := ws.outParts.Reshape(ws.outParts.Len())
	if err != nil {
		return err
	}
	return rankSum(s, g, parts, ws.outSizes.Len())
}

// sumGrads replaces the gradients of the replicated parameters by their sum over the
// ranks (each rank's share is of the mean over the global batch, so the sum is the mean
// of the ranks' mean-loss gradients): an all-gather through the ranks' transport, then a
// sum in rank order, the same on every rank.
func (m *Model) sumGrads() error {
	R := m.dist.Size()
	if R == 1 {
		return nil
	}
	if err := m.dist.tr.AllGather(m.s, m.dpGrad, m.dpRecv); err != nil {
		return err
	}
	if err := rankSum(m.s, m.dpGrad, m.dpRecv, R); err != nil {
		return err
	}
	return m.mark(stageGradSum)
}

// trainStep runs forward, backward and an AdamW step with learning rate lr on the batch
// tok (I32 [B, W+1]: context, then target), enqueued on the model's stream (the embedding
// gradient's grouping of tok and the experts' AdamW steps on its side stream, which the
// model's stream waits for at the end) without waiting for the device (but for the count
// exchanges of expert parallelism), and invalidates the FP8 layers' quantized weights,
// which the step made stale. The batch's loss and routing statistics are added to the
// running sums that takeTrainLoss and takeStats return. After an error the model's
// parameters may hold part of the step: it is not fit to train on.
func (m *Model) trainStep(tok *device.Tensor, h adamHyper, lr float64) (err error) {
	ws, err := m.workspace(tok.Dim(0))
	if err != nil {
		return err
	}
	// The model's stream waits for the side stream's work before the step's last stage
	// ends: the experts' steps, which the next step's forward reads, and the grouping
	// (which the embedding's sums wait for besides), whose tok the batcher refills after
	// the step and whose perm and offs a new workspace frees. A failed step waits for it
	// too, from the grouping on, leaving none of the side stream's work unordered.
	joined := false
	join := func() error {
		joined = true
		return errors.Join(m.evSide.Record(m.side), m.s.Wait(m.evSide))
	}
	defer func() {
		if !joined {
			err = errors.Join(err, join())
		}
	}()
	if err := m.groupEmbed(ws, tok); err != nil {
		return err
	}
	acts, err := m.forward(ws, tok, ws.trainLoss, true, m.layers)
	if err != nil {
		return err
	}
	for l, a := range acts {
		var dropped *device.Tensor
		if a.Perm != nil {
			dropped = a.Perm.Dropped
		} else if a.Layout != nil {
			m.epDropped[l] += int64(a.Layout.Dropped())
		}
		if err == nil {
			err = statsAdd(m.s, m.statsRow(l), a.Routing.Load, dropped)
		}
	}
	if err == nil {
		err = m.mark(stageStats)
	}
	if err != nil {
		for _, a := range acts {
			err = errors.Join(err, a.Free())
		}
		return err
	}
	m.Step++
	h.LR = lr
	layerDone := func(l int) error { return m.stepExperts(l, h) }
	if m.serialSide {
		layerDone = nil
	}
	if err := m.backward(ws, acts, layerDone); err != nil {
		return err
	}
	if err := m.sumGrads(); err != nil {
		return err
	}
	if err := m.adam.step(m.s, h, m.Step); err != nil {
		return err
	}
	if m.serialSide {
		for l := range m.adamW1 {
			for _, t := range []*adamTable{m.adamW2[l], m.adamW1[l]} {
				if err := t.step(m.s, h, m.Step); err != nil {
					return err
				}
			}
		}
	}
	if err := join(); err != nil {
		return err
	}
	// The step changed W1 and W2 (and their BF16 copies) in place.
	if err := m.invalidateWeights(); err != nil {
		return err
	}
	return m.mark(stageAdamW)
}

// groupEmbed groups the rows of the batch tok (I32 [B, W+1], B that of ws) by token for
// the embedding's gradient (embedGroup into ws.perm and ws.offs), which depends on tok
// alone: on the side stream, after the model's stream's work so far (tok's upload), so
// that the sort overlaps the forward; m.evGroup, recorded after it, is what backward's
// sums wait for. With serialSide it runs on the model's stream, as the stage
// stageEmbedSort. The next step's grouping, which overwrites perm and offs, waits for this
// step's work on the model's stream (through m.evBatch), the sums included; a step that
// fails before its sums leaves the grouping to trainStep's join.
func (m *Model) groupEmbed(ws *workspace, tok *device.Tensor) error {
	c := m.Config
	group := func(s *device.Stream) error { return embedGroup(s, ws.perm, ws.offs, tok, c.Window, c.Vocab) }
	ws.grouped = true
	if m.serialSide {
		if err := group(m.s); err != nil {
			return err
		}
		if err := m.evGroup.Record(m.s); err != nil {
			return err
		}
		return m.mark(stageEmbedSort)
	}
	if err := m.evBatch.Record(m.s); err != nil {
		return err
	}
	if err := m.side.Wait(m.evBatch); err != nil {
		return err
	}
	work := func() error { return group(m.side) }
	var err error
	if m.tl == nil {
		err = work()
	} else {
		err = m.tl.onSide(m.side, stageEmbedSort, work)
	}
	if err != nil {
		return err
	}
	return m.evGroup.Record(m.side)
}

// stepExperts applies the step's AdamW to layer l's expert weights on the side stream as
// soon as the backward on the model's stream has made their gradients (which no rank sums
// with another's): W2's and W1's once the layer's backward is done with each, its
// gradient written and its last read enqueued (m.evW2[l] and m.evW1[l], which the
// layer records midway through its backward: moe.Grads' W2Ready and W1Ready), so that
// they overlap the rest of the backward and what follows it: where the model's stream
// has the GPU's priority (the training loop's, without expert parallelism), the step's
// blocks fill what its kernels leave. Called once the layer's Backward is enqueued. The
// results are those of one step over every parameter at the end, bit for bit.
func (m *Model) stepExperts(l int, h adamHyper) error {
	for _, c := range []struct {
		ev    *device.Event
		t     *adamTable
		stage string
	}{{m.evW2[l], m.adamW2[l], stageAdamWW2}, {m.evW1[l], m.adamW1[l], stageAdamWW1}} {
		if err := m.side.Wait(c.ev); err != nil {
			return err
		}
		step := func() error { return c.t.step(m.side, h, m.Step) }
		var err error
		if m.tl == nil {
			err = step()
		} else {
			err = m.tl.onSide(m.side, layerStage(l, c.stage), step)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (m *Model) statsRow(l int) *device.Tensor {
	E := m.Config.Experts
	v, _ := m.stats.View(l*(E+1), E+1) // in range by construction
	return v
}

// takeTrainLoss returns the sum of the row losses of the training steps since the last
// call over the global batch (every rank's rows), and clears it.
func (m *Model) takeTrainLoss() (float64, error) {
	if m.ws == nil {
		return 0, nil
	}
	return m.takeSum(m.ws.trainLoss)
}

// takeSum returns the sum of t's elements over the ranks in row order, and clears t.
func (m *Model) takeSum(t *device.Tensor) (float64, error) {
	v, err := m.dist.gatherFloat32(m.s, t)
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, x := range v {
		sum += float64(x)
	}
	return sum, device.Fill(m.s, t, 0)
}

// takeStats returns each layer's load per expert and the assignments dropped for
// capacity since the last call, over all ranks, and clears them.
func (m *Model) takeStats() (load [][]int64, dropped int64, err error) {
	E, L := m.Config.Experts, m.Config.Layers
	v := make([]int64, L*(E+1))
	if err := device.Download(m.s, m.stats, v); err != nil {
		return nil, 0, err
	}
	for l, n := range m.epDropped {
		v[l*(E+1)+E] += n
	}
	clear(m.epDropped)
	if err := device.Fill(m.s, m.stats, 0); err != nil {
		return nil, 0, err
	}
	all, err := m.dist.gatherInt64(m.s, v)
	if err != nil {
		return nil, 0, err
	}
	load = make([][]int64, L)
	for l := range load {
		load[l] = make([]int64, E)
	}
	for r := range len(all) / len(v) {
		for l := range L {
			row := all[r*len(v)+l*(E+1):]
			for e := range E {
				load[l][e] += row[e]
			}
			dropped += row[E]
		}
	}
	return load, dropped, nil
}

// evalLoss returns the mean loss, in nats per token, over the batches (each R·B rows
// of W+1 ids, this rank's B rows after those of the ranks before it), without changing
// the parameters.
func (m *Model) evalLoss(batches [][]int32) (float64, error) {
	rows := 0
	R, rank := m.dist.Size(), m.dist.Rank()
	for _, all := range batches {
		n := len(all) / R
		B := n / (m.Config.Window + 1)
		ws, err := m.workspace(B)
		if err != nil {
			return 0, err
		}
		if err := device.Upload(m.s, ws.evTok, all[rank*n:(rank+1)*n]); err != nil {
			return 0, err
		}
		acts, err := m.forward(ws, ws.evTok, ws.evLoss, false, m.evalLayers)
		if err != nil {
			return 0, err
		}
		for _, a := range acts {
			if err := a.Free(); err != nil {
				return 0, err
			}
		}
		rows += R * B
	}
	if rows == 0 {
		return math.NaN(), nil
	}
	sum, err := m.takeSum(m.ws.evLoss)
	return sum / float64(rows), err
}
