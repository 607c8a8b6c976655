package gemm

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
	"github.com/dropless/dropless/quant"
)

// The CPU path of the blockwise forms dequantizes the operands exactly as package quant
// documents it (value = decode(q)·s, one f32 product; the layouts of quant.Blockwise and
// quant.BlockwiseWeights) and runs the f32 CPU ragged_dot on them: it is the reference of
// the GPU kernels. The dequantization is done here, on the layouts, so that it runs inside
// the call's CPU op (and so again on each replay of a captured Graph).

// cpu enqueues the call on s's CPU stream: dequantize, then the CPU path of the form it
// runs as.
func (bc *blockCall) cpu(s *device.Stream) error {
	c := bc.c
	c.dequant = func(off []int) (a, b []float32) {
		switch c.f {
		case forward:
			return dequantRows(bc.a), dequantWeights(bc.w, true)
		case inputGrad:
			return dequantRows(bc.a), dequantWeights(bc.w, false)
		}
		return dequantColT(bc.a, off), dequantColT(bc.b, off)
	}
	return c.cpu(s)
}

// fp8Values returns the elements of the FP8 CPU tensor t as float32 (exact).
func fp8Values(t *device.Tensor) []float32 {
	v := make([]float32, t.Len())
	src := t.HostBytes()
	par.For(len(v), 1<<16, func(lo, hi int) { device.DecodeFloat32(t.DType(), v[lo:hi], src[lo:hi]) })
	return v
}

// dequantRows returns the rowwise form of q as float32 [M, K]: element (m, k) is
// Row[m][k]·RowScale[k/128][m].
func dequantRows(q *quant.Blockwise) []float32 {
	v := fp8Values(q.Row)
	sc := device.Slice[float32](q.RowScale)
	M, K := q.M, q.K
	mr := q.RowScale.Dim(1)
	par.For(M, max(1, (1<<16)/max(K, 1)), func(lo, hi int) {
		for m := lo; m < hi; m++ {
			row := v[m*K : (m+1)*K]
			for k := range row {
				row[k] *= sc[(k/quant.BlockSize)*mr+m]
			}
		}
	})
	return v
}

// dequantWeights returns w's KMajor form (kMajor: [G, N, K]) or NMajor form ([G, K, N])
// as float32: the element of w_g at (k, n) is its code times Scales[g][k/128][n/128].
func dequantWeights(w *quant.BlockwiseWeights, kMajor bool) []float32 {
	t, rows, cols := w.NMajor, w.K, w.N
	if kMajor {
		t, rows, cols = w.KMajor, w.N, w.K
	}
	v := fp8Values(t)
	sc := device.Slice[float32](w.Scales)
	sk, sn := ceilDiv(w.K, quant.BlockSize), ceilDiv(w.N, quant.BlockSize)
	par.For(w.G*rows, max(1, (1<<16)/max(cols, 1)), func(lo, hi int) {
		for gr := lo; gr < hi; gr++ {
			g, r := gr/rows, gr%rows
			row := v[gr*cols : (gr+1)*cols]
			for c := range row {
				k, n := r, c
				if kMajor {
					k, n = c, r
				}
				row[c] *= sc[(g*sk+k/quant.BlockSize)*sn+n/quant.BlockSize]
			}
		}
	})
	return v
}

// dequantColT returns the columnwise form of q, quantized in groups whose row offsets
// are off[0..G], as float32 [M, K] in the rows' order: row off[g]+i is token column
// 128·P_g + i of ColT (P_g = Σ_{h<g} ceil(M_h/128)), element k of it ColT[k][p] times
// ColTScale[p/128][k]. Rows past off[G] are zero.
func dequantColT(q *quant.Blockwise, off []int) []float32 {
	M, K := q.M, q.K
	out := make([]float32, M*K)
	mp := q.ColT.Dim(1)
	codes := q.ColT.HostBytes()
	sc := device.Slice[float32](q.ColTScale)
	var dec [256]float32
	for i := range dec {
		device.DecodeFloat32(q.ColT.DType(), dec[i:i+1], []byte{byte(i)})
	}
	// first[g] is the token column of group g's first row.
	first := make([]int, len(off))
	for g := 0; g+1 < len(off); g++ {
		first[g+1] = first[g] + quant.BlockSize*ceilDiv(off[g+1]-off[g], quant.BlockSize)
	}
	par.Each(len(off)-1, func(g int) {
		for i := 0; i < off[g+1]-off[g]; i++ {
			p := first[g] + i
			row := out[(off[g]+i)*K : (off[g]+i+1)*K]
			for k := range row {
				row[k] = dec[codes[k*mp+p]] * sc[(p/quant.BlockSize)*K+k]
			}
		}
	})
	return out
}
