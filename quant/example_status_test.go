package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// ExampleOptions_status shares one device.Status between two grouped quantizations and
// checks it once, after both.
func ExampleOptions_status() {
	s := device.CPU().Stream()
	x, _ := device.FromFloat32(s, device.BF16, make([]float32, 64*32), 64, 32)
	good, _ := device.FromSlice(s, device.I32, []int32{40, 24}, 2)
	bad, _ := device.FromSlice(s, device.I32, []int32{40, 20}, 2)
	st, _ := device.NewStatus(s)
	for _, sizes := range []*device.Tensor{good, bad} {
		q, _ := quant.Quantize(s, x, quant.Options{GroupSizes: sizes, Status: st})
		q.Free()
	}
	fmt.Println(st.Check(s))
	// Output:
	// quant: invalid GroupSizes: the sizes do not sum to the 64 rows of x; the outputs were set to NaN
}
