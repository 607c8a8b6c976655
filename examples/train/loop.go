package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/offload"
)

// profileStep is the step of a run whose stages -profile prints (1-based): the first
// steps compile kernels and fill the memory pool.
const profileStep = 4

// trainModel trains (or, with -resume, continues) the model called name on the ranks
// of cl and saves it; it returns what the lowest rank of this process saw.
func trainModel(cl *cluster, name string, cfg ModelConfig, o options, c *corpus, evalSet [][]int32, w io.Writer) (*result, error) {
	if o.Batch%cl.size != 0 {
		return nil, fmt.Errorf("-batch %d over %d ranks: want a multiple of the ranks", o.Batch, cl.size)
	}
	var res *result
	err := cl.run(func(tr ep.Transport) error {
		dd := &dist{tr: tr}
		out := w
		if dd.Rank() != cl.rank0() {
			out = io.Discard
		}
		r, err := trainRank(cl.device(tr), dd, name, cfg, o, c, evalSet, out)
		if dd.Rank() == cl.rank0() {
			res = r
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

// trainRank is one rank's part of trainModel, on d. Every rank of the model runs it at
// once; it reports to w.
func trainRank(d *device.Device, dd *dist, name string, cfg ModelConfig, o options, c *corpus, evalSet [][]int32, w io.Writer) (res *result, err error) {
	res = &result{Name: name, Path: filepath.Join(o.Out, name+".ckpt"), First: math.NaN()}
	R, rank := dd.Size(), dd.Rank()
	B := o.Batch / R
	dt, err := o.computeType()
	if err != nil {
		return nil, err
	}
	moments, err := o.momentType()
	if err != nil {
		return nil, err
	}
	grads, err := o.gradType()
	if err != nil {
		return nil, err
	}
	prec, err := o.precision()
	if err != nil {
		return nil, err
	}
	pol, err := o.offloadPolicy()
	if err != nil {
		return nil, err
	}
	var ck *Checkpoint
	if o.Resume {
		if ck, err = readCheckpoint(res.Path); err != nil {
			return nil, fmt.Errorf("-resume: %w", err)
		}
		if ck.Config != cfg {
			fmt.Fprintf(w, "%s: the checkpoint's model shape %+v differs from the flags'; using the checkpoint's\n", name, ck.Config)
		}
		cfg = ck.Config
		res.History = ck.History
	}
	// Each rank its own stream (ranks in one process may share a device). Without expert
	// parallelism it has the GPU's priority, so that the experts' AdamW steps on the
	// model's second stream fill what its kernels leave; with it, the priority stays with
	// the expert-parallel groups' transfers.
	newStream := d.NewStream
	if R == 1 {
		newStream = d.NewPriorityStream
	}
	s, err := newStream()
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, s.Close()) }()
	mo := modelOptions{DType: dt, Moments: moments, Grads: grads, Precision: prec, Stream: s, Dist: dd}
	if o.Offload != "" {
		if mo.Offload, err = offload.New(d, offload.Config{PoolBytes: offloadPool(cfg, pol, prec, B, R, dt), Policy: pol}); err != nil {
			return nil, err
		}
		defer func() { err = errors.Join(err, mo.Offload.Close()) }()
	}
	var m *Model
	if ck != nil {
		if m, err = loadModel(d, ck, mo); err != nil {
			return nil, err
		}
		fmt.Fprintf(w, "%s: resumed from %s at step %d\n", name, res.Path, m.Step)
		if from, _ := ck.momentType(); from != moments { // readCheckpoint checked it
			how := "rounded to nearest even"
			if from == device.BF16 {
				how = "exactly"
			}
			fmt.Fprintf(w, "%s: the checkpoint's AdamW moments are %v; converted to -moments %v (%s)\n", name, from, moments, how)
		}
	} else if m, err = newModel(d, cfg, o.Seed, mo); err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, m.Free()) }()
	m.printHeader(w, name, o, B)
	if d.IsCUDA() {
		start := time.Now()
		if err := m.loadKernels(d); err != nil {
			return nil, err
		}
		fmt.Fprintf(w, "%s: kernels compiled and loaded in %v\n", name, time.Since(start).Round(time.Millisecond))
	}
	if ck == nil {
		ev, err := m.evalLoss(evalSet)
		if err != nil {
			return nil, err
		}
		res.First = ev
		res.History.EvalStep = append(res.History.EvalStep, 0)
		res.History.Eval = append(res.History.Eval, ev)
		fmt.Fprintf(w, "%-9s step %5d  held-out %.3f\n", name, 0, ev)
	}
	h := adamHyper{Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps, WeightDecay: o.WeightDecay}
	total := m.Step + o.Steps
	bt, err := newBatcher(s, c.Train, o.Seed, m.Step, total, B, cfg.Window, rank, R)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, bt.close()) }()
	clock, err := newStepClock(d)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, clock.close()) }()
	prog := progressState{batch: o.Batch}
	start := time.Now()
	for i := range o.Steps {
		step := m.Step
		tok, err := bt.next(s)
		if err != nil {
			return nil, err
		}
		if m.tl, err = clock.begin(s); err != nil {
			return nil, err
		}
		t0 := time.Now()
		err = m.trainStep(tok, h, lrAt(step+1, total, o.Warmup, o.LR, o.MinLR))
		enqueue := time.Since(t0)
		marks := m.tl
		m.tl = nil
		if err == nil {
			err = bt.release(s)
		}
		if err != nil {
			return nil, fmt.Errorf("step %d: %w", step+1, err)
		}
		if o.Profile && i == min(profileStep, o.Steps)-1 {
			st, err := marks.stages()
			if err != nil {
				return nil, err
			}
			side, err := marks.sideStages()
			if err != nil {
				return nil, err
			}
			m.printProfile(w, st, side, B, enqueue)
		}
		if m.Step%o.EvalEvery != 0 && i != o.Steps-1 {
			continue
		}
		if err := m.progress(w, name, total, clock, evalSet, &prog, res); err != nil {
			return nil, err
		}
	}
	if o.Steps > 0 || ck == nil {
		res.Heldout = res.History.Eval[len(res.History.Eval)-1]
	} else if res.Heldout, err = m.evalLoss(evalSet); err != nil {
		return nil, err
	}
	if err := m.save(res.Path, o.Seed, res.History); err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "%s: %d steps in %v; saved %s\n", name, o.Steps, time.Since(start).Round(time.Millisecond), res.Path)
	return res, nil
}

// progressState is what the progress lines keep from one to the next.
type progressState struct {
	batch           int   // the global batch
	offloaded, kept int64 // the offloader's bytes at the last line
}

// progress ends the window of steps since the last progress line: it reads the
// window's time, training loss and routing statistics, evaluates the held-out loss,
// records them in res and prints the line.
func (m *Model) progress(w io.Writer, name string, total int, clock *stepClock, evalSet [][]int32, p *progressState, res *result) error {
	span, moeTime, steps, err := clock.window(m.s)
	if err != nil {
		return err
	}
	sum, err := m.takeTrainLoss()
	if err != nil {
		return err
	}
	load, dropped, err := m.takeStats()
	if err != nil {
		return err
	}
	var assigned int64
	for _, l := range load {
		for _, n := range l {
			assigned += n
		}
	}
	tokens := float64(steps * p.batch)
	tr := sum / tokens
	t1 := time.Now()
	ev, err := m.evalLoss(evalSet)
	if err != nil {
		return err
	}
	evTime := time.Since(t1)
	hist := &res.History
	hist.TrainStep = append(hist.TrainStep, m.Step)
	hist.Train = append(hist.Train, tr)
	hist.Dropped = append(hist.Dropped, float64(dropped)/float64(max(assigned, 1)))
	hist.EvalStep = append(hist.EvalStep, m.Step)
	hist.Eval = append(hist.Eval, ev)
	res.Dropped += dropped
	res.Assigned += assigned

	sec := max(span.Seconds(), 1e-9)
	tps, moe := tokens/sec, moeTime.Seconds()/sec
	line := fmt.Sprintf("%-9s step %5d/%d  train %.3f  held-out %.3f  %6.0f tok/s  %.1f ms/step (MoE %.0f%%, rest %.0f%%)",
		name, m.Step, total, tr, ev, tps, 1e3*sec/float64(steps), 100*moe, 100*(1-moe))
	flops := m.Config.flopsPerToken() * tps
	if pk, _ := peak(m.s.Device()); pk > 0 {
		line += fmt.Sprintf("  MFU %.2f%%", 100*flops/pk)
	} else {
		line += fmt.Sprintf("  %.3g GFLOP/s", flops/1e9)
	}
	if m.off != nil {
		st := m.off.Stats()
		line += fmt.Sprintf("  host %s/step", byteSize(float64(st.Offloaded-p.offloaded)/float64(steps)))
		if st.KeptBytes > p.kept {
			line += fmt.Sprintf(" (%s/step kept on the device: pool full)", byteSize(float64(st.KeptBytes-p.kept)/float64(steps)))
		}
		p.offloaded, p.kept = st.Offloaded, st.KeptBytes
	}
	line += fmt.Sprintf("  eval %4.0f ms  load/mean", evTime.Seconds()*1e3)
	for l := range load {
		lo, hi := loadRange(load[l])
		line += fmt.Sprintf(" L%d %.2f-%.2f", l, lo, hi)
	}
	if m.Config.CapacityFactor > 0 {
		line += fmt.Sprintf("  dropped %.1f%%", 100*float64(dropped)/float64(max(assigned, 1)))
	}
	fmt.Fprintln(w, line)
	return nil
}

// printHeader describes the model and how it is trained.
func (m *Model) printHeader(w io.Writer, name string, o options, B int) {
	cfg, R := m.Config, m.dist.Size()
	dense, expert := cfg.paramCounts()
	kind := "dropless"
	if cf := cfg.CapacityFactor; cf > 0 {
		if R > 1 {
			kind = fmt.Sprintf("capacity factor %g per rank (%d rows per rank, the rest dropped)", cf, int(math.Ceil(cf*float64(cfg.TopK*B))))
		} else if c, err := moe.Capacity(cf, B, cfg.TopK, cfg.Experts); err == nil {
			kind = fmt.Sprintf("capacity factor %g (%d rows per expert)", cf, c)
		}
	}
	fmt.Fprintf(w, "\n%s model: W=%d H=%d F=%d E=%d K=%d L=%d, %s; %d parameters (%d in experts, %d active per token)\n",
		name, cfg.Window, cfg.Hidden, cfg.FFN, cfg.Experts, cfg.TopK, cfg.Layers, kind,
		dense+expert, expert, dense+expert*cfg.TopK/cfg.Experts)
	train := fmt.Sprintf("%v compute (f32 weights, gradients and AdamW state)", m.dt)
	switch {
	case m.moments != device.F32 && m.grads != device.F32:
		train = fmt.Sprintf("%v compute (f32 weights, %v expert gradients, f32 others, %v AdamW moments)", m.dt, m.grads, m.moments)
	case m.moments != device.F32:
		train = fmt.Sprintf("%v compute (f32 weights and gradients, %v AdamW moments)", m.dt, m.moments)
	case m.grads != device.F32:
		train = fmt.Sprintf("%v compute (f32 weights and AdamW state, %v expert gradients, f32 others)", m.dt, m.grads)
	}
	switch m.prec {
	case moe.PrecisionBlockwise:
		train += ", expert GEMMs in fp8 (E4M3, f32 scales per 1×128 block of activations and gradients, per 128×128 of weights)"
	case moe.PrecisionMXFP8:
		train += ", expert GEMMs in mxfp8 (E4M3, a power-of-two scale per 32 elements)"
	}
	if R > 1 {
		train += fmt.Sprintf(", %d ranks of %d experts and %d rows each", R, cfg.Experts/R, B)
	}
	if m.off != nil {
		train += fmt.Sprintf(", activations offloaded by policy %q (pinned pool of %s)", m.off.Policy(), byteSize(float64(m.off.Stats().PoolBytes)))
	}
	fmt.Fprintf(w, "training: %s\n", train)
	if pk, who := peak(m.s.Device()); pk > 0 {
		fmt.Fprintf(w, "MFU: %.3g model FLOPs per token (3× the forward's) × tokens/s over %s\n", cfg.flopsPerToken(), who)
	} else {
		fmt.Fprintf(w, "MFU: none (no peak known for %s); the progress lines give the model FLOP/s measured: %.3g FLOPs per token (3× the forward's) × tokens/s\n",
			m.s.Device().Name(), cfg.flopsPerToken())
	}
}

// offloadPool returns the pinned pool the activations that pol sends to the host take,
// for L layers of B rows on each of R ranks in the compute dtype dt with the expert
// GEMMs in precision prec. An FP8 layer keeps ActSwiGLU as FP8 codes and their scales
// (fp8SwiGLUBytes) and ActPermuted, with expert parallelism, as the dispatched FP8 rows
// (fp8RowsBytes); without it no ActPermuted.
func offloadPool(c ModelConfig, pol offload.Policy, prec moe.Precision, B, R int, dt device.DType) int {
	K, E, H, F, Fs := c.TopK, c.Experts, c.Hidden, c.FFN, c.SharedFFN
	rows := B * K
	switch cf := c.CapacityFactor; {
	case R > 1 && cf > 0:
		rows = int(math.Ceil(cf * float64(K*B)))
	case R > 1:
		rows = B * R * min(K, E/R)
	case cf > 0:
		if n, err := moe.Capacity(cf, B, K, E); err == nil {
			rows = min(rows, E*n)
		}
	}
	es := dt.Size()
	acts := []struct {
		name  string
		bytes []int // the tensors kept under the name
	}{
		{moe.ActPermuted, []int{rows * H * es}}, {moe.ActWi, []int{rows * 2 * F * es}},
		{moe.ActSwiGLU, []int{rows * F * es}}, {moe.ActWo, []int{rows * H * es}},
		{moe.ActSharedWi, []int{B * 2 * Fs * es}}, {moe.ActSharedAct, []int{B * Fs * es}},
	}
	if prec != moe.PrecisionBF16 {
		acts[0].bytes = nil
		if R > 1 {
			acts[0].bytes = fp8RowsBytes(prec, rows, H)
		}
		acts[2].bytes = fp8SwiGLUBytes(prec, rows, F, E/R)
	}
	total := 0
	for _, a := range acts {
		if pol.Action(a.name) != offload.Offload {
			continue
		}
		for _, n := range a.bytes {
			if n > 0 {
				total += (n + offload.Align - 1) / offload.Align * offload.Align
			}
		}
	}
	return c.Layers * total
}

// fp8SwiGLUBytes returns the sizes of the two tensors of an FP8 layer's ActSwiGLU for
// rows expert rows of F columns in G local experts: the columnwise codes, transposed,
// one byte an element over the token blocks of 128 that the groups can need
// (⌊rows/128⌋ + min(G, rows), each group's rows in blocks of their own), and their
// scales, an f32 per block and column (blockwise) or a byte per 32 tokens and column
// of F rounded up to 128 (MXFP8), as package quant lays them out.
func fp8SwiGLUBytes(prec moe.Precision, rows, F, G int) []int {
	blocks := rows/128 + min(G, rows)
	codes := F * 128 * blocks
	if prec == moe.PrecisionBlockwise {
		return []int{codes, 4 * F * blocks}
	}
	return []int{codes, 4 * blocks * 128 * ((F + 127) / 128)}
}

// fp8RowsBytes returns the bytes of the two tensors of an FP8 layer's ActPermuted with
// expert parallelism, rows dispatched rows of H columns quantized rowwise: the codes,
// one byte an element, and their scales as package quant lays them out, an f32 per
// 128 columns of rows rounded up to 4 (blockwise) or a byte per 32 columns, rounded up
// to 4, of rows rounded up to 128 (MXFP8).
func fp8RowsBytes(prec moe.Precision, rows, H int) []int {
	if prec == moe.PrecisionBlockwise {
		return []int{rows * H, 4 * ((H + 127) / 128) * ((rows + 3) / 4 * 4)}
	}
	return []int{rows * H, 128 * ((rows + 127) / 128) * ((H + 127) / 128 * 4)}
}

// byteSize formats n bytes in B, KiB, MiB or GiB.
func byteSize(n float64) string {
	units := []string{"B", "KiB", "MiB", "GiB"}
	i := 0
	for ; n >= 1024 && i < len(units)-1; i++ {
		n /= 1024
	}
	if i == 0 {
		return fmt.Sprintf("%.0f %s", n, units[i])
	}
	return fmt.Sprintf("%.1f %s", n, units[i])
}
