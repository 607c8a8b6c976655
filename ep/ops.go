package ep

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// Dispatched is what Dispatch returns on a rank: its experts' rows, grouped by local
// expert.
type Dispatched struct {
	// X is [Capacity, H] of x's dtype: the rows of local expert 0, then those of expert
	// 1, ..., Counts[j] rows each, ready for a ragged (grouped) matrix product. Within an
	// expert, rows come by source rank, then source token, then k. Rows past the kept
	// ones (Layout.Rows) are not written.
	X *device.Tensor
	// Weights is F32 [Capacity]: each row's routing weight (nil when Dispatch got none).
	Weights *device.Tensor
	// Counts is the layout's ExpertCounts: I32, the rows of each local expert.
	Counts *device.Tensor
}

// Free releases X and Weights; Counts belongs to the layout. Freeing a nil Dispatched
// does nothing.
func (d *Dispatched) Free() error {
	if d == nil {
		return nil
	}
	return device.FreeAll(d.X, d.Weights)
}

// dispatchWeights checks the routing weights of a dispatch (op names it; nil: none),
// F32 [T, K] on s's device, and allocates on s the dispatched rows' weights, F32
// [Capacity] (nil without weights).
func (l *Layout) dispatchWeights(s *device.Stream, op string, weights *device.Tensor) (*device.Tensor, error) {
	if weights == nil {
		return nil, nil
	}
	if err := checkShape(s, weights, op+": weights", device.F32, l.t, l.g.k); err != nil {
		return nil, err
	}
	return s.Alloc(device.F32, l.capacity)
}

// chunk returns rows [lo, hi) of chunk c of C of a segment of n rows. A sender and its
// receiver split a segment alike, as both know n. The two end chunks weigh one unit and
// those between three (chunkStart): short end chunks shorten what cannot overlap a
// transfer, the packing before the first and the placing after the last.
func chunk(n, c, C int) (lo, hi int) {
	u := chunkUnits(C)
	return n * chunkStart(c, C) / u, n * chunkStart(c+1, C) / u
}

// chunkUnits is the weight of all C chunks.
func chunkUnits(C int) int {
	if C <= 1 {
		return 1
	}
	return 3*C - 4
}

// chunkStart is the weight of the chunks before chunk c of C.
func chunkStart(c, C int) int {
	switch {
	case c <= 0:
		return 0
	case c >= C:
		return chunkUnits(C)
	}
	return 1 + 3*(c-1)
}

// chunkOf returns the chunk of C that row i of a segment of n rows lies in (the mirror
// of ep_chunk_of in the kernels).
func chunkOf(i, n, C int) int {
	for c := C - 1; c > 0; c-- {
		if lo, _ := chunk(n, c, C); i >= lo {
			return c
		}
	}
	return 0
}

// finalPart selects the tokens of one final sum of Combine: those whose last partial
// sum from another rank arrives with chunk c of C, or, for c = -1, those with no
// partial sum from another rank.
type finalPart struct {
	rank, c, C int
	sendOff    []int          // [R+1] the layout's send offsets
	dev        *device.Tensor // I32 [R+1] sendOff on the device (GPU backend)
}

// takes reports whether the part holds the token whose send rows are rows (one per rank,
// -1 where it does not go).
func (f *finalPart) takes(rows []int32) bool {
	last := -1
	for d, q := range rows {
		if d == f.rank || q < 0 {
			continue
		}
		last = max(last, chunkOf(int(q)-f.sendOff[d], f.sendOff[d+1]-f.sendOff[d], f.C))
	}
	return last == f.c
}

// compact returns the offsets of each rank's rows in a buffer that holds only the rows
// of other ranks: off (a prefix sum over all ranks) without rank r's segment.
func compact(off []int, r int) []int {
	c := make([]int, len(off)-1)
	for p := range c {
		c[p] = off[p]
		if p > r {
			c[p] -= off[r+1] - off[r]
		}
	}
	return c
}

func rows(x *device.Tensor, lo, hi int) *device.Tensor {
	v, err := x.Rows(lo, hi)
	if err != nil {
		panic(err) // the ranges come from the layout and are checked against the shapes
	}
	return v
}

// optRows is rows for an optional tensor.
func optRows(x *device.Tensor, lo, hi int) *device.Tensor {
	if x == nil {
		return nil
	}
	return rows(x, lo, hi)
}

// mark calls the group's trace hook, if any, for a point of an op reached on s: what,
// followed by chunk c unless c < 0. Without a hook it costs a comparison.
func (g *Group) mark(s *device.Stream, what string, c int) {
	if g.trace != nil {
		if c >= 0 {
			what = fmt.Sprintf("%s %d", what, c)
		}
		g.trace(what, s)
	}
}

// checkShape checks that x is live on s's device with dtype dt (Invalid: any) and shape
// (a negative dimension: any size).
func checkShape(s *device.Stream, x *device.Tensor, what string, dt device.DType, shape ...int) error {
	return x.CheckShape(s, "ep: "+what, dt, shape...)
}

func checkFloat(x *device.Tensor, what string) error {
	switch x.DType() {
	case device.F32, device.BF16, device.F16:
		return nil
	}
	return fmt.Errorf("ep: %s is %v: want f32, bf16 or f16", what, x)
}

// Dispatch sends this rank's tokens x ([T, H], any dtype) to the ranks that hold their
// experts, each (token, rank) once, and replicates each arriving token into the
// expert-major buffer once per local expert it chose. weights (F32 [T, K], or nil)
// travel with the tokens and land in Dispatched.Weights. Every rank passes the same H,
// dtype and presence of weights. x and weights are on the group's device and only
// read; Dispatched.X ([Capacity, H], x's dtype) and Dispatched.Weights (F32
// [Capacity]) are new tensors, allocated on s, that alias no input (Dispatched.Counts
// is the layout's). Work is enqueued on s and on the group's transfer stream, with the
// transfer split into Config.Chunks pieces that overlap the packing and the
// replication; nothing waits for the host (Transport.Sync does).
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) Dispatch(s *device.Stream, x, weights *device.Tensor, during ...func() error) (*Dispatched, error) {
	if err := l.usable(s, "Dispatch"); err != nil {
		return nil, err
	}
	if err := checkShape(s, x, "Dispatch: x", device.Invalid, l.t, -1); err != nil {
		return nil, err
	}
	W, err := l.dispatchWeights(s, "Dispatch", weights)
	if err != nil {
		return nil, err
	}
	X, err := s.Alloc(x.DType(), l.capacity, x.Dim(1))
	if err != nil {
		return nil, errors.Join(err, device.FreeAll(W))
	}
	err = l.dispatch(s, "Dispatch", []string{"x"}, []*device.Tensor{x}, weights, during, func(src []*device.Tensor, srcW, rowMap, slot *device.Tensor) error {
		return l.g.be.replicate(s, X, W, src[0], srcW, rowMap, slot)
	})
	if err != nil {
		return nil, errors.Join(err, device.FreeAll(X, W))
	}
	return &Dispatched{X: X, Weights: W, Counts: l.counts}, nil
}

// CombineBackward is the gradient of Combine: given dout ([T, H], f32, bf16 or f16: the
// gradient of Combine's output), it returns dy ([Capacity, H], dout's dtype) with
// dy[row] = w[row] · dout[token of row], and dw (F32 [Capacity]) with dw[row] =
// ⟨y[row], dout[token of row]⟩, the gradient of the routing weight of the row. y
// ([Capacity, H], dout's dtype) is Combine's input and w (F32 [Capacity]) its weights;
// w nil means weights of 1, y nil skips dw (returned nil). It moves dout like Dispatch
// moves x: every rank passes the same H and dtype. The inputs are on the group's device
// and only read; dy and dw are new tensors, allocated on s, that alias no input. Rows
// past the kept ones are not written. Work is enqueued on s and the transfer stream, as
// by Dispatch.
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) CombineBackward(s *device.Stream, dout, y, w *device.Tensor, during ...func() error) (dy, dw *device.Tensor, err error) {
	if err := l.usable(s, "CombineBackward"); err != nil {
		return nil, nil, err
	}
	if err := checkShape(s, dout, "CombineBackward: dout", device.Invalid, l.t, -1); err != nil {
		return nil, nil, err
	}
	if err := checkFloat(dout, "CombineBackward: dout"); err != nil {
		return nil, nil, err
	}
	H := dout.Dim(1)
	if y != nil {
		if err := checkShape(s, y, "CombineBackward: y", device.Invalid, l.capacity, -1); err != nil {
			return nil, nil, err
		}
		if y.DType() != dout.DType() || y.Dim(1) != H {
			return nil, nil, fmt.Errorf("ep: CombineBackward: dout is %v: want %v[%d %d], the dtype and width of y %v", dout, y.DType(), l.t, y.Dim(1), y)
		}
	}
	if w != nil {
		if err := checkShape(s, w, "CombineBackward: w", device.F32, l.capacity); err != nil {
			return nil, nil, err
		}
	}
	if dy, err = s.Alloc(dout.DType(), l.capacity, H); err != nil {
		return nil, nil, err
	}
	if y != nil {
		if dw, err = s.Alloc(device.F32, l.capacity); err != nil {
			dy.Free()
			return nil, nil, err
		}
	}
	err = l.dispatch(s, "CombineBackward", []string{"dout"}, []*device.Tensor{dout}, nil, during, func(src []*device.Tensor, _, rowMap, slot *device.Tensor) error {
		return l.g.be.replicateScaled(s, dy, dw, src[0], rowMap, slot, w, y)
	})
	if err != nil {
		dy.Free()
		if dw != nil {
			dw.Free()
		}
		return nil, nil, err
	}
	return dy, dw, nil
}

// dispatch moves the rows of xs (tensors of T rows each, of any dtypes and widths) and
// weights to the ranks of each token and calls place for each piece that has arrived:
// src holds the piece's rows of each of xs (the rows rowMap names, or all of them when
// rowMap is nil), srcW their weights, slot their [rows, K] expert-major slots. Rows a
// rank sends to itself are placed from xs directly. op is the calling op and names the
// names of xs.
func (l *Layout) dispatch(s *device.Stream, op string, names []string, xs []*device.Tensor, weights *device.Tensor, during []func() error,
	place func(src []*device.Tensor, srcW, rowMap, slot *device.Tensor) error) error {
	g := l.g
	R, r, K, nx := g.r, g.rank, g.k, len(xs)
	tmp := device.NewTemps(s)
	defer tmp.Free()
	var specs []bufSpec
	for _, x := range xs {
		specs = append(specs, bufSpec{x.DType(), x.Dim(1)})
	}
	if weights != nil {
		specs = append(specs, bufSpec{device.F32, K})
	}
	cso, cro := compact(l.sendOff, r), compact(l.recvOff, r)
	xf, err := l.buffers(s, tmp, specs, l.sendOff[R]-l.tokTo[r], cso, l.tokTo, cro, l.tokFrom, l.dispatchGeom)
	if err != nil {
		return err
	}
	xf.op, xf.names, xf.during = op, append(append([]string(nil), names...), "weights")[:len(specs)], during
	C := g.chunks() // once buffers has decided on direct transfers
	var recvW *device.Tensor
	if weights != nil {
		recvW = xf.recv[nx]
	}
	return l.transfers(s, xf, func(st *device.Stream, p, lo, hi int, dst []*device.Tensor) error {
		m := rows(l.sendTok, l.sendOff[p]+lo, l.sendOff[p]+hi)
		for i, x := range xs {
			if err := g.be.gather(st, dst[i], x, m); err != nil {
				return err
			}
		}
		if weights == nil {
			return nil
		}
		return g.be.gather(st, dst[nx], weights, m)
	}, func() error {
		// What this rank routes to itself, straight from xs, while the transfers run.
		if n := l.tokTo[r]; n > 0 {
			m := rows(l.sendTok, l.sendOff[r], l.sendOff[r]+n)
			if err := place(xs, weights, m, rows(l.slot, l.recvOff[r], l.recvOff[r]+n)); err != nil {
				return err
			}
		}
		g.mark(s, "place own", -1)
		return nil
	}, func(c int) error {
		// Place each piece as it arrives.
		src := make([]*device.Tensor, nx)
		for p := range R {
			if p == r {
				continue
			}
			lo, hi := chunk(l.tokFrom[p], c, C)
			if hi == lo {
				continue
			}
			for i := range src {
				src[i] = rows(xf.recv[i], cro[p]+lo, cro[p]+hi)
			}
			err := place(src, optRows(recvW, cro[p]+lo, cro[p]+hi), nil, rows(l.slot, l.recvOff[p]+lo, l.recvOff[p]+hi))
			if err != nil {
				return err
			}
		}
		g.mark(s, "place", c)
		return nil
	})
}

// transfers runs an op's transfers in Config.Chunks pieces: directly (see direct) when
// x has a window, else through the transport on the group's transfer stream. First it
// enqueues on s, for each piece c and each other rank p, pack(s, p, lo, hi, dst): the
// filling of dst, rows [lo, hi) of p's send segment (x.sendCnt[p] rows); then local(),
// the op's work that needs no transfer; then the transfers, each piece moving once s
// has packed it, into x's receive tensors at x.recvOff[p] plus piece c of x.recvCnt[p]
// rows; then the caller's x.during (xfer.overlap), on both paths; then, for each piece
// c, arrive(c) on s after s waits for the piece. Enqueuing the kernels of s before the
// transfers keeps the device busy while the host is in the transport's calls. Whatever
// happens, s waits for every piece that was sent before transfers returns, so that
// temporaries freed on s afterwards are done with.
func (l *Layout) transfers(s *device.Stream, x *xfer, pack func(st *device.Stream, p, lo, hi int, dst []*device.Tensor) error,
	local func() error, arrive func(c int) error) (err error) {
	if x.win != nil {
		return l.direct(s, x, pack, local, arrive)
	}
	R, r, C, cs := l.g.r, l.g.rank, l.g.chunks(), l.g.cs
	var packed, arrived []*device.Event
	defer func() {
		for _, e := range packed {
			e.Close()
		}
		for _, e := range arrived {
			if err != nil { // s has not waited for every piece
				s.Wait(e)
			}
			e.Close()
		}
	}()
	for c := range C {
		for p := range R {
			if lo, hi := chunk(x.sendCnt[p], c, C); p != r && hi > lo {
				if err := pack(s, p, lo, hi, x.dst(p, lo, hi)); err != nil {
					return err
				}
			}
		}
		l.g.mark(s, "pack", c)
		e, err := s.Record()
		if err != nil {
			return err
		}
		packed = append(packed, e)
	}
	if err := local(); err != nil {
		return err
	}
	for c := range C {
		ex := chunkExchange(x.send, x.recv, x.sendOff, x.sendCnt, x.recvOff, x.recvCnt, r, c, C)
		ex.op, ex.names = x.op, x.names
		if err := cs.Wait(packed[c]); err != nil {
			return err
		}
		l.g.mark(cs, "transfer start", c)
		if err := l.g.tr.AllToAllV(cs, ex); err != nil {
			return err
		}
		l.g.mark(cs, "transfer", c)
		e, err := cs.Record()
		if err != nil {
			return err
		}
		arrived = append(arrived, e)
	}
	if err := x.overlap(); err != nil {
		return err
	}
	for c, e := range arrived {
		if err := s.Wait(e); err != nil {
			return err
		}
		l.g.mark(s, "wait", c)
		if err := arrive(c); err != nil {
			return err
		}
	}
	return nil
}

// chunkExchange is the exchange of chunk c of C of a transfer: with each rank p other than
// r, the rows of chunk c of p's send segment (sendCnt[p] rows from sendOff[p]) and of its
// receive segment (recvCnt[p] rows from recvOff[p]).
func chunkExchange(send, recv []*device.Tensor, sendOff, sendCnt, recvOff, recvCnt []int, r, c, C int) *Exchange {
	R := len(sendCnt)
	ex := &Exchange{Send: send, Recv: recv, SendOff: make([]int, R), SendCount: make([]int, R), RecvOff: make([]int, R), RecvCount: make([]int, R)}
	for p := range R {
		if p == r {
			continue
		}
		lo, hi := chunk(sendCnt[p], c, C)
		ex.SendOff[p], ex.SendCount[p] = sendOff[p]+lo, hi-lo
		lo, hi = chunk(recvCnt[p], c, C)
		ex.RecvOff[p], ex.RecvCount[p] = recvOff[p]+lo, hi-lo
	}
	return ex
}

// Combine returns out ([T, H], y's dtype): for each of this rank's tokens, the sum over
// its routing entries of w[row]·y[row], where row is the entry's row in the
// expert-major buffers (y [Capacity, H], f32, bf16 or f16; w F32 [Capacity], or nil for
// weights of 1). Each rank first sums, in float32, the rows of each token it received
// (in k order), rounds the partial sum to y's dtype and sends it back once; the token's
// rank then adds the partial sums in rank order in float32. The result is bit-identical
// from run to run and between the CPU and GPUs. Dropped entries, and tokens routed
// nowhere, contribute zero. Every rank passes the same H and dtype. y and w are on the
// group's device and only read; out is a new tensor, allocated on s, that aliases no
// input. Work is enqueued on s and the transfer stream, as by Dispatch.
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) Combine(s *device.Stream, y, w *device.Tensor, during ...func() error) (*device.Tensor, error) {
	out, _, err := l.combine(s, "Combine", "y", y, w, nil, during)
	return out, err
}

// DispatchBackward is the gradient of Dispatch: given dX ([Capacity, H], f32, bf16 or
// f16: the gradient of Dispatched.X) it returns dx ([T, H], dX's dtype), each token's
// sum of the gradients of its rows, as Combine with weights of 1. Given dW (F32
// [Capacity], the gradient of Dispatched.Weights, as CombineBackward returns it), it
// also returns dweights (F32 [T, K]): each routing entry's weight gradient, 0 for
// entries routed nowhere or dropped; else dweights is nil. Every rank passes the same
// H, dtype and presence of dW. dX and dW are on the group's device and only read; dx
// and dweights are new tensors, allocated on s, that alias no input. Work is enqueued
// on s and the transfer stream, as by Dispatch.
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) DispatchBackward(s *device.Stream, dX, dW *device.Tensor, during ...func() error) (dx, dweights *device.Tensor, err error) {
	return l.combine(s, "DispatchBackward", "dX", dX, nil, dW, during)
}

// combine is Combine and DispatchBackward: op is the op, yName its name for y.
func (l *Layout) combine(s *device.Stream, op, yName string, y, w, dW *device.Tensor, during []func() error) (out, dweights *device.Tensor, err error) {
	if err := l.usable(s, op); err != nil {
		return nil, nil, err
	}
	K := l.g.k
	if err := checkShape(s, y, op+": "+yName, device.Invalid, l.capacity, -1); err != nil {
		return nil, nil, err
	}
	if err := checkFloat(y, op+": "+yName); err != nil {
		return nil, nil, err
	}
	for _, v := range []struct {
		t    *device.Tensor
		what string
	}{{w, ": w"}, {dW, ": dW"}} {
		if v.t != nil {
			if err := checkShape(s, v.t, op+v.what, device.F32, l.capacity); err != nil {
				return nil, nil, err
			}
		}
	}
	H, dt := y.Dim(1), y.DType()
	if out, err = s.Alloc(dt, l.t, H); err != nil {
		return nil, nil, err
	}
	if dW != nil {
		if dweights, err = s.Alloc(device.F32, l.t, K); err != nil {
			out.Free()
			return nil, nil, err
		}
	}
	if err = l.combineInto(s, op, yName, out, dweights, y, w, dW, during); err != nil {
		out.Free()
		if dweights != nil {
			dweights.Free()
		}
		return nil, nil, err
	}
	return out, dweights, nil
}

func (l *Layout) combineInto(s *device.Stream, op, yName string, out, dweights, y, w, dW *device.Tensor, during []func() error) error {
	g := l.g
	R, r, K, H, dt := g.r, g.rank, g.k, y.Dim(1), y.DType()
	tmp := device.NewTemps(s)
	defer tmp.Free()
	specs := []bufSpec{{dt, H}}
	if dW != nil {
		specs = append(specs, bufSpec{device.F32, K})
	}
	cro := compact(l.recvOff, r)
	xf, err := l.buffers(s, tmp, specs, l.recvOff[R]-l.tokFrom[r], cro, l.tokFrom, l.sendOff, l.tokTo, l.combineGeom)
	if err != nil {
		return err
	}
	xf.op, xf.names, xf.during = op, []string{yName, "dW"}[:len(specs)], during
	back := xf.recv[0]
	var dback *device.Tensor
	if dW != nil {
		dback = xf.recv[1]
	}
	// sums writes on st the partial sums of the received rows from row from (and their
	// weight gradients) into dst[0] (and dst[1]).
	sums := func(st *device.Stream, dst []*device.Tensor, from int) error {
		n := dst[0].Dim(0)
		slot := rows(l.slot, from, from+n)
		if err := g.be.wsum(st, dst[0], y, w, slot); err != nil || dW == nil {
			return err
		}
		return g.be.dwPack(st, dst[1], slot, dW)
	}
	// part selects the tokens of the final sums of chunk c (-1: no other rank's partial sum).
	part := func(c int) *finalPart {
		return &finalPart{rank: r, c: c, C: g.chunks(), sendOff: l.sendOff, dev: l.sendOfs}
	}
	return l.transfers(s, xf, func(st *device.Stream, p, lo, hi int, dst []*device.Tensor) error {
		return sums(st, dst, l.recvOff[p]+lo)
	}, func() error {
		// This rank's own partial sums go straight to their place; then the final sums
		// of the tokens with no other rank's partial sum.
		if n := l.tokTo[r]; n > 0 {
			own := []*device.Tensor{rows(back, l.sendOff[r], l.sendOff[r]+n), optRows(dback, l.sendOff[r], l.sendOff[r]+n)}
			if err := sums(s, own, l.recvOff[r]); err != nil {
				return err
			}
		}
		g.mark(s, "sums own", -1)
		err := g.be.finalSum(s, out, back, l.sendRow, part(-1))
		g.mark(s, "final local", -1)
		return err
	}, func(c int) error {
		// The final sums of the tokens whose last partial sum from another rank came
		// with this chunk.
		if err := g.be.finalSum(s, out, back, l.sendRow, part(c)); err != nil {
			return err
		}
		g.mark(s, "final", c)
		if dW != nil && c == g.chunks()-1 {
			// Every weight gradient has come back (and is read before the window is
			// handed back to the peers).
			return g.be.dwUnpack(s, dweights, l.idx, l.sendRow, dback, g.l)
		}
		return nil
	})
}
