package gemm

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
	"github.com/dropless/dropless/quant"
)

// The CPU path of the FP8 forms dequantizes the operands into f32 temporaries with
// package quant (blockwise: decode(q)·s, one f32 product; MXFP8: decode(q)·2^(e−127),
// exact) and runs the f32 CPU ragged_dot on them: it is the reference of the GPU kernels.
// The dequantizations are ops enqueued on the call's stream before it, so that a
// captured Graph runs them again on each replay. The temporaries are host memory that is
// not freed explicitly (on the CPU, Free would drop it at once, while a captured Graph
// still reads it): they go with the call, or with the Graph.

// cpuDequantized enqueues c, the call an FP8 form runs as, on s's CPU stream: a and b
// dequantize its operands A and B into F32 temporaries of their shapes (operandShapes),
// then the CPU path of the form runs on them.
func (c *call) cpuDequantized(s *device.Stream, a, b func(t *device.Tensor) error) error {
	inner := *c
	aShape, bShape := c.operandShapes()
	var err error
	if inner.a, err = dequant(s, aShape, a); err == nil {
		inner.b, err = dequant(s, bShape, b)
	}
	if err != nil {
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	return inner.cpu(s)
}

// operandShapes returns the shapes of the call's operands A and B: x [M,K] (dy [M,N]
// for the input gradient) and w in c.layout, or, for the weight gradient, x [M,K] and dy
// [M,N].
func (c *call) operandShapes() (a, b []int) {
	switch c.f {
	case forward:
		return []int{c.M, c.K}, wshape(c.layout, c.G, c.K, c.N)
	case inputGrad:
		return []int{c.M, c.N}, wshape(c.layout, c.G, c.K, c.N)
	}
	return []int{c.M, c.K}, []int{c.M, c.N}
}

// cpu enqueues the call on s's CPU stream: dequantize, then the CPU path of the form it
// runs as (the forward's w_g as KMajor [N][K], layout NK).
func (bc *blockCall) cpu(s *device.Stream) error {
	acts := func(q *quant.Blockwise, dir quant.Direction) func(t *device.Tensor) error {
		return func(t *device.Tensor) error { return quant.DequantizeBlockwise(s, t, q, dir) }
	}
	switch bc.c.f {
	case forward:
		return bc.c.cpuDequantized(s, acts(bc.a, quant.Rowwise), func(t *device.Tensor) error { return dequantKMajor(s, t, bc.w) })
	case inputGrad:
		return bc.c.cpuDequantized(s, acts(bc.a, quant.Rowwise), func(t *device.Tensor) error { return quant.DequantizeWeights(s, t, bc.w) })
	}
	// The token blocks of the quantizations, those of sizes (the operands' contract),
	// hold every row.
	return bc.c.cpuDequantized(s, acts(bc.a, quant.Columnwise), acts(bc.b, quant.Columnwise))
}

// dequant allocates an F32 tensor of shape on s and enqueues into it the dequantization
// into.
func dequant(s *device.Stream, shape []int, into func(t *device.Tensor) error) (*device.Tensor, error) {
	t, err := s.Alloc(device.F32, shape...)
	if err != nil {
		return nil, err
	}
	return t, into(t)
}

// quietNaN is the NaN that package quant's dequantizations write.
var quietNaN = math.Float32frombits(0x7fc00000)

// dequantKMajor enqueues on s the dequantization of w.KMajor into dst, F32 [G, N, K]:
// the element of w_g at (k, n) is decode(code)·Scales[g][k/128][n/128] in float32, NaN
// as the quiet NaN, the values quant.DequantizeWeights computes from NMajor. Package
// quant has no dequantization of KMajor, and the forward reads no more of w than KMajor
// and Scales.
func dequantKMajor(s *device.Stream, dst *device.Tensor, w *quant.BlockwiseWeights) error {
	return s.EnqueueCPU(func() {
		v, codes := device.Slice[float32](dst), w.KMajor.HostBytes()
		sc := device.Slice[float32](w.Scales)
		sk, sn := ceilDiv(w.K, quant.BlockSize), ceilDiv(w.N, quant.BlockSize)
		par.For(w.G*w.N, max(1, (1<<16)/max(w.K, 1)), func(lo, hi int) {
			device.DecodeFloat32(w.KMajor.DType(), v[lo*w.K:hi*w.K], codes[lo*w.K:hi*w.K])
			for gn := lo; gn < hi; gn++ {
				g, n := gn/w.N, gn%w.N
				row := v[gn*w.K : (gn+1)*w.K]
				for k, c := range row {
					if row[k] = c * sc[(g*sk+k/quant.BlockSize)*sn+n/quant.BlockSize]; row[k] != row[k] {
						row[k] = quietNaN
					}
				}
			}
		})
	})
}
