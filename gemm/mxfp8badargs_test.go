package gemm_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// newMXArgs makes fp8Args of the MXFP8 forms: x and dy quantized in the groups, rowwise
// and columnwise (transposed).
func newMXArgs(s *device.Stream) *fp8Args[quant.MXFP8, quant.MXFP8Weights] {
	return newFP8Args(s,
		func(r recipe, v []float32, M, K int, sz []int32) *quant.MXFP8 {
			return mxfp8(s, mxFam.recipe(r), v, M, K, sz)
		},
		func(r recipe, v []float32, G, K, N int) *quant.MXFP8Weights {
			return mxWeights(s, mxFam.recipe(r), v, G, K, N)
		})
}

// TestMXFP8BadArgs feeds the MXFP8 forms nil, freed, wrong-shape, wrong-dtype, swizzled,
// untransposed and inconsistent arguments on the CPU: each returns an error naming the
// argument.
func TestMXFP8BadArgs(t *testing.T) {
	s := device.CPU().Stream()
	v := newMXArgs(s)
	al, freed := fp8BadKit(t, s)
	r := dt.Rand(2)
	e4m3 := mxFam.recipe(e4m3F32)
	x16 := mxfp8(s, e4m3, dt.Normal(r, 10*16, 1), 10, 16, nil)              // K=16
	x3 := mxfp8(s, e4m3, dt.Normal(r, 10*32, 1), 10, 32, []int32{3, 3, 4})  // 3 groups
	dy3 := mxfp8(s, e4m3, dt.Normal(r, 10*48, 1), 10, 48, []int32{3, 3, 4}) // 3 groups
	dy12 := mxfp8(s, e4m3, dt.Normal(r, 12*48, 1), 12, 48, []int32{4, 8})   // M=12
	w3 := mxWeights(s, e4m3, dt.Normal(r, 3*32*48, 1), 3, 32, 48)           // 3 groups
	xPlain := mxfp8(s, e4m3, dt.Normal(r, 10*32, 1), 10, 32, nil)           // rowwise without groups
	src := dt.Must(device.FromSlice(s, device.F32, dt.Normal(r, 10*32, 1), 10, 32))
	xCols := dt.Must(quant.Quantize(s, src, quant.Options{Dir: quant.Columnwise, Transpose: true})) // columnwise without groups
	dt.NoErr(t, src.Free())
	fwd := func(s *device.Stream, y *device.Tensor, x *quant.MXFP8, w *quant.MXFP8Weights, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotMXFP8(s, y, x, w, sz, opt) }
	}
	dgrad := func(dx *device.Tensor, dy *quant.MXFP8, w *quant.MXFP8Weights, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotMXFP8InputGrad(s, dx, dy, w, sz, opt) }
	}
	wgrad := func(dw *device.Tensor, x, dy *quant.MXFP8, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotMXFP8WeightGrad(s, dw, x, dy, sz, opt) }
	}
	for _, call := range []func() error{fwd(s, v.y, v.x, v.w, v.sizes, nil), fwd(s, v.y, xPlain, v.w, v.sizes, nil),
		dgrad(v.dx, v.dy, v.w, v.sizes, nil), wgrad(v.dw, v.x, v.dy, v.sizes, nil)} {
		dt.NoErr(t, call())
	}
	swizzled := func(q *quant.MXFP8) { q.Swizzled = true }
	cases := append(fp8BadCases(t, v, fp8Forms[quant.MXFP8, quant.MXFP8Weights]{fwd, dgrad, wgrad},
		fp8Odd[quant.MXFP8, quant.MXFP8Weights]{x16, x3, dy3, dy12, w3}), []badCase{
		{"fwd/x without Row", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.Row = nil }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/x without RowScale", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.RowScale = nil }), v.w, v.sizes, nil), "x.RowScale"},
		{"fwd/freed x.Row", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.Row = freed(device.E4M3, 10, 32) }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/x.Row of another format", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.Format = quant.E5M2 }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/x.RowScale shape", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.RowScale = al(device.E8M0, 10, 4) }), v.w, v.sizes, nil), "x.RowScale"},
		{"fwd/x.RowScale f32", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.RowScale = al(device.F32, v.x.RowScale.Shape()...) }), v.w, v.sizes, nil), "x.RowScale"},
		{"fwd/x.Format", fwd(s, v.y, with(v.x, func(q *quant.MXFP8) { q.Format = 7 }), v.w, v.sizes, nil), "x.Format"},
		{"fwd/x swizzled", fwd(s, v.y, with(v.x, swizzled), v.w, v.sizes, nil), "x.Swizzled"},
		{"fwd/x in other groups", fwd(s, v.y, x3, v.w, v.sizes, nil), "x"},
		{"fwd/w without KMajor", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KMajor = nil }), v.sizes, nil), "w.KMajor"},
		{"fwd/w without KScale", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KScale = nil }), v.sizes, nil), "w.KScale"},
		{"fwd/w.KScale shape", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KScale = al(device.E8M0, 2, 1, 48, 2) }), v.sizes, nil), "w.KScale"},
		{"fwd/w.KScale f32", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KScale = al(device.F32, 2, 1, 48, 4) }), v.sizes, nil), "w.KScale"},
		{"fwd/w.KMajor dtype", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KMajor = al(device.BF16, 2, 48, 32) }), v.sizes, nil), "w.KMajor"},
		{"fwd/freed w.KMajor", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.KMajor = freed(device.E4M3, 2, 48, 32) }), v.sizes, nil), "w.KMajor"},
		{"fwd/w.Format", fwd(s, v.y, v.x, with(v.w, func(w *quant.MXFP8Weights) { w.Format = -1 }), v.sizes, nil), "w.Format"},
		{"dgrad/dy without Row", dgrad(v.dx, with(v.dy, func(q *quant.MXFP8) { q.RowScale = nil }), v.w, v.sizes, nil), "dy.Row"},
		{"dgrad/dy swizzled", dgrad(v.dx, with(v.dy, swizzled), v.w, v.sizes, nil), "dy.Swizzled"},
		{"dgrad/dy in other groups", dgrad(v.dx, dy3, v.w, v.sizes, nil), "dy"},
		{"dgrad/w without NMajor", dgrad(v.dx, v.dy, with(v.w, func(w *quant.MXFP8Weights) { w.NMajor = nil }), v.sizes, nil), "w.NMajor"},
		{"dgrad/w.NScale shape", dgrad(v.dx, v.dy, with(v.w, func(w *quant.MXFP8Weights) { w.NScale = al(device.E8M0, 2, 1, 48, 4) }), v.sizes, nil), "w.NScale"},
		{"wgrad/x without ColT", wgrad(v.dw, with(v.x, func(q *quant.MXFP8) { q.ColT = nil }), v.dy, v.sizes, nil), "x.ColT"},
		{"wgrad/x untransposed", wgrad(v.dw, with(v.x, func(q *quant.MXFP8) { q.Col, q.ColT = al(device.E4M3, 10, 32), nil }), v.dy, v.sizes, nil), "x.Col"},
		{"wgrad/x without ColScale", wgrad(v.dw, with(v.x, func(q *quant.MXFP8) { q.ColScale = nil }), v.dy, v.sizes, nil), "x.ColScale"},
		{"wgrad/dy.ColScale shape", wgrad(v.dw, v.x, with(v.dy, func(q *quant.MXFP8) { q.ColScale = al(device.E8M0, 1, 128) }), v.sizes, nil), "dy.ColScale"},
		{"wgrad/dy.ColScale f32", wgrad(v.dw, v.x, with(v.dy, func(q *quant.MXFP8) { q.ColScale = al(device.F32, v.dy.ColScale.Shape()...) }), v.sizes, nil), "dy.ColScale"},
		{"wgrad/freed dy.ColT", wgrad(v.dw, v.x, with(v.dy, func(q *quant.MXFP8) { q.ColT = freed(device.E5M2, v.dy.ColT.Shape()...) }), v.sizes, nil), "dy.ColT"},
		{"wgrad/dy.ColT shape", wgrad(v.dw, v.x, with(v.dy, func(q *quant.MXFP8) { q.ColT = al(device.E5M2, 48, 10) }), v.sizes, nil), "dy.ColT"},
		{"wgrad/dy swizzled", wgrad(v.dw, v.x, with(v.dy, swizzled), v.sizes, nil), "dy.Swizzled"},
		{"wgrad/x without groups", wgrad(v.dw, xCols, v.dy, v.sizes, nil), "dy"},
		{"wgrad/dy.Format", wgrad(v.dw, v.x, with(v.dy, func(q *quant.MXFP8) { q.Format = -1 }), v.sizes, nil), "dy.Format"},
	}...)
	runBad(t, cases)
}

// TestMXFP8OtherDevice: a quantized operand on another device than the stream's is an
// error naming it.
func TestMXFP8OtherDevice(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		if !d.IsCUDA() {
			t.Skip("needs a second device")
		}
		cpu, s := newMXArgs(device.CPU().Stream()), d.Stream()
		v := newMXArgs(s)
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotMXFP8(s, v.y, cpu.x, v.w, v.sizes, nil) }, "x.Row")
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotMXFP8(s, v.y, v.x, cpu.w, v.sizes, nil) }, "w.KMajor")
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotMXFP8InputGrad(s, v.dx, v.dy, cpu.w, v.sizes, nil) }, "w.NMajor")
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotMXFP8WeightGrad(s, v.dw, v.x, cpu.dy, v.sizes, nil) }, "dy.ColT")
	})
}
