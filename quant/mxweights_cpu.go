package quant

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// The CPU path of the MXFP8 weights is their reference: encodeBlock on each block of
// each orientation, tile of 32 rows of w_g by tile, as the kernels cut them.

func quantizeMXFP8WeightsCPU(s *device.Stream, q *MXFP8Weights, w *device.Tensor) error {
	return s.EnqueueCPU(func() {
		g, f, mode := q.wg, q.Format, q.Mode
		in := source(w)
		d, dsT, tr, tsT := g.orient(q)
		direct, ds, trans, ts := bytesOf(d), bytesOf(dsT), bytesOf(tr), bytesOf(tsT)
		nbc := ceilDiv(g.c, blockSize) // blocks of a direct row
		par.For(g.g*g.nrt, max(1, 512/max(g.c, 1)), func(lo, hi int) {
			rows := make([]float32, blockSize*g.c) // the tile's rows of w_g
			col := make([]float32, blockSize)
			for gt := lo; gt < hi; gt++ {
				e, rt := gt/g.nrt, gt%g.nrt
				base := e * g.r * g.c
				r0, nr := rt*blockSize, min(blockSize, g.r-rt*blockSize)
				for i := range nr * g.c {
					rows[i] = in(base + r0*g.c + i)
				}
				// The direct orientation: each row in blocks along c.
				for r := range nr {
					row := rows[r*g.c : (r+1)*g.c]
					for b := range 4 * g.cb {
						off := g.directScaleOff(e, r0+r, b)
						if b >= nbc {
							ds[off] = 0
							continue
						}
						v := row[b*blockSize : min((b+1)*blockSize, g.c)]
						o := base + (r0+r)*g.c + b*blockSize
						ds[off] = encodeBlock(direct[o:o+len(v)], v, f, mode)
					}
				}
				// The transposed orientation: block rt of each column.
				for c := range g.c {
					v := col[:nr]
					for r := range v {
						v[r] = rows[r*g.c+c]
					}
					o := base + c*g.r + r0
					ts[g.transScaleOff(e, c, rt)] = encodeBlock(trans[o:o+nr], v, f, mode)
					if rt == g.nrt-1 {
						for b := rt + 1; b < 4*g.rb; b++ {
							ts[g.transScaleOff(e, c, b)] = 0
						}
					}
				}
			}
		})
	})
}

func dequantizeMXFP8WeightsCPU(s *device.Stream, dst *device.Tensor, q *MXFP8Weights, kMajor bool) error {
	return s.EnqueueCPU(func() {
		g, f := q.wg, q.Format
		put := bwStore(dst)
		kq, ks, nq, ns := bytesOf(q.KMajor), bytesOf(q.KScale), bytesOf(q.NMajor), bytesOf(q.NScale)
		kb, nb := ceilDiv(g.k, 128), ceilDiv(g.n, 128)
		par.For(g.g*g.k, max(1, 4096/max(g.n, 1)), func(lo, hi int) {
			for gk := lo; gk < hi; gk++ {
				e, k := gk/g.k, gk%g.k
				for n := range g.n {
					var code, sc uint8
					if kMajor {
						code, sc = kq[(e*g.n+n)*g.k+k], ks[((e*kb+k/128)*g.n+n)*4+(k/blockSize)%4]
					} else {
						code, sc = nq[gk*g.n+n], ns[((e*nb+n/128)*g.k+k)*4+(n/blockSize)%4]
					}
					put(gk*g.n+n, dequantValue(f, code, sc))
				}
			}
		})
	})
}
