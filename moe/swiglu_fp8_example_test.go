package moe_test

import (
	"fmt"
	"log"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/quant"
)

// SwiGLU of two rows of gate and up projections, quantized to MXFP8 as it is computed:
// the rowwise form that W2's GEMM reads and the transposed columnwise one of the weight
// gradient, without writing the bf16 activation.
func ExampleSwiGLUMXFP8() {
	s := device.CPU().Stream()
	const M, F = 2, 32
	v := make([]float32, M*2*F)
	for r := range M {
		for f := range F {
			v[r*2*F+f] = float32(f) / 8   // gate
			v[r*2*F+F+f] = float32(r + 1) // up
		}
	}
	h, err := device.FromFloat32(s, device.BF16, v, M, 2*F)
	if err != nil {
		log.Fatal(err)
	}
	opt := quant.Options{Dir: quant.Both, Transpose: true}
	q, err := quant.Alloc(s, M, F, opt)
	if err != nil {
		log.Fatal(err)
	}
	defer q.Free()
	if err := moe.SwiGLUMXFP8(s, q, h, opt); err != nil {
		log.Fatal(err)
	}
	y, _ := s.Alloc(device.F32, M, F)
	quant.Dequantize(s, y, q, quant.Rowwise)
	got, _ := y.Float32s(s)
	a, _ := s.Alloc(device.BF16, M, F)
	moe.SwiGLU(s, a, h)
	want, _ := a.Float32s(s)
	fmt.Println("Row", q.Row.Shape(), "ColT", q.ColT.Shape())
	fmt.Printf("row 1, quantized: %.3f\n", got[F+8:F+12])
	fmt.Printf("row 1, SwiGLU:    %.3f\n", want[F+8:F+12])
	// Output:
	// Row [2 32] ColT [32 128]
	// row 1, quantized: [1.500 1.750 2.000 2.250]
	// row 1, SwiGLU:    [1.461 1.695 1.945 2.188]
}
