package epmodel

import (
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// TestTwoGPUs checks that the model calibrated by the two-GPU run predicts that run
// back: R = 2, E = 64, K = 8, T = 16384, H = 7168 bf16 in 1.89 ms.
func TestTwoGPUs(t *testing.T) {
	eff, err := Calibrate(twoGPUBytes, twoGPUSeconds, nvlink4)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(eff-0.5526) > 1e-4 {
		t.Errorf("Calibrate = %v, want 0.5526 (248.7 of 450 GB/s)", eff)
	}
	st, err := Simulate(Routing{Ranks: 2, Experts: 64, TopK: 8, NodeSize: 8}, 30000, 1)
	if err != nil {
		t.Fatal(err)
	}
	tm, err := Predict(System{NodeSize: 8, NVLink: Link{nvlink4, eff}, IB: Link{50, eff}}, st, dsv3(false))
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(tm.Comm()/twoGPUSeconds-1) > 0.01 || tm.Dispatch != tm.Combine {
		t.Errorf("Predict: dispatch %v + combine %v s, want 1.89 ms within 1%%, halves equal", tm.Dispatch, tm.Combine)
	}
}

func TestPredict(t *testing.T) {
	st := Stats{Routing: Routing{NodeSize: 8, TopK: 2}, Tokens: 1, Local: 1, Forwarded: 2, OffNodes: 1.5}
	l := Layer{Tokens: 1000, Hidden: 100, FFN: 50, TopK: 2, DispatchBytes: 2, CombineBytes: 1, TFLOPs: 1}
	for _, c := range []struct {
		name string
		sys  System
		want Time
	}{
		// NVLink: 1000·3·100 elements at 50 GB/s, IB: 1000·1.5·100 at 5 GB/s; the
		// GEMMs: 6·1000·2·100·50 flops at 1 TFLOP/s.
		{"IB-bound", System{NodeSize: 8, NVLink: Link{100, 0.5}, IB: Link{10, 0.5}}, Time{Dispatch: 60e-6, Combine: 30e-6, Compute: 60e-6}},
		{"NVLink-bound", System{NodeSize: 8, NVLink: Link{10, 1}, IB: Link{100, 1}}, Time{Dispatch: 60e-6, Combine: 30e-6, Compute: 60e-6}},
		{"IB-bound, NVLink nearly", System{NodeSize: 8, NVLink: Link{20, 1}, IB: Link{5, 1}}, Time{Dispatch: 60e-6, Combine: 30e-6, Compute: 60e-6}},
		{"fast", System{NodeSize: 8, NVLink: Link{600, 1}, IB: Link{150, 1}}, Time{Dispatch: 2e-6, Combine: 1e-6, Compute: 60e-6}},
	} {
		got, err := Predict(c.sys, st, l)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(c.want, got, cmpopts.EquateApprox(1e-12, 0)); d != "" {
			t.Errorf("%s: Predict (-want +got):\n%s", c.name, d)
		}
	}
}

func TestEfficiency(t *testing.T) {
	for _, c := range []struct {
		t       Time
		overlap bool
		want    float64
	}{
		{Time{Dispatch: 2, Combine: 3, Compute: 10}, false, 10.0 / 15},
		{Time{Dispatch: 2, Combine: 3, Compute: 10}, true, 1},
		{Time{Dispatch: 5, Combine: 5, Compute: 10}, true, 1},
		{Time{Dispatch: 10, Combine: 10, Compute: 10}, true, 0.5},
		{Time{Compute: 10}, false, 1},
		{Time{Dispatch: 10, Combine: 10, Compute: 10}.WithBackward(), true, 0.75},
		{Time{Dispatch: 10, Combine: 10, Compute: 10}.WithBackward(), false, 30.0 / 70},
	} {
		if got := c.t.Efficiency(c.overlap); math.Abs(got-c.want) > 1e-15 {
			t.Errorf("%+v.Efficiency(%v) = %v, want %v", c.t, c.overlap, got, c.want)
		}
	}
	if got := (Time{Dispatch: 1}).Efficiency(true); !math.IsNaN(got) {
		t.Errorf("Efficiency without compute = %v, want NaN", got)
	}
}

func TestModelErrors(t *testing.T) {
	sys := System{NodeSize: 8, NVLink: Link{450, 0.5}, IB: Link{50, 0.5}}
	st := Stats{Routing: Routing{NodeSize: 8, TopK: 8}, Tokens: 10}
	for _, c := range []struct {
		mod  func(*System, *Stats, *Layer)
		want string
	}{
		{func(s *System, _ *Stats, _ *Layer) { s.NodeSize = 0 }, "sys.NodeSize is 0"},
		{func(s *System, _ *Stats, _ *Layer) { s.NodeSize = 72 }, "NodeSize 8, want ≥ 1 token with NodeSize 72"},
		{func(_ *System, st *Stats, _ *Layer) { st.Tokens = 0 }, "st is of 0 tokens"},
		{func(_ *System, _ *Stats, l *Layer) { l.TopK = 4 }, "st has TopK 8, want l.TopK (4)"},
		{func(_ *System, _ *Stats, l *Layer) { l.Hidden = 0 }, "Hidden 0"},
		{func(_ *System, _ *Stats, l *Layer) { l.Tokens = 0 }, "Tokens 0"},
		{func(s *System, _ *Stats, _ *Layer) { s.NVLink.GBps = 0 }, "sys.NVLink.GBps is 0"},
		{func(s *System, _ *Stats, _ *Layer) { s.IB.Eff = math.NaN() }, "sys.IB.Eff is NaN"},
		{func(_ *System, _ *Stats, l *Layer) { l.DispatchBytes = -2 }, "l.DispatchBytes is -2"},
		{func(_ *System, _ *Stats, l *Layer) { l.TFLOPs = math.Inf(1) }, "l.TFLOPs is +Inf"},
	} {
		s, st, l := sys, st, dsv3(false)
		c.mod(&s, &st, &l)
		if _, err := Predict(s, st, l); err == nil || !strings.HasPrefix(err.Error(), "epmodel: Predict ") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Predict error %v, want %q", err, c.want)
		}
	}
	for _, c := range []struct {
		bytes, seconds, gbps float64
		want                 string
	}{
		{0, 1, 1, "bytes is 0"},
		{1, -1, 1, "seconds is -1"},
		{1, 1, math.Inf(1), "gbps is +Inf"},
	} {
		if _, err := Calibrate(c.bytes, c.seconds, c.gbps); err == nil || !strings.Contains(err.Error(), "epmodel: Calibrate "+c.want) {
			t.Errorf("Calibrate(%v, %v, %v) error %v, want %q", c.bytes, c.seconds, c.gbps, err, c.want)
		}
	}
}
