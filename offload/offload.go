package offload

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/dropless/dropless/device"
)

// ErrRecompute is returned (wrapped) by Load for an activation whose action is Remat:
// the caller recomputes it.
var ErrRecompute = errors.New("offload: activation was dropped for recompute")

// allocPinned allocates the pool; tests replace it to count pinned allocations.
var allocPinned = func(d *device.Device, n int) (*device.HostBuffer, error) { return d.AllocPinned(n) }

// eventDone reports whether a reload has finished; tests replace it to report false
// more often, driving the CPU through the paths a GPU takes when reloads lag.
var eventDone = (*device.Event).Done

// Config configures an Offloader.
type Config struct {
	// PoolBytes is the size of the pinned host pool, allocated once by New (0: no pool,
	// every offload stays on the device). Each offloaded tensor takes its size rounded up
	// to Align bytes; a pool size that is not a multiple of Align is used rounded down.
	PoolBytes int
	// Policy maps activation names to actions; the zero Policy keeps everything on the device.
	Policy Policy
}

// Offloader moves activations (tensors of any dtype and shape) of one device to a
// pinned host pool and back, on two streams of its own: D2H for offloads, H2D for
// reloads. Copies wait for their inputs with events, never by blocking the host. The
// pool is pinned once by New; Save, Prefetch and Load pin nothing and allocate no host
// buffers (a reload's tensor comes from the device's pool). On the CPU the same code
// runs with Go memory as the pool and memcpy as the copies, in the calling goroutine.
//
// An Offloader is safe for concurrent use; each handle belongs to the offloader that made it.
type Offloader struct {
	dev      *device.Device
	policy   Policy
	d2h, h2d *device.Stream
	pool     *device.HostBuffer
	ready    *device.Event // the producer's point, recorded on the compute stream by each Save

	mu       sync.Mutex
	arena    arena
	recs     []record
	free     []int32 // unused records
	pending  []int32 // loaded records whose slots wait for their reloads, by increasing seq
	draining int     // pool bytes of pending
	seq      uint64  // reloads enqueued on h2d
	stats    Stats
	closed   bool
}

type state uint8

const (
	stFree       state = iota
	stSaved            // Save done; Offload: D2H copy enqueued
	stPrefetched       // Offload: H2D copy enqueued into t
	stDraining         // loaded; the slot waits for the H2D copy to finish
)

// record is one saved activation. Records and their events are reused, so a steady
// stream of steps creates neither.
type record struct {
	gen    uint32 // bumped when the handle stops being valid
	state  state
	act    Action // what Save did (Device for an offload kept on the device)
	name   string
	t      *device.Tensor // Device: the saved tensor; Offload, prefetched: the reload
	dtype  device.DType
	shape  []int
	nbytes int           // tensor bytes
	off, n int           // pool slot; n = 0 for none
	seq    uint64        // order of the reload on h2d
	saved  *device.Event // Device: the producer's point; Offload: D2H copy done
	loaded *device.Event // H2D copy done
}

// Handle names an activation saved by Save, until Load or Drop. The zero Handle is invalid.
type Handle struct {
	o   *Offloader
	id  int32
	gen uint32
	act Action
}

// Action returns what Save did with the activation: Offload when it went to the pool,
// Device when it stayed on the device (by policy or because the pool was full), Remat
// when it was dropped.
func (h Handle) Action() Action { return h.act }

// Stats counts what an Offloader did since New. Pool bytes count whole slots (sizes
// rounded up to Align); moved bytes count tensor bytes.
type Stats struct {
	PoolBytes    int64 // size of the pinned pool
	InUse        int64 // pool bytes held by handles not yet loaded
	Draining     int64 // pool bytes of loaded handles whose reload may still be reading them
	Peak         int64 // most pool bytes held at once (InUse + Draining); ≤ PoolBytes
	Offloaded    int64 // bytes copied device → host
	Reloaded     int64 // bytes copied host → device
	Offloads     int   // tensors copied to the pool
	Device       int   // Saves kept on the device by the policy
	Remat        int   // Saves dropped for recompute
	Kept         int   // offloads kept on the device because the pool had no room
	KeptBytes    int64 // their bytes
	Stalls       int   // Saves that took slots still being reloaded: the D2H stream waits for those reloads (on the device; the host never waits)
	Unprefetched int   // Loads that started their own reload (no Prefetch before)
}

// New returns an offloader for d, with its two streams and a pinned pool of
// cfg.PoolBytes bytes. Pinning is slow (about 1 s per GiB): make one offloader and
// keep it. Close it when done. A pool the host cannot hold is an error.
func New(d *device.Device, cfg Config) (*Offloader, error) {
	if d == nil {
		return nil, errors.New("offload: New: nil device")
	}
	if cfg.PoolBytes < 0 {
		return nil, fmt.Errorf("offload: New: Config.PoolBytes = %d: want ≥ 0", cfg.PoolBytes)
	}
	o := &Offloader{dev: d, policy: cfg.Policy, arena: newArena(cfg.PoolBytes &^ (Align - 1))}
	o.stats.PoolBytes = int64(o.arena.size)
	var err error
	if o.d2h, err = d.NewStream(); err == nil {
		if o.h2d, err = d.NewStream(); err == nil {
			o.ready, err = d.NewEvent()
		}
	}
	if err == nil {
		if o.pool, err = allocPinned(d, cfg.PoolBytes); err != nil {
			err = fmt.Errorf("pinning %d bytes: %w", cfg.PoolBytes, err)
		}
	}
	if err != nil {
		o.closeAll()
		return nil, fmt.Errorf("offload: New on %v: %w", d, err)
	}
	return o, nil
}

// Device returns the offloader's device (nil for a nil Offloader).
func (o *Offloader) Device() *device.Device {
	if o == nil {
		return nil
	}
	return o.dev
}

// Policy returns the offloader's policy (the zero Policy for a nil Offloader).
func (o *Offloader) Policy() Policy {
	if o == nil {
		return Policy{}
	}
	return o.policy
}

// D2H returns the stream the offload copies run on, for ordering other work after them
// (nil for a nil Offloader).
func (o *Offloader) D2H() *device.Stream {
	if o == nil {
		return nil
	}
	return o.d2h
}

// H2D returns the stream the reload copies run on, for ordering other work after them
// (nil for a nil Offloader).
func (o *Offloader) H2D() *device.Stream {
	if o == nil {
		return nil
	}
	return o.h2d
}

// lock locks o for op, or returns why it cannot: o is nil.
func (o *Offloader) lock(op string) error {
	if o == nil {
		return fmt.Errorf("offload: %s: nil Offloader", op)
	}
	o.mu.Lock()
	return nil
}

// Save saves the activation t (any dtype and shape, on the offloader's device),
// produced by work enqueued on compute, under name; the policy decides what happens:
//
//   - Offload: a D2H copy of t into a pool slot is enqueued after the work enqueued on
//     compute so far, and t is then freed in stream order on the D2H stream. When the
//     pool has no room, t stays on the device as for Device (Stats.Kept).
//   - Device: t is held as it is.
//   - Remat: t is freed in stream order on compute; t may be nil.
//
// Save takes t in every case: enqueue every use of t before calling Save (on compute,
// or on streams ordered before compute's current end), never use t afterwards, and
// never Save a view of a tensor still in use. Saving a tensor that a handle still holds
// on the device is an error. Save does not block the host; on error, t is left to the
// caller.
func (o *Offloader) Save(compute *device.Stream, name string, t *device.Tensor) (Handle, error) {
	if err := o.lock("Save"); err != nil {
		return Handle{}, err
	}
	defer o.mu.Unlock()
	if err := o.check(compute, "Save"); err != nil {
		return Handle{}, err
	}
	act := o.policy.Action(name)
	if act != Remat || t != nil {
		if err := t.Check(compute, "tensor"); err != nil {
			return Handle{}, fmt.Errorf("offload: Save %q: %w", name, err)
		}
		if i := o.holder(t); i >= 0 {
			return Handle{}, fmt.Errorf("offload: Save %q: tensor %v is held by the handle of Save %q: a tensor is saved once", name, t, o.recs[i].name)
		}
	}
	if act == Remat {
		if t != nil {
			if err := t.FreeOn(compute); err != nil {
				return Handle{}, fmt.Errorf("offload: Save %q: %w", name, err)
			}
		}
		o.stats.Remat++
		return o.handle(o.newRecord(name, Remat))
	}
	off, n, policyDevice := 0, 0, act == Device
	if act == Offload {
		if err := o.reclaimDone(); err != nil {
			return Handle{}, fmt.Errorf("offload: Save %q: %w", name, err)
		}
		if n = alignUp(t.Bytes()); n > 0 {
			var ok bool
			var err error
			if off, ok, err = o.slot(n); err != nil {
				return Handle{}, fmt.Errorf("offload: Save %q: %w", name, err)
			}
			if !ok {
				act, n = Device, 0
				o.stats.Kept++
				o.stats.KeptBytes += int64(t.Bytes())
			}
		}
	}
	id, err := o.newRecord(name, act)
	if err == nil {
		if act == Device {
			err = o.keep(id, compute, t)
		} else {
			err = o.offload(id, compute, t, off, n)
		}
		if err != nil {
			o.retire(id)
		}
	}
	if err != nil {
		if n > 0 {
			o.arena.release(off, n)
		}
		return Handle{}, fmt.Errorf("offload: Save %q: %w", name, err)
	}
	if policyDevice {
		o.stats.Device++
	}
	return o.handle(id, nil)
}

// keep holds t on the device, marking its producer's point.
func (o *Offloader) keep(id int32, compute *device.Stream, t *device.Tensor) error {
	r := &o.recs[id]
	if err := r.saved.Record(compute); err != nil {
		return err
	}
	r.t = t
	return nil
}

// offload enqueues the copy of t into the slot [off, off+n) on d2h after compute's
// current end, then the free of t after the copy.
func (o *Offloader) offload(id int32, compute *device.Stream, t *device.Tensor, off, n int) error {
	r := &o.recs[id]
	r.dtype, r.nbytes, r.off, r.n = t.DType(), t.Bytes(), off, n
	r.shape = r.shape[:0]
	for i := range t.Rank() {
		r.shape = append(r.shape, t.Dim(i))
	}
	if err := o.ready.Record(compute); err != nil {
		return err
	}
	if err := o.d2h.Wait(o.ready); err != nil {
		return err
	}
	if err := t.CopyToPinned(o.d2h, o.pool, off); err != nil {
		return err
	}
	if err := r.saved.Record(o.d2h); err != nil {
		return err
	}
	if err := t.FreeOn(o.d2h); err != nil {
		return err
	}
	o.stats.Offloads++
	o.stats.Offloaded += int64(r.nbytes)
	return nil
}

// Prefetch starts reloading an offloaded activation: it allocates a fresh tensor on the
// H2D stream and enqueues the copy from the pool there, after the activation's offload
// copy. It does nothing for activations kept on the device, dropped, or already
// prefetched, and does not block the host.
func (o *Offloader) Prefetch(h Handle) error {
	if err := o.lock("Prefetch"); err != nil {
		return err
	}
	defer o.mu.Unlock()
	r, _, err := o.lookup(h, "Prefetch")
	if err != nil {
		return err
	}
	if r.act != Offload || r.state != stSaved {
		return nil
	}
	return o.prefetch(r)
}

func (o *Offloader) prefetch(r *record) error {
	x, err := o.h2d.Alloc(r.dtype, r.shape...)
	if err != nil {
		return fmt.Errorf("offload: reloading %q: %w", r.name, err)
	}
	err = o.h2d.Wait(r.saved)
	if err == nil {
		err = x.CopyFromPinned(o.h2d, o.pool, r.off)
	}
	if err == nil {
		err = r.loaded.Record(o.h2d)
	}
	if err != nil {
		x.Free()
		return fmt.Errorf("offload: reloading %q: %w", r.name, err)
	}
	o.seq++
	r.seq, r.t, r.state = o.seq, x, stPrefetched
	o.stats.Reloaded += int64(r.nbytes)
	return nil
}

// Load returns the activation h names and ends h. Work enqueued on compute after Load
// sees the tensor's data: compute waits, on the device, for the reload (started now
// unless Prefetch was called) or, for an activation kept on the device, for its
// producer. Load never blocks the host. The caller owns the tensor: a reloaded tensor
// was allocated on the H2D stream, so release it with FreeOn(compute) (or FreeOn the
// stream of its last use), not Free. For an activation kept on the device, the tensor
// is the one Save was given, not a copy. For an activation dropped by Remat, Load returns
// an error wrapping ErrRecompute. The pool slot is reused once the reload has finished.
func (o *Offloader) Load(compute *device.Stream, h Handle) (*device.Tensor, error) {
	if err := o.lock("Load"); err != nil {
		return nil, err
	}
	defer o.mu.Unlock()
	if err := o.check(compute, "Load"); err != nil {
		return nil, err
	}
	r, id, err := o.lookup(h, "Load")
	if err != nil {
		return nil, err
	}
	switch r.act {
	case Remat:
		name := r.name
		o.retire(id)
		return nil, fmt.Errorf("offload: Load %q: %w", name, ErrRecompute)
	case Device:
		if err := compute.Wait(r.saved); err != nil {
			return nil, fmt.Errorf("offload: Load %q: %w", r.name, err)
		}
		x := r.t
		o.retire(id)
		return x, nil
	}
	if r.state == stSaved {
		if err := o.prefetch(r); err != nil {
			return nil, err
		}
		o.stats.Unprefetched++
	}
	if err := compute.Wait(r.loaded); err != nil {
		return nil, fmt.Errorf("offload: Load %q: %w", r.name, err)
	}
	x := r.t
	o.drain(id)
	return x, nil
}

// Drop ends h without loading it, releasing what it holds in stream order: a tensor
// kept on the device is freed on s (the stream of its last use); a reload in flight is
// freed after its copy.
func (o *Offloader) Drop(s *device.Stream, h Handle) error {
	if err := o.lock("Drop"); err != nil {
		return err
	}
	defer o.mu.Unlock()
	if err := o.check(s, "Drop"); err != nil {
		return err
	}
	r, id, err := o.lookup(h, "Drop")
	if err != nil {
		return err
	}
	switch {
	case r.act == Device:
		err = r.t.FreeOn(s)
	case r.act == Offload && r.state == stPrefetched:
		err = r.t.FreeOn(o.h2d)
		o.drain(id)
		return err
	case r.act == Offload && r.n > 0:
		// Only the D2H stream writes the slot, after this copy in stream order.
		o.arena.release(r.off, r.n)
	}
	o.retire(id)
	return err
}

// Synchronize blocks until every copy enqueued so far has finished and returns the pool
// slots of loaded activations to the pool. It is for the end of a run, not a step.
func (o *Offloader) Synchronize() error {
	if err := o.lock("Synchronize"); err != nil {
		return err
	}
	defer o.mu.Unlock()
	if o.closed {
		return errors.New("offload: Synchronize: offloader is closed")
	}
	if err := errors.Join(o.d2h.Synchronize(), o.h2d.Synchronize()); err != nil {
		return fmt.Errorf("offload: Synchronize: %w", err)
	}
	o.reclaim(len(o.pending))
	return nil
}

// Stats returns the offloader's counters (zero for a nil Offloader).
func (o *Offloader) Stats() Stats {
	if o == nil {
		return Stats{}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	s := o.stats
	s.Draining = int64(o.draining)
	s.InUse = int64(o.arena.used - o.draining)
	s.Peak = int64(o.arena.peak)
	return s
}

// Close waits for all work on the device, frees the tensors held by live handles, the
// pool, the events and the streams. Handles are invalid afterwards. Closing twice is
// not an error.
func (o *Offloader) Close() error {
	if err := o.lock("Close"); err != nil {
		return err
	}
	defer o.mu.Unlock()
	if o.closed {
		return nil
	}
	o.closed = true
	err := o.dev.Synchronize()
	for i := range o.recs {
		// The device is idle: free on a stream of ours, which is open, whatever
		// became of the streams that allocated the tensors.
		if r := &o.recs[i]; r.t != nil {
			err = errors.Join(err, r.t.FreeOn(o.d2h))
			r.t = nil
		}
	}
	return errors.Join(err, o.closeAll())
}

func (o *Offloader) closeAll() error {
	var err error
	for i := range o.recs {
		r := &o.recs[i]
		if r.saved != nil {
			err = errors.Join(err, r.saved.Close(), r.loaded.Close())
		}
	}
	if o.ready != nil {
		err = errors.Join(err, o.ready.Close())
	}
	if o.pool != nil {
		err = errors.Join(err, o.pool.Free())
	}
	for _, s := range []*device.Stream{o.d2h, o.h2d} {
		if s != nil {
			err = errors.Join(err, s.Close())
		}
	}
	return err
}

// check validates the stream argument of op.
func (o *Offloader) check(s *device.Stream, op string) error {
	switch {
	case o.closed:
		return fmt.Errorf("offload: %s: offloader is closed", op)
	case s == nil:
		return fmt.Errorf("offload: %s: nil stream", op)
	case s.Closed():
		return fmt.Errorf("offload: %s: stream was closed", op)
	case s.Device() != o.dev:
		return fmt.Errorf("offload: %s: stream of %v, offloader of %v", op, s.Device(), o.dev)
	}
	return nil
}

// holder returns the index of the record that holds t, or -1.
func (o *Offloader) holder(t *device.Tensor) int {
	for i := range o.recs {
		if o.recs[i].t == t {
			return i
		}
	}
	return -1
}

// lookup returns the live record h names.
func (o *Offloader) lookup(h Handle, op string) (*record, int32, error) {
	switch {
	case h.o == nil:
		return nil, 0, fmt.Errorf("offload: %s: zero Handle", op)
	case h.o != o:
		return nil, 0, fmt.Errorf("offload: %s: handle of another Offloader", op)
	case o.closed:
		return nil, 0, fmt.Errorf("offload: %s: offloader is closed", op)
	}
	r := &o.recs[h.id]
	if r.gen != h.gen || r.state == stFree || r.state == stDraining {
		return nil, 0, fmt.Errorf("offload: %s: handle was already loaded or dropped", op)
	}
	return r, h.id, nil
}

func (o *Offloader) handle(id int32, err error) (Handle, error) {
	if err != nil {
		return Handle{}, err
	}
	return Handle{o: o, id: id, gen: o.recs[id].gen, act: o.recs[id].act}, nil
}

// newRecord returns a record for a Save, with its events for Device and Offload.
func (o *Offloader) newRecord(name string, act Action) (int32, error) {
	var id int32
	if k := len(o.free); k > 0 {
		id, o.free = o.free[k-1], o.free[:k-1]
	} else {
		o.recs = append(o.recs, record{})
		id = int32(len(o.recs) - 1)
	}
	r := &o.recs[id]
	if act != Remat && r.saved == nil {
		saved, err := o.dev.NewEvent()
		if err != nil {
			o.free = append(o.free, id)
			return -1, err
		}
		loaded, err := o.dev.NewEvent()
		if err != nil {
			saved.Close()
			o.free = append(o.free, id)
			return -1, err
		}
		r.saved, r.loaded = saved, loaded
	}
	r.state, r.act, r.name, r.n = stSaved, act, name, 0
	return id, nil
}

// retire ends a record's handle and makes the record reusable.
func (o *Offloader) retire(id int32) {
	r := &o.recs[id]
	r.gen++
	r.state, r.t, r.name = stFree, nil, ""
	o.free = append(o.free, id)
}

// drain ends a loaded record's handle; its slot, if any, waits for the reload to finish.
func (o *Offloader) drain(id int32) {
	r := &o.recs[id]
	if r.n == 0 {
		o.retire(id)
		return
	}
	r.gen++
	r.state, r.t = stDraining, nil
	i, _ := slices.BinarySearchFunc(o.pending, r.seq, func(p int32, seq uint64) int {
		if s := o.recs[p].seq; s < seq {
			return -1
		} else if s > seq {
			return 1
		}
		return 0
	})
	o.pending = slices.Insert(o.pending, i, id)
	o.draining += r.n
}

// reclaimDone returns to the pool the slots whose reloads have finished. Reloads
// finish in seq order (one stream), so it stops at the first one still running.
func (o *Offloader) reclaimDone() error {
	k := 0
	for ; k < len(o.pending); k++ {
		done, err := eventDone(o.recs[o.pending[k]].loaded)
		if err != nil {
			return err
		}
		if !done {
			break
		}
	}
	o.reclaim(k)
	return nil
}

// reclaim returns the slots of the first k pending records to the pool.
func (o *Offloader) reclaim(k int) {
	for _, id := range o.pending[:k] {
		r := &o.recs[id]
		o.arena.release(r.off, r.n)
		o.draining -= r.n
		r.state, r.name = stFree, ""
		o.free = append(o.free, id)
	}
	o.pending = o.pending[:copy(o.pending, o.pending[k:])]
}

// slot returns a pool slot of n bytes. When the free slots are too small it takes
// slots whose reloads are still running, oldest first, and makes the D2H stream wait
// for the newest of those reloads (a stall, on the device only). It reports false when
// the pool has no room even so.
func (o *Offloader) slot(n int) (int, bool, error) {
	if off, ok := o.arena.alloc(n); ok {
		return off, true, nil
	}
	if o.arena.size-(o.arena.used-o.draining) < n {
		return 0, false, nil
	}
	var fence *device.Event
	off, ok := 0, false
	for !ok && len(o.pending) > 0 {
		fence = o.recs[o.pending[0]].loaded
		o.reclaim(1)
		off, ok = o.arena.alloc(n)
	}
	if fence != nil {
		if err := o.d2h.Wait(fence); err != nil {
			if ok {
				o.arena.release(off, n)
			}
			return 0, false, err
		}
		o.stats.Stalls++
	}
	return off, ok, nil
}
