package main

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

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

// TestGemmCases checks the cases that -gemm and -gemm-shape select and the format of
// their peer figures.
func TestGemmCases(t *testing.T) {
	custom := baseline.Case{Name: "custom_uniform", G: 3, M: 50, K: 16, N: 8, Skew: "uniform"}
	for _, c := range []struct {
		name    string
		o       options
		gpu     bool
		want    []baseline.Case
		wantErr string
	}{
		{name: "cpu default", want: []baseline.Case{baseline.CPUCase()}},
		{name: "gpu default", gpu: true, want: baseline.Cases()},
		{name: "named", o: options{Gemm: "qwen3_30b_small_uniform, tiny_uniform"},
			want: []baseline.Case{baseline.Cases()[6], baseline.CPUCase()}},
		{name: "shape", o: options{Gemm: "tiny_uniform", Shape: "3,50,16,8"}, want: []baseline.Case{baseline.CPUCase(), custom}},
		{name: "unknown", o: options{Gemm: "dsv3"}, wantErr: `-gemm: unknown case "dsv3"`},
		{name: "bad shape", o: options{Shape: "3,50,0,8"}, wantErr: `-gemm-shape "3,50,0,8"`},
	} {
		got, err := gemmCases(c.o, c.gpu)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%s: error %v, want one containing %q", c.name, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if d := cmp.Diff(c.want, got); d != "" {
			t.Errorf("%s: cases (-want +got):\n%s", c.name, d)
		}
	}
	for _, c := range []struct {
		v    float64
		want string
	}{{653, "653 TFLOP/s"}, {45, "45 TFLOP/s"}, {0, ""}} {
		if got := peerRate(c.v); got != c.want {
			t.Errorf("peerRate(%g) = %q, want %q", c.v, got, c.want)
		}
	}
}
