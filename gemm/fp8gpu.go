package gemm

import (
	_ "embed"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm/internal/hopper"
	"github.com/dropless/dropless/quant"
)

//go:embed kernels/fp8.cu
var fp8Src string

// fp8Program holds the dequantization kernels of the blockwise forms' portable GPU path.
var fp8Program = device.NewProgram("gemm_fp8.cu", fp8Src)

// gpu enqueues the call on s: the Hopper FP8 kernels where they run, else the portable
// path.
func (bc *blockCall) gpu(s *device.Stream) error {
	c := bc.c
	d := s.Device()
	if cc := d.ComputeCapability(); cc < 80 {
		return fmt.Errorf("gemm: %v: %v has compute capability %d.%d: the kernels need 8.0 or newer", c.op, d, cc/10, cc%10)
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

// hopperOK reports whether the call can run on the Hopper FP8 kernels: M ≥ 1, K and N
// positive multiples of 16 (16-byte FP8 rows for the tensor maps; quant's weights are),
// 1 to 1024 groups, 16-byte aligned tensors, an sm_90 GPU with NVRTC that targets sm_90a
// (hopper.BlockwiseSupported), unless forceMMA is set.
func (bc *blockCall) hopperOK(d *device.Device) bool {
	c := bc.c
	if forceMMA || c.M < 1 || c.K < 16 || c.N < 16 || c.K%16 != 0 || c.N%16 != 0 || c.G < 1 || c.G > 1024 {
		return false
	}
	for _, t := range append(bc.operands(), c.out) {
		if t.Ptr()%16 != 0 {
			return false
		}
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
	if int64(tm)*int64(tn) >= 1<<30 {
		return false
	}
	return hopper.BlockwiseSupported(d) == nil
}

// hopper runs the call on the Hopper FP8 kernels, after the plan kernel that checks the
// sizes into the call's status (as for the bf16 forms).
func (bc *blockCall) hopper(s *device.Stream) error {
	c := bc.c
	ws, err := c.plan(s, 0, 0)
	if err != nil {
		return err
	}
	defer ws.Free()
	if c.out.Len() == 0 {
		return nil
	}
	op := int(c.op)
	switch c.f {
	case forward:
		err = hopper.BlockwiseGEMM(s, c.out, hopper.FP8{Q: bc.a.Row, Scale: bc.a.RowScale}, hopper.FP8{Q: bc.w.KMajor, Scale: bc.w.Scales},
			c.sizes, c.status, op, false)
	case inputGrad:
		err = hopper.BlockwiseGEMM(s, c.out, hopper.FP8{Q: bc.a.Row, Scale: bc.a.RowScale}, hopper.FP8{Q: bc.w.NMajor, Scale: bc.w.Scales},
			c.sizes, c.status, op, true)
	default: // dw_g = x_gᵀ·dy_g ([G,K,N]) or dy_gᵀ·x_g ([G,N,K])
		x, dy := hopper.FP8{Q: bc.a.ColT, Scale: bc.a.ColTScale}, hopper.FP8{Q: bc.b.ColT, Scale: bc.b.ColTScale}
		if c.layout == NK {
			x, dy = dy, x
		}
		err = hopper.BlockwiseWeightGrad(s, c.out, x, dy, c.M, c.sizes, c.status, op, c.accum)
	}
	if err != nil {
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	return nil
}

// portable runs the call on any GPU: it dequantizes the operands into bf16 temporaries
// and enqueues the bf16 ragged_dot of the form on them (correct everywhere, slow: the
// operands are written and read again in bf16).
func (bc *blockCall) portable(s *device.Stream) error {
	c := bc.c
	ts := device.NewTemps(s)
	defer ts.Free()
	inner := *c
	var err error
	switch c.f {
	case forward, inputGrad:
		w, rows, cols := bc.w.KMajor, c.N, c.K // forward: w_g [N][K], layout NK
		if c.f == inputGrad {
			w, rows, cols = bc.w.NMajor, c.K, c.N // w_g [K][N], layout KN
		}
		inner.a = ts.Alloc(device.BF16, bc.a.M, bc.a.K)
		inner.b = ts.Alloc(device.BF16, c.G, rows, cols)
		if err := ts.Err(); err != nil {
			return fmt.Errorf("gemm: %v: %w", c.op, err)
		}
		if err = dequantRowsGPU(s, inner.a, bc.a); err == nil {
			err = dequantWeightsGPU(s, inner.b, w, bc.w, c.f == forward)
		}
	default:
		inner.a = ts.Alloc(device.BF16, c.M, c.K)
		inner.b = ts.Alloc(device.BF16, c.M, c.N)
		if err := ts.Err(); err != nil {
			return fmt.Errorf("gemm: %v: %w", c.op, err)
		}
		// The plan of 128-row tiles, one column tile each, gives the groups' row offsets
		// and first token blocks.
		ws, perr := c.plan(s, quant.BlockSize, 1)
		if perr != nil {
			return perr
		}
		ts.Add(ws)
		for i, q := range []*quant.Blockwise{bc.a, bc.b} {
			t := []*device.Tensor{inner.a, inner.b}[i]
			if err = device.Fill(s, t, 0); err == nil {
				err = dequantColTGPU(s, t, q, ws, c.G)
			}
			if err != nil {
				break
			}
		}
	}
	if err != nil {
		return fmt.Errorf("gemm: %v: %w", c.op, err)
	}
	return inner.gpu(s)
}

// gridFor returns the blocks of a grid-stride loop over n elements, 256 threads a block.
func gridFor(n int) device.Dim3 { return device.D1(max(1, min(ceilDiv(n, 256), 1<<16))) }

func isE5M2(t *device.Tensor) bool { return t.DType() == device.E5M2 }

// dequantRowsGPU writes the rowwise form of q into out (BF16 [M, K]).
func dequantRowsGPU(s *device.Stream, out *device.Tensor, q *quant.Blockwise) error {
	if out.Len() == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_fp8_dequant_rows")
	if err != nil {
		return err
	}
	return k.Launch(s, gridFor(out.Len()), device.D1(256), 0, q.Row, q.RowScale, out,
		int64(q.M), int64(q.K), int64(q.RowScale.Dim(1)), isE5M2(q.Row))
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

// dequantColTGPU writes the columnwise form of q into the rows of out (BF16 [M, K]) that
// the groups own, plan being the gemm plan of the sizes with 128-row tiles and one
// column tile.
func dequantColTGPU(s *device.Stream, out *device.Tensor, q *quant.Blockwise, plan *device.Tensor, G int) error {
	mp := q.ColT.Dim(1)
	if out.Len() == 0 || mp == 0 || G == 0 {
		return nil
	}
	k, err := s.Device().Kernel(fp8Program, "dl_fp8_dequant_colt")
	if err != nil {
		return err
	}
	grid := device.Dim3{X: mp / 32, Y: ceilDiv(q.K, 32), Z: 1}
	if grid.Y > 65535 {
		return fmt.Errorf("the portable path handles K up to %d, not %d", 32*65535, q.K)
	}
	return k.Launch(s, grid, device.Dim3{X: 32, Y: 8, Z: 1}, 0, q.ColT, q.ColTScale, out, plan, int32(G), int64(q.K), int64(mp), isE5M2(q.ColT))
}
