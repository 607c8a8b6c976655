package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// Quantize two rows of 32 bf16 values rowwise to E4M3 and dequantize them back.
func ExampleQuantize() {
	s := device.CPU().Stream()
	vals := make([]float32, 64)
	for i := range vals {
		vals[i] = float32(i) / 4 // row 0: 0 … 7.75, row 1: 8 … 15.75
	}
	x, _ := device.FromFloat32(s, device.BF16, vals, 2, 32)
	q, _ := quant.Quantize(s, x, quant.Options{})
	scales, _ := q.RowScale.Float32s(s)
	fmt.Println("scales:", q.RowScale.Shape(), scales[0], scales[4])

	y, _ := s.Alloc(device.F32, 2, 32)
	quant.Dequantize(s, y, q, quant.Rowwise)
	v, _ := y.Float32s(s)
	fmt.Println("row 0:", v[:4], "…", v[16:18])
	fmt.Println("row 1:", v[60:])
	// Output:
	// scales: [128 4] 0.03125 0.0625
	// row 0: [0 0.25 0.5 0.75] … [4 4]
	// row 1: [15 15 16 16]
}
