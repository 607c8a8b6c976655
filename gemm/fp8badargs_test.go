package gemm_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// fp8Args are valid arguments of the FP8 forms of one recipe (Q its quantized
// activations, W its weights) on one device: M=10 rows in two groups, K=32, N=48.
type fp8Args[Q, W any] struct {
	s         *device.Stream
	sizes     *device.Tensor
	x, dy     *Q
	w         *W
	y, dx, dw *device.Tensor
}

// newFP8Args makes the arguments with the recipe's quantizers: acts(r, v, M, K, sizes)
// quantizes activations or gradients in the groups of sizes, weights(r, v, G, K, N) the
// weights; x and w with the recipe e4m3F32, dy with e5m2Pow2 (as the family maps them).
func newFP8Args[Q, W any](s *device.Stream, acts func(r recipe, v []float32, M, K int, sizes []int32) *Q,
	weights func(r recipe, v []float32, G, K, N int) *W) *fp8Args[Q, W] {
	r := dt.Rand(1)
	sz := []int32{4, 6}
	return &fp8Args[Q, W]{s: s,
		sizes: dt.Must(device.FromSlice(s, device.I32, sz, 2)),
		x:     acts(e4m3F32, dt.Normal(r, 10*32, 1), 10, 32, sz),
		dy:    acts(e5m2Pow2, dt.Normal(r, 10*48, 1), 10, 48, sz),
		w:     weights(e4m3F32, dt.Normal(r, 2*32*48, 1), 2, 32, 48),
		y:     dt.Must(s.Alloc(device.F32, 10, 48)),
		dx:    dt.Must(s.Alloc(device.BF16, 10, 32)),
		dw:    dt.Must(s.Alloc(device.F32, 2, 32, 48)),
	}
}

func newBlockArgs(s *device.Stream) *fp8Args[quant.Blockwise, quant.BlockwiseWeights] {
	return newFP8Args(s,
		func(r recipe, v []float32, M, K int, sz []int32) *quant.Blockwise {
			return blockwise(s, r, v, M, K, sz)
		},
		func(r recipe, v []float32, G, K, N int) *quant.BlockwiseWeights {
			return blockwiseWeights(s, r, v, G, K, N)
		})
}

// with returns a copy of q (a quantized operand) edited by edit.
func with[Q any](q *Q, edit func(q *Q)) *Q {
	c := *q
	edit(&c)
	return &c
}

// TestBlockwiseBadArgs feeds the blockwise forms nil, freed, wrong-shape, wrong-dtype and
// inconsistent arguments on the CPU: each returns an error naming the argument.
func TestBlockwiseBadArgs(t *testing.T) {
	s := device.CPU().Stream()
	v := newBlockArgs(s)
	al, freed := fp8BadKit(t, s)
	r := dt.Rand(2)
	x16 := blockwise(s, e4m3F32, dt.Normal(r, 10*16, 1), 10, 16, []int32{4, 6})    // K=16
	dy3 := blockwise(s, e4m3F32, dt.Normal(r, 10*48, 1), 10, 48, []int32{3, 3, 4}) // 3 groups
	x3 := blockwise(s, e4m3F32, dt.Normal(r, 10*32, 1), 10, 32, []int32{3, 3, 4})  // 3 groups
	dy12 := blockwise(s, e4m3F32, dt.Normal(r, 12*48, 1), 12, 48, []int32{4, 8})   // M=12
	w3 := blockwiseWeights(s, e4m3F32, dt.Normal(r, 3*32*48, 1), 3, 32, 48)        // 3 groups
	fwd := func(s *device.Stream, y *device.Tensor, x *quant.Blockwise, w *quant.BlockwiseWeights, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotBlockwise(s, y, x, w, sz, opt) }
	}
	dgrad := func(dx *device.Tensor, dy *quant.Blockwise, w *quant.BlockwiseWeights, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotBlockwiseInputGrad(s, dx, dy, w, sz, opt) }
	}
	wgrad := func(dw *device.Tensor, x, dy *quant.Blockwise, sz *device.Tensor, opt *gemm.Options) func() error {
		return func() error { return gemm.RaggedDotBlockwiseWeightGrad(s, dw, x, dy, sz, opt) }
	}
	for _, call := range []func() error{fwd(s, v.y, v.x, v.w, v.sizes, nil), dgrad(v.dx, v.dy, v.w, v.sizes, nil), wgrad(v.dw, v.x, v.dy, v.sizes, nil)} {
		dt.NoErr(t, call())
	}
	cases := append(fp8BadCases(t, v, fp8Forms[quant.Blockwise, quant.BlockwiseWeights]{fwd, dgrad, wgrad},
		fp8Odd[quant.Blockwise, quant.BlockwiseWeights]{x16, x3, dy3, dy12, w3}), []badCase{
		{"fwd/x without Row", fwd(s, v.y, with(v.x, func(q *quant.Blockwise) { q.Row = nil }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/freed x.Row", fwd(s, v.y, with(v.x, func(q *quant.Blockwise) { q.Row = freed(device.E4M3, 10, 32) }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/x.Row of another format", fwd(s, v.y, with(v.x, func(q *quant.Blockwise) { q.Format = quant.E5M2 }), v.w, v.sizes, nil), "x.Row"},
		{"fwd/x.RowScale shape", fwd(s, v.y, with(v.x, func(q *quant.Blockwise) { q.RowScale = al(device.F32, 1, 10) }), v.w, v.sizes, nil), "x.RowScale"},
		{"fwd/x.Format", fwd(s, v.y, with(v.x, func(q *quant.Blockwise) { q.Format = 7 }), v.w, v.sizes, nil), "x.Format"},
		{"fwd/w without KMajor", fwd(s, v.y, v.x, with(v.w, func(w *quant.BlockwiseWeights) { w.KMajor = nil }), v.sizes, nil), "w.KMajor"},
		{"fwd/w.Scales shape", fwd(s, v.y, v.x, with(v.w, func(w *quant.BlockwiseWeights) { w.Scales = al(device.F32, 2, 1, 2) }), v.sizes, nil), "w.Scales"},
		{"fwd/w.KMajor dtype", fwd(s, v.y, v.x, with(v.w, func(w *quant.BlockwiseWeights) { w.KMajor = al(device.BF16, 2, 48, 32) }), v.sizes, nil), "w.KMajor"},
		{"dgrad/dy without Row", dgrad(v.dx, with(v.dy, func(q *quant.Blockwise) { q.RowScale = nil }), v.w, v.sizes, nil), "dy.Row"},
		{"dgrad/w without NMajor", dgrad(v.dx, v.dy, with(v.w, func(w *quant.BlockwiseWeights) { w.NMajor = nil }), v.sizes, nil), "w.NMajor"},
		{"wgrad/x without ColT", wgrad(v.dw, with(v.x, func(q *quant.Blockwise) { q.ColT = nil }), v.dy, v.sizes, nil), "x.ColT"},
		{"wgrad/dy.ColTScale shape", wgrad(v.dw, v.x, with(v.dy, func(q *quant.Blockwise) { q.ColTScale = al(device.F32, 1, 48) }), v.sizes, nil), "dy.ColTScale"},
		{"wgrad/freed dy.ColT", wgrad(v.dw, v.x, with(v.dy, func(q *quant.Blockwise) { q.ColT = freed(device.E5M2, 48, 256) }), v.sizes, nil), "dy.ColT"},
		{"wgrad/dy.Format", wgrad(v.dw, v.x, with(v.dy, func(q *quant.Blockwise) { q.Format = -1 }), v.sizes, nil), "dy.Format"},
	}...)
	runBad(t, cases)
}

// TestBlockwiseOtherDevice: a quantized operand on another device than the stream's is an
// error naming it.
func TestBlockwiseOtherDevice(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		if !d.IsCUDA() {
			t.Skip("needs a second device")
		}
		cpu, s := newBlockArgs(device.CPU().Stream()), d.Stream()
		v := newBlockArgs(s)
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotBlockwise(s, v.y, cpu.x, v.w, v.sizes, nil) }, "x.Row")
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotBlockwise(s, v.y, v.x, cpu.w, v.sizes, nil) }, "w.KMajor")
		dt.WantErrorNaming(t, func() error { return gemm.RaggedDotBlockwiseWeightGrad(s, v.dw, v.x, cpu.dy, v.sizes, nil) }, "dy.ColT")
	})
}

// fp8Forms are one recipe's three forms, each as a call of a bad-argument table.
type fp8Forms[Q, W any] struct {
	fwd   func(s *device.Stream, y *device.Tensor, x *Q, w *W, sz *device.Tensor, opt *gemm.Options) func() error
	dgrad func(dx *device.Tensor, dy *Q, w *W, sz *device.Tensor, opt *gemm.Options) func() error
	wgrad func(dw *device.Tensor, x, dy *Q, sz *device.Tensor, opt *gemm.Options) func() error
}

// fp8Odd are operands of a recipe that differ from fp8Args' in one way: x16 has K=16,
// x3 and dy3 three groups, dy12 M=12 rows, w3 three groups.
type fp8Odd[Q, W any] struct {
	x16, x3, dy3, dy12 *Q
	w3                 *W
}

// fp8BadCases are the bad-argument cases that read alike in both recipes: the stream,
// the outputs, nil operands, operands that disagree with each other or with sizes, the
// sizes and the options.
func fp8BadCases[Q, W any](t *testing.T, v *fp8Args[Q, W], f fp8Forms[Q, W], o fp8Odd[Q, W]) []badCase {
	s := v.s
	al, freed := fp8BadKit(t, s)
	freedStatus := dt.FreedStatus(t, s)
	fwd, dgrad, wgrad := f.fwd, f.dgrad, f.wgrad
	x16, x3, dy3, dy12, w3 := o.x16, o.x3, o.dy3, o.dy12, o.w3
	return []badCase{
		{"fwd/nil stream", fwd(nil, v.y, v.x, v.w, v.sizes, nil), "stream"},
		{"fwd/nil y", fwd(s, nil, v.x, v.w, v.sizes, nil), "y"},
		{"fwd/freed y", fwd(s, freed(device.F32, 10, 48), v.x, v.w, v.sizes, nil), "y"},
		{"fwd/y f16", fwd(s, al(device.F16, 10, 48), v.x, v.w, v.sizes, nil), "y"},
		{"fwd/y shape", fwd(s, al(device.F32, 10, 47), v.x, v.w, v.sizes, nil), "y"},
		{"fwd/nil x", fwd(s, v.y, nil, v.w, v.sizes, nil), "x"},
		{"fwd/x and w of different K", fwd(s, v.y, x16, v.w, v.sizes, nil), "x"},
		{"fwd/nil w", fwd(s, v.y, v.x, nil, v.sizes, nil), "w"},
		{"fwd/w of other G", fwd(s, v.y, v.x, w3, v.sizes, nil), "w"},
		{"fwd/nil sizes", fwd(s, v.y, v.x, v.w, nil, nil), "sizes"},
		{"fwd/sizes i64", fwd(s, v.y, v.x, v.w, al(device.I64, 2), nil), "sizes"},
		{"fwd/sizes rank", fwd(s, v.y, v.x, v.w, al(device.I32, 2, 1), nil), "sizes"},
		{"fwd/layout", fwd(s, v.y, v.x, v.w, v.sizes, &gemm.Options{Layout: 7}), "opt.Layout"},
		{"fwd/accumulate", fwd(s, v.y, v.x, v.w, v.sizes, &gemm.Options{Accumulate: true}), "opt.Accumulate"},
		{"fwd/status not from NewStatus", fwd(s, v.y, v.x, v.w, v.sizes, &gemm.Options{Status: &device.Status{}}), "opt.Status"},
		{"fwd/freed status", fwd(s, v.y, v.x, v.w, v.sizes, &gemm.Options{Status: freedStatus}), "opt.Status"},
		{"dgrad/dy of K columns", dgrad(v.dx, v.x, v.w, v.sizes, nil), "dy"},
		{"dgrad/dx shape", dgrad(al(device.F32, 10, 48), v.dy, v.w, v.sizes, nil), "dx"},
		{"dgrad/accumulate", dgrad(v.dx, v.dy, v.w, v.sizes, &gemm.Options{Accumulate: true}), "opt.Accumulate"},
		{"wgrad/nil dw", wgrad(nil, v.x, v.dy, v.sizes, nil), "dw"},
		{"wgrad/dw shape", wgrad(al(device.F32, 2, 48, 32), v.x, v.dy, v.sizes, nil), "dw"},
		{"wgrad/dw NK shape", wgrad(v.dw, v.x, v.dy, v.sizes, &gemm.Options{Layout: gemm.NK}), "dw"},
		{"wgrad/dw i32", wgrad(al(device.I32, 2, 32, 48), v.x, v.dy, v.sizes, nil), "dw"},
		{"wgrad/nil x", wgrad(v.dw, nil, v.dy, v.sizes, nil), "x"},
		{"wgrad/nil dy", wgrad(v.dw, v.x, nil, v.sizes, nil), "dy"},
		{"wgrad/x and dy in different groups", wgrad(v.dw, v.x, dy3, v.sizes, nil), "dy"},
		{"wgrad/groups other than sizes", wgrad(v.dw, x3, dy3, v.sizes, nil), "sizes"},
		{"wgrad/x and dy of different M", wgrad(v.dw, v.x, dy12, v.sizes, nil), "dy"},
		{"wgrad/freed status", wgrad(v.dw, v.x, v.dy, v.sizes, &gemm.Options{Status: freedStatus}), "opt.Status"},
	}
}

// fp8BadKit returns what the FP8 forms' bad-argument tables build their arguments from, on
// s: al allocates a tensor, freed allocates and frees one.
func fp8BadKit(t *testing.T, s *device.Stream) (al, freed func(typ device.DType, shape ...int) *device.Tensor) {
	al = func(typ device.DType, shape ...int) *device.Tensor { return dt.Must(s.Alloc(typ, shape...)) }
	freed = func(typ device.DType, shape ...int) *device.Tensor { return dt.Freed(t, s, typ, shape...) }
	return al, freed
}
