package ep

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dropless/dropless/device"
)

// World is an in-process transport: R ranks in one process, each used from its own
// goroutine like a real rank. Ranks may live on the CPU or on GPUs (all on one, or one
// each), whose tensors move through host memory. It counts the bytes each rank sends
// to each other rank. Every error (a rank's bad call, mismatched calls, a rank that
// closes, or one that keeps the others waiting past the timeout) aborts the world: all
// ranks' calls then fail with it.
type World struct {
	n       int
	devs    []*device.Device
	timeout atomic.Int64 // nanoseconds
	bytes   []atomic.Int64

	mu    sync.Mutex
	count int
	gen   chan struct{} // closed when every rank has arrived at the current barrier
	dead  chan struct{} // closed on abort
	err   error
	posts []*post
}

type op int

const (
	opAllGather op = iota
	opAllToAllV
)

func (o op) String() string {
	if o == opAllGather {
		return "AllGather"
	}
	return "AllToAllV"
}

// post is what a rank offers the others in one collective.
type post struct {
	op    op
	rowB  []int      // per pair: row bytes
	segs  [][][]byte // AllToAllV: per pair, per destination: the rows it sends
	whole []byte     // AllGather: the send tensor
}

// NewWorld returns an in-process world of n ranks. With no devices every rank is on the
// CPU; with one, every rank is on it; with n, rank r is on devs[r]. The timeout starts
// as Timeout().
func NewWorld(n int, devs ...*device.Device) (*World, error) {
	if n < 1 || n > MaxRanks {
		return nil, fmt.Errorf("ep: NewWorld(%d): want 1 to %d ranks", n, MaxRanks)
	}
	w := &World{n: n, bytes: make([]atomic.Int64, n*n), gen: make(chan struct{}), dead: make(chan struct{}), posts: make([]*post, n)}
	switch len(devs) {
	case 0:
		devs = []*device.Device{device.CPU()}
		fallthrough
	case 1:
		for range n {
			w.devs = append(w.devs, devs[0])
		}
	case n:
		w.devs = append(w.devs, devs...)
	default:
		return nil, fmt.Errorf("ep: NewWorld(%d) with %d devices: want 0, 1 or %d", n, len(devs), n)
	}
	for i, d := range w.devs {
		if d == nil {
			return nil, fmt.Errorf("ep: NewWorld: device %d is nil", i)
		}
	}
	w.timeout.Store(int64(Timeout()))
	return w, nil
}

// Size returns the number of ranks.
func (w *World) Size() int { return w.n }

// SetTimeout sets how long a rank waits for the others in a collective.
func (w *World) SetTimeout(d time.Duration) { w.timeout.Store(int64(d)) }

// Transport returns rank r's endpoint. Use each from one goroutine.
func (w *World) Transport(r int) Transport { return &inproc{w: w, rank: r} }

// Bytes returns the bytes each rank has sent to each rank since the world began or
// ResetBytes: Bytes()[src][dst]. Copies within a rank are not transfers and not counted.
func (w *World) Bytes() [][]int64 {
	out := make([][]int64, w.n)
	for s := range w.n {
		out[s] = make([]int64, w.n)
		for d := range w.n {
			out[s][d] = w.bytes[s*w.n+d].Load()
		}
	}
	return out
}

// ResetBytes zeroes the byte counts.
func (w *World) ResetBytes() {
	for i := range w.bytes {
		w.bytes[i].Store(0)
	}
}

// Err returns the error that aborted the world, or nil.
func (w *World) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// Run calls fn with every rank's transport, each in its own goroutine, and returns when
// all have returned: the ranks' errors joined, each prefixed by its rank. A rank's error
// aborts the world, so that the others do not wait for it.
func (w *World) Run(fn func(tr Transport) error) error {
	errs := make([]error, w.n)
	var wg sync.WaitGroup
	for r := range w.n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(w.Transport(r)); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				w.abort(err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (w *World) abort(err error) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = err
		close(w.dead)
	}
	return w.err
}

// barrier waits until every rank has called it, having stored p (if not nil) as the
// rank's post for the others to read.
func (w *World) barrier(rank int, p *post) error {
	w.mu.Lock()
	if w.err != nil {
		defer w.mu.Unlock()
		return w.err
	}
	if p != nil {
		w.posts[rank] = p
	}
	ch := w.gen
	w.count++
	if w.count == w.n {
		w.count = 0
		w.gen = make(chan struct{})
		close(ch)
		w.mu.Unlock()
		return nil
	}
	w.mu.Unlock()
	d := time.Duration(w.timeout.Load())
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ch:
		return nil
	case <-w.dead:
	case <-t.C:
		w.abort(fmt.Errorf("ep: in-process rank %d waited %v for the other ranks", rank, d))
	}
	select {
	case <-ch: // everyone arrived after all
		return nil
	default:
		return w.Err()
	}
}

// inproc is one rank of a World.
type inproc struct {
	w    *World
	rank int
}

func (t *inproc) Rank() int              { return t.rank }
func (t *inproc) Size() int              { return t.w.n }
func (t *inproc) Device() *device.Device { return t.w.devs[t.rank] }

// fail aborts the world with err and returns the world's error.
func (t *inproc) fail(err error) error { return t.w.abort(err) }

// hostBytes returns the bytes of rows [lo, hi) of x: its memory on the CPU, a copy from
// a GPU, made after the work enqueued on s.
func hostBytes(s *device.Stream, x *device.Tensor, lo, hi int) ([]byte, error) {
	v, err := x.Rows(lo, hi)
	if err != nil {
		return nil, err
	}
	if !x.Device().IsCUDA() {
		return v.HostBytes(), nil
	}
	b := make([]byte, v.Bytes())
	return b, v.CopyToHost(s, b)
}

// putBytes writes b into rows [lo, hi) of x, ordered after the work on s.
func putBytes(s *device.Stream, x *device.Tensor, lo, hi int, b []byte) error {
	v, err := x.Rows(lo, hi)
	if err != nil {
		return err
	}
	if !x.Device().IsCUDA() {
		copy(v.HostBytes(), b)
		return nil
	}
	return v.CopyFromHost(s, b)
}

func (t *inproc) AllGather(s *device.Stream, send, recv *device.Tensor) error {
	n := t.w.n
	switch {
	case send == nil || recv == nil:
		return t.fail(errors.New("ep: AllGather: nil tensor"))
	case s.Device() != t.Device():
		return t.fail(fmt.Errorf("ep: AllGather on a stream of %v, rank %d on %v", s.Device(), t.rank, t.Device()))
	case recv.Bytes() != n*send.Bytes():
		return t.fail(fmt.Errorf("ep: AllGather: receive %v holds %d bytes, want %d ranks × %d", recv, recv.Bytes(), n, send.Bytes()))
	}
	for _, x := range []*device.Tensor{send, recv} {
		if err := x.Check(s, "ep: AllGather tensor"); err != nil {
			return t.fail(err)
		}
	}
	flat, err := send.Reshape(send.Len())
	if err != nil {
		return t.fail(err)
	}
	whole, err := hostBytes(s, flat, 0, send.Len())
	if err != nil {
		return t.fail(err)
	}
	if err := t.w.barrier(t.rank, &post{op: opAllGather, whole: whole}); err != nil {
		return err
	}
	nb := send.Bytes()
	all := make([]byte, n*nb)
	for p, q := range t.w.posts {
		if q.op != opAllGather {
			return t.fail(fmt.Errorf("ep: rank %d called AllGather while rank %d called %v", t.rank, p, q.op))
		}
		if len(q.whole) != nb {
			return t.fail(fmt.Errorf("ep: AllGather: rank %d sends %d bytes, rank %d %d", p, len(q.whole), t.rank, nb))
		}
		copy(all[p*nb:], q.whole)
		if p != t.rank {
			t.w.bytes[p*n+t.rank].Add(int64(nb))
		}
	}
	rflat, err := recv.Reshape(recv.Len())
	if err == nil {
		err = putBytes(s, rflat, 0, recv.Len(), all)
	}
	if err != nil {
		return t.fail(err)
	}
	return t.w.barrier(t.rank, nil)
}

func (t *inproc) AllToAllV(s *device.Stream, x *Exchange) error {
	if err := x.check(t, s); err != nil {
		return t.fail(err)
	}
	n := t.w.n
	p := &post{op: opAllToAllV}
	for _, snd := range x.Send {
		p.rowB = append(p.rowB, rowBytes(snd))
		segs := make([][]byte, n)
		for d := range n {
			b, err := hostBytes(s, snd, x.SendOff[d], x.SendOff[d]+x.SendCount[d])
			if err != nil {
				return t.fail(err)
			}
			segs[d] = b
		}
		p.segs = append(p.segs, segs)
	}
	if err := t.w.barrier(t.rank, p); err != nil {
		return err
	}
	me := t.rank
	for src, q := range t.w.posts {
		if q.op != opAllToAllV || len(q.segs) != len(p.segs) {
			return t.fail(fmt.Errorf("ep: rank %d called AllToAllV with %d tensors while rank %d called %v with %d", me, len(p.segs), src, q.op, len(q.segs)))
		}
		for i := range p.segs {
			rb := p.rowB[i]
			if q.rowB[i] != rb {
				return t.fail(fmt.Errorf("ep: AllToAllV tensor %d: rank %d sends rows of %d bytes, rank %d receives rows of %d", i, src, q.rowB[i], me, rb))
			}
			seg := q.segs[i][me]
			if len(seg) != x.RecvCount[src]*rb {
				return t.fail(fmt.Errorf("ep: AllToAllV tensor %d: rank %d sends %d rows to rank %d, which expects %d", i, src, len(seg)/max(rb, 1), me, x.RecvCount[src]))
			}
			if err := putBytes(s, x.Recv[i], x.RecvOff[src], x.RecvOff[src]+x.RecvCount[src], seg); err != nil {
				return t.fail(err)
			}
			if src != me {
				t.w.bytes[src*n+me].Add(int64(len(seg)))
			}
		}
	}
	return t.w.barrier(t.rank, nil)
}

// Sync waits for s: the world's collectives are synchronous, so only s's own work can
// be pending.
func (t *inproc) Sync(s *device.Stream) error { return s.Synchronize() }

// Close leaves the world: the other ranks' later calls fail.
func (t *inproc) Close() error {
	t.w.abort(fmt.Errorf("ep: in-process rank %d closed its transport", t.rank))
	return nil
}
