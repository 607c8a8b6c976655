package epmodel

import (
	"fmt"
	"math"
)

// Link is one kind of link of a GPU: GBps is its datasheet bandwidth in GB/s each way
// per GPU, Eff the fraction of it that dispatch and combine reach.
type Link struct {
	GBps, Eff float64
}

// rate returns the bytes per second the link moves.
func (l Link) rate() float64 { return l.GBps * l.Eff * 1e9 }

// System is a cluster of GPUs in NVLink domains of NodeSize GPUs, linked by
// InfiniBand (IB) between domains.
type System struct {
	Name     string
	NodeSize int
	NVLink   Link
	IB       Link
}

// Layer is the shape of one MoE layer on one rank: Tokens tokens of width Hidden routed
// to TopK SwiGLU experts of width FFN each. Dispatched rows take DispatchBytes bytes per
// element (2 for bf16; 1 + 4/128 for FP8 with one float32 scale per 128 elements, or
// 1 + 1/32 for MXFP8), combined rows CombineBytes; the expert GEMMs run at TFLOPs.
type Layer struct {
	Tokens, Hidden, FFN, TopK   int
	DispatchBytes, CombineBytes float64
	TFLOPs                      float64
}

// Time is the time of one layer on one rank, in seconds: dispatch, combine and the
// expert GEMMs (of the forward pass, as Predict returns it).
type Time struct {
	Dispatch, Combine, Compute float64
}

// Comm returns Dispatch + Combine.
func (t Time) Comm() float64 { return t.Dispatch + t.Combine }

// WithBackward returns the time of the forward and backward passes: the backward
// passes move the same bytes again (the gradient of a dispatch is a combine, that of a
// combine a dispatch) and compute twice the forward's flops.
func (t Time) WithBackward() Time {
	return Time{Dispatch: 2 * t.Dispatch, Combine: 2 * t.Combine, Compute: 3 * t.Compute}
}

// Efficiency returns Compute/(Compute + exposed communication): without overlap all
// of Comm is exposed, with it Comm − Compute, if positive. It is NaN when Compute is
// not positive, which no Time from Predict has.
func (t Time) Efficiency(overlap bool) float64 {
	if !(t.Compute > 0) {
		return math.NaN()
	}
	exposed := t.Comm()
	if overlap {
		exposed = math.Max(0, exposed-t.Compute)
	}
	return t.Compute / (t.Compute + exposed)
}

// Predict returns the time of a layer of shape l on system sys with the routing
// statistics st (simulated with sys.NodeSize and l.TopK).
//
// Each op moves, per rank and each way, T·(Local + Forwarded) rows over NVLink and
// T·OffNodes rows over InfiniBand (one row per token and destination domain, forwarded
// over NVLink there to the ranks that need it), each row Hidden·bytes long; the two
// kinds of link run at once, so an op takes the longer of bytes/(GBps·Eff) over the
// two. The expert GEMMs (gate, up and down) take 6·T·TopK·Hidden·FFN flops. The load is
// taken as balanced: every rank sends, receives and computes the mean.
func Predict(sys System, st Stats, l Layer) (Time, error) {
	switch {
	case sys.NodeSize < 1:
		return Time{}, fmt.Errorf("epmodel: Predict sys.NodeSize is %d, want ≥ 1", sys.NodeSize)
	case st.Tokens < 1 || st.Routing.NodeSize != sys.NodeSize:
		return Time{}, fmt.Errorf("epmodel: Predict st is of %d tokens with NodeSize %d, want ≥ 1 token with NodeSize %d", st.Tokens, st.Routing.NodeSize, sys.NodeSize)
	case st.Routing.TopK != l.TopK:
		return Time{}, fmt.Errorf("epmodel: Predict st has TopK %d, want l.TopK (%d)", st.Routing.TopK, l.TopK)
	case l.Tokens < 1 || l.Hidden < 1 || l.FFN < 1:
		return Time{}, fmt.Errorf("epmodel: Predict l has Tokens %d, Hidden %d, FFN %d, want each ≥ 1", l.Tokens, l.Hidden, l.FFN)
	}
	if err := positive("Predict", []string{"sys.NVLink.GBps", "sys.NVLink.Eff", "sys.IB.GBps", "sys.IB.Eff", "l.DispatchBytes", "l.CombineBytes", "l.TFLOPs"},
		sys.NVLink.GBps, sys.NVLink.Eff, sys.IB.GBps, sys.IB.Eff, l.DispatchBytes, l.CombineBytes, l.TFLOPs); err != nil {
		return Time{}, err
	}
	nvl := float64(l.Tokens) * (st.Local + st.Forwarded) * float64(l.Hidden)
	ib := float64(l.Tokens) * st.OffNodes * float64(l.Hidden)
	op := func(bytes float64) float64 {
		return math.Max(nvl*bytes/sys.NVLink.rate(), ib*bytes/sys.IB.rate())
	}
	return Time{
		Dispatch: op(l.DispatchBytes),
		Combine:  op(l.CombineBytes),
		Compute:  6 * float64(l.Tokens) * float64(l.TopK) * float64(l.Hidden) * float64(l.FFN) / (l.TFLOPs * 1e12),
	}, nil
}

// Calibrate returns the fraction of a link of gbps GB/s each way that a run reached
// when it moved bytes each way in seconds.
func Calibrate(bytes, seconds, gbps float64) (float64, error) {
	if err := positive("Calibrate", []string{"bytes", "seconds", "gbps"}, bytes, seconds, gbps); err != nil {
		return 0, err
	}
	return bytes / seconds / (gbps * 1e9), nil
}

// positive returns an error naming the first of values that is not finite and
// positive, by its name in names, for the function fn.
func positive(fn string, names []string, values ...float64) error {
	for i, v := range values {
		if !(v > 0) || math.IsInf(v, 0) {
			return fmt.Errorf("epmodel: %s %s is %v, want a finite value > 0", fn, names[i], v)
		}
	}
	return nil
}
