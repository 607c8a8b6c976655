package gemm

import (
	"os"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm/internal/hopper"
)

// forceMMA makes every call take the portable mma.sync kernels even where the Hopper
// kernels could run: DROPLESS_GEMM_KERNEL=mma, read once when the package is
// initialized (for comparisons). Tests may set it.
var forceMMA = os.Getenv("DROPLESS_GEMM_KERNEL") == "mma"

// hopperOK reports whether the call can run on the Hopper kernels (wgmma and TMA) as it
// is: it passes hopperShapeOK, K and N are multiples of 8 (16-byte rows for the tensor
// maps) and the pointers are 16-byte aligned. Calls that pass hopperShapeOK only run on
// them through padded copies (see padded).
func (c *call) hopperOK(d *device.Device) bool {
	return c.K%8 == 0 && c.N%8 == 0 && device.Aligned(16, c.out, c.a, c.b) && c.hopperShapeOK(d)
}

// hopperShapeOK reports whether the call could run on the Hopper kernels but for the
// alignment of its rows and pointers: bf16 operands, M, K, N ≥ 1, 1 to 1024 groups, an
// sm_90 GPU and NVRTC that targets sm_90a, unless forceMMA is set.
func (c *call) hopperShapeOK(d *device.Device) bool {
	if forceMMA {
		return false
	}
	if c.a.DType() != device.BF16 || c.M < 1 || c.K < 1 || c.N < 1 || c.G > 1024 || c.G < 1 {
		return false
	}
	return hopper.Supported(d) == nil
}

// hopper enqueues the call on the Hopper kernels. The plan kernel has already checked
// the sizes into the call's Status; on invalid sizes these kernels write nothing (and
// record into the same Status, where the plan's record, first, stays). counter is the
// call's scratch element for the forward kernels' tile schedule.
func (c *call) hopper(s *device.Stream, counter *device.Tensor) error {
	x2 := func(t *device.Tensor, r, k int) (*device.Tensor, error) { return t.Reshape(r, k) }
	switch c.f {
	case forward: // y[M,N] = x[M,K]·w_g: B is w, MN-major when stored [G,K,N]
		x, err := x2(c.a, c.M, c.K)
		if err != nil {
			return err
		}
		y, err := x2(c.out, c.M, c.N)
		if err != nil {
			return err
		}
		return hopper.GroupedGEMM(s, y, x, c.b, c.sizes, c.status, int(c.name()), counter, c.layout == KN)
	case inputGrad: // dx[M,K] = dy[M,N]·w_gᵀ: K-major B when w is [G,K,N]
		dy, err := x2(c.a, c.M, c.N)
		if err != nil {
			return err
		}
		dx, err := x2(c.out, c.M, c.K)
		if err != nil {
			return err
		}
		return hopper.GroupedGEMM(s, dx, dy, c.b, c.sizes, c.status, int(c.name()), counter, c.layout == NK)
	default: // dw_g = x_gᵀ·dy_g ([G,K,N]) or dy_gᵀ·x_g ([G,N,K])
		x, err := x2(c.a, c.M, c.K)
		if err != nil {
			return err
		}
		dy, err := x2(c.b, c.M, c.N)
		if err != nil {
			return err
		}
		if c.layout == NK {
			x, dy = dy, x
		}
		return hopper.WeightGrad(s, c.out, x, dy, c.sizes, c.status, int(c.name()), c.accum)
	}
}
