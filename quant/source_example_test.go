package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// sumSrc is the CUDA program of ExampleQuantizeSource: the loader of x + y for two f32
// [M, K] tensors, and the MXFP8 kernels for it.
const sumSrc = `
#include "quant_mxfp8.cuh"

struct SumSrc {
    typedef float T;
    const float *x, *y;
    i64 K;
    template <bool VEC>
    __device__ void load8(u64 r, u64 c, int n, float f[8]) const {
        for (int e = 0; e < 8; e++) f[e] = e < n ? x[r * K + c + e] + y[r * K + c + e] : 0.f;
    }
    __device__ float at(u64 r, u64 c) const { return x[r * K + c] + y[r * K + c]; }
};

DL_MX_SOURCE_KERNELS(sum_mxq, SumSrc, 4)
`

var sumProgram = device.NewProgram("sum.cu", sumSrc).WithHeaders(quant.Headers()...)

// Quantize the sum of two tensors to MXFP8 without writing the sum: the Source computes
// it as the quantization reads it (Go code on the CPU, the loader of sumProgram on a
// GPU).
func ExampleQuantizeSource() {
	s := device.CPU().Stream()
	const m, k = 2, 32
	a, b := make([]float32, m*k), make([]float32, m*k)
	for i := range a {
		a[i], b[i] = float32(i), 0.5
	}
	x, _ := device.FromFloat32(s, device.F32, a, m, k)
	y, _ := device.FromFloat32(s, device.F32, b, m, k)
	src := quant.Source{M: m, K: k, DType: device.F32, Inputs: []*device.Tensor{x, y},
		Fill: func(v []float32) {
			xs, ys := device.Slice[float32](x), device.Slice[float32](y)
			for i := range v {
				v[i] = xs[i] + ys[i]
			}
		},
		Program: sumProgram, Kernels: "sum_mxq",
		Loader: struct {
			X, Y *device.Tensor
			K    int64
		}{x, y, k},
		Vec: false, // load8 reads element by element
	}
	q, _ := quant.Alloc(s, m, k, quant.Options{})
	defer q.Free()
	if err := quant.QuantizeSource(s, q, src, quant.Options{}); err != nil {
		fmt.Println(err)
		return
	}
	out, _ := s.Alloc(device.F32, m, k)
	quant.Dequantize(s, out, q, quant.Rowwise)
	v, _ := out.Float32s(s)
	fmt.Println("row 0:", v[:4], "… row 1:", v[60:])
	// Output:
	// row 0: [0.5 1.5 2.5 3.5] … row 1: [60 60 64 64]
}
