package gemm

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
	"github.com/dropless/dropless/quant"
)

// The CPU path of the blockwise forms dequantizes the operands into f32 temporaries with
// package quant (value = decode(q)·s, one f32 product) and runs the f32 CPU ragged_dot
// on them: it is the reference of the GPU kernels. The dequantizations are ops enqueued
// on the call's stream before it, so that a captured Graph runs them again on each
// replay. The temporaries are host memory that is not freed explicitly (on the CPU, Free
// would drop it at once, while a captured Graph still reads it): they go with the call,
// or with the Graph.

// cpu enqueues the call on s's CPU stream: dequantize, then the CPU path of the form it
// runs as.
func (bc *blockCall) cpu(s *device.Stream) error {
	c := bc.c
	acts := func(q *quant.Blockwise, dir quant.Direction) func(t *device.Tensor) error {
		return func(t *device.Tensor) error { return quant.DequantizeBlockwise(s, t, q, dir) }
	}
	// The operands A and B of the f32 form: their shapes and dequantizations.
	var aShape, bShape []int
	var a, b func(t *device.Tensor) error
	switch c.f {
	case forward: // w_g [N][K], layout NK
		aShape, bShape = []int{c.M, c.K}, []int{c.G, c.N, c.K}
		a, b = acts(bc.a, quant.Rowwise), func(t *device.Tensor) error { return dequantKMajor(s, t, bc.w) }
	case inputGrad: // w_g [K][N], layout KN
		aShape, bShape = []int{c.M, c.N}, []int{c.G, c.K, c.N}
		a, b = acts(bc.a, quant.Rowwise), func(t *device.Tensor) error { return quant.DequantizeWeights(s, t, bc.w) }
	default:
		// The token blocks of the quantizations, those of sizes (the operands'
		// contract), hold every row.
		aShape, bShape = []int{c.M, c.K}, []int{c.M, c.N}
		a, b = acts(bc.a, quant.Columnwise), acts(bc.b, quant.Columnwise)
	}
	inner := *c
	var err error
	if inner.a, err = dequant(s, aShape, a); err == nil {
		inner.b, err = dequant(s, bShape, b)
	}
	if err != nil {
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	return inner.cpu(s)
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
