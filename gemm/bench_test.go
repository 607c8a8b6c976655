package gemm_test

import (
	"flag"
	"math"
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

// BenchmarkRaggedDotInputGrad times the input-gradient form likewise: dx[M,K] =
// dy[M,N]·W_gᵀ for the rows of each group, W [G,K,N].
func BenchmarkRaggedDotInputGrad(b *testing.B) { benchmark(b, dgrad, benchCall) }

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
	// x: [M,K], or dy [M,N] for the input gradient; other: W [G,K,N], or dy [M,N] for the
	// weight gradient; out: y [M,N], dx [M,K] or dW [G,K,N].
	var x, other, out *device.Tensor
	switch f {
	case fwd, dgrad:
		in, on := K, N // x's and out's columns
		if f == dgrad {
			in, on = N, K
		}
		x = dt.Must(s.Alloc(device.BF16, M, in))
		other = dt.Must(s.Alloc(device.BF16, G, K, N))
		randomFill(b, s, other, 2, 0.02)
		out = dt.Must(s.Alloc(device.BF16, M, on))
	default:
		x = dt.Must(s.Alloc(device.BF16, M, K))
		other = dt.Must(s.Alloc(device.BF16, M, N))
		randomFill(b, s, other, 3, 1)
		out = dt.Must(s.Alloc(device.BF16, G, K, N))
	}
	randomFill(b, s, x, 1, 1)
	defer func() {
		for _, t := range []*device.Tensor{sizes, x, other, out} {
			t.Free()
		}
	}()
	call := func() error {
		switch f {
		case fwd:
			return gemm.RaggedDot(s, out, x, other, sizes, nil)
		case dgrad:
			return gemm.RaggedDotInputGrad(s, out, x, other, sizes, nil)
		}
		return gemm.RaggedDotWeightGrad(s, out, x, other, sizes, nil)
	}
	timeCalls(b, s, 2*float64(M)*float64(K)*float64(N), call)
}

// BenchmarkRaggedDotUnaligned times the forward form, bf16 in and out, on G=8 uniform
// groups of M=32768 rows at K×N = 4096×4096 (aligned: k4096) and at unaligned
// neighbours that run on padded copies on the H100 and H200: K=4100 (even, not a
// multiple of 8: k4100), K=4099 (odd: k4099), N=4100 (n4100). TFLOP/s count the real
// shape's 2·M·K·N. On the CPU the shapes are 16 times smaller in M, K and N (M=2048,
// K×N = 256×256, 260, 259), named alike.
func BenchmarkRaggedDotUnaligned(b *testing.B) { unalignedBenchmark(b, fwd) }

// BenchmarkRaggedDotInputGradUnaligned times the input-gradient form likewise: dx[M,K] =
// dy[M,N]·W_gᵀ with W [G,K,N] of the same K×N.
func BenchmarkRaggedDotInputGradUnaligned(b *testing.B) { unalignedBenchmark(b, dgrad) }

// BenchmarkRaggedDotWeightGradUnaligned times the weight-gradient form likewise: dW[G,K,N]
// from x[M,K] and dy[M,N].
func BenchmarkRaggedDotWeightGradUnaligned(b *testing.B) { unalignedBenchmark(b, wgrad) }

func unalignedBenchmark(b *testing.B, f form) {
	cases := []struct {
		name string
		K, N int // added to 4096 (GPU) or 256 (CPU)
	}{{"k4096", 0, 0}, {"k4100", 4, 0}, {"k4099", 3, 0}, {"n4100", 0, 4}}
	for _, d := range dt.Devices(b) {
		M, dim := 32768, 4096
		if !d.IsCUDA() {
			M, dim = 2048, 256
		}
		for _, c := range cases {
			bc := baseline.Case{Name: c.name, G: 8, M: M, K: dim + c.K, N: dim + c.N, Skew: "uniform"}
			b.Run(d.String()+"/"+c.name, func(b *testing.B) { benchCall(b, d, f, bc) })
		}
	}
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

// BenchmarkRaggedDotMXFP8 times the MXFP8 forward (E4M3 operands, RCEIL scales, bf16
// output) as BenchmarkRaggedDotBlockwise times the blockwise one.
func BenchmarkRaggedDotMXFP8(b *testing.B) { benchmark(b, fwd, mxBenchCall) }

// BenchmarkRaggedDotMXFP8InputGrad times the MXFP8 input gradient likewise.
func BenchmarkRaggedDotMXFP8InputGrad(b *testing.B) { benchmark(b, dgrad, mxBenchCall) }

// BenchmarkRaggedDotMXFP8WeightGrad times the MXFP8 weight gradient likewise, its operands
// quantized in the case's groups, transposed.
func BenchmarkRaggedDotMXFP8WeightGrad(b *testing.B) { benchmark(b, wgrad, mxBenchCall) }

func blockBenchCall(b *testing.B, d *device.Device, f form, bc baseline.Case) {
	fp8BenchCall(b, d, f, bc, blockwiseFam)
}

func mxBenchCall(b *testing.B, d *device.Device, f form, bc baseline.Case) {
	fp8BenchCall(b, d, f, bc, mxFam)
}

// fp8BenchCall times family fam's form f on case bc, its operands quantized (E4M3) once
// before the timed loop.
func fp8BenchCall(b *testing.B, d *device.Device, f form, bc baseline.Case, fam family) {
	s := d.Stream()
	G, M, K, N := bc.G, bc.M, bc.K, bc.N
	ts := device.NewTemps(s)
	defer ts.Free()
	sizes := dt.Must(device.FromSlice(s, device.I32, bc.Sizes(), G))
	ts.Add(sizes)
	var qs []quantized
	defer func() {
		for _, q := range qs {
			q.Free()
		}
	}()
	// quantize quantizes a bf16 tensor of shape filled with N(0, scale²) values: weights
	// [G, K, N], or activations and gradients [M, k] (grouped for the weight gradient).
	quantize := func(seed uint64, scale float32, shape ...int) quantized {
		src := dt.Must(s.Alloc(device.BF16, shape...))
		defer src.Free()
		randomFill(b, s, src, seed, scale)
		var gs *device.Tensor
		if f == wgrad {
			gs = sizes
		}
		q, st := benchQuantize(fam, s, src, len(shape) == 3, gs)
		qs = append(qs, q)
		if st != nil {
			dt.NoErr(b, st.Check(s))
		}
		return q
	}
	var x, dy, w quantized
	var out *device.Tensor
	switch f {
	case fwd:
		x, w, out = quantize(1, 1, M, K), quantize(2, 0.02, G, K, N), ts.Alloc(device.BF16, M, N)
	case dgrad:
		x, w, out = quantize(3, 1, M, N), quantize(2, 0.02, G, K, N), ts.Alloc(device.BF16, M, K)
	default:
		x, dy, out = quantize(1, 1, M, K), quantize(3, 1, M, N), ts.Alloc(device.BF16, G, K, N)
	}
	dt.NoErr(b, ts.Err())
	call := func() error { return fp8Call(fam, f, s, out, x, dy, w, sizes, nil) }
	timeCalls(b, s, 2*float64(M)*float64(K)*float64(N), call)
	if *benchRelErr {
		b.ReportMetric(fp8RelErr(b, fam, f, s, x, dy, w, sizes, bc), "relerr")
	}
}

// benchRelErr makes the FP8 benchmarks also report each case's error (fp8RelErr), at the
// cost of an f32 product and two downloads per case.
var benchRelErr = flag.Bool("gemm.relerr", false, "FP8 benchmarks: also report each case's relative Frobenius error against the f32 form on the dequantized operands")

// fp8RelErr returns the relative Frobenius error of family fam's form f on the quantized
// operands of case bc, with f32 output, against the f32 form on the operands dequantized
// exactly (the CPU path's reference, computed on s's device).
func fp8RelErr(b *testing.B, fam family, f form, s *device.Stream, x, dy, w quantized, sizes *device.Tensor, bc baseline.Case) float64 {
	G, M, K, N := bc.G, bc.M, bc.K, bc.N
	ts := device.NewTemps(s)
	defer ts.Free()
	deq := func(q quantized, cols int, dir quant.Direction) *device.Tensor {
		t := ts.Alloc(device.F32, M, cols)
		dt.NoErr(b, ts.Err())
		switch q := q.(type) {
		case *quant.MXFP8:
			dt.NoErr(b, quant.Dequantize(s, t, q, dir))
		case *quant.Blockwise:
			dt.NoErr(b, quant.DequantizeBlockwise(s, t, q, dir))
		}
		return t
	}
	deqW := func(kMajor bool) *device.Tensor {
		t := ts.Alloc(device.F32, G, K, N)
		dt.NoErr(b, ts.Err())
		switch q := w.(type) {
		case *quant.MXFP8Weights:
			dt.NoErr(b, quant.DequantizeMXFP8Weights(s, t, q, kMajor))
		case *quant.BlockwiseWeights:
			dt.NoErr(b, quant.DequantizeWeights(s, t, q))
		}
		return t
	}
	shape := []int{M, N}
	switch f {
	case dgrad:
		shape = []int{M, K}
	case wgrad:
		shape = []int{G, K, N}
	}
	got, want := ts.Alloc(device.F32, shape...), ts.Alloc(device.F32, shape...)
	dt.NoErr(b, ts.Err())
	dt.NoErr(b, fp8Call(fam, f, s, got, x, dy, w, sizes, nil))
	switch f {
	case fwd:
		dt.NoErr(b, gemm.RaggedDot(s, want, deq(x, K, quant.Rowwise), deqW(true), sizes, nil))
	case dgrad:
		dt.NoErr(b, gemm.RaggedDotInputGrad(s, want, deq(x, N, quant.Rowwise), deqW(false), sizes, nil))
	default:
		dt.NoErr(b, gemm.RaggedDotWeightGrad(s, want, deq(x, K, quant.Columnwise), deq(dy, N, quant.Columnwise), sizes, nil))
	}
	// Both outputs, 1<<26 elements at a time (some are several GB).
	var num, den float64
	for off, n := 0, got.Len(); off < n; off += 1 << 26 {
		c := min(1<<26, n-off)
		g := dt.Must(dt.Must(got.View(off, c)).Float32s(s))
		r := dt.Must(dt.Must(want.View(off, c)).Float32s(s))
		for i, v := range r {
			d := float64(g[i]) - float64(v)
			num += d * d
			den += float64(v) * float64(v)
		}
	}
	if den == 0 {
		return 0
	}
	return math.Sqrt(num / den)
}

// benchQuantize quantizes src with family fam to E4M3 (blockwise: f32 scales; MXFP8:
// RCEIL): weights (src [G, K, N]), or activations and gradients rowwise, or with sizes
// columnwise in their groups (MXFP8: transposed). It returns the quantization's Status
// of invalid sizes (nil without groups).
func benchQuantize(fam family, s *device.Stream, src *device.Tensor, weights bool, sizes *device.Tensor) (quantized, *device.Status) {
	dir := quant.Rowwise
	if sizes != nil {
		dir = quant.Columnwise
	}
	switch {
	case fam.mx && weights:
		return dt.Must(quant.QuantizeMXFP8Weights(s, src, quant.Options{Format: quant.E4M3})), nil
	case fam.mx:
		q := dt.Must(quant.Quantize(s, src, quant.Options{Format: quant.E4M3, Dir: dir, Transpose: sizes != nil, GroupSizes: sizes}))
		return q, q.Status
	case weights:
		return dt.Must(quant.QuantizeWeights(s, src, quant.BlockOptions{Format: quant.E4M3})), nil
	}
	q := dt.Must(quant.QuantizeBlockwise(s, src, quant.BlockOptions{Format: quant.E4M3, Dir: dir, GroupSizes: sizes}))
	return q, q.Status
}
