package ep_test

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
)

// TestNCCLScenariosOnCPU runs the routing of the NCCL scenarios (the large ones among
// them, with a narrower hidden size) on an in-process CPU world, whose AllToAllV fails
// on any send a receiver does not expect, with several chunk counts: the same counts and
// chunk splits as over NCCL, where a mismatch would hang instead.
func TestNCCLScenariosOnCPU(t *testing.T) {
	for _, sc := range ncclScenarios() {
		sc.H = min(sc.H, 8)
		chunks := []int{sc.chunks}
		if strings.HasPrefix(sc.name, "R2/large") && !testing.Short() {
			chunks = []int{1, 4, 5, 7}
		}
		for _, c := range chunks {
			sc.chunks = c
			name := sc.name
			if len(chunks) > 1 {
				name = fmt.Sprintf("%s/H%d/chunks%d", sc.name, sc.H, c)
			}
			t.Run(name, func(t *testing.T) {
				ins := sc.inputs()
				check(t, sc, ins, runWorld(t, device.CPU(), sc, ins, nil))
			})
		}
	}
}

// TestDiffOuts: diffOuts finds what cmp.Diff found, and compares the 1e7 elements that
// took cmp.Diff 16 s in a small fraction of that.
func TestDiffOuts(t *testing.T) {
	mk := func(n int) []*rankOut {
		outs := make([]*rankOut, 2)
		for r := range outs {
			o := &rankOut{TokTo: []int{1, 2}, Capacity: 7, Origins: []int32{0, 1, 2}, X: make([]float32, n), Bytes: [][]int64{{0, 5}, {6, 0}}}
			for i := range o.X {
				o.X[i] = float32(i%977) / 8
			}
			outs[r] = o
		}
		return outs
	}
	const n = 5_000_000
	want, got := mk(n), mk(n)
	start := time.Now()
	if d := diffOuts(want, got); d != "" {
		t.Fatalf("equal outputs differ:\n%s", d)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("comparing 2 × %d elements took %v", n, el)
	}
	got[1].X[123] = float32(math.Copysign(0, -1)) + 1
	got[0].Capacity = 8
	got[1].Bytes[1][0] = 7
	got[0].Origins = got[0].Origins[:2]
	d := diffOuts(want, got)
	for _, s := range []string{"rank 1: X[123] = 1, want 15.375", "rank 0: Capacity[0] = 8, want 7", "rank 1: Bytes[1][0] = 7, want 6", "rank 0: Origins: 2 elements, want 3"} {
		if !strings.Contains(d, s) {
			t.Errorf("diff lacks %q:\n%s", s, d)
		}
	}
	nan := mk(1)
	nan[0].X[0] = float32(math.NaN())
	if diffOuts(nan, nan) == "" {
		t.Error("NaN compares equal, unlike in cmp.Diff")
	}
}
