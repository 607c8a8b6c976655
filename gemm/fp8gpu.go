package gemm

import (
	_ "embed"
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm/internal/hopper"
	"github.com/dropless/dropless/quant"
)

//go:embed kernels/fp8.cu
var fp8Src string

// fp8Program holds the dequantization kernels of the FP8 forms' portable GPU path.
var fp8Program = device.NewProgram("gemm_fp8.cu", fp8Src)

// gpu enqueues the call on s: the Hopper FP8 kernels where they run, else the portable
// path.
func (bc *blockCall) gpu(s *device.Stream) error {
	d := s.Device()
	if err := needSM80(d, bc.c.op); err != nil {
		return err
	}
	if bc.hopperOK(d) {
		return bc.hopper(s)
	}
	return bc.portable(s)
}

// operands returns the quantized tensors the call reads.
func (bc *blockCall) operands() []*device.Tensor {
	if bc.c.f == weightGrad {
		return []*device.Tensor{bc.a.ColT, bc.a.ColTScale, bc.b.ColT, bc.b.ColTScale}
	}
	t := bc.w.KMajor
	if bc.c.f == inputGrad {
		t = bc.w.NMajor
	}
	return []*device.Tensor{bc.a.Row, bc.a.RowScale, t, bc.w.Scales}
}

// hopperOK reports whether the call can run on the Hopper FP8 kernels: hopperShapes,
// and an sm_90 GPU with NVRTC that targets sm_90a (hopper.BlockwiseSupported).
func (bc *blockCall) hopperOK(d *device.Device) bool {
	return bc.c.hopperShapes(bc.operands()) && hopper.BlockwiseSupported(d) == nil
}

// hopperShapes reports whether c, the call of an FP8 form reading the quantized tensors
// operands, has the shapes that the Hopper FP8 kernels take: M ≥ 1, K and N positive
// multiples of 16 (16-byte FP8 rows for the tensor maps), 1 to 1024 groups, 16-byte
// aligned tensors and fewer than 2^30 tiles of 128×128, unless forceMMA is set.
func (c *call) hopperShapes(operands []*device.Tensor) bool {
	if forceMMA || c.M < 1 || c.K < 16 || c.N < 16 || c.K%16 != 0 || c.N%16 != 0 || c.G < 1 || c.G > 1024 {
		return false
	}
	if !device.Aligned(16, append(operands, c.out)...) {
		return false
	}
	tm, tn := ceilDiv(c.M, quant.BlockSize), ceilDiv(c.N, quant.BlockSize) // forward
	switch c.f {
	case inputGrad:
		tn = ceilDiv(c.K, quant.BlockSize)
	case weightGrad:
		tm, tn = c.G*ceilDiv(c.K, quant.BlockSize), ceilDiv(c.N, quant.BlockSize)
	}
	if c.f != weightGrad {
		tm = 2*tm + c.G // the schedule's bound on the row tiles of G groups
	}
	return int64(tm)*int64(tn) < 1<<30
}

// hopper runs the call on the Hopper FP8 kernels (through onHopper).
func (bc *blockCall) hopper(s *device.Stream) error {
	c := bc.c
	return c.onHopper(s, func(op int) error {
		switch c.f {
		case forward:
			return hopper.BlockwiseGEMM(s, c.out, hopper.FP8{Q: bc.a.Row, Scale: bc.a.RowScale}, hopper.FP8{Q: bc.w.KMajor, Scale: bc.w.Scales},
				c.sizes, c.status, op, false)
		case inputGrad:
			return hopper.BlockwiseGEMM(s, c.out, hopper.FP8{Q: bc.a.Row, Scale: bc.a.RowScale}, hopper.FP8{Q: bc.w.NMajor, Scale: bc.w.Scales},
				c.sizes, c.status, op, true)
		}
		// dw_g = x_gᵀ·dy_g ([G,K,N]) or dy_gᵀ·x_g ([G,N,K])
		x, dy := hopper.FP8{Q: bc.a.ColT, Scale: bc.a.ColTScale}, hopper.FP8{Q: bc.b.ColT, Scale: bc.b.ColTScale}
		if c.layout == NK {
			x, dy = dy, x
		}
		return hopper.BlockwiseWeightGrad(s, c.out, x, dy, c.M, c.sizes, c.status, op, c.accum)
	})
}

// onHopper runs an FP8 form on the Hopper kernels: the plan kernel that checks the sizes
// into the call's status (as for the bf16 forms), then run with the form's status code
// (nothing for an empty output), its error wrapped with the form.
func (c *call) onHopper(s *device.Stream, run func(op int) error) error {
	ws, err := c.plan(s, 0, 0)
	if err != nil {
		return err
	}
	defer ws.Free()
	if c.out.Len() == 0 {
		return nil
	}
	if err := run(int(c.op)); err != nil {
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	return nil
}

// portable runs the call on any GPU: the operands dequantized into bf16, then the bf16
// form.
func (bc *blockCall) portable(s *device.Stream) error {
	c := bc.c
	switch c.f {
	case forward, inputGrad:
		w := bc.w.KMajor // forward: w_g [N][K], layout NK
		if c.f == inputGrad {
			w = bc.w.NMajor // w_g [K][N], layout KN
		}
		return c.gpuDequantized(s, false, true,
			func(t, _ *device.Tensor) error {
				return dequantRowsGPU(s, t, bc.a.Row, bc.a.RowScale, quant.BlockSize, int64(bc.a.RowScale.Dim(1)), 1, nil, 0)
			},
			func(t, _ *device.Tensor) error { return dequantWeightsGPU(s, t, w, bc.w, c.f == forward) })
	}
	colT := func(q *quant.Blockwise) func(t, plan *device.Tensor) error {
		return func(t, plan *device.Tensor) error {
			return dequantColTGPU(s, t, q.ColT, q.ColTScale, quant.BlockSize, int64(q.K), plan, c.G)
		}
	}
	return c.gpuDequantized(s, true, true, colT(bc.a), colT(bc.b))
}

// errDequantTemps is wrapped, with the device's error, by gpuDequantized's error when its
// temporaries do not fit in the device's memory: nothing has been enqueued then, so a
// caller may run the call another way.
var errDequantTemps = errors.New("no memory for the bf16 temporaries of the dequantized operands")

// dequantAllocFault, when not nil, is called after gpuDequantized allocates its
// temporaries; an error it returns stands for theirs. Tests set it to reach the fallback.
var dequantAllocFault func() error

// gpuDequantized runs c, the call an FP8 form runs as, on any GPU: a and b dequantize its
// operands A and B into bf16 temporaries of their shapes (operandShapes), then the bf16
// form runs on them (correct everywhere, slow: the operands are written and read again in
// bf16). With withPlan, a and b get the gemm plan of the sizes with 128-row tiles and one
// column tile, which gives the groups' row offsets and first 128-row tiles (else nil).
// With fill, the weight gradient's temporaries are zeroed first, so that rows no group
// owns are zeros (without it a and b see to that).
func (c *call) gpuDequantized(s *device.Stream, withPlan, fill bool, a, b func(t, plan *device.Tensor) error) error {
	ts := device.NewTemps(s)
	defer ts.Free()
	inner := *c
	aShape, bShape := c.operandShapes()
	inner.a = ts.Alloc(device.BF16, aShape...)
	inner.b = ts.Alloc(device.BF16, bShape...)
	err := ts.Err()
	if err == nil && dequantAllocFault != nil {
		err = dequantAllocFault()
	}
	if err != nil {
		if device.IsOutOfMemory(err) {
			err = fmt.Errorf("%w: %w", errDequantTemps, err)
		}
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	var plan *device.Tensor
	if withPlan {
		var err error
		if plan, err = c.plan(s, quant.BlockSize, 1); err != nil {
			return err
		}
		ts.Add(plan)
	}
	for _, op := range []struct {
		t     *device.Tensor
		write func(t, plan *device.Tensor) error
	}{{inner.a, a}, {inner.b, b}} {
		var err error
		if fill && c.f == weightGrad {
			err = device.Fill(s, op.t, 0)
		}
		if err == nil {
			err = op.write(op.t, plan)
		}
		if err != nil {
			return fmt.Errorf("gemm: %v: %w", c.op, err)
		}
	}
	return inner.gpu(s)
}

// gridFor returns the blocks of a grid-stride loop over n elements, 256 threads a block.
func gridFor(n int) device.Dim3 { return device.D1(max(1, min(ceilDiv(n, 256), 1<<16))) }

func isE5M2(t *device.Tensor) bool { return t.DType() == device.E5M2 }

// isE8M0 reports whether the scales t are E8M0 codes (MXFP8), not F32 (blockwise).
func isE8M0(t *device.Tensor) bool { return t.DType() == device.E8M0 }

// dequantRowsGPU writes a rowwise form, q Format [M, K] with its scales, F32 or E8M0, in
// blocks of blk along K, into out (BF16 [M, K]): out[m][k] = q[m][k]·scale[(k/blk)·ks +
// row(m)·ms], where row(m) = m, or, with a plan (the gemm plan of the sizes with 128-row
// tiles and one column tile, for G groups), the scale row of m in the tile layout of
// grouped MXFP8 scales, 128·P_g + m − off_g for the group g that owns m (rows no group
// owns are left as they are).
func dequantRowsGPU(s *device.Stream, out, q, scale *device.Tensor, blk int, ks, ms int64, plan *device.Tensor, G int) error {
	if out.Len() == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_fp8_dequant_rows")
	if err != nil {
		return err
	}
	return k.Launch(s, gridFor(out.Len()), device.D1(256), 0, q, scale, out, int64(q.Dim(0)), int64(q.Dim(1)),
		int32(blk), ks, ms, plan, int32(G), isE8M0(scale), isE5M2(q))
}

// dequantWeightsGPU writes t, w's KMajor (kMajor) or NMajor form, into out (BF16, t's
// shape).
func dequantWeightsGPU(s *device.Stream, out, t *device.Tensor, w *quant.BlockwiseWeights, kMajor bool) error {
	if out.Len() == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_fp8_dequant_weights")
	if err != nil {
		return err
	}
	return k.Launch(s, gridFor(out.Len()), device.D1(256), 0, t, w.Scales, out,
		int64(t.Dim(0)), int64(t.Dim(1)), int64(t.Dim(2)),
		int64(ceilDiv(w.K, quant.BlockSize)), int64(ceilDiv(w.N, quant.BlockSize)), kMajor, isE5M2(t))
}

// dequantColTGPU writes a columnwise form, colt Format [K, Mp] with its scales, F32 or
// E8M0, in blocks of blk tokens (the scale of token column p, feature k at
// (p/blk)·ld + k), into the rows of out (BF16 [M, K]) that the groups own, plan being the
// gemm plan of the sizes with 128-row tiles and one column tile, for G groups.
func dequantColTGPU(s *device.Stream, out, colt, scale *device.Tensor, blk int, ld int64, plan *device.Tensor, G int) error {
	K, mp := colt.Dim(0), colt.Dim(1)
	if out.Len() == 0 || mp == 0 || G == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_fp8_dequant_colt")
	if err != nil {
		return err
	}
	grid := device.Dim3{X: mp / 32, Y: ceilDiv(K, 32), Z: 1}
	if grid.Y > 65535 {
		return fmt.Errorf("the portable path handles K up to %d, not %d", 32*65535, K)
	}
	return k.Launch(s, grid, device.Dim3{X: 32, Y: 8, Z: 1}, 0, colt, scale, out, plan, int32(G), int64(K), int64(mp),
		int32(blk), ld, isE8M0(scale), isE5M2(colt))
}
