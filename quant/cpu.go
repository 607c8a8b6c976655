package quant

import (
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// The CPU path is the reference: it follows the specification literally, tile by tile,
// with the same tile descriptors as the kernels.

// source returns a reader of x's elements as float32 (bf16 widens exactly).
func source(x *device.Tensor) func(i int) float32 {
	if x.DType() == device.BF16 {
		v := device.Slice[uint16](x)
		return func(i int) float32 { return math.Float32frombits(uint32(v[i]) << 16) }
	}
	v := device.Slice[float32](x)
	return func(i int) float32 { return v[i] }
}

func bytesOf(t *device.Tensor) []uint8 {
	if t == nil {
		return nil
	}
	return device.Slice[uint8](t)
}

// cpuTiles computes q's tile descriptors from the group sizes (nil: no groups) and
// stores them in q's tensors when q is grouped, recording invalid sizes in st.
func cpuTiles(q *MXFP8, sizes *device.Tensor, st *device.Status) []tile {
	if sizes == nil {
		ts, _ := q.g.tiles(nil)
		return ts
	}
	ts, code := q.g.tiles(device.Slice[int32](sizes))
	d := device.Slice[int32](q.tiles)
	for t, tl := range ts {
		d[4*t], d[4*t+1], d[4*t+2], d[4*t+3] = tl.row0, tl.nrows, tl.p4, tl.cg
	}
	recordStatus(st, code, q.M)
	return ts
}

// storedTiles returns q's tile descriptors as the last quantization left them.
func storedTiles(q *MXFP8) []tile {
	if q.tiles == nil {
		ts, _ := q.g.tiles(nil)
		return ts
	}
	d := device.Slice[int32](q.tiles)
	ts := make([]tile, q.g.ntiles)
	for t := range ts {
		ts[t] = tile{d[4*t], d[4*t+1], d[4*t+2], d[4*t+3]}
	}
	return ts
}

// encodeBlock quantizes one block v (at most 32 values; NaN left out of its amax) to
// format f under rule mode: it writes the elements to out[:len(v)] and returns the
// scale code. Every MXFP8 block of the package, rowwise, columnwise or of weights, is
// quantized by it.
func encodeBlock(out []uint8, v []float32, f Format, mode ScaleMode) uint8 {
	code := scaleCode(amax(v), f, mode)
	inv := invScale(code)
	for i, x := range v {
		out[i] = f.encode(float32(x * inv))
	}
	return code
}

func quantizeCPU(s *device.Stream, q *MXFP8, x input, sizes *device.Tensor, st *device.Status) error {
	return s.EnqueueCPU(func() {
		ts := cpuTiles(q, sizes, st)
		in := x.reader()
		rq, rs, cq, cs, ct := bytesOf(q.Row), bytesOf(q.RowScale), bytesOf(q.Col), bytesOf(q.ColScale), bytesOf(q.ColT)
		g, f, mode, swz := q.g, q.Format, q.Mode, q.Swizzled
		ld := blockSize * g.ntiles // ColT's row length
		par.For(len(ts), max(1, 4096/max(g.k, 1)), func(lo, hi int) {
			buf := make([]float32, blockSize*g.k)
			col := make([]float32, blockSize)
			enc := make([]uint8, blockSize)
			for t := lo; t < hi; t++ {
				tl := ts[t]
				row0, n := int(tl.row0), int(tl.nrows)
				if n < 0 { // invalid group sizes: NaN elements and scales
					for _, d := range [][]uint8{rq, cq} {
						if d != nil {
							for i := row0 * g.k; i < min(row0+blockSize, g.m)*g.k; i++ {
								d[i] = 0x7f
							}
						}
					}
					if ct != nil { // every element of ColT: the tile's 32 columns
						for j := range g.k {
							o := j*ld + blockSize*t
							for i := range blockSize {
								ct[o+i] = 0x7f
							}
						}
					}
					if rs != nil {
						for r := range blockSize {
							for c := range g.cp {
								rs[g.rowScaleOff(swz, blockSize*t+r, c)] = 0xff
							}
						}
					}
					if cs != nil {
						for j := range g.kp {
							cs[g.colScaleOff(swz, t, j, int(tl.p4), int(tl.cg))] = 0xff
						}
					}
					continue
				}
				for r := range n {
					for j := range g.k {
						buf[r*g.k+j] = in((row0+r)*g.k + j)
					}
				}
				if rs != nil {
					for r := range blockSize {
						for c := range g.cp {
							off := g.rowScaleOff(swz, blockSize*t+r, c)
							if r >= n || c >= g.nbk {
								rs[off] = 0
								continue
							}
							blk := buf[r*g.k+c*blockSize : r*g.k+min((c+1)*blockSize, g.k)]
							o := (row0+r)*g.k + c*blockSize
							rs[off] = encodeBlock(rq[o:o+len(blk)], blk, f, mode)
						}
					}
				}
				if cs != nil {
					for j := range g.kp {
						off := g.colScaleOff(swz, t, j, int(tl.p4), int(tl.cg))
						var tc []uint8 // the tile's 32 columns of ColT row j
						if ct != nil && j < g.k {
							tc = ct[j*ld+blockSize*t : j*ld+blockSize*(t+1)]
							clear(tc[n:]) // padding columns
						}
						if j >= g.k || n == 0 {
							cs[off] = 0
							continue
						}
						v := col[:n]
						for r := range v {
							v[r] = buf[r*g.k+j]
						}
						if tc != nil {
							cs[off] = encodeBlock(tc, v, f, mode)
							continue
						}
						cs[off] = encodeBlock(enc, v, f, mode)
						for r, e := range enc[:n] {
							cq[(row0+r)*g.k+j] = e
						}
					}
				}
			}
		})
	})
}

func abs32(v float32) float32 { return math.Float32frombits(math.Float32bits(v) &^ (1 << 31)) }

// amax returns the largest magnitude in v, leaving NaNs out (0 if all are NaN).
func amax(v []float32) float32 {
	a := float32(0)
	for _, x := range v {
		if m := abs32(x); m > a {
			a = m
		}
	}
	return a
}

func dequantizeCPU(s *device.Stream, dst *device.Tensor, q *MXFP8, dir Direction, data, scale *device.Tensor) error {
	return s.EnqueueCPU(func() {
		ts := storedTiles(q)
		e, sc := bytesOf(data), bytesOf(scale)
		g, f, swz := q.g, q.Format, q.Swizzled
		tr := dir == Columnwise && q.Transposed
		ld := blockSize * g.ntiles
		var put func(i int, v float32)
		if dst.DType() == device.BF16 {
			d := device.Slice[uint16](dst)
			put = func(i int, v float32) { d[i] = device.BF16FromFloat32(v) }
		} else {
			d := device.Slice[float32](dst)
			put = func(i int, v float32) { d[i] = v }
		}
		par.For(len(ts), max(1, 4096/max(g.k, 1)), func(lo, hi int) {
			for t := lo; t < hi; t++ {
				tl := ts[t]
				row0, n := int(tl.row0), int(tl.nrows)
				if n < 0 {
					for r := row0; r < min(row0+blockSize, g.m); r++ {
						for j := range g.k {
							put(r*g.k+j, nanF32)
						}
					}
					continue
				}
				for r := range n {
					for j := range g.k {
						var c uint8
						if dir == Rowwise {
							c = sc[g.rowScaleOff(swz, blockSize*t+r, j/blockSize)]
						} else {
							c = sc[g.colScaleOff(swz, t, j, int(tl.p4), int(tl.cg))]
						}
						i := (row0+r)*g.k + j
						code := e[i]
						if tr {
							code = e[j*ld+blockSize*t+r]
						}
						put(i, dequantValue(f, code, c))
					}
				}
			}
		})
	})
}
