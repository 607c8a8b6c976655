package gemm_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/dropless/dropless/quant"
)

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
func BenchmarkRaggedDot(b *testing.B) { benchmark(b, fwd, benchCall) }

// BenchmarkRaggedDotWeightGrad times the weight-gradient form likewise.
func BenchmarkRaggedDotWeightGrad(b *testing.B) { benchmark(b, wgrad, benchCall) }

// benchmark runs bench for form f on each device, in a sub-benchmark per baseline case
// (one small case on the CPU) named device/case.
func benchmark(b *testing.B, f form, bench func(*testing.B, *device.Device, form, baseline.Case)) {
	for _, d := range dt.Devices(b) {
		cases := baseline.Cases()
		if !d.IsCUDA() {
			cases = []baseline.Case{baseline.CPUCase()}
		}
		for _, bc := range cases {
			b.Run(d.String()+"/"+bc.Name, func(b *testing.B) { bench(b, d, f, bc) })
		}
	}
}

func benchCall(b *testing.B, d *device.Device, f form, bc baseline.Case) {
	s := d.Stream()
	G, M, K, N := bc.G, bc.M, bc.K, bc.N
	sizes := dt.Must(device.FromSlice(s, device.I32, bc.Sizes(), G))
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
	timeCalls(b, s, 2*float64(M)*float64(K)*float64(N), call)
}

// timeCalls times call on s between two events after two warm-up calls (compile, load)
// and reports flops per call as TFLOP/s.
func timeCalls(b *testing.B, s *device.Stream, flops float64, call func() error) {
	d := s.Device()
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
	b.ReportMetric(flops*float64(b.N)/el.Seconds()/1e12, "TFLOP/s")
	dt.NoErr(b, gemm.CheckStatus(s))
}

// BenchmarkRaggedDotBlockwise times the blockwise FP8 forward (E4M3 operands, bf16
// output) on the baseline cases (one small case on the CPU), reporting TFLOP/s =
// 2·M·K·N / time, the bf16 product's count. The FP8 operands are quantized once, outside
// the timed loop, by package quant from random bf16 data (f32 scales).
func BenchmarkRaggedDotBlockwise(b *testing.B) { benchmark(b, fwd, blockBenchCall) }

// BenchmarkRaggedDotBlockwiseInputGrad times the blockwise FP8 input gradient likewise.
func BenchmarkRaggedDotBlockwiseInputGrad(b *testing.B) { benchmark(b, dgrad, blockBenchCall) }

// BenchmarkRaggedDotBlockwiseWeightGrad times the blockwise FP8 weight gradient likewise,
// its operands quantized in the case's groups.
func BenchmarkRaggedDotBlockwiseWeightGrad(b *testing.B) { benchmark(b, wgrad, blockBenchCall) }

func blockBenchCall(b *testing.B, d *device.Device, f form, bc baseline.Case) {
	s := d.Stream()
	G, M, K, N := bc.G, bc.M, bc.K, bc.N
	ts := device.NewTemps(s)
	defer ts.Free()
	sizes := dt.Must(device.FromSlice(s, device.I32, bc.Sizes(), G))
	ts.Add(sizes)
	// random returns a bf16 tensor of shape filled with N(0, scale²) values; free it.
	random := func(seed uint64, scale float32, shape ...int) *device.Tensor {
		t := dt.Must(s.Alloc(device.BF16, shape...))
		randomFill(b, s, t, seed, scale)
		return t
	}
	opt := quant.BlockOptions{Format: quant.E4M3, Dir: quant.Rowwise}
	if f == wgrad {
		opt.Dir, opt.GroupSizes = quant.Columnwise, sizes
	}
	var qs []*quant.Blockwise
	var w *quant.BlockwiseWeights
	defer func() {
		for _, q := range qs {
			q.Free()
		}
		w.Free()
	}()
	acts := func(seed uint64, k int) *quant.Blockwise {
		src := random(seed, 1, M, k)
		defer src.Free()
		q := dt.Must(quant.QuantizeBlockwise(s, src, opt))
		qs = append(qs, q)
		if q.Status != nil {
			dt.NoErr(b, q.Status.Check(s))
		}
		return q
	}
	if f != wgrad {
		src := random(2, 0.02, G, K, N)
		w = dt.Must(quant.QuantizeWeights(s, src, quant.BlockOptions{Format: quant.E4M3}))
		src.Free()
	}
	var call func() error
	switch f {
	case fwd:
		x, y := acts(1, K), ts.Alloc(device.BF16, M, N)
		call = func() error { return gemm.RaggedDotBlockwise(s, y, x, w, sizes, nil) }
	case dgrad:
		dy, dx := acts(3, N), ts.Alloc(device.BF16, M, K)
		call = func() error { return gemm.RaggedDotBlockwiseInputGrad(s, dx, dy, w, sizes, nil) }
	default:
		x, dy, dw := acts(1, K), acts(3, N), ts.Alloc(device.BF16, G, K, N)
		call = func() error { return gemm.RaggedDotBlockwiseWeightGrad(s, dw, x, dy, sizes, nil) }
	}
	dt.NoErr(b, ts.Err())
	timeCalls(b, s, 2*float64(M)*float64(K)*float64(N), call)
}
