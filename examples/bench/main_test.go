package main

import (
	"testing"
	"time"

	"github.com/dropless/dropless/internal/baseline"
)

// TestRun runs every primitive at small sizes on the CPU.
func TestRun(t *testing.T) {
	o := options{Device: "cpu", Only: "copy,gemm,quant,ep,moe", Gemm: "tiny_uniform", Shape: "3,50,16,8", EPTransport: "world",
		MinTime: time.Millisecond, CopyBytes: 1 << 16, QuantM: 64, QuantK: 96,
		MoeT: 32, MoeH: 16, MoeF: 8, MoeE: 4, MoeK: 2, EPRanks: 2, EPT: 16, EPH: 8, EPE: 4, EPK: 2}
	if err := run(o); err != nil {
		t.Fatal(err)
	}
}

// TestAnchorSizes checks the group sizes against those of the gemm package's benchmarks.
func TestAnchorSizes(t *testing.T) {
	for _, c := range gemmTable {
		sum, empty := 0, 0
		for _, v := range baseline.GroupSizes(c.G, c.M, c.dist) {
			sum += int(v)
			if v == 0 {
				empty++
			}
		}
		if sum != c.M || (c.dist == "skewed" && empty < c.G/8) {
			t.Errorf("%s: sizes sum to %d with %d empty groups, want %d and ≥ %d", c.name, sum, empty, c.M, c.G/8)
		}
	}
	for _, m := range []int{64, 2048, 65536} {
		sum := 0
		for _, v := range baseline.ZipfSizes(128, m, 1) {
			if v < 0 {
				t.Fatalf("ZipfSizes(128, %d): negative size", m)
			}
			sum += int(v)
		}
		if sum != m {
			t.Errorf("ZipfSizes(128, %d) sums to %d", m, sum)
		}
	}
}
