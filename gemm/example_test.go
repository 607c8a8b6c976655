package gemm_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
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
