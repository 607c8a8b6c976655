package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/dropless/dropless/device"
)

// The stages of a training step, in order; a layer's stages are prefixed with "L<l> ".
const (
	stageEmbedSort = "embed sort"  // the grouping of the batch's rows by token that the embedding's gradient reads, on the side stream beside the forward
	stageEmbed     = "embed+norm"  // embedding and the first norm
	stageMoEFwd    = "moe fwd"     // a layer's MoE forward
	stageAddNorm   = "add+norm"    // its residual add and the next norm
	stageOutput    = "output+loss" // output projection and softmax cross-entropy
	stageStats     = "stats"       // routing statistics added up on the device
	stageOutputBwd = "output bwd"  // output projection's gradients and the last norm's
	stageMoEBwd    = "moe bwd"     // a layer's MoE backward
	stageNormBwd   = "norm bwd"    // the gradient of its norm, added to the residual's
	stageEmbedBwd  = "embed bwd"   // the embedding table's gradient: each table row's sum over its rows
	stageGradSum   = "grad sum"    // replicated parameters' gradients summed over the ranks
	stageAdamW     = "adamw"       // the optimizer step of the parameters but the experts'
	stageAdamWW2   = "adamw w2"    // a layer's experts' optimizer step of W2, on the side stream
	stageAdamWW1   = "adamw w1"    // and of W1
)

func layerStage(l int, stage string) string { return fmt.Sprintf("L%d %s", l, stage) }

// splitStage returns the layer and the stage of a name layerStage made, or −1 and name
// for the stages of no layer.
func splitStage(name string) (l int, stage string) {
	if i := strings.IndexByte(name, ' '); i > 1 && name[0] == 'L' {
		if l, err := strconv.Atoi(name[1:i]); err == nil {
			return l, name[i+1:]
		}
	}
	return -1, name
}

// isMoE reports whether a stage is one of the MoE layers'.
func isMoE(stage string) bool {
	return strings.HasSuffix(stage, stageMoEFwd) || strings.HasSuffix(stage, stageMoEBwd)
}

// stepMarks are the marks of one training step: events recorded on the step's stream
// at the end of each stage, after one at its start.
type stepMarks struct {
	evs   []*device.Event
	names []string
	n     int
	side  []sideSpan // spans of work on another stream; side[:ns] this step's
	ns    int
}

// sideSpan is a span of work called name on another stream, between two events.
type sideSpan struct {
	name       string
	start, end *device.Event
}

// mark records the end of the stage called name (the start of the step for the first
// mark) on s.
func (t *stepMarks) mark(s *device.Stream, name string) error {
	if t.n == len(t.evs) {
		e, err := s.Device().NewEvent()
		if err != nil {
			return err
		}
		t.evs, t.names = append(t.evs, e), append(t.names, "")
	}
	if err := t.evs[t.n].Record(s); err != nil {
		return err
	}
	t.names[t.n] = name
	t.n++
	return nil
}

// onSide runs work, the span called name, on the stream s beside the step's stages,
// between two events that sideStages reads.
func (t *stepMarks) onSide(s *device.Stream, name string, work func() error) error {
	if t.ns == len(t.side) {
		var sp sideSpan
		var err error
		if sp.start, err = s.Device().NewEvent(); err != nil {
			return err
		}
		if sp.end, err = s.Device().NewEvent(); err != nil {
			return errors.Join(err, sp.start.Close())
		}
		t.side = append(t.side, sp)
	}
	sp := &t.side[t.ns]
	sp.name = name
	t.ns++
	if err := sp.start.Record(s); err != nil {
		return err
	}
	if err := work(); err != nil {
		return err
	}
	return sp.end.Record(s)
}

// sideStages waits for the step's spans of onSide and returns their times.
func (t *stepMarks) sideStages() ([]stageTime, error) {
	var out []stageTime
	for _, sp := range t.side[:t.ns] {
		if err := sp.end.Synchronize(); err != nil {
			return nil, err
		}
		d, err := sp.end.Since(sp.start)
		if err != nil {
			return nil, err
		}
		out = append(out, stageTime{sp.name, d})
	}
	return out, nil
}

// stageTime is how long a stage of a step took on the device.
type stageTime struct {
	name string
	d    time.Duration
}

// stages waits for the step's marks and returns its stages' times.
func (t *stepMarks) stages() ([]stageTime, error) {
	if t.n == 0 {
		return nil, nil
	}
	if err := t.evs[t.n-1].Synchronize(); err != nil {
		return nil, err
	}
	out := make([]stageTime, 0, t.n-1)
	for i := 1; i < t.n; i++ {
		d, err := t.evs[i].Since(t.evs[i-1])
		if err != nil {
			return nil, err
		}
		out = append(out, stageTime{t.names[i], d})
	}
	return out, nil
}

func (t *stepMarks) close() error {
	var errs []error
	for _, e := range t.evs {
		errs = append(errs, e.Close())
	}
	for _, sp := range t.side {
		errs = append(errs, sp.start.Close(), sp.end.Close())
	}
	return errors.Join(errs...)
}

// clockRing is how many steps' marks a stepClock keeps: the batcher keeps the host at
// most two steps ahead of the device, so the step that last used a slot is done when
// the slot comes round again, and reading its events does not wait.
const clockRing = 4

// stepClock times the training steps of a window between progress lines on the device:
// the window's span, and the MoE layers' share of it, from the marks of every step.
type stepClock struct {
	ring     [clockRing]stepMarks
	pending  [clockRing]bool
	k        int // steps begun
	winStart *device.Event
	winEnd   *device.Event
	steps    int           // steps in the window
	moe      time.Duration // the MoE layers' stages of the window's steps
}

func newStepClock(d *device.Device) (*stepClock, error) {
	c := &stepClock{}
	var err error
	if c.winStart, err = d.NewEvent(); err != nil {
		return nil, err
	}
	if c.winEnd, err = d.NewEvent(); err != nil {
		return nil, errors.Join(err, c.winStart.Close())
	}
	return c, nil
}

// begin starts timing a step on s and returns the marks to record its stages with.
func (c *stepClock) begin(s *device.Stream) (*stepMarks, error) {
	i := c.k % clockRing
	if err := c.harvest(i); err != nil {
		return nil, err
	}
	if c.steps == 0 {
		if err := c.winStart.Record(s); err != nil {
			return nil, err
		}
	}
	t := &c.ring[i]
	t.n, t.ns = 0, 0
	if err := t.mark(s, ""); err != nil {
		return nil, err
	}
	c.k++
	c.steps++
	c.pending[i] = true
	return t, nil
}

// harvest adds the MoE stages of the step in slot i, if any, to the window.
func (c *stepClock) harvest(i int) error {
	if !c.pending[i] {
		return nil
	}
	c.pending[i] = false
	st, err := c.ring[i].stages()
	for _, x := range st {
		if isMoE(x.name) {
			c.moe += x.d
		}
	}
	return err
}

// window ends the window on s (waiting for it) and returns its span on the device, the
// MoE layers' time in it and its steps; the next begin starts a new one.
func (c *stepClock) window(s *device.Stream) (span, moe time.Duration, steps int, err error) {
	if err := c.winEnd.Record(s); err != nil {
		return 0, 0, 0, err
	}
	if err := c.winEnd.Synchronize(); err != nil {
		return 0, 0, 0, err
	}
	for i := range clockRing {
		if err := c.harvest(i); err != nil {
			return 0, 0, 0, err
		}
	}
	if span, err = c.winEnd.Since(c.winStart); err != nil {
		return 0, 0, 0, err
	}
	moe, steps = c.moe, c.steps
	c.moe, c.steps = 0, 0
	return span, moe, steps, nil
}

func (c *stepClock) close() error {
	errs := []error{c.winStart.Close(), c.winEnd.Close()}
	for i := range c.ring {
		errs = append(errs, c.ring[i].close())
	}
	return errors.Join(errs...)
}

// flopsPerToken returns the model FLOPs of a training step per token: three times the
// forward's (the backward's products are twice the forward's), which per token are
// 2·H·E for the router, 6·K·H·F for K SwiGLU experts, 6·H·Fs for the shared expert in
// each of L layers, and 2·H·V for the output projection. The embedding is a gather.
func (c ModelConfig) flopsPerToken() float64 {
	H, F, Fs, E, K, V, L := float64(c.Hidden), float64(c.FFN), float64(c.SharedFFN), float64(c.Experts), float64(c.TopK), float64(c.Vocab), float64(c.Layers)
	return 3 * (L*(2*H*E+6*K*H*F+6*H*Fs) + 2*H*V)
}

// peak returns the dense BF16 peak of d in FLOP/s and says whose it is; 0 for the CPU
// and GPUs peakFor does not know.
func peak(d *device.Device) (float64, string) {
	if !d.IsCUDA() {
		return 0, ""
	}
	return peakFor(d.Name())
}

// peakFor returns the dense BF16 peak of the GPU called name: 989 TFLOP/s for an H100
// or H200 SXM (not the PCIe and NVL boards, which are slower), else 0.
func peakFor(name string) (float64, string) {
	if (strings.Contains(name, "H100") || strings.Contains(name, "H200")) &&
		!strings.Contains(name, "PCIe") && !strings.Contains(name, "NVL") {
		return 989e12, "989 TFLOP/s, the dense bf16 peak of an H100/H200 SXM"
	}
	return 0, ""
}

// stageWork returns the FLOPs and the bytes moved of a stage on a rank of B rows,
// estimated from the shapes (zero where not meaningful): products for the stages of
// matrix products, the bytes read and written for the bandwidth-bound ones.
func (m *Model) stageWork(stage string, B int) (flops, bytes float64) {
	c := m.Config
	b, H, F, Fs, E, K, V, W := float64(B), float64(c.Hidden), float64(c.FFN), float64(c.SharedFFN), float64(c.Experts), float64(c.TopK), float64(c.Vocab), float64(c.Window)
	e := float64(m.dt.Size())
	l, stage := splitStage(stage)
	moeFwd := b * (2*H*E + 6*K*H*F + 6*H*Fs)
	switch stage {
	case stageEmbed:
		return 0, b*H*(4*W+4+e) + b*(W+1)*4
	case stageMoEFwd:
		return moeFwd, 0
	case stageAddNorm:
		return 0, b * H * (4 + e + 4 + e)
	case stageOutput:
		return 2 * b * H * V, 0
	case stageOutputBwd:
		return 4 * b * H * V, 0
	case stageMoEBwd:
		return 2 * moeFwd, 0
	case stageNormBwd:
		return 0, b * H * (e + 4 + 4 + 4 + e)
	case stageEmbedSort:
		return 0, 4 * (2*W*b + W*b + W*(V+1)) // tok's column read twice, perm and offs written
	case stageEmbedBwd:
		return 0, W*b*(e*H+4) + 4*W*V*H // each row read W times (in the compute dtype) through perm
	case stageAdamW:
		return 0, m.adam.bytes()
	case stageAdamWW1:
		if l >= 0 && l < len(m.adamW1) {
			return 0, m.adamW1[l].bytes()
		}
	case stageAdamWW2:
		if l >= 0 && l < len(m.adamW2) {
			return 0, m.adamW2[l].bytes()
		}
	case stageGradSum:
		R := float64(m.dist.Size())
		return 0, float64(m.dpGrad.Len()) * 4 * (2*R + 1)
	}
	return 0, 0
}

// printProfile writes the table of a step's stages: time, share of the step, and the
// rate of the work stageWork estimates.
func (m *Model) printProfile(w io.Writer, st, side []stageTime, B int, host time.Duration) {
	var total, moe time.Duration
	for _, x := range st {
		total += x.d
		if isMoE(x.name) {
			moe += x.d
		}
	}
	fmt.Fprintf(w, "profile of step %d on %v (B=%d rows on this rank, %v compute):\n", m.Step, m.s.Device(), B, m.dt)
	fmt.Fprintf(w, "  %-16s %10s %7s  %s\n", "stage", "ms", "share", "rate (estimated work)")
	rate := func(x stageTime) string {
		flops, bytes := m.stageWork(x.name, B)
		switch sec := x.d.Seconds(); {
		case sec <= 0:
		case flops > 0:
			return fmt.Sprintf("%.2f TFLOP/s (%.3g GFLOP)", flops/sec/1e12, flops/1e9)
		case bytes > 0:
			return fmt.Sprintf("%.1f GB/s (%.3g MB)", bytes/sec/1e9, bytes/1e6)
		}
		return ""
	}
	for _, x := range st {
		fmt.Fprintf(w, "  %-16s %10.3f %6.1f%%  %s\n", x.name, x.d.Seconds()*1e3, 100*x.d.Seconds()/max(total.Seconds(), 1e-12), rate(x))
	}
	fmt.Fprintf(w, "  %-16s %10.3f %6.1f%%  MoE layers %.3f ms, the rest %.3f ms; host %.3f ms to enqueue the step\n",
		"step", total.Seconds()*1e3, 100.0, moe.Seconds()*1e3, (total-moe).Seconds()*1e3, host.Seconds()*1e3)
	if len(side) > 0 {
		fmt.Fprintf(w, "  on a second stream (part of the time above): the embedding's grouping beside the forward, each layer's experts' AdamW, W2's beside the rest of the layer's backward, W1's beside what follows it:\n")
	}
	for _, x := range side {
		fmt.Fprintf(w, "  %-16s %10.3f %7s  %s\n", x.name, x.d.Seconds()*1e3, "", rate(x))
	}
}
