package moe

import (
	_ "embed"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

//go:embed kernels/moe.cuh
var moeHeaderSrc string

//go:embed kernels/router.cu
var routerSrc string

//go:embed kernels/sort.cu
var sortSrc string

//go:embed kernels/permute.cu
var permuteSrc string

//go:embed kernels/swiglu.cu
var swigluSrc string

//go:embed kernels/swiglu_fp8.cu
var swigluFP8Src string

//go:embed kernels/grad_fp8.cu
var gradFP8Src string

// moeHeader is the package's kernel header, which every source includes.
var moeHeader = device.Header{Name: "moe.cuh", Source: moeHeaderSrc}

var (
	routerProg  = device.NewProgram("router.cu", routerSrc).WithHeaders(moeHeader)
	sortProg    = device.NewProgram("sort.cu", sortSrc).WithHeaders(moeHeader)
	permuteProg = device.NewProgram("permute.cu", permuteSrc).WithHeaders(moeHeader)
	swigluProg  = device.NewProgram("swiglu.cu", swigluSrc).WithHeaders(moeHeader)

	// The fused SwiGLU and quantization, one program per recipe (so that a layer
	// compiles the kernels of its own).
	swigluMXProg = device.NewProgram("swiglu_fp8.cu", swigluFP8Src, "-DDL_SWIGLU_MX=1").
			WithHeaders(append([]device.Header{moeHeader}, quant.Headers()...)...)
	swigluBwProg = device.NewProgram("swiglu_fp8.cu", swigluFP8Src, "-DDL_SWIGLU_MX=0").
			WithHeaders(append([]device.Header{moeHeader}, quant.Headers()...)...)

	// The backward's operands quantized as they are computed (grad_fp8.go), one program
	// per recipe and activations' dtype, and the dispatched FP8 rows dequantized for W1's
	// weight gradient with Config.EP (fp8RowsSource), one program per recipe.
	gradMXBF16Prog = gradProgram("-DDL_GRAD_MX=1", "-DDL_GRAD_F32=0")
	gradMXF32Prog  = gradProgram("-DDL_GRAD_MX=1", "-DDL_GRAD_F32=1")
	gradBwBF16Prog = gradProgram("-DDL_GRAD_MX=0", "-DDL_GRAD_F32=0")
	gradBwF32Prog  = gradProgram("-DDL_GRAD_MX=0", "-DDL_GRAD_F32=1")
	fp8RowsMXProg  = gradProgram("-DDL_GRAD_MX=1", "-DDL_GRAD_FP8ROWS=1")
	fp8RowsBwProg  = gradProgram("-DDL_GRAD_MX=0", "-DDL_GRAD_FP8ROWS=1")
)

// programs returns the package's CUDA programs.
func programs() []*device.Program {
	return []*device.Program{routerProg, sortProg, permuteProg, swigluProg, swigluMXProg, swigluBwProg,
		gradMXBF16Prog, gradMXF32Prog, gradBwBF16Prog, gradBwF32Prog, fp8RowsMXProg, fp8RowsBwProg}
}

// launch enqueues kernel name of p on s.
func launch(s *device.Stream, p *device.Program, name string, grid, block device.Dim3, smem int, args ...any) error {
	k, err := s.Device().Kernel(p, name)
	if err != nil {
		return err
	}
	return k.Launch(s, grid, block, smem, args...)
}

// vecWidth returns how many elements of dt the row kernels move at once: 16 bytes
// when every row length in cols is a multiple of it and every tensor is 16-byte
// aligned, else 1.
func vecWidth(dt device.DType, cols []int, ts ...*device.Tensor) int {
	v := 16 / dt.Size()
	for _, c := range cols {
		if c%v != 0 {
			return 1
		}
	}
	if !device.Aligned(16, ts...) {
		return 1
	}
	return v
}

// rowKernel returns the name suffix of a dtype and vector width: "bf16_v8".
func rowKernel(dt device.DType, v int) string { return fmt.Sprintf("%s_v%d", dt, v) }

// routeArgs mirrors the kernels' struct dl_route_args, passed by value.
type routeArgs struct {
	T, E, K     int32
	Sigmoid     bool
	G, TG       int32
	Renorm, Aux bool
	TPW         int32
	Scale       float32
}

// blockFor returns a block size of at least n threads, a multiple of 32, at most 1024.
func blockFor(n int) int { return min(max((n+31)/32*32, 32), 1024) }

// gradProgram returns the program of grad_fp8.cu compiled with options.
func gradProgram(options ...string) *device.Program {
	return device.NewProgram("grad_fp8.cu", gradFP8Src, options...).
		WithHeaders(append([]device.Header{moeHeader}, quant.Headers()...)...)
}
