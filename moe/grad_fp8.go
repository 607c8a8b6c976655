package moe

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
	"github.com/dropless/dropless/quant"
)

// Without Config.EP an FP8 Backward can quantize three of its GEMMs' operands as it
// computes them, from what they are computed from, instead of writing them in the
// activations' dtype and reading them back: the expert rows' gradient dyp (weight·dy of
// each row's token, UnpermuteGrad's, which then computes the routing weights' gradient
// alone), SwiGLU's gradient dh (from h and da, SwiGLUGrad's) and the permuted rows of x
// for W1's weight gradient (Permute's). Each is a rowsSource, a quant.Source of the
// rows a quantization covers, whose values are bit for bit those of the tensor it
// stands for (grad_fp8.cu computes them as permute.cu and swiglu.cu do, and quant
// quantizes a source as the tensor of its values): the layer's results are those of
// the path that writes the tensors, without the write and the read back of an [R,H],
// an [R,2F] and an [R,H] tensor, nor their memory. Which of the three are fused is
// Layer.fusedGrad.

// gradParts is a set of the operands of an FP8 Backward that it can quantize as it
// computes them.
type gradParts uint8

const (
	gradDyp gradParts = 1 << iota // the expert rows' gradient dyp, from dy and the routing weights
	gradDh                        // SwiGLU's gradient dh, from h and da
	gradXp                        // the permuted x of W1's weight gradient, from x

	allGradParts = gradDyp | gradDh | gradXp
	// defaultFusedGrad are the parts a Layer fuses: dyp and the permuted x, which save
	// two [R,H] temporaries at no cost in time; dh's quantization from h and da took
	// longer than SwiGLU's gradient pass and the quantization of dh together (see
	// docs/perf.md, seventh round).
	defaultFusedGrad = gradDyp | gradXp
)

// rowsSource is an [R, N] operand of the experts' GEMMs computed as its quantizations
// read it: the quant.Source of its first rows rows.
type rowsSource func(rows int) (quant.Source, error)

// gradKernels returns the program of grad_fp8.cu for the layer's recipe that holds the
// kernels of loader (dh, rows or fp8rows) in dtype dt (bf16 or f32; fp8rows: f32), and
// their prefix.
func (e *experts) gradKernels(loader string, dt device.DType) (*device.Program, string) {
	bw, mx := gradBwBF16Prog, gradMXBF16Prog
	switch {
	case loader == "fp8rows":
		bw, mx = fp8RowsBwProg, fp8RowsMXProg
	case dt == device.F32:
		bw, mx = gradBwF32Prog, gradMXF32Prog
	}
	if e.cfg.Precision == PrecisionBlockwise {
		return bw, "dl_moe_" + loader + "_bwq_" + dt.String()
	}
	return mx, "dl_moe_" + loader + "_mxq_" + dt.String()
}

// swigluGradLoader mirrors DlSwigluGradSrc of kernels/grad_fp8.cu.
type swigluGradLoader struct {
	H, DA, Used *device.Tensor
	Rows, F     int64
}

// swigluGradSource returns dh[R,2F] = [da·up·silu'(gate) | da·silu(gate)] of h[R,2F] and
// da[R,F] over the layer's used rows (act.used), the rest zeros, as swigluGrad computes
// it.
func (e *experts) swigluGradSource(h, da *device.Tensor) rowsSource {
	used := e.act.used
	return func(rows int) (quant.Source, error) {
		M, F2, dt := h.Dim(0), h.Dim(1), h.DType()
		F := F2 / 2
		if rows > M || da.Dim(0) != M || da.Dim(1) != F {
			return quant.Source{}, fmt.Errorf("moe: internal error: SwiGLU's gradient of %d rows from h %v and da %v", rows, h, da)
		}
		inputs := []*device.Tensor{h, da}
		if used != nil {
			inputs = append(inputs, used)
		}
		prog, kernels := e.gradKernels("dh", dt)
		return quant.Source{
			M: rows, K: F2, DType: dt, Inputs: inputs,
			Fill: func(v []float32) {
				n := min(usedRows(used, M), rows)
				swigluGradCPU(v, hostF32(h), hostF32(da), n, F)
				clear(v[n*F2:])
			},
			Program: prog,
			Kernels: kernels,
			Loader:  swigluGradLoader{H: h, DA: da, Used: used, Rows: int64(M), F: int64(F)},
			Vec:     F%8 == 0 && device.Aligned(16, h, da),
		}, nil
	}
}

// gatherLoader mirrors DlGatherSrc of kernels/grad_fp8.cu.
type gatherLoader struct {
	X, Source, W *device.Tensor
	Per, K       int64
}

// gatherSource returns the expert rows of x[T,N] as Permute writes them (w nil: row r is
// x[t] for the token t of its assignment, a zero row for an unused row), or with w
// (F32[T,TopK], the routing weights) as UnpermuteGrad writes dyp of dy = x: row r is
// w[t,k]·x[t] for its assignment (t, k).
func (e *experts) gatherSource(x, w *device.Tensor) rowsSource {
	p := e.act.Perm
	return func(rows int) (quant.Source, error) {
		if p == nil || rows > p.Rows {
			return quant.Source{}, errors.New("moe: internal error: expert rows gathered without a permutation of them")
		}
		N, dt, per := x.Dim(1), x.DType(), p.TopK
		inputs := []*device.Tensor{x, p.Source}
		if w != nil {
			inputs = append(inputs, w)
		}
		prog, kernels := e.gradKernels("rows", dt)
		return quant.Source{
			M: rows, K: N, DType: dt, Inputs: inputs,
			Fill: func(v []float32) {
				xv, src := hostF32(x), device.Slice[int32](p.Source)
				var wv []float32
				if w != nil {
					wv = device.Slice[float32](w)
				}
				par.For(rows, 64, func(lo, hi int) {
					for r := lo; r < hi; r++ {
						out, a := v[r*N:(r+1)*N], int(src[r])
						switch {
						case a < 0:
							clear(out)
						case wv == nil:
							copy(out, xv[a/per*N:][:N])
						default:
							for c, xc := range xv[a/per*N:][:N] {
								out[c] = wv[a] * xc
							}
						}
					}
				})
			},
			Program: prog,
			Kernels: kernels,
			Loader:  gatherLoader{X: x, Source: p.Source, W: w, Per: int64(per), K: int64(N)},
			Vec:     N*dt.Size()%16 == 0 && device.Aligned(16, x),
		}, nil
	}
}

// mxBlock is the length of MXFP8's blocks.
const mxBlock = 32

// fp8RowsLoader mirrors DlFP8RowsSrc of kernels/grad_fp8.cu.
type fp8RowsLoader struct {
	Codes, Scales *device.Tensor
	K, LD         int64
}

// fp8RowsSource returns the rows that q quantizes rowwise in the layer's recipe (E4M3,
// quant's plain layouts: the dispatched rows of Config.EP), dequantized: the value at
// (r, c) is the f32 product of its code and its block's scale, as an F32 source, whose
// quantization rounds nothing more. The columnwise form of W1's weight gradient is
// quantized from it (DeepSeek-V3's recipe: the activation moves and is kept in FP8).
//
// The source reads the tensors q holds now.
func (e *experts) fp8RowsSource(q fp8Rows) rowsSource {
	var codes, scales *device.Tensor
	var M, K, block int
	if q.b != nil {
		codes, scales, M, K, block = q.b.Row, q.b.RowScale, q.b.M, q.b.K, quant.BlockSize
	} else if q.m != nil {
		codes, scales, M, K, block = q.m.Row, q.m.RowScale, q.m.M, q.m.K, mxBlock
	}
	mx := q.m != nil
	return func(rows int) (quant.Source, error) {
		if codes == nil || scales == nil || rows > M {
			return quant.Source{}, fmt.Errorf("moe: internal error: %d dequantized rows of FP8 rows without their rowwise form or of fewer rows", rows)
		}
		ld := scales.Dim(1)
		prog, kernels := e.gradKernels("fp8rows", device.F32)
		return quant.Source{
			M: rows, K: K, DType: device.F32, Inputs: []*device.Tensor{codes, scales},
			Fill: func(v []float32) {
				c := device.Slice[uint8](codes)
				var bs []float32
				var es []uint8
				if mx {
					es = device.Slice[uint8](scales)
				} else {
					bs = device.Slice[float32](scales)
				}
				par.For(rows, 64, func(lo, hi int) {
					for r := lo; r < hi; r++ {
						for b, j0 := 0, 0; j0 < K; b, j0 = b+1, j0+block {
							var sc float32 // the block's scale
							if mx {
								sc = device.E8M0ToFloat32(es[r*ld+b])
							} else {
								sc = bs[b*ld+r]
							}
							for j, code := range c[r*K+j0 : r*K+min(j0+block, K)] {
								v[r*K+j0+j] = device.E4M3ToFloat32(code) * sc
							}
						}
					}
				})
			},
			Program: prog,
			Kernels: kernels,
			Loader:  fp8RowsLoader{Codes: codes, Scales: scales, K: int64(K), LD: int64(ld)},
			Vec:     K%8 == 0 && device.Aligned(8, codes),
		}, nil
	}
}

// quantize quantizes the first rows rows of x, from its tensor or its source, on e's
// stream in the layer's recipe, with bo (blockwise) or mo (MXFP8).
func (e *experts) quantize(x operand, rows int, bo quant.BlockOptions, mo quant.Options) (fp8Rows, error) {
	if x.src == nil {
		t, err := x.t.Rows(0, rows)
		if err != nil {
			return fp8Rows{}, err
		}
		return quantizeFP8(e.s, e.cfg.Precision, t, bo, mo)
	}
	src, err := x.src(rows)
	if err != nil {
		return fp8Rows{}, err
	}
	var q fp8Rows
	if e.cfg.Precision == PrecisionBlockwise {
		if q.b, err = quant.AllocBlockwise(e.s, src.M, src.K, bo); err == nil {
			err = quant.QuantizeBlockwiseSource(e.s, q.b, src, bo)
		}
	} else if q.m, err = quant.Alloc(e.s, src.M, src.K, mo); err == nil {
		err = quant.QuantizeSource(e.s, q.m, src, mo)
	}
	if err != nil {
		return fp8Rows{}, errors.Join(err, q.free())
	}
	return q, nil
}

// String returns the parts as "fused_dyp_dh_xp" (those of f), or "unfused".
func (f gradParts) String() string {
	if f == 0 {
		return "unfused"
	}
	s := "fused"
	for _, p := range []struct {
		part gradParts
		name string
	}{{gradDyp, "dyp"}, {gradDh, "dh"}, {gradXp, "xp"}} {
		if f&p.part != 0 {
			s += "_" + p.name
		}
	}
	return s
}
