package quant_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// Quantize one expert's 32×64 bf16 weights w [G, K, N] to MXFP8 in both orientations:
// KMajor [G, N, K] in 1×32 blocks along K for the forward, NMajor [G, K, N] in blocks
// along N for the input gradient, each with its own E8M0 scales; then dequantize back.
func ExampleQuantizeMXFP8Weights() {
	s := device.CPU().Stream()
	const k, n = 32, 64
	vals := make([]float32, k*n)
	for i := range vals {
		vals[i] = float32(i%n) / 8 // w[k][n] = n/8: columns of equal values, rows 0 … 7.875
	}
	w, _ := device.FromFloat32(s, device.BF16, vals, 1, k, n)
	q, _ := quant.QuantizeMXFP8Weights(s, w, quant.Options{})
	defer q.Free()
	ks, _ := q.KScale.Float32s(s)
	fmt.Println("KMajor", q.KMajor.Shape(), "KScale", q.KScale.Shape(), "of columns 1, 8, 63:", ks[4], ks[32], ks[252])
	// Row 0's two blocks along N (amax 3.875 and 7.875: 2^-6 and 2^-5), then two
	// padding slots of code 0.
	fmt.Println("NMajor", q.NMajor.Shape(), "NScale", q.NScale.Shape(), "codes of row 0:", q.NScale.HostBytes()[:4])

	y, _ := s.Alloc(device.F32, 1, k, n)
	quant.DequantizeMXFP8Weights(s, y, q, true)
	v, _ := y.Float32s(s)
	fmt.Println("row 0:", v[:4], "…", v[60:64]) // E4M3 keeps 4 significant bits
	// Output:
	// KMajor [1 64 32] KScale [1 1 64 4] of columns 1, 8, 63: 0.00048828125 0.00390625 0.03125
	// NMajor [1 32 64] NScale [1 1 32 4] codes of row 0: [121 122 0 0]
	// row 0: [0 0.125 0.25 0.375] … [7.5 7.5 8 8]
}
