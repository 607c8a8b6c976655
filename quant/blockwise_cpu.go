package quant

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// The CPU path of the blockwise recipe is its reference: the block rule of
// blockwise_layout.go applied block by block.

// bwCPUTiles returns q's token blocks for the group sizes (nil: no groups), stores them
// in q's descriptors when q is grouped, and records invalid sizes in st with op.
func bwCPUTiles(q *Blockwise, sizes *device.Tensor, st *device.Status, op int) []bwTile {
	if sizes == nil {
		ts, _ := q.alloc.g.tiles(nil)
		return ts
	}
	ts, c := q.alloc.g.tiles(device.Slice[int32](sizes))
	d := device.Slice[int32](q.alloc.tiles)
	for t, tl := range ts {
		d[2*t], d[2*t+1] = tl.row0, tl.n
	}
	c.record(st, op)
	return ts
}

// bwStoredTiles returns q's token blocks as the last quantization left them; blocks
// out of [0, M] count as padding.
func bwStoredTiles(q *Blockwise) []bwTile {
	g := q.alloc.g
	if q.alloc.tiles == nil {
		ts, _ := g.tiles(nil)
		return ts
	}
	d := device.Slice[int32](q.alloc.tiles)
	ts := make([]bwTile, g.ntiles)
	for t := range ts {
		r0, n := d[2*t], d[2*t+1]
		if r0 >= 0 && n >= 0 && n <= BlockSize && int(r0) <= g.m-int(n) {
			ts[t] = bwTile{r0, n}
		}
	}
	return ts
}

func quantizeBlockwiseCPU(s *device.Stream, q *Blockwise, x input, sizes *device.Tensor, st *device.Status, op int) error {
	return s.EnqueueCPU(func() {
		ts := bwCPUTiles(q, sizes, st, op)
		in := x.reader()
		g, f, kind := q.alloc.g, q.Format, q.Scale
		if q.Row != nil {
			rq, rs := bytesOf(q.Row), device.Slice[float32](q.RowScale)
			par.For(g.m, max(1, 4096/max(g.k, 1)), func(lo, hi int) {
				blk := make([]float32, BlockSize)
				for m := lo; m < hi; m++ {
					for b := range g.nb {
						j0 := b * BlockSize
						v := blk[:min(BlockSize, g.k-j0)]
						for j := range v {
							v[j] = in(m*g.k + j0 + j)
						}
						sc := blockScale(amax(v), f, kind)
						rs[b*g.mr+m] = sc
						for j, x := range v {
							rq[m*g.k+j0+j] = blockEncode(f, x, sc)
						}
					}
				}
			})
			for b := range g.nb {
				clear(rs[b*g.mr+g.m : (b+1)*g.mr])
			}
		}
		if q.ColT != nil {
			cq, cs := bytesOf(q.ColT), device.Slice[float32](q.ColTScale)
			mp := g.mp()
			par.For(len(ts), 1, func(lo, hi int) {
				col := make([]float32, BlockSize*g.k) // the block transposed: column j at [128j, 128j+128)
				for t := lo; t < hi; t++ {
					row0, n := int(ts[t].row0), int(ts[t].n)
					for r := range n {
						for j := range g.k {
							col[j*BlockSize+r] = in((row0+r)*g.k + j)
						}
					}
					for j := range g.k {
						o := j*mp + t*BlockSize
						if n == 0 {
							cs[t*g.k+j] = 0
							clear(cq[o : o+BlockSize])
							continue
						}
						v := col[j*BlockSize : j*BlockSize+n]
						sc := blockScale(amax(v), f, kind)
						cs[t*g.k+j] = sc
						for r, x := range v {
							cq[o+r] = blockEncode(f, x, sc)
						}
						clear(cq[o+n : o+BlockSize])
					}
				}
			})
		}
	})
}

// bwStore returns a function that stores v at element i of dst, a BF16 or F32 CPU
// tensor (BF16 rounds to nearest even).
func bwStore(dst *device.Tensor) func(i int, v float32) {
	if dst.DType() != device.BF16 {
		d := device.Slice[float32](dst)
		return func(i int, v float32) { d[i] = v }
	}
	d := device.Slice[uint16](dst)
	return func(i int, v float32) { d[i] = device.BF16FromFloat32(v) }
}

func dequantizeBlockwiseCPU(s *device.Stream, dst *device.Tensor, q *Blockwise, dir Direction) error {
	return s.EnqueueCPU(func() {
		g, tab := q.alloc.g, q.Format.decodeTable()
		put := bwStore(dst)
		if dir == Rowwise {
			e, sc := bytesOf(q.Row), device.Slice[float32](q.RowScale)
			par.For(g.m, max(1, 4096/max(g.k, 1)), func(lo, hi int) {
				for m := lo; m < hi; m++ {
					for j := range g.k {
						put(m*g.k+j, blockDecode(tab, e[m*g.k+j], sc[(j/BlockSize)*g.mr+m]))
					}
				}
			})
			return
		}
		ts := bwStoredTiles(q)
		e, sc := bytesOf(q.ColT), device.Slice[float32](q.ColTScale)
		mp := g.mp()
		par.For(len(ts), 1, func(lo, hi int) {
			for t := lo; t < hi; t++ {
				row0, n := int(ts[t].row0), int(ts[t].n)
				for r := range n {
					for j := range g.k {
						put((row0+r)*g.k+j, blockDecode(tab, e[j*mp+t*BlockSize+r], sc[t*g.k+j]))
					}
				}
			}
		})
	})
}

func quantizeWeightsCPU(s *device.Stream, q *BlockwiseWeights, w *device.Tensor) error {
	return s.EnqueueCPU(func() {
		g, f, kind := q.wg, q.Format, q.Scale
		in := source(w)
		direct, trans := bytesOf(q.NMajor), bytesOf(q.KMajor) // [G, R, C] and [G, C, R]
		if g.nk {
			direct, trans = trans, direct
		}
		sc := device.Slice[float32](q.Scales)
		par.For(g.g*g.nrt, 1, func(lo, hi int) {
			for gr := lo; gr < hi; gr++ {
				e, rt := gr/g.nrt, gr%g.nrt
				base := e * g.r * g.c
				r0, r1 := rt*BlockSize, min((rt+1)*BlockSize, g.r)
				for ct := range g.nct {
					c0, c1 := ct*BlockSize, min((ct+1)*BlockSize, g.c)
					a := float32(0)
					for r := r0; r < r1; r++ {
						for c := c0; c < c1; c++ {
							if v := abs32(in(base + r*g.c + c)); v > a {
								a = v
							}
						}
					}
					s := blockScale(a, f, kind)
					sc[g.scaleOff(e, rt, ct)] = s
					for r := r0; r < r1; r++ {
						for c := c0; c < c1; c++ {
							code := blockEncode(f, in(base+r*g.c+c), s)
							direct[base+r*g.c+c] = code
							trans[base+c*g.r+r] = code
						}
					}
				}
			}
		})
	})
}

func dequantizeWeightsCPU(s *device.Stream, dst *device.Tensor, q *BlockwiseWeights) error {
	return s.EnqueueCPU(func() {
		g, tab := q.wg, q.Format.decodeTable()
		put := bwStore(dst)
		e, sc := bytesOf(q.NMajor), device.Slice[float32](q.Scales)
		nkt, nnt := ceilDiv(g.k, BlockSize), ceilDiv(g.n, BlockSize)
		par.For(g.g*g.k, max(1, 4096/max(g.n, 1)), func(lo, hi int) {
			for gk := lo; gk < hi; gk++ {
				ge, k := gk/g.k, gk%g.k
				for n := range g.n {
					i := gk*g.n + n
					put(i, blockDecode(tab, e[i], sc[(ge*nkt+k/BlockSize)*nnt+n/BlockSize]))
				}
			}
		})
	})
}
