package gemm_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// Two experts: rows 0-1 go to expert 0 (which doubles), row 2 to expert 1 (which swaps
// the columns); row 3 belongs to no group and comes out as zeros.
func ExampleRaggedDot() {
	s := device.CPU().Stream()
	x, _ := device.FromFloat32(s, device.F32, []float32{
		1, 2,
		3, 4,
		5, 6,
		7, 8,
	}, 4, 2)
	w, _ := device.FromFloat32(s, device.F32, []float32{
		2, 0, 0, 2, // w[0] = 2·I
		0, 1, 1, 0, // w[1] swaps
	}, 2, 2, 2)
	sizes, _ := device.FromSlice(s, device.I32, []int32{2, 1}, 2)
	y, _ := s.Alloc(device.F32, 4, 2)
	if err := gemm.RaggedDot(s, y, x, w, sizes, nil); err != nil {
		fmt.Println(err)
		return
	}
	v, _ := y.Float32s(s)
	fmt.Println(v)

	// Sizes that sum past M are an error; on a GPU, a Status records it instead.
	bad, _ := device.FromSlice(s, device.I32, []int32{2, 3}, 2)
	fmt.Println(gemm.RaggedDot(s, y, x, w, bad, nil))
	// Output:
	// [2 4 6 8 6 5 0 0]
	// gemm: RaggedDot: sizes sum to 5 > M=4
}

// An MXFP8 training step of two experts: x and dy are quantized once, in the groups of the
// tokens (rowwise for the forward and the input gradient, columnwise and transposed for the
// weight gradient), the weights once in both orientations. Rows 0-2 go to expert 0
// (w[0] = I), row 3 to expert 1 (w[1] = 2·I); K = N = 32, one MXFP8 block.
func ExampleRaggedDotMXFP8() {
	const M, K, N = 4, 32, 32
	s := device.CPU().Stream()
	xv, dyv, wv := make([]float32, M*K), make([]float32, M*N), make([]float32, 2*K*N)
	for m := range M {
		for k := range 4 {
			xv[m*K+k] = float32(m + 1) // x[m][:4] = m+1
			dyv[m*N+k] = 1             // dy[m][:4] = 1
		}
	}
	for g := range 2 {
		for k := range K {
			wv[(g*K+k)*N+k] = float32(g + 1)
		}
	}
	x, _ := device.FromFloat32(s, device.F32, xv, M, K)
	dy, _ := device.FromFloat32(s, device.F32, dyv, M, N)
	w, _ := device.FromFloat32(s, device.F32, wv, 2, K, N)
	sizes, _ := device.FromSlice(s, device.I32, []int32{3, 1}, 2)

	opt := quant.Options{Format: quant.E4M3, Dir: quant.Both, Transpose: true, GroupSizes: sizes}
	qx, err := quant.Quantize(s, x, opt)
	if err != nil {
		fmt.Println(err)
		return
	}
	opt.Format = quant.E5M2 // gradients
	qdy, _ := quant.Quantize(s, dy, opt)
	qw, _ := quant.QuantizeMXFP8Weights(s, w, quant.Options{Format: quant.E4M3})

	y, _ := s.Alloc(device.F32, M, N)
	dx, _ := s.Alloc(device.F32, M, K)
	dw, _ := s.Alloc(device.F32, 2, K, N)
	for _, err := range []error{
		gemm.RaggedDotMXFP8(s, y, qx, qw, sizes, nil),
		gemm.RaggedDotMXFP8InputGrad(s, dx, qdy, qw, sizes, nil),
		gemm.RaggedDotMXFP8WeightGrad(s, dw, qx, qdy, sizes, nil),
	} {
		if err != nil {
			fmt.Println(err)
			return
		}
	}
	// firsts returns the first 4 columns of each row of t, rows of n values.
	firsts := func(t *device.Tensor, n int) [][]float32 {
		v, _ := t.Float32s(s)
		var out [][]float32
		for r := 0; r < len(v); r += n {
			out = append(out, v[r:r+4])
		}
		return out
	}
	fmt.Println("y: ", firsts(y, N))
	fmt.Println("dx:", firsts(dx, K))
	dwv := firsts(dw, N)
	fmt.Println("dw[0][0]:", dwv[0], "dw[1][0]:", dwv[K])
	// Output:
	// y:  [[1 1 1 1] [2 2 2 2] [3 3 3 3] [8 8 8 8]]
	// dx: [[1 1 1 1] [1 1 1 1] [1 1 1 1] [2 2 2 2]]
	// dw[0][0]: [6 6 6 6] dw[1][0]: [4 4 4 4]
}
