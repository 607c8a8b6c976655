package gemm

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// cpu enqueues the call on s's CPU stream as the blockwise forms do (see fp8cpu.go):
// package quant dequantizes the operands exactly into f32 temporaries, the rows in their
// own layout (grouped or not), the weights as [G, K, N] from the orientation the form
// reads, and the f32 CPU path runs on them.
func (mc *mxCall) cpu(s *device.Stream) error {
	acts := func(q *quant.MXFP8, dir quant.Direction) func(t *device.Tensor) error {
		return func(t *device.Tensor) error { return quant.Dequantize(s, t, q, dir) }
	}
	weights := func(kMajor bool) func(t *device.Tensor) error {
		return func(t *device.Tensor) error { return quant.DequantizeMXFP8Weights(s, t, mc.w, kMajor) }
	}
	c := *mc.c
	switch c.f {
	case forward:
		c.layout = KN // w_g dequantized from KMajor into [K][N]
		return c.cpuDequantized(s, acts(mc.a, quant.Rowwise), weights(true))
	case inputGrad:
		return c.cpuDequantized(s, acts(mc.a, quant.Rowwise), weights(false))
	}
	return c.cpuDequantized(s, acts(mc.a, quant.Columnwise), acts(mc.b, quant.Columnwise))
}
