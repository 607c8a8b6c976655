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

// recipe is an element format and a scale kind.
type recipe struct {
	f quant.Format
	k quant.ScaleKind
}

var (
	e4m3F32  = recipe{quant.E4M3, quant.ScaleF32}
	e5m2Pow2 = recipe{quant.E5M2, quant.ScalePow2}
	e4m3Pow2 = recipe{quant.E4M3, quant.ScalePow2}
)

func ceil(a, b int) int { return (a + b - 1) / b }

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

// blockwiseWeights quantizes w [G, K, N] with r on s.
func blockwiseWeights(s *device.Stream, r recipe, w []float32, G, K, N int) *quant.BlockwiseWeights {
	t := dt.Must(device.FromSlice(s, device.F32, w, G, K, N))
	defer t.Free()
	return dt.Must(quant.QuantizeWeights(s, t, quant.BlockOptions{Format: r.f, Scale: r.k}))
}

// hostQ is an activation or gradient [M, K] (its values v), the recipe and groups it is
// quantized with, and, from its quantization on the CPU, the elements, scales and
// dequantized values of the form the call reads: Row and RowScale without groups, ColT
// and ColTScale with them (deq: the columnwise form back in rows).
type hostQ struct {
	r      recipe
	M, K   int
	v      []float32
	sizes  []int32
	codes  []uint8
	scales []float32
	deq    []float32
}

// quantize quantizes v [M, K] with r, rowwise (nil sizes) or in the groups of sizes.
func quantize(r recipe, v []float32, M, K int, sizes []int32) *hostQ {
	h := &hostQ{r: r, M: M, K: K, v: v, sizes: sizes}
	s := device.CPU().Stream()
	q := h.upload(s)
	defer q.Free()
	codes, scales, dir := q.Row, q.RowScale, quant.Rowwise
	if sizes != nil {
		codes, scales, dir = q.ColT, q.ColTScale, quant.Columnwise
	}
	h.codes = append([]uint8(nil), codes.HostBytes()...)
	h.scales = append([]float32(nil), device.Slice[float32](scales)...)
	deq := dt.Must(s.Alloc(device.F32, M, K))
	defer deq.Free()
	if err := quant.DequantizeBlockwise(s, deq, q, dir); err != nil {
		panic(err)
	}
	h.deq = append([]float32(nil), device.Slice[float32](deq)...)
	return h
}

// upload returns h quantized on s.
func (h *hostQ) upload(s *device.Stream) *quant.Blockwise {
	return blockwise(s, h.r, h.v, h.M, h.K, h.sizes)
}

// hostW is weights w [G, K, N] (their values v) and the recipe they are quantized with
// in 128×128 blocks, and, from that quantization on the CPU, their scales
// [G, ceil(K/128), ceil(N/128)] and dequantized values [G, K, N].
type hostW struct {
	r       recipe
	G, K, N int
	v       []float32
	scales  []float32
	deq     []float32
}

// quantizeWeights quantizes w [G, K, N] with r; K and N must be multiples of 16.
func quantizeWeights(r recipe, w []float32, G, K, N int) *hostW {
	h := &hostW{r: r, G: G, K: K, N: N, v: w}
	s := device.CPU().Stream()
	q := h.upload(s)
	defer q.Free()
	h.scales = append([]float32(nil), device.Slice[float32](q.Scales)...)
	deq := dt.Must(s.Alloc(device.F32, G, K, N))
	defer deq.Free()
	if err := quant.DequantizeWeights(s, deq, q); err != nil {
		panic(err)
	}
	h.deq = append([]float32(nil), device.Slice[float32](deq)...)
	return h
}

// upload returns h quantized on s.
func (h *hostW) upload(s *device.Stream) *quant.BlockwiseWeights {
	return blockwiseWeights(s, h.r, h.v, h.G, h.K, h.N)
}
