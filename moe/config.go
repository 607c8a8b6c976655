package moe

import (
	"errors"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/offload"
)

// Config describes an MoE layer of SwiGLU experts.
type Config struct {
	Hidden    int          // H: model width
	FFN       int          // F: each expert's intermediate width
	SharedFFN int          // intermediate width of the shared expert applied to every token; 0: none
	Router    RouterConfig // E, K and the routing rule
	// CapacityFactor > 0 makes a capacity layer: each expert takes at most
	// Capacity(CapacityFactor, T, K, E) rows, the first assignments in token order,
	// and the others are dropped (they add nothing to the output; see Stats.Dropped).
	// 0: dropless, every assignment is computed.
	CapacityFactor float64
	Layout         gemm.WeightLayout // layout of W1, W2, SharedW1, SharedW2 and their gradients
	// Precision is the arithmetic of the routed experts' GEMMs: PrecisionBF16 (the zero
	// value: the parameters' dtype), or an FP8 recipe, PrecisionBlockwise or
	// PrecisionMXFP8, which needs Hidden and FFN multiples of 16. Parameters, gradients,
	// the optimizer and everything outside those GEMMs (router, shared expert) are
	// unchanged. An FP8 layer caches W1 and W2 quantized: after changing them in place,
	// call Layer.InvalidateWeights (see Precision).
	Precision Precision

	// EP, when set, runs the experts in parallel over the group's ranks: each rank
	// routes its own tokens, dispatches them to the ranks of their experts, runs its
	// E/R local experts (W1, W2 hold those: [E/R, ...]) and combines the results back.
	// Every rank calls Forward and Backward together. The group's Capacity and Overflow
	// replace CapacityFactor (which must be 0), and its Layout waits once per Forward
	// for the exchange of counts. The load-balancing loss (RouterConfig.AuxLoss) is
	// over the group's batch: each rank computes its share, and the ranks' shares, of
	// the value and of the gradients, add up to the loss over all their tokens.
	EP *ep.Group
	// Offload, when set, receives the activations Backward needs (named by the Act
	// constants) as soon as Forward is done with them; its policy keeps, offloads or
	// drops each, and Backward loads or recomputes them, releasing each after its last
	// use (so Backward runs once per Forward).
	Offload *offload.Offloader
}

// Validate reports whether c is usable.
func (c Config) Validate() error {
	if err := c.Router.Validate(); err != nil {
		return err
	}
	switch {
	case c.Hidden < 1:
		return fmt.Errorf("moe: Config.Hidden = %d, want ≥ 1", c.Hidden)
	case c.FFN < 1:
		return fmt.Errorf("moe: Config.FFN = %d, want ≥ 1", c.FFN)
	case c.SharedFFN < 0:
		return fmt.Errorf("moe: Config.SharedFFN = %d, want ≥ 0", c.SharedFFN)
	case c.CapacityFactor < 0 || math.IsNaN(c.CapacityFactor) || math.IsInf(c.CapacityFactor, 0):
		return fmt.Errorf("moe: Config.CapacityFactor = %v, want a finite value ≥ 0", c.CapacityFactor)
	case c.Layout != gemm.KN && c.Layout != gemm.NK:
		return fmt.Errorf("moe: Config.Layout = %v, want KN or NK", c.Layout)
	case !c.Precision.valid():
		return fmt.Errorf("moe: Config.Precision = %v, want PrecisionBF16, PrecisionBlockwise or PrecisionMXFP8", c.Precision)
	case c.Precision.fp8() && c.Hidden%fp8Align != 0:
		return fmt.Errorf("moe: Config.Hidden = %d with Config.Precision %v: want a multiple of %d (FP8 weight rows of whole 16-byte units)", c.Hidden, c.Precision, fp8Align)
	case c.Precision.fp8() && c.FFN%fp8Align != 0:
		return fmt.Errorf("moe: Config.FFN = %d with Config.Precision %v: want a multiple of %d (FP8 weight rows of whole 16-byte units)", c.FFN, c.Precision, fp8Align)
	}
	if c.EP != nil {
		g := c.EP.Config()
		switch {
		case g.Experts != c.Router.Experts || g.TopK != c.Router.TopK:
			return fmt.Errorf("moe: Config.EP has %d experts, top-%d; the router %d, top-%d", g.Experts, g.TopK, c.Router.Experts, c.Router.TopK)
		case c.CapacityFactor != 0:
			return errors.New("moe: Config.CapacityFactor must be 0 with Config.EP (the group's Capacity applies)")
		}
	}
	if c.EP != nil && c.Offload != nil && c.EP.Transport().Device() != c.Offload.Device() {
		return fmt.Errorf("moe: Config.EP is on %v, Config.Offload on %v", c.EP.Transport().Device(), c.Offload.Device())
	}
	return nil
}

// localExperts returns the experts whose weights this layer holds.
func (c Config) localExperts() int {
	if c.EP != nil {
		return c.EP.LocalExperts()
	}
	return c.Router.Experts
}

// Params are the layer's parameters, on one device. Expert weights share the input's
// dtype (F32 or BF16). Shapes are for Layout KN; NK swaps the last two dimensions.
// With Config.EP, W1 and W2 hold the rank's E/R experts.
type Params struct {
	Router   *device.Tensor // [E,H], F32 or the input's dtype
	Bias     *device.Tensor // F32[E] score-correction bias, or nil
	W1       *device.Tensor // [E,H,2F]: gate columns [0,F), up columns [F,2F)
	W2       *device.Tensor // [E,F,H]
	SharedW1 *device.Tensor // [H,2Fs] for SharedFFN = Fs > 0, else nil
	SharedW2 *device.Tensor // [Fs,H]
}

// Grads receives the gradients of Backward, each shaped as its parameter (X as the
// input). Weight gradients are F32 or BF16 (the router's: F32 or its dtype); nil ones
// are not computed, but X must be given. With Config.EP, Router and the shared
// expert's gradients are this rank's share (sum them over ranks as for data
// parallelism); W1 and W2 are complete for the local experts.
type Grads struct {
	X        *device.Tensor
	Router   *device.Tensor
	W1, W2   *device.Tensor
	SharedW1 *device.Tensor
	SharedW2 *device.Tensor
	// Accumulate adds the weight gradients to the tensors instead of overwriting them
	// (X is always overwritten).
	Accumulate bool
	// W2Ready and W1Ready, when not nil (and W2, W1 given), are recorded on Backward's
	// stream as soon as the backward is done with that expert weight: its gradient
	// written and the input gradient that reads the weight enqueued (W2's before
	// SwiGLU's backward and W1's products, W1's before the router's and X's gradients).
	// An optimizer step of the weight on another stream that waits for the event
	// overlaps the rest of the backward. Events of the stream's device.
	W2Ready, W1Ready *device.Event
}

// wshape returns the shape of a [g, k, n] weight in layout l.
func wshape(l gemm.WeightLayout, g, k, n int) []int {
	if l == gemm.NK {
		return []int{g, n, k}
	}
	return []int{g, k, n}
}

// check validates x[T,H], y and the parameters.
func (l *Layer) check(s *device.Stream, y, x *device.Tensor, p *Params) error {
	c := l.cfg
	H := c.Hidden
	if err := checkFloat(s, x, "Layer x"); err != nil {
		return err
	}
	T, dt := x.Dim(0), x.DType()
	if x.Dim(1) != H {
		return fmt.Errorf("moe: Layer x is %v, want [T %d]", x, H)
	}
	if err := checkRows(s, y, "Layer y", dt, T, H); err != nil {
		return err
	}
	if c.EP != nil && c.EP.Transport().Device() != s.Device() {
		return fmt.Errorf("moe: Config.EP is on %v, the stream on %v", c.EP.Transport().Device(), s.Device())
	}
	if c.Offload != nil && c.Offload.Device() != s.Device() {
		return fmt.Errorf("moe: Config.Offload is on %v, the stream on %v", c.Offload.Device(), s.Device())
	}
	return l.checkParams(s, dt, p)
}

// checkParams validates the parameters of a layer of dtype dt.
func (l *Layer) checkParams(s *device.Stream, dt device.DType, p *Params) error {
	c := l.cfg
	H, F, E, L := c.Hidden, c.FFN, c.Router.Experts, c.localExperts()
	if p == nil {
		return errors.New("moe: Layer: nil Params")
	}
	if err := checkFloat(s, p.Router, "Params.Router"); err != nil {
		return err
	}
	if rd := p.Router.DType(); rd != device.F32 && rd != dt {
		return fmt.Errorf("moe: Params.Router is %v, want f32 or %v", p.Router, dt)
	}
	if err := checkShape(p.Router, "Params.Router", E, H); err != nil {
		return err
	}
	if p.Bias != nil {
		if err := checkTensor(s, p.Bias, "Params.Bias", device.F32, E); err != nil {
			return err
		}
	}
	if err := checkTensor(s, p.W1, "Params.W1", dt, wshape(c.Layout, L, H, 2*F)...); err != nil {
		return err
	}
	if err := checkTensor(s, p.W2, "Params.W2", dt, wshape(c.Layout, L, F, H)...); err != nil {
		return err
	}
	if c.SharedFFN > 0 {
		Fs := c.SharedFFN
		if err := checkTensor(s, p.SharedW1, "Params.SharedW1", dt, wshape(c.Layout, 1, H, 2*Fs)[1:]...); err != nil {
			return err
		}
		if err := checkTensor(s, p.SharedW2, "Params.SharedW2", dt, wshape(c.Layout, 1, Fs, H)[1:]...); err != nil {
			return err
		}
	} else if p.SharedW1 != nil || p.SharedW2 != nil {
		return errors.New("moe: Params.SharedW1 and SharedW2 given but Config.SharedFFN is 0")
	}
	return nil
}

func (l *Layer) gemmOpt(acc bool) *gemm.Options {
	return &gemm.Options{Layout: l.cfg.Layout, Accumulate: acc}
}
