package quant

import (
	_ "embed"
	"fmt"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/source.cuh
var sourceHeaderSrc string

//go:embed kernels/mxfp8.cuh
var mxfp8HeaderSrc string

//go:embed kernels/blockwise.cuh
var blockwiseHeaderSrc string

// The package's kernel headers, by the names their sources include.
var (
	sourceHeader    = device.Header{Name: "quant_source.cuh", Source: sourceHeaderSrc}
	mxfp8Header     = device.Header{Name: "quant_mxfp8.cuh", Source: mxfp8HeaderSrc}
	blockwiseHeader = device.Header{Name: "quant_blockwise.cuh", Source: blockwiseHeaderSrc}
)

// Headers returns the CUDA headers of the package's activation quantization kernels,
// for the Program of a Source: quant_source.cuh, which describes the loaders the kernels
// read their source through; quant_mxfp8.cuh, the MXFP8 kernels, instantiated for a
// loader type by DL_MX_SOURCE_KERNELS(prefix, loader, minBlocks); and
// quant_blockwise.cuh, the blockwise ones, by DL_BW_SOURCE_KERNELS(prefix, loader,
// minBlocks). minBlocks is the second argument of the kernels' __launch_bounds__ (quant's
// own: 6 for bf16 and 4 for f32 MXFP8, 3 and 2 blockwise). Pass them to
// device.Program.WithHeaders.
func Headers() []device.Header { return []device.Header{sourceHeader, mxfp8Header, blockwiseHeader} }

// Source is an M×K matrix that QuantizeSource and QuantizeBlockwiseSource compute as
// they read it, instead of reading a tensor: an elementwise function of other tensors,
// such as the SwiGLU of a layer's projections (moe.SwiGLUMXFP8), quantized in the pass
// that computes it, so that it is neither written nor read back. The result is bit for
// bit that of quantizing, with QuantizeInto or QuantizeBlockwiseInto, the tensor of
// DType that holds the source's values rounded to DType.
//
// The source is given twice: as Go code for the CPU (Fill) and as a loader of a CUDA
// program for GPUs (Program, Kernels, Loader, Vec); both must compute the same values.
type Source struct {
	M, K  int
	DType device.DType // BF16 or F32: the values are rounded to it (to nearest even for bf16)

	// Inputs are the tensors the source reads, checked to be live on the quantization's
	// device. The quantization's outputs must not overlap them.
	Inputs []*device.Tensor

	// Fill writes the M·K values, row-major, into v, on the CPU: the quantization calls
	// it when it runs, in stream order, so it may read Inputs then.
	Fill func(v []float32)

	// Program is a CUDA program that includes the package's Headers and instantiates
	// the kernels of the recipes it is quantized in for its loader, under the prefix
	// Kernels: DL_MX_SOURCE_KERNELS(Kernels, loader, minBlocks) for QuantizeSource,
	// DL_BW_SOURCE_KERNELS(Kernels, loader, minBlocks) for QuantizeBlockwiseSource. The
	// loader is a struct of the program with the type T and the functions load8 and at
	// that quant_source.cuh describes, its T the C type of DType (u16 for bf16, float
	// for f32); the kernels take it by value as their first argument, and Loader is its
	// Go value: a struct of the same fields in the same order, as device.Kernel.Launch
	// lays out struct arguments (a *device.Tensor for a pointer, int64 for a 64-bit
	// integer, and so on). Vec reports that the loader's 16-byte loads apply (its
	// load8<true>), for the kernels that use them.
	Program *device.Program
	Kernels string
	Loader  any
	Vec     bool
}

// tensorLoader mirrors DlQTensor of kernels/source.cuh: the loader of a row-major
// [M, K] tensor.
type tensorLoader struct {
	X *device.Tensor
	K int64
}

// input is what a quantization reads: the tensor x, or the Source src.
type input struct {
	x   *device.Tensor
	src *Source
}

// dtype returns the dtype of the input's values.
func (in input) dtype() device.DType {
	if in.src != nil {
		return in.src.DType
	}
	return in.x.DType()
}

// vec16 reports whether 16-byte loads of the input apply: x 16-byte aligned, or the
// source's Vec.
func (in input) vec16() bool {
	if in.src != nil {
		return in.src.Vec
	}
	return device.Aligned(16, in.x)
}

// kernel returns the program and the kernel of the input, named prefix (the tensor
// kernels' prefix without a source) then suffix, in prog (without a source), and the
// loader argument of its kernels.
func (in input) kernel(prog *device.Program, prefix, suffix string) (*device.Program, string, any) {
	if in.src != nil {
		return in.src.Program, in.src.Kernels + suffix, in.src.Loader
	}
	return prog, prefix + suffix, tensorLoader{X: in.x, K: int64(in.x.Dim(1))}
}

// reader returns, on the CPU when the quantization runs, a reader of the input's
// elements as float32 by row-major index.
func (in input) reader() func(i int) float32 {
	if in.src == nil {
		return source(in.x)
	}
	v := make([]float32, in.src.M*in.src.K)
	in.src.Fill(v)
	if in.src.DType == device.BF16 {
		for i, x := range v {
			v[i] = device.BF16ToFloat32(device.BF16FromFloat32(x))
		}
	}
	return func(i int) float32 { return v[i] }
}

// check returns an error of fn unless the input is one that q of shape m×k can be
// quantized from on s: x a live BF16 or F32 [m, k] tensor on s's device, or src a
// complete Source of that shape whose inputs are there.
func (in input) check(fn string, s *device.Stream, m, k int) error {
	if in.src == nil {
		return checkIntoSource(fn, s, in.x, m, k)
	}
	src := in.src
	for i, t := range src.Inputs {
		if err := t.Check(s, fmt.Sprintf("src.Inputs[%d]", i)); err != nil {
			return fmt.Errorf("quant: %s: %w", fn, err)
		}
	}
	switch {
	case src.DType != device.BF16 && src.DType != device.F32:
		return fmt.Errorf("quant: %s: src.DType is %v: want bf16 or f32", fn, src.DType)
	case src.M != m || src.K != k:
		return fmt.Errorf("quant: %s: src is %d×%d: want %d×%d, the shape q was allocated for", fn, src.M, src.K, m, k)
	case src.Fill == nil:
		return fmt.Errorf("quant: %s: src.Fill is nil: want the source's values on the CPU", fn)
	case src.Program == nil || src.Kernels == "" || src.Loader == nil:
		return fmt.Errorf("quant: %s: src has no kernels (src.Program %v, src.Kernels %q, src.Loader %v): want its CUDA loader", fn,
			src.Program != nil, src.Kernels, src.Loader)
	}
	return nil
}

// QuantizeSource is QuantizeInto from src instead of a tensor: it quantizes the M×K
// values of src to MXFP8 into q, which Alloc made for src's shape and opt's format,
// direction, swizzle and grouping, enqueued on s, bit for bit as QuantizeInto quantizes
// the tensor of src.DType that holds them, from one pass that computes them. On a GPU
// it runs src's kernels (see Source); the tile descriptors of group sizes are made as
// by QuantizeInto. q's tensors must not overlap src's inputs or opt.GroupSizes.
func QuantizeSource(s *device.Stream, q *MXFP8, src Source, opt Options) error {
	return quantizeInto("QuantizeSource", s, q, input{src: &src}, opt)
}

// QuantizeBlockwiseSource is QuantizeBlockwiseInto from src instead of a tensor: it
// quantizes the M×K values of src in 1×128 blocks into q, which AllocBlockwise made
// for src's shape and opt's format, direction and grouping, enqueued on s, bit for bit
// as QuantizeBlockwiseInto quantizes the tensor of src.DType that holds them, from one
// pass that computes them. On a GPU it runs src's kernels (see Source). q's tensors
// must not overlap src's inputs or opt.GroupSizes.
func QuantizeBlockwiseSource(s *device.Stream, q *Blockwise, src Source, opt BlockOptions) error {
	return quantizeBlockwiseInto("QuantizeBlockwiseSource", opQuantizeBlockwiseSource, s, q, input{src: &src}, opt)
}
