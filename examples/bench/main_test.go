package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/internal/baseline"
	"github.com/dropless/dropless/moe"
)

// TestRun runs every primitive at small sizes on the CPU and checks the table: each row
// in the columns of the header, with a time and a rate, and the rows of each primitive.
func TestRun(t *testing.T) {
	o := options{Device: "cpu", Only: "copy,gemm,fp8,quant,ep,moe", Gemm: "tiny_uniform", Shape: "3,50,16,16", EPTransport: "world",
		MoePrecision: "bf16,blockwise,mxfp8", MinTime: time.Millisecond, CopyBytes: 1 << 16, QuantM: 64, QuantK: 96,
		MoeT: 32, MoeH: 16, MoeF: 16, MoeE: 4, MoeK: 2, EPRanks: 2, EPT: 16, EPH: 8, EPE: 4, EPK: 2}
	var out strings.Builder
	if err := run(&out, o); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) < 2 || !strings.HasPrefix(lines[0], "device: cpu") || !strings.HasPrefix(lines[1], "primitive") {
		t.Fatalf("table does not start with the device and the header:\n%s", out.String())
	}
	// The columns are 20, 62 and 10 characters wide (the time right-aligned), two
	// spaces apart.
	rowRE := regexp.MustCompile(`^(\S.{19})  (\S.{61})  ( *[0-9]+\.[0-9]+ (?:s|ms|µs))  ([0-9.]+) ([TG](?:FLOP|B)/s(?: \(.+\))?)$`)
	count := map[string]int{}
	names := map[string][]string{}
	for _, l := range lines[2:] {
		m := rowRE.FindStringSubmatch(l)
		if m == nil || utf8.RuneCountInString(m[3]) != 10 {
			t.Errorf("row %q is not in the table's columns", l)
			continue
		}
		if v, err := strconv.ParseFloat(m[4], 64); err != nil || !(v > 0) {
			t.Errorf("row %q: rate %q", l, m[4])
		}
		prim := strings.TrimSpace(m[1])
		count[prim]++
		names[prim] = append(names[prim], strings.TrimSpace(m[2]))
	}
	wantCount := map[string]int{
		"copy": 1, "gemm forward": 2, "gemm input grad": 2, "gemm weight grad": 2,
		"fp8 forward": 4, "fp8 input grad": 4, "fp8 weight grad": 4, "fp8 quant rowwise": 4, "fp8 quant weights": 4, "fp8 quant grouped": 4,
		"quant rowwise": 1, "quant both": 1, "quant grouped both": 1, "ep dispatch+combine": 1, "moe layer forward": 3, "moe layer fwd+bwd": 3,
	}
	if d := cmp.Diff(wantCount, count); d != "" {
		t.Errorf("rows per primitive (-want +got):\n%s", d)
	}
	for prim, want := range map[string][]string{
		"fp8 forward": {"tiny_uniform G=8 M=512 K=256 N=256 blockwise", "tiny_uniform G=8 M=512 K=256 N=256 mxfp8",
			"custom_uniform G=3 M=50 K=16 N=16 blockwise", "custom_uniform G=3 M=50 K=16 N=16 mxfp8"},
		"fp8 quant grouped": {"tiny_uniform x M×K grouped columnwise, blockwise", "tiny_uniform x M×K grouped columnwise, mxfp8",
			"custom_uniform x M×K grouped columnwise, blockwise", "custom_uniform x M×K grouped columnwise, mxfp8"},
		"moe layer fwd+bwd": {"T=32 H=16 F=16 E=4 K=2 bf16", "T=32 H=16 F=16 E=4 K=2 blockwise, weights requantized",
			"T=32 H=16 F=16 E=4 K=2 mxfp8, weights requantized"},
	} {
		if d := cmp.Diff(want, names[prim]); d != "" {
			t.Errorf("%s rows (-want +got):\n%s", prim, d)
		}
	}
	if t.Failed() {
		t.Logf("table:\n%s", out.String())
	}
}

// TestPrecisions checks the precisions that -moe-precision selects, and the errors of
// bad values and of shapes that the FP8 forms cannot run.
func TestPrecisions(t *testing.T) {
	all := []moe.Precision{moe.PrecisionBF16, moe.PrecisionBlockwise, moe.PrecisionMXFP8}
	for _, c := range []struct {
		list    string
		want    []moe.Precision
		wantErr string
	}{
		{list: "bf16,blockwise,mxfp8", want: all},
		{list: precisionNames(","), want: all},
		{list: " mxfp8, bf16", want: []moe.Precision{moe.PrecisionMXFP8, moe.PrecisionBF16}},
		{list: "fp8", wantErr: `-moe-precision: unknown precision "fp8"; known: bf16, blockwise, mxfp8`},
		{list: "BF16", wantErr: `-moe-precision: unknown precision "BF16"`},
		{list: "", wantErr: `-moe-precision: unknown precision ""`},
		{list: "bf16,", wantErr: `-moe-precision: unknown precision ""`},
		{list: "mxfp8,bf16,mxfp8", wantErr: "-moe-precision: mxfp8 given twice"},
	} {
		got, err := moePrecisions(c.list)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%q: error %v, want one containing %q", c.list, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", c.list, err)
			continue
		}
		if d := cmp.Diff(c.want, got); d != "" {
			t.Errorf("%q: precisions (-want +got):\n%s", c.list, d)
		}
	}
	if err := moeCheck([]moe.Precision{moe.PrecisionBF16}, 16, 8); err != nil {
		t.Errorf("moeCheck(bf16, H=16, F=8): %v", err)
	}
	if err := fp8Check(append(baseline.Cases(), baseline.CPUCase())); err != nil {
		t.Errorf("fp8Check(the baseline and CPU cases): %v", err)
	}
	// Bad values fail before the table.
	for _, c := range []struct {
		name    string
		o       options
		wantErr string
	}{
		{"unknown precision", options{Only: "moe", MoePrecision: "fp8"}, `-moe-precision: unknown precision "fp8"`},
		{"fp8 layer width", options{Only: "moe", MoePrecision: "bf16,blockwise", MoeH: 16, MoeF: 8},
			"-moe-precision blockwise: -moe-hidden 16 and -moe-ffn 8 must be multiples of 16"},
		{"fp8 case width", options{Only: "fp8", MoePrecision: "bf16", Gemm: "tiny_uniform", Shape: "3,50,16,8"},
			"fp8: case custom_uniform has K=16, N=8: FP8 weights need K and N multiples of 16"},
	} {
		c.o.Device = "cpu"
		var out strings.Builder
		err := run(&out, c.o)
		if err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.wantErr)
		}
		if out.Len() != 0 {
			t.Errorf("%s: printed %q before failing", c.name, out.String())
		}
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
