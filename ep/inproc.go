package ep

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dropless/dropless/device"
)

// World is an in-process transport: R ranks in one process, each used from its own
// goroutine like a real rank. Ranks may live on the CPU or on GPUs (all on one, or one
// each). When every rank is on a GPU and the GPUs can address each other's memory (one
// GPU, or GPUs with peer access, which NewWorld enables), a collective moves rows device
// to device: each rank copies, on its own stream, the rows the others send it, straight
// from a sender's tensors when they are on its GPU, or from the sender's staging copy in
// peer memory when they are on another. Events order the streams of ranks on one GPU, so
// that the host waits for nothing; for a sender on another GPU the host waits for the
// sender's event, since a stream cannot wait for an event of another device. Otherwise
// (ranks on the CPU, or GPUs that cannot address each other) rows move through host
// memory. The results are the same bits either way. It counts the bytes each rank sends
// to each other rank. Every error (a rank's bad call, mismatched calls, a rank that
// closes or panics in Run, or ranks that keep the others waiting past the timeout,
// which the error names) aborts the world: all ranks' calls then fail with it.
type World struct {
	n       int
	devs    []*device.Device
	route   route        // how collectives move rows, decided by NewWorld
	dr      *devRanks    // the device route's state of each rank
	timeout atomic.Int64 // nanoseconds
	def     time.Duration
	bytes   []atomic.Int64

	mu    sync.Mutex
	count int
	in    []bool        // the ranks that have arrived at the current barrier
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
	rowB  []int      // AllToAllV: per pair, row bytes
	segs  [][][]byte // host route, AllToAllV: per pair, per destination: the rows it sends
	whole []byte     // host route, AllGather: the send tensor
	dev   *devPost   // device route: the send tensors' pieces and the events that order them

	// AllToAllV of an op of the package: the op, and per pair the tensor's name and
	// what its rows are (Exchange.op, Exchange.names).
	from  string
	names []string
	rows  []rowKind
}

// NewWorld returns an in-process world of n ranks. With no devices every rank is on the
// CPU; with one, every rank is on it; with n, rank r is on devs[r]. When the devices are
// GPUs that can address each other's memory, NewWorld enables peer access between every
// two of them and the world moves rows device to device (see World). The timeout starts
// as Timeout().
func NewWorld(n int, devs ...*device.Device) (*World, error) {
	if n < 1 || n > MaxRanks {
		return nil, fmt.Errorf("ep: NewWorld(%d): want 1 to %d ranks", n, MaxRanks)
	}
	timeout, err := Timeout()
	if err != nil {
		return nil, err
	}
	w := &World{n: n, def: timeout, bytes: make([]atomic.Int64, n*n), in: make([]bool, n), gen: make(chan struct{}),
		dead: make(chan struct{}), posts: make([]*post, n)}
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
	w.route = chooseRoute(w.devs, (*device.Device).EnablePeerAccess)
	if w.route == viaDevice {
		if w.dr, err = newDevRanks(w.devs); err != nil {
			return nil, err
		}
		runtime.AddCleanup(w, (*devRanks).release, w.dr)
	}
	w.timeout.Store(int64(timeout))
	return w, nil
}

// Size returns the number of ranks.
func (w *World) Size() int { return w.n }

// SetTimeout sets how long a rank waits for the others in a collective; d ≤ 0 restores
// the timeout the world began with, Timeout().
func (w *World) SetTimeout(d time.Duration) {
	if d <= 0 {
		d = w.def
	}
	w.timeout.Store(int64(d))
}

// Transport returns rank r's endpoint. Use each from one goroutine. For r outside [0,
// Size()) it returns an endpoint whose calls fail with an error naming r and the size
// (and whose Device is nil), leaving the world as it is.
func (w *World) Transport(r int) Transport {
	t := &inproc{w: w, rank: r}
	if r < 0 || r >= w.n {
		t.err = fmt.Errorf("ep: World.Transport(%d): rank %d is outside a world of %d ranks", r, r, w.n)
	}
	return t
}

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
// aborts the world, so that the others do not wait for it. A rank whose fn panics
// returns a *PanicError, which aborts the world like an error: the other ranks' calls
// fail with it.
func (w *World) Run(fn func(tr Transport) error) error {
	switch {
	case w == nil:
		return errors.New("ep: World.Run: nil World")
	case fn == nil:
		return errors.New("ep: World.Run: nil function")
	}
	errs := make([]error, w.n)
	var wg sync.WaitGroup
	for r := range w.n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.call(r, fn); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				w.abort(err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// call returns fn's error for rank r, or a *PanicError when fn panics.
func (w *World) call(r int, fn func(tr Transport) error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Rank: r, Value: p, Stack: debug.Stack()}
		}
	}()
	return fn(w.Transport(r))
}

// PanicError is the error of a rank whose function panicked in World.Run.
type PanicError struct {
	Rank  int    // the rank that panicked
	Value any    // the value it panicked with
	Stack []byte // the rank's stack where it panicked
}

func (e *PanicError) Error() string { return fmt.Sprintf("ep: rank %d panicked: %v", e.Rank, e.Value) }

// Unwrap returns the panic value when it is an error, else nil.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
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

// barrier waits until every rank has called it in collective o, having stored p (if
// not nil) as the rank's post for the others to read.
func (w *World) barrier(rank int, o op, p *post) error {
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
	w.in[rank] = true
	if w.count == w.n {
		w.count = 0
		clear(w.in)
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
		var missing []int
		w.mu.Lock()
		if w.gen == ch { // else everyone arrived after all
			for q, in := range w.in {
				if !in {
					missing = append(missing, q)
				}
			}
		}
		w.mu.Unlock()
		if missing != nil {
			w.abort(fmt.Errorf("ep: in-process rank(s) %v of %d did not reach %v within %v", missing, w.n, o, d))
		}
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
	err  error // the rank is not one of the world's
}

func (t *inproc) Rank() int { return t.rank }
func (t *inproc) Size() int { return t.w.n }

func (t *inproc) Device() *device.Device {
	if t.err != nil {
		return nil
	}
	return t.w.devs[t.rank]
}

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
	if t.err != nil {
		return t.err
	}
	if err := checkAllGather(t, s, send, recv); err != nil {
		return t.fail(err)
	}
	n := t.w.n
	flat, err := send.Reshape(send.Len())
	if err != nil {
		return t.fail(err)
	}
	nb := send.Bytes()
	check := func(posts []*post) error { return checkGather(t.rank, nb, posts) }
	if t.w.route == viaDevice {
		into, err := segments(recv, flat, n)
		if err != nil {
			return t.fail(err)
		}
		pieces := [][]*device.Tensor{slices.Repeat([]*device.Tensor{flat}, n)}
		return t.move(s, &post{op: opAllGather}, pieces, [][]*device.Tensor{into}, check)
	}
	whole, err := hostBytes(s, flat, 0, send.Len())
	if err != nil {
		return t.fail(err)
	}
	if !send.Device().IsCUDA() {
		// A copy: send may be this rank's segment of recv, which it writes while the
		// others read whole.
		whole = slices.Clone(whole)
	}
	if err := t.w.barrier(t.rank, opAllGather, &post{op: opAllGather, whole: whole}); err != nil {
		return err
	}
	if err := check(t.w.posts); err != nil {
		return t.fail(err)
	}
	all := make([]byte, n*nb)
	for p, q := range t.w.posts {
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
	return t.w.barrier(t.rank, opAllGather, nil)
}

// checkGather returns an error unless every rank's post is an AllGather of nb bytes, as
// rank me's is.
func checkGather(me, nb int, posts []*post) error {
	for p, q := range posts {
		if q.op != opAllGather {
			return fmt.Errorf("ep: rank %d called AllGather while rank %d called %v", me, p, q.op)
		}
		if got := q.sends(0, me); got != nb {
			return fmt.Errorf("ep: AllGather: rank %d sends %d bytes, rank %d %d", p, got, me, nb)
		}
	}
	return nil
}

func (t *inproc) AllToAllV(s *device.Stream, x *Exchange) error {
	if t.err != nil {
		return t.err
	}
	if err := x.check(t, s); err != nil {
		return t.fail(err)
	}
	n, me := t.w.n, t.rank
	p := &post{op: opAllToAllV, from: x.op, names: x.names}
	for _, snd := range x.Send {
		p.rowB = append(p.rowB, rowBytes(snd))
		if x.op != "" {
			p.rows = append(p.rows, rowKindOf(snd))
		}
	}
	check := func(posts []*post) error { return checkExchange(me, p, posts, x.RecvCount) }
	if t.w.route == viaDevice {
		pieces, into := make([][]*device.Tensor, len(x.Send)), make([][]*device.Tensor, len(x.Send))
		for i := range x.Send {
			for d := range n {
				pieces[i] = append(pieces[i], rows(x.Send[i], x.SendOff[d], x.SendOff[d]+x.SendCount[d]))
				into[i] = append(into[i], rows(x.Recv[i], x.RecvOff[d], x.RecvOff[d]+x.RecvCount[d]))
			}
		}
		return t.move(s, p, pieces, into, check)
	}
	for _, snd := range x.Send {
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
	if err := t.w.barrier(me, opAllToAllV, p); err != nil {
		return err
	}
	if err := check(t.w.posts); err != nil {
		return t.fail(err)
	}
	for src, q := range t.w.posts {
		for i := range p.segs {
			seg := q.segs[i][me]
			if err := putBytes(s, x.Recv[i], x.RecvOff[src], x.RecvOff[src]+x.RecvCount[src], seg); err != nil {
				return t.fail(err)
			}
			if src != me {
				t.w.bytes[src*n+me].Add(int64(len(seg)))
			}
		}
	}
	return t.w.barrier(me, opAllToAllV, nil)
}

// checkExchange returns an error unless every rank's post is an AllToAllV that agrees
// with p, rank me's, and sends me the rows it expects: recvCount[src] from rank src.
func checkExchange(me int, p *post, posts []*post, recvCount []int) error {
	for src, q := range posts {
		if err := disagree(me, p, src, q); err != nil {
			return err
		}
		if q.op != opAllToAllV || len(q.rowB) != len(p.rowB) {
			return fmt.Errorf("ep: rank %d called AllToAllV with %d tensors while rank %d called %v with %d", me, len(p.rowB), src, q.op, len(q.rowB))
		}
		for i, rb := range p.rowB {
			if q.rowB[i] != rb {
				return fmt.Errorf("ep: AllToAllV tensor %d: rank %d sends rows of %d bytes, rank %d receives rows of %d", i, src, q.rowB[i], me, rb)
			}
			if nb := q.sends(i, me); nb != recvCount[src]*rb {
				return fmt.Errorf("ep: AllToAllV tensor %d: rank %d sends %d rows to rank %d, which expects %d", i, src, nb/max(rb, 1), me, recvCount[src])
			}
		}
	}
	return nil
}

// sends returns the bytes of pair i that the post's rank sends rank d (AllGather: its
// send tensor's).
func (q *post) sends(i, d int) int {
	switch {
	case q.dev != nil:
		return q.dev.pieces[i][d].Bytes()
	case q.op == opAllGather:
		return len(q.whole)
	}
	return len(q.segs[i][d])
}

// disagree describes how the AllToAllV posts of ranks a and b, both of an op of the
// package, disagree on what they move (the ops, the tensors, their dtypes or widths),
// or returns nil.
func disagree(a int, pa *post, b int, pb *post) error {
	if pb.op != opAllToAllV || pa.from == "" || pb.from == "" {
		return nil
	}
	if a > b {
		a, pa, b, pb = b, pb, a, pa
	}
	if pa.from != pb.from || !slices.Equal(pa.names, pb.names) {
		return fmt.Errorf("ep: the ranks' calls differ: %s of %v on rank %d, %s of %v on rank %d", pa.from, pa.names, a, pb.from, pb.names, b)
	}
	for i, name := range pa.names {
		if pa.rows[i] != pb.rows[i] {
			return fmt.Errorf("ep: %s: the ranks' %s differ: %s on rank %d, %s on rank %d", pa.from, name, pa.rows[i], a, pb.rows[i], b)
		}
	}
	return nil
}

// Sync waits for s. Through host memory the world's collectives are synchronous, so
// only s's own work can be pending; device to device, s's copies wait only for events
// the other ranks recorded before the collective returned, so s's work always ends.
func (t *inproc) Sync(s *device.Stream) error {
	if t.err != nil {
		return t.err
	}
	if err := checkStream(t, s, "Sync"); err != nil {
		return err
	}
	return s.Synchronize()
}

// Close leaves the world: the other ranks' later calls fail.
func (t *inproc) Close() error {
	if t.err != nil {
		return t.err
	}
	t.w.abort(fmt.Errorf("ep: in-process rank %d closed its transport", t.rank))
	return nil
}
