package moe

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
	"github.com/dropless/dropless/quant"
)

// SwiGLUBlockwise computes a[M,F] = silu(h[:, :F])·h[:, F:] of h[M,2F] as SwiGLU does,
// rounded to h's dtype (F32 or BF16), and quantizes it in the same pass, in 1×128 blocks
// as opt says, into q, enqueued on s: bit for bit what quant.QuantizeBlockwiseInto(s, q,
// a, opt) makes of SwiGLU's a, without writing a or reading it back (Row and RowScale
// for the forward's GEMM, ColT and ColTScale in opt.GroupSizes' groups for the weight
// gradient, or both). q is what quant.AllocBlockwise made for M×F and opt; on a GPU the
// work is one kernel (and with groups quant's token blocks), and nothing waits for the
// device. q's tensors must not overlap h or opt.GroupSizes.
func SwiGLUBlockwise(s *device.Stream, q *quant.Blockwise, h *device.Tensor, opt quant.BlockOptions) error {
	const fn = "SwiGLUBlockwise"
	if q == nil {
		return fmt.Errorf("moe: %s: q is nil", fn)
	}
	return swigluBlockwise(fn, s, q, h, nil, opt)
}

// SwiGLUMXFP8 is SwiGLUBlockwise for MXFP8: it computes a = SwiGLU(h) as SwiGLU does,
// rounded to h's dtype, and quantizes it in the same pass to MXFP8 as opt says into q,
// which quant.Alloc made for M×F and opt, enqueued on s: bit for bit what
// quant.QuantizeInto(s, q, a, opt) makes of SwiGLU's a. q's tensors must not overlap h
// or opt.GroupSizes.
func SwiGLUMXFP8(s *device.Stream, q *quant.MXFP8, h *device.Tensor, opt quant.Options) error {
	const fn = "SwiGLUMXFP8"
	if q == nil {
		return fmt.Errorf("moe: %s: q is nil", fn)
	}
	return swigluMXFP8(fn, s, q, h, nil, opt)
}

// swigluBlockwise is SwiGLUBlockwise for fn over the first *used rows of h (a device
// I32; nil: all), the rest zeros, as swiglu.
func swigluBlockwise(fn string, s *device.Stream, q *quant.Blockwise, h, used *device.Tensor, opt quant.BlockOptions) error {
	src, err := swigluSource(fn, s, h, used, q.M, q.K, swigluBwProg, "dl_moe_swiglu_bwq_")
	if err != nil {
		return err
	}
	if err := quant.QuantizeBlockwiseSource(s, q, src, opt); err != nil {
		return fmt.Errorf("moe: %s: %w", fn, err)
	}
	return nil
}

// swigluMXFP8 is SwiGLUMXFP8 for fn over the first *used rows of h, as swigluBlockwise.
func swigluMXFP8(fn string, s *device.Stream, q *quant.MXFP8, h, used *device.Tensor, opt quant.Options) error {
	src, err := swigluSource(fn, s, h, used, q.M, q.K, swigluMXProg, "dl_moe_swiglu_mxq_")
	if err != nil {
		return err
	}
	if err := quant.QuantizeSource(s, q, src, opt); err != nil {
		return fmt.Errorf("moe: %s: %w", fn, err)
	}
	return nil
}

// swigluLoader mirrors DlSwigluSrc of kernels/swiglu_fp8.cu.
type swigluLoader struct {
	H, Used *device.Tensor
	Rows, F int64
}

// swigluSource checks h[M,2F] for fn against q's shape M×F and returns the
// quant.Source of a = SwiGLU(h) over the first *used rows (nil: all), the rest zeros:
// on the CPU the same f32 arithmetic as swiglu, on a GPU the loader of prog's kernels
// of prefix (then the dtype's name).
func swigluSource(fn string, s *device.Stream, h, used *device.Tensor, m, f int, prog *device.Program, prefix string) (quant.Source, error) {
	if err := checkStream(s, fn); err != nil {
		return quant.Source{}, err
	}
	if err := checkFloat(s, h, fn+" h"); err != nil {
		return quant.Source{}, err
	}
	M, F2, dt := h.Dim(0), h.Dim(1), h.DType()
	if F2 != 2*f || M != m {
		return quant.Source{}, fmt.Errorf("moe: %s h is %v: want [%d %d], the gate and up halves of q's %d×%d", fn, h, m, 2*f, m, f)
	}
	F := f
	inputs := []*device.Tensor{h}
	if used != nil {
		inputs = append(inputs, used)
	}
	return quant.Source{
		M: M, K: F, DType: dt, Inputs: inputs,
		Fill: func(v []float32) {
			hv := hostF32(h)
			n := usedRows(used, M)
			par.For(n, 64, func(lo, hi int) {
				for r := lo; r < hi; r++ {
					for c := range F {
						v[r*F+c] = silu32(hv[r*F2+c]) * hv[r*F2+F+c]
					}
				}
			})
			clear(v[n*F:])
		},
		Program: prog,
		Kernels: prefix + dt.String(),
		Loader:  swigluLoader{H: h, Used: used, Rows: int64(M), F: int64(F)},
		Vec:     F*dt.Size()%16 == 0 && device.Aligned(16, h),
	}, nil
}
