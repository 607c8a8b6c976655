package gemm_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/internal/baseline"
)

// benchCase is a row of the baseline table of the GPU README.
type benchCase struct {
	name       string
	G, M, K, N int
	dist       string // uniform or skewed
}

var benchCases = []benchCase{
	{"dsv3_wi_ep8_uniform", 32, 65536, 7168, 4096, "uniform"},
	{"dsv3_wi_ep8_skewed", 32, 65536, 7168, 4096, "skewed"},
	{"dsv3_wo_ep8_uniform", 32, 65536, 2048, 7168, "uniform"},
	{"mixtral_wi_uniform", 8, 32768, 4096, 28672, "uniform"},
	{"qwen3_30b_wi_uniform", 128, 32768, 2048, 1536, "uniform"},
	{"qwen3_30b_wi_skewed", 128, 32768, 2048, 1536, "skewed"},
	{"qwen3_30b_small_uniform", 128, 2048, 2048, 1536, "uniform"},
}

// cpuBenchCase is the one case benchmarked on the CPU.
var cpuBenchCase = benchCase{"tiny_uniform", 8, 512, 256, 256, "uniform"}

func TestAnchorSizes(t *testing.T) {
	if d := cmp.Diff([]int32{2, 2, 2, 4}, baseline.GroupSizes(4, 10, "uniform")); d != "" {
		t.Errorf("uniform sizes (-want +got):\n%s", d)
	}
	for _, bc := range benchCases {
		s := baseline.GroupSizes(bc.G, bc.M, bc.dist)
		sum, empty := 0, 0
		for _, v := range s {
			if v < 0 {
				t.Fatalf("%s: negative size", bc.name)
			}
			sum += int(v)
			if v == 0 {
				empty++
			}
		}
		if sum != bc.M {
			t.Errorf("%s: sizes sum to %d, want %d", bc.name, sum, bc.M)
		}
		if bc.dist == "skewed" && empty < bc.G/8 {
			t.Errorf("%s: %d empty groups, want at least %d", bc.name, empty, bc.G/8)
		}
	}
}

// randomFill fills t with N(0, scale²) values: a random block uploaded once and copied
// over t, which is enough to keep the tensor cores' inputs realistic.
func randomFill(b *testing.B, s *device.Stream, t *device.Tensor, seed uint64, scale float32) {
	b.Helper()
	n := t.Len()
	blk := min(n, 1<<22)
	src := dt.Must(device.FromFloat32(s, t.DType(), dt.Normal(dt.Rand(seed), blk, scale), blk))
	for off := 0; off < n; off += blk {
		m := min(blk, n-off)
		dst := dt.Must(t.View(off, m))
		sv := dt.Must(src.View(0, m))
		dt.NoErr(b, device.Copy(s, dst, sv))
	}
	src.Free()
}

// BenchmarkRaggedDot times the forward form, bf16 in and out, on the baseline cases
// (one small case on the CPU), reporting TFLOP/s = 2·M·K·N / time.
func BenchmarkRaggedDot(b *testing.B) { benchmark(b, fwd) }

// BenchmarkRaggedDotWeightGrad times the weight-gradient form likewise.
func BenchmarkRaggedDotWeightGrad(b *testing.B) { benchmark(b, wgrad) }

func benchmark(b *testing.B, f form) {
	for _, d := range dt.Devices(b) {
		cases := benchCases
		if !d.IsCUDA() {
			cases = []benchCase{cpuBenchCase}
		}
		for _, bc := range cases {
			b.Run(d.String()+"/"+bc.name, func(b *testing.B) { benchCall(b, d, f, bc) })
		}
	}
}

func benchCall(b *testing.B, d *device.Device, f form, bc benchCase) {
	s := d.Stream()
	G, M, K, N := bc.G, bc.M, bc.K, bc.N
	sizes := dt.Must(device.FromSlice(s, device.I32, baseline.GroupSizes(G, M, bc.dist), G))
	x := dt.Must(s.Alloc(device.BF16, M, K))
	randomFill(b, s, x, 1, 1)
	var other, out *device.Tensor
	if f == fwd {
		other = dt.Must(s.Alloc(device.BF16, G, K, N))
		randomFill(b, s, other, 2, 0.02)
		out = dt.Must(s.Alloc(device.BF16, M, N))
	} else {
		other = dt.Must(s.Alloc(device.BF16, M, N))
		randomFill(b, s, other, 3, 1)
		out = dt.Must(s.Alloc(device.BF16, G, K, N))
	}
	defer func() {
		for _, t := range []*device.Tensor{sizes, x, other, out} {
			t.Free()
		}
	}()
	call := func() error {
		if f == fwd {
			return gemm.RaggedDot(s, out, x, other, sizes, nil)
		}
		return gemm.RaggedDotWeightGrad(s, out, x, other, sizes, nil)
	}
	for range 2 { // compile, load, warm up
		dt.NoErr(b, call())
	}
	dt.NoErr(b, s.Synchronize())
	start := dt.Must(d.NewEvent())
	stop := dt.Must(d.NewEvent())
	defer start.Close()
	defer stop.Close()
	b.ResetTimer()
	dt.NoErr(b, start.Record(s))
	for i := 0; i < b.N; i++ {
		if err := call(); err != nil {
			b.Fatal(err)
		}
	}
	dt.NoErr(b, stop.Record(s))
	dt.NoErr(b, stop.Synchronize())
	b.StopTimer()
	el := dt.Must(stop.Since(start))
	flops := 2 * float64(M) * float64(K) * float64(N) * float64(b.N)
	b.ReportMetric(flops/el.Seconds()/1e12, "TFLOP/s")
	dt.NoErr(b, gemm.CheckStatus(s))
}
