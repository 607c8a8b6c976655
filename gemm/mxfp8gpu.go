package gemm

import (
	"errors"
	"os"

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
		if mc.viaBF16() {
			err := mc.portable(s)
			if mxPath == mxAuto && errors.Is(err, errDequantTemps) {
				return mc.hopper(s) // the MXFP8 kernels need no temporaries
			}
			return err
		}
		return mc.hopper(s)
	}
	return mc.portable(s)
}

// mxPath chooses how a call that the Hopper MXFP8 kernels take runs: mxAuto by the
// estimate of viaBF16, mxWGMMA always on those kernels, mxBF16 always on the operands
// dequantized to bf16 (DROPLESS_MXFP8_PATH=wgmma or bf16, read once when the package is
// initialized, for comparisons; tests may set it).
var mxPath = parseMXPath(os.Getenv("DROPLESS_MXFP8_PATH"))

const (
	mxAuto = iota
	mxWGMMA
	mxBF16
)

// parseMXPath returns the path that v, a value of DROPLESS_MXFP8_PATH, names: mxWGMMA for
// "wgmma", mxBF16 for "bf16", else mxAuto.
func parseMXPath(v string) int {
	switch v {
	case "wgmma":
		return mxWGMMA
	case "bf16":
		return mxBF16
	}
	return mxAuto
}

// Rates of the H200 that viaBF16's estimate takes (see docs/perf.md): the MXFP8 wgmma
// kernels' TFLOP/s (each 32-element block's partial sums promoted on the CUDA cores, two
// instructions an element, bound them), the bf16 Hopper kernels' and the bytes a second
// that the vector dequantization kernels move.
const (
	mxWGMMARate   = 340e12
	mxBF16Rate    = 650e12
	mxDequantRate = 3.0e12
)

// viaBF16 reports whether the call, which the Hopper MXFP8 kernels take, runs on its
// operands dequantized exactly into bf16 and the Hopper bf16 kernels instead: whether
// the estimated time of that, the dequantization (one byte read and two written for each
// code of both operands) and the bf16 product, is below the MXFP8 kernels' time for the
// product. That holds where the operands are small beside the FLOPs: every weight
// gradient and the forms of many rows a group, as in the DeepSeek-V3 and Mixtral shapes;
// calls bound by reading the weights (few rows a group) stay on the MXFP8 kernels. The
// results are the same to within the f32 summation order (both sum exact products in f32).
// Where the bf16 temporaries do not fit in the device's memory, the call runs on the
// MXFP8 kernels after all (gpu).
func (mc *mxCall) viaBF16() bool {
	switch mxPath {
	case mxWGMMA:
		return false
	case mxBF16:
		return true
	}
	c := mc.c
	M, K, N, G := float64(c.M), float64(c.K), float64(c.N), float64(c.G)
	flops := 2 * M * K * N
	codes := M*K + G*K*N // forward: x and w
	switch c.f {
	case inputGrad:
		codes = M*N + G*K*N
	case weightGrad:
		codes = M * (K + N)
	}
	return flops/mxBF16Rate+3*codes/mxDequantRate < flops/mxWGMMARate
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
// form. Where the shapes allow (vector) the vector kernels dequantize.
func (mc *mxCall) portable(s *device.Stream) error {
	c := mc.c
	vec := mc.vector()
	switch c.f {
	case forward, inputGrad:
		w, scale := mc.w.KMajor, mc.w.KScale // forward: w_g [N][K], layout NK
		if c.f == inputGrad {
			w, scale = mc.w.NMajor, mc.w.NScale // w_g [K][N], layout KN
		}
		x := mc.a
		rows := func(t, plan *device.Tensor) error {
			return dequantRowsGPU(s, t, x.Row, x.RowScale, mxBlock, 1, int64(x.RowScale.Dim(1)), plan, c.G)
		}
		weights := func(t, _ *device.Tensor) error { return dequantMXWeightsGPU(s, t, w, scale) }
		if vec {
			rows = func(t, plan *device.Tensor) error { return dequantMXRowsGPU(s, t, x.Row, x.RowScale, plan, c.G) }
			weights = func(t, _ *device.Tensor) error { return dequantMXWeightsVec(s, t, w, scale) }
		}
		return c.gpuDequantized(s, x.Groups > 0, !vec, rows, weights)
	}
	colT := func(q *quant.MXFP8) func(t, plan *device.Tensor) error {
		if vec {
			return func(t, plan *device.Tensor) error { return dequantMXColTGPU(s, t, q.ColT, q.ColScale, plan, c.G) }
		}
		return func(t, plan *device.Tensor) error {
			return dequantColTGPU(s, t, q.ColT, q.ColScale, mxBlock, int64(q.ColScale.Dim(1)), plan, c.G)
		}
	}
	return c.gpuDequantized(s, true, !vec, colT(mc.a), colT(mc.b))
}

// vector reports whether the vector dequantization kernels take the call's operands:
// K and N multiples of 16 and the codes 16-byte aligned (the temporaries are).
func (mc *mxCall) vector() bool {
	return !mxNoVector && mc.c.K%16 == 0 && mc.c.N%16 == 0 && device.Aligned(16, mc.operands()...)
}

// mxNoVector turns the vector dequantization kernels off, for tests that compare them
// with the element kernels.
var mxNoVector bool

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

// dequantMXWeightsVec is dequantMXWeightsGPU on the vector kernel (C a multiple of 16,
// t 16-byte aligned).
func dequantMXWeightsVec(s *device.Stream, out, t, scale *device.Tensor) error {
	G, R, C := int64(t.Dim(0)), int64(t.Dim(1)), int64(t.Dim(2))
	return mxRowsVec(s, out, t, scale, G*R, C, R, int64(ceilDiv(int(C), 128))*R*4, 4, 4*R, nil, 0)
}

// dequantMXRowsGPU writes the rowwise form q [M, K] (K a multiple of 16, q 16-byte
// aligned) with its E8M0 scales [rows, ms] into out (BF16 [M, K]) on the vector kernel,
// as dequantRowsGPU does with blocks of 32 (with a plan, for q quantized in G groups).
func dequantMXRowsGPU(s *device.Stream, out, q, scale, plan *device.Tensor, G int) error {
	M := int64(q.Dim(0))
	return mxRowsVec(s, out, q, scale, M, int64(q.Dim(1)), M, 0, int64(scale.Dim(1)), 4, plan, G)
}

// mxRowsVec launches dl_mx_dequant_rows16 (kernels/fp8.cu) on rows of C codes, one row a
// block.
func mxRowsVec(s *device.Stream, out, q, scale *device.Tensor, rows, C, R, gstride, rstride, s4 int64, plan *device.Tensor, G int) error {
	if out.Len() == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_mx_dequant_rows16")
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(int(min(rows, 1<<20))), device.D1(128), 0, q, scale, out, rows, C, R, gstride, rstride, s4,
		plan, int32(G), isE5M2(q))
}

// dequantMXColTGPU writes the transposed columnwise form colt [K, mp] (K a multiple of
// 16, colt 16-byte aligned) with its E8M0 scales [mp/32, ld] into the rows the groups own
// of out (BF16 [M, K]) and zeros into the rows past them, as dequantColTGPU does with
// blocks of 32 and a zeroed out.
func dequantMXColTGPU(s *device.Stream, out, colt, scale, plan *device.Tensor, G int) error {
	if out.Len() == 0 {
		return nil
	}
	d := s.Device()
	k, err := d.Kernel(fp8Program, "dl_mx_dequant_colt16")
	if err != nil {
		return err
	}
	z, err := d.Kernel(fp8Program, "dl_mx_zero_tail")
	if err != nil {
		return err
	}
	K, mp := colt.Dim(0), colt.Dim(1)
	grid := device.Dim3{X: ceilDiv(mp, 64), Y: ceilDiv(K, 64), Z: 1}
	if err := k.Launch(s, grid, device.D1(256), 0, colt, scale, out, plan, int32(G), int64(K), int64(mp), int64(scale.Dim(1)), isE5M2(colt)); err != nil {
		return err
	}
	return z.Launch(s, gridFor(out.Len()/8), device.D1(256), 0, out, plan, int32(G), int64(out.Dim(0)), int64(K))
}
