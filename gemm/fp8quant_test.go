package gemm_test

import (
	"math"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// The tests quantize with their own host implementation of package quant's blockwise
// rule and layouts (quant/blockwise.go), so that the FP8 GEMMs are tested on their own;
// the quantized tensors are uploaded to the device under test.

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

// scale returns the scale of a block whose largest magnitude (NaN left out) is amax.
func (r recipe) scale(amax float32) float32 {
	switch {
	case amax == 0:
		return 1
	case math.IsInf(float64(amax), 1):
		return float32(math.Inf(1))
	}
	f := amax / r.f.Max()
	if r.k == quant.ScaleF32 {
		return f
	}
	b := math.Float32bits(f)
	e := b >> 23
	if b&0x7fffff != 0 {
		e++
	}
	return math.Float32frombits(min(max(e, 1), 254) << 23)
}

func (r recipe) encode(x float32) uint8 {
	if r.f == quant.E5M2 {
		return device.E5M2FromFloat32(x)
	}
	return device.E4M3FromFloat32(x)
}

func (r recipe) decode(c uint8) float32 {
	if r.f == quant.E5M2 {
		return device.E5M2ToFloat32(c)
	}
	return device.E4M3ToFloat32(c)
}

// block quantizes the n values at(i) of one block into put(i, code) and returns its scale.
func (r recipe) block(n int, at func(i int) float32, put func(i int, c uint8)) float32 {
	var amax float32
	for i := range n {
		if v := float32(math.Abs(float64(at(i)))); v > amax {
			amax = v
		}
	}
	s := r.scale(amax)
	for i := range n {
		put(i, r.encode(at(i)/s))
	}
	return s
}

func ceil(a, b int) int { return (a + b - 1) / b }

// colTokens is Mp of quant's columnwise layout of M rows in G groups.
func colTokens(M, G int) int { return blk * (M/blk + min(G, M)) }

// hostQ is an activation or gradient [M, K] quantized on the host in both directions,
// with its dequantized values.
type hostQ struct {
	r            recipe
	M, K, G      int
	row          []uint8   // [M, K]
	rowScale     []float32 // [ceil(K/128), roundup(M, 4)]
	colT         []uint8   // [K, Mp]
	colTScale    []float32 // [Mp/128, K]
	rows, colRow []float32 // dequantized: rowwise, and the columnwise form back in rows (zeros past sum(sizes))
}

// quantize quantizes v [M, K] rowwise and, in the groups of sizes, columnwise.
func quantize(r recipe, v []float32, M, K int, sizes []int32) *hostQ {
	G := len(sizes)
	mr, nkb, mp := 4*ceil(M, 4), ceil(K, blk), colTokens(M, G)
	h := &hostQ{r: r, M: M, K: K, G: G, row: make([]uint8, M*K), rowScale: make([]float32, nkb*mr),
		colT: make([]uint8, K*mp), colTScale: make([]float32, mp/blk*K), rows: make([]float32, M*K), colRow: make([]float32, M*K)}
	for m := range M {
		for b := range nkb {
			k0 := b * blk
			s := r.block(min(blk, K-k0), func(i int) float32 { return v[m*K+k0+i] }, func(i int, c uint8) { h.row[m*K+k0+i] = c })
			h.rowScale[b*mr+m] = s
			for k := k0; k < min(K, k0+blk); k++ {
				h.rows[m*K+k] = r.decode(h.row[m*K+k]) * s
			}
		}
	}
	off, t := 0, 0 // the group's first row and first token block
	for _, sz := range sizes {
		n := int(sz)
		for j := range ceil(n, blk) {
			i0 := j * blk
			p0 := (t + j) * blk
			for k := range K {
				s := r.block(min(blk, n-i0), func(i int) float32 { return v[(off+i0+i)*K+k] }, func(i int, c uint8) { h.colT[k*mp+p0+i] = c })
				h.colTScale[(t+j)*K+k] = s
				for i := range min(blk, n-i0) {
					h.colRow[(off+i0+i)*K+k] = r.decode(h.colT[k*mp+p0+i]) * s
				}
			}
		}
		off += n
		t += ceil(n, blk)
	}
	return h
}

// upload returns h on s's device (rowwise and columnwise forms).
func (h *hostQ) upload(s *device.Stream) *quant.Blockwise {
	mp := colTokens(h.M, h.G)
	return &quant.Blockwise{M: h.M, K: h.K, Format: h.r.f, Scale: h.r.k, Dir: quant.Both, Groups: h.G,
		Row:       dt.Must(device.FromSlice(s, h.r.f.DType(), h.row, h.M, h.K)),
		RowScale:  dt.Must(device.FromSlice(s, device.F32, h.rowScale, ceil(h.K, blk), 4*ceil(h.M, 4))),
		ColT:      dt.Must(device.FromSlice(s, h.r.f.DType(), h.colT, h.K, mp)),
		ColTScale: dt.Must(device.FromSlice(s, device.F32, h.colTScale, mp/blk, h.K)),
	}
}

// hostW is weights w [G, K, N] quantized on the host in 128×128 blocks, with their
// dequantized values [G, K, N].
type hostW struct {
	r          recipe
	G, K, N    int
	kmaj, nmaj []uint8   // [G, N, K], [G, K, N]
	scales     []float32 // [G, ceil(K/128), ceil(N/128)]
	deq        []float32
}

func quantizeWeights(r recipe, w []float32, G, K, N int) *hostW {
	sk, sn := ceil(K, blk), ceil(N, blk)
	h := &hostW{r: r, G: G, K: K, N: N, kmaj: make([]uint8, G*K*N), nmaj: make([]uint8, G*K*N), scales: make([]float32, G*sk*sn), deq: make([]float32, G*K*N)}
	for g := range G {
		for kb := range sk {
			for nb := range sn {
				k0, n0 := kb*blk, nb*blk
				bk, bn := min(blk, K-k0), min(blk, N-n0)
				at := func(i int) int { return (g*K+k0+i/bn)*N + n0 + i%bn }
				s := r.block(bk*bn, func(i int) float32 { return w[at(i)] }, func(i int, c uint8) {
					k, n := k0+i/bn, n0+i%bn
					h.nmaj[(g*K+k)*N+n] = c
					h.kmaj[(g*N+n)*K+k] = c
				})
				h.scales[(g*sk+kb)*sn+nb] = s
				for i := range bk * bn {
					h.deq[at(i)] = r.decode(h.nmaj[at(i)]) * s
				}
			}
		}
	}
	return h
}

func (h *hostW) upload(s *device.Stream) *quant.BlockwiseWeights {
	return &quant.BlockwiseWeights{G: h.G, K: h.K, N: h.N, Format: h.r.f, Scale: h.r.k,
		KMajor: dt.Must(device.FromSlice(s, h.r.f.DType(), h.kmaj, h.G, h.N, h.K)),
		NMajor: dt.Must(device.FromSlice(s, h.r.f.DType(), h.nmaj, h.G, h.K, h.N)),
		Scales: dt.Must(device.FromSlice(s, device.F32, h.scales, h.G, ceil(h.K, blk), ceil(h.N, blk))),
	}
}

// freeQ frees the tensors of quantized operands.
func freeQ(qs ...any) {
	for _, q := range qs {
		switch v := q.(type) {
		case *quant.Blockwise:
			if v != nil {
				device.FreeAll(v.Row, v.RowScale, v.ColT, v.ColTScale)
			}
		case *quant.BlockwiseWeights:
			if v != nil {
				device.FreeAll(v.KMajor, v.NMajor, v.Scales)
			}
		}
	}
}
