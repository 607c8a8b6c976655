package moe

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/prelude.cuh
var preludeSrc string

//go:embed kernels/router.cu
var routerSrc string

//go:embed kernels/sort.cu
var sortSrc string

//go:embed kernels/permute.cu
var permuteSrc string

//go:embed kernels/swiglu.cu
var swigluSrc string

// program returns a Program whose source is the shared prelude followed by src, with
// line numbers of compile errors counted from the start of src.
func program(name, src string) *device.Program {
	return device.NewProgram(name, preludeSrc+"\n#line 1 \""+name+"\"\n"+src)
}

var (
	routerProg  = program("router.cu", routerSrc)
	sortProg    = program("sort.cu", sortSrc)
	permuteProg = program("permute.cu", permuteSrc)
	swigluProg  = program("swiglu.cu", swigluSrc)
)

// Programs returns the package's CUDA programs, so tools can compile them ahead of use.
func Programs() []*device.Program {
	return []*device.Program{routerProg, sortProg, permuteProg, swigluProg}
}

// launch enqueues kernel name of p on s.
func launch(s *device.Stream, p *device.Program, name string, grid, block device.Dim3, smem int, args ...any) error {
	k, err := s.Device().Kernel(p, name)
	if err != nil {
		return err
	}
	if smem > 48<<10 {
		if err := k.SetMaxDynamicSharedMemory(smem); err != nil {
			return err
		}
	}
	return k.Launch(s, grid, block, smem, args...)
}

// opt returns t as a kernel argument, or a null pointer when t is nil.
func opt(t *device.Tensor) any {
	if t == nil {
		return uint64(0)
	}
	return t
}

// dtName is the kernels' name of a float dtype.
func dtName(dt device.DType) string {
	if dt == device.BF16 {
		return "bf16"
	}
	return "f32"
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
	for _, t := range ts {
		if t != nil && t.Ptr()%16 != 0 {
			return 1
		}
	}
	return v
}

// rowKernel returns the name suffix of a dtype and vector width: "bf16_v8".
func rowKernel(dt device.DType, v int) string { return fmt.Sprintf("%s_v%d", dtName(dt), v) }

// routeArgs is the kernels' dl_route_args struct.
type routeArgs struct {
	T, E, K, Sigmoid, G, TG, Renorm, Aux, TPW int32
	Scale                                     float32
}

func (a routeArgs) bytes() []byte {
	b := make([]byte, 40)
	for i, v := range []int32{a.T, a.E, a.K, a.Sigmoid, a.G, a.TG, a.Renorm, a.Aux, a.TPW} {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	binary.LittleEndian.PutUint32(b[36:], math.Float32bits(a.Scale))
	return b
}

func b2i(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// blockFor returns a block size of at least n threads, a multiple of 32, at most 1024.
func blockFor(n int) int { return min(max((n+31)/32*32, 32), 1024) }
