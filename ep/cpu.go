package ep

import (
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// backend holds the device work of the package's operations; the Group picks the CPU's
// or the GPU's by its transport's device. Tensors are views that the callers cut to
// the rows at hand; every op is enqueued on s.
type backend interface {
	// localCounts validates idx (I32 [T, K]) against E experts of L per rank and writes
	// sendRow (I32 [T, R]: the row of (t, d) among the tokens sent, by rank then token,
	// or -1) and vec (I32 [R, 4+L]: per rank d, T, the first bad entry (flat index, or
	// MaxInt32) for an expert out of range and for a repeated one, the tokens sent to d,
	// and the entries for each expert of d).
	localCounts(s *device.Stream, idx, sendRow, vec *device.Tensor, E, L int) error
	// packMeta writes, for each sent row, sendTok (I32 [S]: its token) and meta (I32 [S,
	// K+1]: for each k, the expert's index on the destination rank or -1, then the token).
	packMeta(s *device.Stream, idx, sendRow, sendTok, meta *device.Tensor, L int) error
	// assignSlots places each (received row j, k) with a local expert in expert-major
	// order (by expert, then j, then k): slot (I32 [Rv, K]) gets its row, or -1 when it
	// has no expert here or its row is at or past capacity; counts (I32 [L]) the kept rows.
	assignSlots(s *device.Stream, meta, slot, counts *device.Tensor, L, capacity int) error
	// origins writes (source rank, token, k) into out[slot] for each kept slot; recvOff
	// (I32 [R+1]) holds the prefix sums of the rows received from each rank.
	origins(s *device.Stream, out, slot, meta, recvOff *device.Tensor) error

	// gather copies src rows rowMap[j] into dst rows j.
	gather(s *device.Stream, dst, src, rowMap *device.Tensor) error
	// replicate copies, for each row j of slot, src row r (rowMap[j], or j when rowMap is
	// nil) into X rows slot[j, k] ≥ 0, and srcW[r, k] into W[slot[j, k]] when W is not nil.
	replicate(s *device.Stream, X, W, src, srcW, rowMap, slot *device.Tensor) error
	// wsum writes dst row j = Σ_k w[slot[j, k]]·y[slot[j, k]] over slot[j, k] ≥ 0, in k
	// order, in float32 (w nil: weights of 1).
	wsum(s *device.Stream, dst, y, w, slot *device.Tensor) error
	// finalSum writes out row t = Σ_d back[sendRow[t, d]] over sendRow[t, d] ≥ 0, in
	// rank order, in float32, for the tokens of part (nil: all).
	finalSum(s *device.Stream, out, back, sendRow *device.Tensor, part *finalPart) error
	// replicateScaled writes, for each row j of slot with source row g (as in replicate)
	// and each slot sl = slot[j, k] ≥ 0: dy[sl] = w[sl]·g, and dw[sl] = ⟨y[sl], g⟩ when
	// dw and y are not nil (float32, summed as one warp of the GPU does: see warpDot).
	replicateScaled(s *device.Stream, dy, dw, src, rowMap, slot, w, y *device.Tensor) error
	// transpose4 writes dst[j·ldd + i] = src[i·lds + j] for i < rows and j < cols, over
	// elements of 4 bytes.
	transpose4(s *device.Stream, dst, src *device.Tensor, rows, cols, ldd, lds int) error
	// dwPack writes dst[j, k] = dW[slot[j, k]], or 0 where slot[j, k] < 0.
	dwPack(s *device.Stream, dst, slot, dW *device.Tensor) error
	// dwUnpack writes dweights[t, k] = back[sendRow[t, d], k] for the rank d of expert
	// idx[t, k], or 0 where idx[t, k] < 0.
	dwUnpack(s *device.Stream, dweights, idx, sendRow, back *device.Tensor, L int) error
}

// cpuBackend runs the operations in Go, in the order the GPU kernels define, so that
// results are bit-identical to theirs.
type cpuBackend struct{}

func i32s(t *device.Tensor) []int32 { return device.Slice[int32](t) }

func f32s(t *device.Tensor) []float32 {
	if t == nil {
		return nil
	}
	return device.Slice[float32](t)
}

func (cpuBackend) localCounts(s *device.Stream, idx, sendRow, vec *device.Tensor, E, L int) error {
	return s.EnqueueCPU(func() {
		T, K, R := idx.Dim(0), idx.Dim(1), sendRow.Dim(1)
		id, sr, v := i32s(idx), i32s(sendRow), i32s(vec)
		badRange, badDup := int32(math.MaxInt32), int32(math.MaxInt32)
		tok := make([]int, R)
		exp := make([]int32, E)
		for t := range T {
			row := id[t*K : (t+1)*K]
			mark := sr[t*R : (t+1)*R]
			for d := range mark {
				mark[d] = -1
			}
			for k, e := range row {
				switch {
				case e == -1:
					continue
				case e < -1 || int(e) >= E:
					badRange = min(badRange, int32(t*K+k))
					continue
				}
				dup := false
				for _, f := range row[:k] {
					dup = dup || f == e
				}
				if dup {
					badDup = min(badDup, int32(t*K+k))
					continue
				}
				exp[e]++
				mark[int(e)/L] = 0
			}
			for d, m := range mark {
				if m == 0 {
					mark[d] = int32(tok[d]) // position among the tokens to d, offset below
					tok[d]++
				}
			}
		}
		off := make([]int32, R)
		for d := 1; d < R; d++ {
			off[d] = off[d-1] + int32(tok[d-1])
		}
		for i, m := range sr {
			if m >= 0 {
				sr[i] = m + off[i%R]
			}
		}
		W := 4 + L
		for d := range R {
			row := v[d*W : (d+1)*W]
			row[0], row[1], row[2], row[3] = int32(T), badRange, badDup, int32(tok[d])
			copy(row[4:], exp[d*L:(d+1)*L])
		}
	})
}

func (cpuBackend) packMeta(s *device.Stream, idx, sendRow, sendTok, meta *device.Tensor, L int) error {
	return s.EnqueueCPU(func() {
		T, K, R := idx.Dim(0), idx.Dim(1), sendRow.Dim(1)
		id, sr, st, m := i32s(idx), i32s(sendRow), i32s(sendTok), i32s(meta)
		for t := range T {
			for d := range R {
				row := int(sr[t*R+d])
				if row < 0 {
					continue
				}
				st[row] = int32(t)
				mr := m[row*(K+1) : (row+1)*(K+1)]
				for k, e := range id[t*K : (t+1)*K] {
					mr[k] = -1
					if int(e) >= d*L && int(e) < (d+1)*L {
						mr[k] = e - int32(d*L)
					}
				}
				mr[K] = int32(t)
			}
		}
	})
}

func (cpuBackend) assignSlots(s *device.Stream, meta, slot, counts *device.Tensor, L, capacity int) error {
	return s.EnqueueCPU(func() {
		n, K := slot.Dim(0), slot.Dim(1)
		m, sl, cnt := i32s(meta), i32s(slot), i32s(counts)
		total := make([]int, L)
		for j := range n {
			for _, e := range m[j*(K+1) : j*(K+1)+K] {
				if e >= 0 && int(e) < L {
					total[e]++
				}
			}
		}
		next := make([]int, L)
		off := 0
		for e := range L {
			next[e] = off
			cnt[e] = int32(max(0, min(off+total[e], capacity)-min(off, capacity)))
			off += total[e]
		}
		for j := range n {
			for k, e := range m[j*(K+1) : j*(K+1)+K] {
				p := int32(-1)
				if e >= 0 && int(e) < L {
					if next[e] < capacity {
						p = int32(next[e])
					}
					next[e]++
				}
				sl[j*K+k] = p
			}
		}
	})
}

func (cpuBackend) origins(s *device.Stream, out, slot, meta, recvOffs *device.Tensor) error {
	return s.EnqueueCPU(func() {
		n, K := slot.Dim(0), slot.Dim(1)
		o, sl, m, recvOff := i32s(out), i32s(slot), i32s(meta), i32s(recvOffs)
		p := 0
		for j := range n {
			for p+1 < len(recvOff)-1 && int(recvOff[p+1]) <= j {
				p++
			}
			for k := range K {
				if q := sl[j*K+k]; q >= 0 {
					o[3*q], o[3*q+1], o[3*q+2] = int32(p), m[j*(K+1)+K], int32(k)
				}
			}
		}
	})
}

func rowOf(rowMap []int32, j int) int {
	if rowMap == nil {
		return j
	}
	return int(rowMap[j])
}

func optI32s(t *device.Tensor) []int32 {
	if t == nil {
		return nil
	}
	return i32s(t)
}

func (cpuBackend) gather(s *device.Stream, dst, src, rowMap *device.Tensor) error {
	return s.EnqueueCPU(func() {
		rb := rowBytes(dst)
		d, sr, m := dst.HostBytes(), src.HostBytes(), optI32s(rowMap)
		par.For(dst.Dim(0), 64, func(lo, hi int) {
			for j := lo; j < hi; j++ {
				r := rowOf(m, j)
				copy(d[j*rb:(j+1)*rb], sr[r*rb:(r+1)*rb])
			}
		})
	})
}

func (cpuBackend) replicate(s *device.Stream, X, W, src, srcW, rowMap, slot *device.Tensor) error {
	return s.EnqueueCPU(func() {
		n, K, rb := slot.Dim(0), slot.Dim(1), rowBytes(X)
		x, sr, m, sl := X.HostBytes(), src.HostBytes(), optI32s(rowMap), i32s(slot)
		w, sw := f32s(W), f32s(srcW)
		par.For(n, 16, func(lo, hi int) {
			for j := lo; j < hi; j++ {
				r := rowOf(m, j)
				for k := range K {
					q := int(sl[j*K+k])
					if q < 0 {
						continue
					}
					copy(x[q*rb:(q+1)*rb], sr[r*rb:(r+1)*rb])
					if w != nil {
						w[q] = sw[r*K+k]
					}
				}
			}
		})
	})
}

func (cpuBackend) wsum(s *device.Stream, dst, y, w, slot *device.Tensor) error {
	return s.EnqueueCPU(func() {
		n, K, H, dt := slot.Dim(0), slot.Dim(1), y.Dim(1), y.DType()
		rb := rowBytes(y)
		d, yb, sl, wv := dst.HostBytes(), y.HostBytes(), i32s(slot), f32s(w)
		par.For(n, 16, func(lo, hi int) {
			acc, v := make([]float32, H), make([]float32, H)
			for j := lo; j < hi; j++ {
				clear(acc)
				for k := range K {
					q := int(sl[j*K+k])
					if q < 0 {
						continue
					}
					c := float32(1)
					if wv != nil {
						c = wv[q]
					}
					device.DecodeFloat32(dt, v, yb[q*rb:(q+1)*rb])
					for h, x := range v {
						acc[h] += float32(c * x)
					}
				}
				device.EncodeFloat32(dt, d[j*rb:(j+1)*rb], acc)
			}
		})
	})
}

func (cpuBackend) finalSum(s *device.Stream, out, back, sendRow *device.Tensor, part *finalPart) error {
	return s.EnqueueCPU(func() {
		T, R, H, dt := out.Dim(0), sendRow.Dim(1), out.Dim(1), out.DType()
		rb := rowBytes(out)
		o, b, sr := out.HostBytes(), back.HostBytes(), i32s(sendRow)
		par.For(T, 16, func(lo, hi int) {
			acc, v := make([]float32, H), make([]float32, H)
			for t := lo; t < hi; t++ {
				if part != nil && !part.takes(sr[t*R:(t+1)*R]) {
					continue
				}
				clear(acc)
				for d := range R {
					q := int(sr[t*R+d])
					if q < 0 {
						continue
					}
					device.DecodeFloat32(dt, v, b[q*rb:(q+1)*rb])
					for h, x := range v {
						acc[h] += x
					}
				}
				device.EncodeFloat32(dt, o[t*rb:(t+1)*rb], acc)
			}
		})
	})
}

// warpDot returns ⟨a, b⟩ summed as one warp of the GPU kernels sums it: lane l adds,
// in order, the products of the elements of the 8-element groups l, l+32, ...; then the
// lanes' sums are combined by a butterfly over lane distances 16, 8, 4, 2, 1. Products
// and sums round to float32 one by one.
func warpDot(a, b []float32) float32 {
	var lanes [32]float32
	for h := range a {
		lanes[(h/8)%32] += float32(a[h] * b[h])
	}
	for off := 16; off >= 1; off /= 2 {
		var next [32]float32
		for i := range lanes {
			next[i] = lanes[i] + lanes[i^off]
		}
		lanes = next
	}
	return lanes[0]
}

func (cpuBackend) replicateScaled(s *device.Stream, dy, dw, src, rowMap, slot, w, y *device.Tensor) error {
	return s.EnqueueCPU(func() {
		n, K, H, dt := slot.Dim(0), slot.Dim(1), dy.Dim(1), dy.DType()
		rb := rowBytes(dy)
		o, sr, m, sl := dy.HostBytes(), src.HostBytes(), optI32s(rowMap), i32s(slot)
		wv, dwv := f32s(w), f32s(dw)
		var yb []byte
		if y != nil {
			yb = y.HostBytes()
		}
		par.For(n, 16, func(lo, hi int) {
			g, v, yv := make([]float32, H), make([]float32, H), make([]float32, H)
			for j := lo; j < hi; j++ {
				r := rowOf(m, j)
				device.DecodeFloat32(dt, g, sr[r*rb:(r+1)*rb])
				for k := range K {
					q := int(sl[j*K+k])
					if q < 0 {
						continue
					}
					c := float32(1)
					if wv != nil {
						c = wv[q]
					}
					for h, x := range g {
						v[h] = float32(c * x)
					}
					device.EncodeFloat32(dt, o[q*rb:(q+1)*rb], v)
					if dwv != nil && yb != nil {
						device.DecodeFloat32(dt, yv, yb[q*rb:(q+1)*rb])
						dwv[q] = warpDot(yv, g)
					}
				}
			}
		})
	})
}

func (cpuBackend) transpose4(s *device.Stream, dst, src *device.Tensor, rows, cols, ldd, lds int) error {
	return s.EnqueueCPU(func() {
		d, sr := device.Slice[uint32](dst), device.Slice[uint32](src)
		par.For(cols, 64, func(lo, hi int) {
			for j := lo; j < hi; j++ {
				for i := range rows {
					d[j*ldd+i] = sr[i*lds+j]
				}
			}
		})
	})
}

func (cpuBackend) dwPack(s *device.Stream, dst, slot, dW *device.Tensor) error {
	return s.EnqueueCPU(func() {
		d, sl, w := f32s(dst), i32s(slot), f32s(dW)
		for i, q := range sl {
			d[i] = 0
			if q >= 0 {
				d[i] = w[q]
			}
		}
	})
}

func (cpuBackend) dwUnpack(s *device.Stream, dweights, idx, sendRow, back *device.Tensor, L int) error {
	return s.EnqueueCPU(func() {
		K, R := idx.Dim(1), sendRow.Dim(1)
		o, id, sr, b := f32s(dweights), i32s(idx), i32s(sendRow), f32s(back)
		for i, e := range id {
			o[i] = 0
			if e < 0 {
				continue
			}
			if q := int(sr[(i/K)*R+int(e)/L]); q >= 0 {
				o[i] = b[q*K+i%K]
			}
		}
	})
}
