package quant

import (
	_ "embed"
	"fmt"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/mxfp8.cu
var mxfp8Src string

// kernels is the program of the package's MXFP8 kernels (kernels/mxfp8.cu, with the
// quantizations of kernels/mxfp8.cuh), which use the hardware FP8 conversion on sm_89
// and later.
var kernels = device.NewProgram("mxfp8.cu", mxfp8Src).WithHeaders(sourceHeader, mxfp8Header)

// softKernels is kernels with the software element conversion of dtype.cuh; tests run
// both against the CPU.
var softKernels = device.NewProgram("mxfp8.cu", mxfp8Src, "-DDL_MX_HW_CVT=0").WithHeaders(sourceHeader, mxfp8Header)

// fastThreads is DL_MX_FAST_THREADS, the block of the 32×256 tile kernels.
const fastThreads = 128

// Kernel selection, changed by tests only.
var (
	program      = kernels
	forceGeneral = false // use the general quantization kernel even where the fast one applies
)

// fastOK reports whether the fast kernel applies: K a multiple of 32, 16-byte loads of
// the input, the data outputs 8-byte aligned (ColT 16-byte aligned).
func fastOK(q *MXFP8, in input) bool {
	return !forceGeneral && q.K%blockSize == 0 && in.vec16() && device.Aligned(16, q.ColT) && device.Aligned(8, q.Row, q.Col)
}

// fastSuffix names the fast kernel of q's outputs.
func fastSuffix(q *MXFP8) string {
	name := map[Direction]string{Rowwise: "row", Columnwise: "col", Both: "both"}[q.Dir]
	if q.Transposed {
		name += "t" // colt, botht: ColT instead of Col
	}
	return name
}

// quantizeGPU enqueues the quantization of in into q on s; with group sizes, invalid
// ones are recorded in st.
func quantizeGPU(s *device.Stream, q *MXFP8, in input, sizes *device.Tensor, st *device.Status) error {
	d := s.Device()
	g := q.g
	var tiles *device.Tensor
	if sizes != nil {
		k, err := d.Kernel(program, "dl_mx_groups")
		if err != nil {
			return err
		}
		if err := k.Launch(s, device.D1(1), device.D1(1024), 0, sizes, int32(sizes.Len()), int32(g.m), int32(g.ntiles),
			q.gtab, q.tiles, st); err != nil {
			return err
		}
		tiles = q.tiles
		// Grouped layouts hold padding tiles (the shapes bound the groups' tiles); the
		// kernels skip them, so their scale bytes are zeroed here in one pass.
		for _, sc := range []*device.Tensor{q.RowScale, q.ColScale} {
			if sc != nil {
				if err := device.Memset(s, sc, 0); err != nil {
					return err
				}
			}
		}
	}
	grid := g.ntiles * g.ncolt
	if grid == 0 {
		return nil
	}
	col := q.Col
	if q.Transposed {
		col = q.ColT
	}
	suffix := fmt.Sprintf("_gen_%s", q.Format)
	threads := 256
	fast := fastOK(q, in)
	if fast {
		suffix = fmt.Sprintf("_%s_%s", q.Format, fastSuffix(q))
		threads = fastThreads
	}
	prog, name, loader := in.kernel(program, "dl_mxq_"+in.dtype().String(), suffix)
	args := []any{loader, q.Row, q.RowScale, col, q.ColScale, tiles,
		int32(g.m), int32(g.k), int32(g.ntiles), int32(g.ncolt), int32(g.cp), int32(g.kp),
		q.Format.rcp(), int32(q.Format.emax()), q.Mode == FLOOR, q.Swizzled}
	if !fast {
		args = append(args, q.Dir.rows(), q.Dir.cols(), q.Transposed)
	}
	k, err := d.Kernel(prog, name)
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(threads), 0, args...)
}

func dequantizeGPU(s *device.Stream, dst *device.Tensor, q *MXFP8, dir Direction, data, scale *device.Tensor) error {
	g := q.g
	grid := g.ntiles * g.ncolt
	if grid == 0 || g.k == 0 {
		return nil
	}
	k, err := s.Device().Kernel(program, fmt.Sprintf("dl_mxdq_%s_%s", dst.DType(), q.Format))
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(256), 0, dst, data, scale, q.tiles,
		int32(g.m), int32(g.k), int32(g.ntiles), int32(g.ncolt), int32(g.cp), int32(g.kp), q.Swizzled, dir == Columnwise,
		dir == Columnwise && q.Transposed)
}
