package gemm

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm/internal/hopper"
	"github.com/dropless/dropless/quant"
)

// gpu enqueues the call on s: the Hopper MXFP8 kernels where they run, else the portable
// path.
func (mc *mxCall) gpu(s *device.Stream) error {
	d := s.Device()
	if err := needSM80(d, mc.c.op); err != nil {
		return err
	}
	if mc.hopperOK(d) {
		return mc.hopper(s)
	}
	return mc.portable(s)
}

// operands returns the quantized tensors the call reads.
func (mc *mxCall) operands() []*device.Tensor {
	switch mc.c.f {
	case forward:
		return []*device.Tensor{mc.a.Row, mc.a.RowScale, mc.w.KMajor, mc.w.KScale}
	case inputGrad:
		return []*device.Tensor{mc.a.Row, mc.a.RowScale, mc.w.NMajor, mc.w.NScale}
	}
	return []*device.Tensor{mc.a.ColT, mc.a.ColScale, mc.b.ColT, mc.b.ColScale}
}

// hopperOK reports whether the call can run on the Hopper MXFP8 kernels: the shapes that
// the Hopper FP8 kernels take (hopperShapes) on a device that runs them
// (hopper.BlockwiseSupported, which compiles both recipes' kernels).
func (mc *mxCall) hopperOK(d *device.Device) bool {
	return mc.c.hopperShapes(mc.operands()) && hopper.BlockwiseSupported(d) == nil
}

// hopper runs the call on the Hopper MXFP8 kernels (through onHopper). A grouped A (x or dy quantized
// with the groups of sizes) has its scale rows in package quant's tile layout: row r of
// group g at scale row 128·P_g + r − start_g, P_g = Σ_{h<g} ceil(M_h/128), which the
// kernels compute from the sizes.
func (mc *mxCall) hopper(s *device.Stream) error {
	c := mc.c
	return c.onHopper(s, func(op int) error {
		switch c.f {
		case forward:
			return hopper.MXFP8GEMM(s, c.out, hopper.MXOperand{Q: mc.a.Row, Scale: mc.a.RowScale},
				hopper.MXOperand{Q: mc.w.KMajor, Scale: mc.w.KScale}, c.sizes, c.status, op, mc.a.Groups > 0)
		case inputGrad:
			return hopper.MXFP8GEMM(s, c.out, hopper.MXOperand{Q: mc.a.Row, Scale: mc.a.RowScale},
				hopper.MXOperand{Q: mc.w.NMajor, Scale: mc.w.NScale}, c.sizes, c.status, op, mc.a.Groups > 0)
		}
		// dw_g = x_gᵀ·dy_g ([G,K,N]) or dy_gᵀ·x_g ([G,N,K])
		x, dy := hopper.MXOperand{Q: mc.a.ColT, Scale: mc.a.ColScale}, hopper.MXOperand{Q: mc.b.ColT, Scale: mc.b.ColScale}
		if c.layout == NK {
			x, dy = dy, x
		}
		return hopper.MXFP8WeightGrad(s, c.out, x, dy, c.M, c.sizes, c.status, op, c.accum)
	})
}

// portable runs the call on any GPU: the operands dequantized into bf16 (rows in their own
// layout, grouped or not; columnwise forms into the rows the groups own), then the bf16
// form.
func (mc *mxCall) portable(s *device.Stream) error {
	c := mc.c
	switch c.f {
	case forward, inputGrad:
		w, scale := mc.w.KMajor, mc.w.KScale // forward: w_g [N][K], layout NK
		if c.f == inputGrad {
			w, scale = mc.w.NMajor, mc.w.NScale // w_g [K][N], layout KN
		}
		x := mc.a
		return c.gpuDequantized(s, x.Groups > 0,
			func(t, plan *device.Tensor) error {
				return dequantRowsGPU(s, t, x.Row, x.RowScale, mxBlock, 1, int64(x.RowScale.Dim(1)), plan, c.G)
			},
			func(t, _ *device.Tensor) error { return dequantMXWeightsGPU(s, t, w, scale) })
	}
	colT := func(q *quant.MXFP8) func(t, plan *device.Tensor) error {
		return func(t, plan *device.Tensor) error {
			return dequantColTGPU(s, t, q.ColT, q.ColScale, mxBlock, int64(q.ColScale.Dim(1)), plan, c.G)
		}
	}
	return c.gpuDequantized(s, true, colT(mc.a), colT(mc.b))
}

// dequantMXWeightsGPU writes t, one orientation of MXFP8 weights ([G, R, C], blocks along
// C) with its E8M0 scales [G, ceil(C/128), R, 4], into out (BF16, t's shape).
func dequantMXWeightsGPU(s *device.Stream, out, t, scale *device.Tensor) error {
	if out.Len() == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_mx_dequant_weights")
	if err != nil {
		return err
	}
	return k.Launch(s, gridFor(out.Len()), device.D1(256), 0, t, scale, out, int64(t.Dim(0)), int64(t.Dim(1)), int64(t.Dim(2)), isE5M2(t))
}
