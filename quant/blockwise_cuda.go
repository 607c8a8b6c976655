package quant

import (
	_ "embed"
	"fmt"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/blockwise.cu
var blockwiseSrc string

// blockwiseKernels is the program of the blockwise kernels (kernels/blockwise.cu, with
// the quantizations of kernels/blockwise.cuh), which use the hardware FP8 conversion on
// sm_89 and later; softBlockwiseKernels uses the software conversion of dtype.cuh. Tests
// run both against the CPU.
var (
	blockwiseKernels     = device.NewProgram("blockwise.cu", blockwiseSrc).WithHeaders(sourceHeader, blockwiseHeader)
	softBlockwiseKernels = device.NewProgram("blockwise.cu", blockwiseSrc, "-DDL_BW_HW_CVT=0").WithHeaders(sourceHeader, blockwiseHeader)
)

// Kernel selection, changed by tests only.
var (
	bwProgram     = blockwiseKernels
	bwForceScalar = false // use the element-by-element loads even where 16-byte ones apply
)

const bwThreads = 256

// bwQuantArgs mirrors DlBwArgs of kernels/blockwise.cuh.
type bwQuantArgs struct {
	Row, RowScale, ColT, ColTScale, Tiles *device.Tensor
	M, K, Mr, Mp, Ntiles, Ncolt           int32
	Max                                   float32
	Pow2                                  bool
}

// bwWeightArgs mirrors DlBwWArgs.
type bwWeightArgs struct {
	W, Direct, Trans, Scales *device.Tensor
	R, C, Nrt, Nct, Srs, Scs int32
	Max                      float32
	Pow2                     bool
}

// bwDequantArgs mirrors DlBwDqArgs.
type bwDequantArgs struct {
	Y, Q, Scale, Tiles  *device.Tensor
	M, K, Mr, Mp, Ncolt int32
	Col, Vec            bool
}

// bwWeightDequantArgs mirrors DlBwWDqArgs.
type bwWeightDequantArgs struct {
	Y, Q, Scales   *device.Tensor
	K, N, Nkt, Nnt int32
	Vec            bool
}

// bwVecOK reports whether 16-byte loads apply to x of rows of k elements.
func bwVecOK(x *device.Tensor, k int) bool {
	return !bwForceScalar && k%8 == 0 && device.Aligned(16, x)
}

// bwSuffix names the scalar variant of a kernel.
func bwSuffix(vec bool) string {
	if vec {
		return ""
	}
	return "_scalar"
}

// quantizeBlockwiseGPU enqueues the quantization of in into q on s; with group sizes,
// the token blocks are made on the device first and invalid sizes recorded in st.
func quantizeBlockwiseGPU(s *device.Stream, q *Blockwise, in input, sizes *device.Tensor, st *device.Status, op int) error {
	d := s.Device()
	g := q.alloc.g
	var tiles *device.Tensor
	if sizes != nil {
		k, err := d.Kernel(bwProgram, "dl_bw_groups")
		if err != nil {
			return err
		}
		if err := k.Launch(s, device.D1(1), device.D1(1024), 0, sizes, int32(sizes.Len()), int32(g.m), int32(g.ntiles),
			int32(op), q.alloc.gtab, q.alloc.tiles, st); err != nil {
			return err
		}
		tiles = q.alloc.tiles
	}
	grid := g.ntiles * g.nb
	if grid == 0 {
		return nil
	}
	vec := !bwForceScalar && g.k%8 == 0 && in.vec16()
	suffix := fmt.Sprintf("_%s_%s%s", q.Format, map[Direction]string{Rowwise: "row", Columnwise: "col", Both: "both"}[q.Dir], bwSuffix(vec))
	prog, name, loader := in.kernel(bwProgram, "dl_bwq_"+in.dtype().String(), suffix)
	k, err := d.Kernel(prog, name)
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(bwThreads), 0, bwQuantArgs{
		Row: q.Row, RowScale: q.RowScale, ColT: q.ColT, ColTScale: q.ColTScale, Tiles: tiles,
		M: int32(g.m), K: int32(g.k), Mr: int32(g.mr), Mp: int32(g.mp()), Ntiles: int32(g.ntiles), Ncolt: int32(g.nb),
		Max: q.Format.Max(), Pow2: q.Scale == ScalePow2,
	}, loader)
}

// dequantizeBlockwiseGPU enqueues the dequantization of q's direction dir into dst on
// s: Row by the ungrouped 128-row tiles (its layout does not depend on the groups), ColT
// by the token blocks of the last quantization.
func dequantizeBlockwiseGPU(s *device.Stream, dst *device.Tensor, q *Blockwise, dir Direction) error {
	g := q.alloc.g
	a := bwDequantArgs{Y: dst, Q: q.Row, Scale: q.RowScale,
		M: int32(g.m), K: int32(g.k), Mr: int32(g.mr), Mp: int32(g.mp()), Ncolt: int32(g.nb), Vec: bwVecOK(dst, g.k)}
	tiles := ceilDiv(g.m, BlockSize)
	if dir == Columnwise {
		a.Q, a.Scale, a.Tiles, a.Col = q.ColT, q.ColTScale, q.alloc.tiles, true
		tiles = g.ntiles
	}
	grid := tiles * g.nb
	if grid == 0 {
		return nil
	}
	k, err := s.Device().Kernel(bwProgram, fmt.Sprintf("dl_bwdq_%s_%s", dst.DType(), q.Format))
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(bwThreads), 0, a)
}

func quantizeWeightsGPU(s *device.Stream, q *BlockwiseWeights, w *device.Tensor) error {
	g := q.wg
	grid := g.g * g.nrt * g.nct
	if grid == 0 {
		return nil
	}
	vec := bwVecOK(w, g.c)
	k, err := s.Device().Kernel(bwProgram, fmt.Sprintf("dl_bww_%s_%s%s", w.DType(), q.Format, bwSuffix(vec)))
	if err != nil {
		return err
	}
	a := bwWeightArgs{W: w, Direct: q.NMajor, Trans: q.KMajor, Scales: q.Scales,
		R: int32(g.r), C: int32(g.c), Nrt: int32(g.nrt), Nct: int32(g.nct), Srs: int32(g.nct), Scs: 1,
		Max: q.Format.Max(), Pow2: q.Scale == ScalePow2}
	if g.nk {
		a.Direct, a.Trans, a.Srs, a.Scs = q.KMajor, q.NMajor, 1, int32(g.nrt)
	}
	return k.Launch(s, device.D1(grid), device.D1(bwThreads), 0, a)
}

func dequantizeWeightsGPU(s *device.Stream, dst *device.Tensor, q *BlockwiseWeights) error {
	g := q.wg
	nkt, nnt := ceilDiv(g.k, BlockSize), ceilDiv(g.n, BlockSize)
	grid := g.g * nkt * nnt
	if grid == 0 {
		return nil
	}
	k, err := s.Device().Kernel(bwProgram, fmt.Sprintf("dl_bwdqw_%s_%s", dst.DType(), q.Format))
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(bwThreads), 0, bwWeightDequantArgs{Y: dst, Q: q.NMajor, Scales: q.Scales,
		K: int32(g.k), N: int32(g.n), Nkt: int32(nkt), Nnt: int32(nnt), Vec: bwVecOK(dst, g.n)})
}
