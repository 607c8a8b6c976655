package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// Quantize two tokens once and move their quantized rows to the rows of the experts
// they are routed to, two each (index numbers token t's copies 2t and 2t+1), with one
// unused row: the gathered rows are what quantizing the moved bf16 rows gives.
func ExampleGatherBlockwise() {
	s := device.CPU().Stream()
	vals := make([]float32, 2*128)
	for i := range vals {
		vals[i] = float32(i%128) * float32(1+i/128) // token 1 twice token 0
	}
	x, _ := device.FromFloat32(s, device.BF16, vals, 2, 128)
	q, _ := quant.QuantizeBlockwise(s, x, quant.BlockOptions{Scale: quant.ScalePow2})
	defer q.Free()
	// Expert rows: token 1's first copy, token 0's two, an unused row, token 1's second.
	index, _ := device.FromSlice(s, device.I32, []int32{2, 0, 1, -1, 3}, 5)
	st, _ := device.NewStatus(s)
	g, err := quant.GatherBlockwise(s, q, index, 2, st)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer g.Free()
	sc, _ := g.RowScale.Float32s(s)
	fmt.Println("rows", g.M, "scales", sc[:5], "index errors:", st.Check(s))
	y, _ := s.Alloc(device.F32, 5, 128)
	quant.DequantizeBlockwise(s, y, g, quant.Rowwise)
	v, _ := y.Float32s(s)
	for r := range 5 {
		fmt.Println("row", r, v[r*128:r*128+3], v[r*128+127])
	}
	// Output:
	// rows 5 scales [1 0.5 0.5 1 1] index errors: <nil>
	// row 0 [0 2 4] 256
	// row 1 [0 1 2] 128
	// row 2 [0 1 2] 128
	// row 3 [0 0 0] 0
	// row 4 [0 2 4] 256
}
