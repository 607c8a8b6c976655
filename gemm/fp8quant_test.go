package gemm_test

import (
	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// The tests quantize their operands with package quant, on the device under test, and
// take the values that the float64 reference multiplies from quant's dequantization of
// the same quantization on the CPU (bit for bit the device's: see package quant).

const blk = quant.BlockSize

// recipe is an element format and a scale rule: a blockwise scale kind, or, with mx, an
// MXFP8 scale mode.
type recipe struct {
	f    quant.Format
	k    quant.ScaleKind
	mx   bool
	mode quant.ScaleMode
}

var (
	e4m3F32  = recipe{f: quant.E4M3, k: quant.ScaleF32}
	e5m2Pow2 = recipe{f: quant.E5M2, k: quant.ScalePow2}
	e4m3Pow2 = recipe{f: quant.E4M3, k: quant.ScalePow2}
)

// family is the FP8 recipe whose forms a test runs.
type family struct {
	name string // the forms are RaggedDot<name>, RaggedDot<name>InputGrad, RaggedDot<name>WeightGrad
	mx   bool
	bs   int // the scale block along the contracted dimension
	// fwdNK: the CPU path multiplies the forward's dequantized weights stored [G, N, K]
	// (else [G, K, N]).
	fwdNK bool
}

var (
	blockwiseFam = family{name: "Blockwise", bs: quant.BlockSize, fwdNK: true}
	mxFam        = family{name: "MXFP8", mx: true, bs: 32}
)

// recipe returns the family's counterpart of the blockwise recipe r: r itself, or the
// MXFP8 recipe of r's format with the RCEIL rule for f32 scales and FLOOR for
// power-of-two ones (MXFP8 scales are all powers of two).
func (fm family) recipe(r recipe) recipe {
	if !fm.mx || r.mx {
		return r
	}
	m := quant.RCEIL
	if r.k == quant.ScalePow2 {
		m = quant.FLOOR
	}
	return recipe{f: r.f, mx: true, mode: m}
}

// op returns the name of the family's form f, as errors and status records name it.
func (fm family) op(f form) string {
	return "RaggedDot" + fm.name + [...]string{"", "InputGrad", "WeightGrad"}[f]
}

// weightsOK reports whether the family's weight quantization takes K×N matrices: both
// need K and N multiples of 16.
func (fm family) weightsOK(K, N int) bool { return K%16 == 0 && N%16 == 0 }

func ceil(a, b int) int { return (a + b - 1) / b }

// quantized is a tensor quantized by package quant: *quant.Blockwise, *quant.MXFP8,
// *quant.BlockwiseWeights or *quant.MXFP8Weights.
type quantized interface{ Free() error }

// blockwise quantizes v [M, K] with r on s: rowwise, and without a nil sizes also
// columnwise in the groups of sizes (which must sum to M).
func blockwise(s *device.Stream, r recipe, v []float32, M, K int, sizes []int32) *quant.Blockwise {
	x := dt.Must(device.FromSlice(s, device.F32, v, M, K))
	defer x.Free()
	opt := quant.BlockOptions{Format: r.f, Scale: r.k, Dir: quant.Rowwise}
	if sizes != nil {
		gs := dt.Must(device.FromSlice(s, device.I32, sizes, len(sizes)))
		defer gs.Free()
		opt.Dir, opt.GroupSizes = quant.Both, gs
	}
	q := dt.Must(quant.QuantizeBlockwise(s, x, opt))
	if sizes != nil {
		if err := q.Status.Check(s); err != nil {
			panic(err)
		}
	}
	return q
}

// mxfp8 quantizes v [M, K] with r on s: rowwise without groups for a nil sizes, else in
// the groups of sizes (which must sum to M) both rowwise and columnwise, transposed.
func mxfp8(s *device.Stream, r recipe, v []float32, M, K int, sizes []int32) *quant.MXFP8 {
	x := dt.Must(device.FromSlice(s, device.F32, v, M, K))
	defer x.Free()
	opt := quant.Options{Format: r.f, Mode: r.mode, Dir: quant.Rowwise}
	if sizes != nil {
		gs := dt.Must(device.FromSlice(s, device.I32, sizes, len(sizes)))
		defer gs.Free()
		opt.Dir, opt.Transpose, opt.GroupSizes = quant.Both, true, gs
	}
	q := dt.Must(quant.Quantize(s, x, opt))
	if sizes != nil {
		if err := q.Status.Check(s); err != nil {
			panic(err)
		}
	}
	return q
}

// blockwiseWeights quantizes w [G, K, N] with r on s.
func blockwiseWeights(s *device.Stream, r recipe, w []float32, G, K, N int) *quant.BlockwiseWeights {
	t := dt.Must(device.FromSlice(s, device.F32, w, G, K, N))
	defer t.Free()
	return dt.Must(quant.QuantizeWeights(s, t, quant.BlockOptions{Format: r.f, Scale: r.k}))
}

// mxWeights quantizes w [G, K, N] with r on s.
func mxWeights(s *device.Stream, r recipe, w []float32, G, K, N int) *quant.MXFP8Weights {
	t := dt.Must(device.FromSlice(s, device.F32, w, G, K, N))
	defer t.Free()
	return dt.Must(quant.QuantizeMXFP8Weights(s, t, quant.Options{Format: r.f, Mode: r.mode}))
}

// scaleValues returns the scales t as float32: F32 as they are, E8M0 codes decoded, code
// 0 (padding entries, and the scale of all-zero blocks) as 0, so that scaling an operand
// by 2^k scales every entry by 2^k.
func scaleValues(t *device.Tensor) []float32 {
	if t.DType() == device.F32 {
		return append([]float32(nil), device.Slice[float32](t)...)
	}
	codes := t.HostBytes()
	v := make([]float32, len(codes))
	for i, c := range codes {
		if c != 0 {
			v[i] = device.E8M0ToFloat32(c)
		}
	}
	return v
}

// hostQ is an activation or gradient [M, K] (its values v), the recipe and groups it is
// quantized with, and, from its quantization on the CPU, the elements, scales and
// dequantized values of the form the call reads: the rowwise one (Row, RowScale), or with
// cols the columnwise one (ColT with ColTScale or ColScale; deq: back in rows).
type hostQ struct {
	r      recipe
	M, K   int
	v      []float32
	sizes  []int32 // the groups of the quantization (nil: none)
	cols   bool
	codes  []uint8
	scales []float32 // see scaleValues
	deq    []float32
}

// quantize quantizes v [M, K] with r, without groups (nil sizes) or in the groups of sizes,
// for a call that reads the columnwise form (cols) or the rowwise one.
func quantize(r recipe, v []float32, M, K int, sizes []int32, cols bool) *hostQ {
	h := &hostQ{r: r, M: M, K: K, v: v, sizes: sizes, cols: cols}
	s := device.CPU().Stream()
	q := h.upload(s)
	defer q.Free()
	deq := dt.Must(s.Alloc(device.F32, M, K))
	defer deq.Free()
	var codes, scales *device.Tensor
	var err error
	dir := quant.Rowwise
	if cols {
		dir = quant.Columnwise
	}
	switch q := q.(type) {
	case *quant.Blockwise:
		codes, scales = q.Row, q.RowScale
		if cols {
			codes, scales = q.ColT, q.ColTScale
		}
		err = quant.DequantizeBlockwise(s, deq, q, dir)
	case *quant.MXFP8:
		codes, scales = q.Row, q.RowScale
		if cols {
			codes, scales = q.ColT, q.ColScale
		}
		err = quant.Dequantize(s, deq, q, dir)
	}
	if err != nil {
		panic(err)
	}
	h.codes = append([]uint8(nil), codes.HostBytes()...)
	h.scales = scaleValues(scales)
	h.deq = append([]float32(nil), device.Slice[float32](deq)...)
	return h
}

// upload returns h quantized on s: a *quant.Blockwise or a *quant.MXFP8.
func (h *hostQ) upload(s *device.Stream) quantized {
	if h.r.mx {
		return mxfp8(s, h.r, h.v, h.M, h.K, h.sizes)
	}
	return blockwise(s, h.r, h.v, h.M, h.K, h.sizes)
}

// hostW is weights w [G, K, N] (their values v) and the recipe they are quantized with,
// and, from that quantization on the CPU, the scales and dequantized values [G, K, N] of
// the orientation a call reads: blockwise, the one set of 128×128 block scales
// [G, ceil(K/128), ceil(N/128)]; MXFP8, KMajor's (kMajor, the forward's) or NMajor's.
type hostW struct {
	r       recipe
	G, K, N int
	v       []float32
	kMajor  bool
	scales  []float32 // see scaleValues
	deq     []float32
}

// quantizeWeights quantizes w [G, K, N] with r for a call reading its KMajor form
// (kMajor) or its NMajor form; K and N must be multiples of 16.
func quantizeWeights(r recipe, w []float32, G, K, N int, kMajor bool) *hostW {
	h := &hostW{r: r, G: G, K: K, N: N, v: w, kMajor: kMajor}
	s := device.CPU().Stream()
	q := h.upload(s)
	defer q.Free()
	deq := dt.Must(s.Alloc(device.F32, G, K, N))
	defer deq.Free()
	var err error
	switch q := q.(type) {
	case *quant.BlockwiseWeights:
		h.scales = scaleValues(q.Scales)
		err = quant.DequantizeWeights(s, deq, q)
	case *quant.MXFP8Weights:
		sc := q.KScale
		if !kMajor {
			sc = q.NScale
		}
		h.scales = scaleValues(sc)
		err = quant.DequantizeMXFP8Weights(s, deq, q, kMajor)
	}
	if err != nil {
		panic(err)
	}
	h.deq = append([]float32(nil), device.Slice[float32](deq)...)
	return h
}

// upload returns h quantized on s: a *quant.BlockwiseWeights or a *quant.MXFP8Weights.
func (h *hostW) upload(s *device.Stream) quantized {
	if h.r.mx {
		return mxWeights(s, h.r, h.v, h.G, h.K, h.N)
	}
	return blockwiseWeights(s, h.r, h.v, h.G, h.K, h.N)
}
