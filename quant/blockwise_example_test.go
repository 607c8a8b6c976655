package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// Quantize three rows of 128 bf16 values in 1×128 blocks, rowwise and transposed, with
// power-of-two scales, and dequantize them back.
func ExampleQuantizeBlockwise() {
	s := device.CPU().Stream()
	vals := make([]float32, 3*128)
	for i := range vals {
		vals[i] = float32(i%128) * float32(int(1)<<(i/128)) // row r: 0, 2^r, 2·2^r, …, 127·2^r
	}
	x, _ := device.FromFloat32(s, device.BF16, vals, 3, 128)
	q, _ := quant.QuantizeBlockwise(s, x, quant.BlockOptions{Scale: quant.ScalePow2, Dir: quant.Both})
	defer q.Free()
	rs, _ := q.RowScale.Float32s(s)
	fmt.Println("RowScale", q.RowScale.Shape(), rs)
	cs, _ := q.ColTScale.Float32s(s)
	fmt.Println("ColT", q.ColT.Shape(), "ColTScale", q.ColTScale.Shape(), cs[:2], cs[127])

	y, _ := s.Alloc(device.F32, 3, 128)
	quant.DequantizeBlockwise(s, y, q, quant.Rowwise)
	v, _ := y.Float32s(s)
	fmt.Println("row 2:", v[256:260], "…", v[380:])
	// Output:
	// RowScale [1 4] [0.5 1 2 0]
	// ColT [128 128] ColTScale [1 128] [1 0.015625] 2
	// row 2: [0 4 8 12] … [512 512 512 512]
}
