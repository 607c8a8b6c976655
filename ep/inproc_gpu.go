package ep

import (
	"errors"
	"fmt"
	"slices"

	"github.com/dropless/dropless/device"
)

// The device route of a World. A collective is, for every rank, pieces to send (views of
// its send tensors, one per destination) and places to receive into (views of its
// receive tensors, one per source). Each rank pulls what it receives on its own stream:
//
//  1. It copies the pieces for ranks on other GPUs into its staging memory (peer memory,
//     which those ranks' kernels read), records its ready event and posts both.
//  2. Once every rank has posted (a barrier), it checks the posts; a second barrier makes
//     sure every rank found them right before anything moves.
//  3. It copies each piece for it into its receive tensors: from a rank on its GPU
//     straight from the sender's tensor, after its stream waits for the sender's ready
//     event; from a rank on another GPU out of the sender's staging memory, after the
//     host waits for that event (device.Stream.Wait takes only events of the stream's
//     device). Then it records its done event.
//  4. After a third barrier its stream waits for the done events of the ranks on its GPU
//     that read its tensors, so that its later work (freeing them) follows their reads.
//     The host waits for the done events of the ranks on other GPUs that read its
//     staging memory at the start of its next collective, before the memory is written
//     again.
//
// The events are each rank's own, recorded anew at every collective: ready before the
// first barrier, once the rank has passed the third barrier of the last collective,
// which every other rank reached after its waits for the last ready; done after the
// second barrier, which every other rank reaches after its waits for the last done (in
// step 4 of the last collective, or, on another GPU, at the start of this one). Every
// wait is for an event recorded before the wait was enqueued, so a stream's work never
// waits for work enqueued after it.

// route is how a World's collectives move rows.
type route int

const (
	viaHost   route = iota // through host memory
	viaDevice              // device to device, in stream order
)

// routeDev is what chooseRoute asks of a device: *device.Device, or a test's fake.
type routeDev interface {
	comparable
	IsCUDA() bool
}

// chooseRoute returns viaDevice when every device is a GPU and enable(a, b), which lets
// a's kernels read b's peer memory, succeeds for every two distinct devices a and b, and
// viaHost otherwise.
func chooseRoute[D routeDev](devs []D, enable func(a, b D) error) route {
	var distinct []D
	for _, d := range devs {
		if !d.IsCUDA() {
			return viaHost
		}
		if !slices.Contains(distinct, d) {
			distinct = append(distinct, d)
		}
	}
	for _, a := range distinct {
		for _, b := range distinct {
			if a != b && enable(a, b) != nil {
				return viaHost
			}
		}
	}
	return viaDevice
}

// devRank is what a rank of the device route keeps from one collective to the next.
type devRank struct {
	ready *device.Event // recorded on the rank's stream once its pieces can be read
	done  *device.Event // recorded on the rank's stream once it has read its pieces

	stage   *device.PeerMemory // the staged copies of pieces for ranks on other GPUs
	readers []*device.Event    // done events of the ranks on other GPUs that read stage last
}

// devRanks is the device route's state of a world's ranks.
type devRanks struct{ ranks []*devRank }

// newDevRanks makes the events of ranks on devs.
func newDevRanks(devs []*device.Device) (*devRanks, error) {
	dr := &devRanks{}
	for _, d := range devs {
		st := &devRank{}
		dr.ranks = append(dr.ranks, st)
		var err error
		if st.ready, err = d.NewEvent(); err == nil {
			st.done, err = d.NewEvent()
		}
		if err != nil {
			dr.release()
			return nil, err
		}
	}
	return dr, nil
}

// release frees the ranks' events and staging memory once every rank's reads are done.
// It runs when the world is no longer reachable, so there is no one to report an error
// to: the resources are released as far as the driver lets.
func (dr *devRanks) release() {
	for _, st := range dr.ranks {
		if st.done != nil {
			st.done.Synchronize()
		}
	}
	for _, st := range dr.ranks {
		if st.stage != nil {
			st.stage.Free()
		}
		for _, e := range []*device.Event{st.ready, st.done} {
			if e != nil {
				e.Close()
			}
		}
	}
}

// devPost is what a rank offers the others in a collective on the device route.
type devPost struct {
	dev    *device.Device
	pieces [][]*device.Tensor // [pair][destination]: the bytes for each rank, views of the rank's tensors
	stage  [][]int            // [pair][destination]: where the piece lies in stage (-1: not staged)
	base   uintptr            // the address of the rank's staging memory
	ready  *device.Event
	done   *device.Event // set in step 3 (nil if the host waited for the rank's reads instead)
}

// move runs p's collective on the device route (see above): the bytes of pieces[i][d]
// go to rank d, which copies them into its into[i][me]; check checks the ranks' posts.
// Views in into are on s's device and have the bytes of the pieces they receive; a view
// whose piece is empty may be nil.
func (t *inproc) move(s *device.Stream, p *post, pieces, into [][]*device.Tensor, check func([]*post) error) error {
	w, me := t.w, t.rank
	if err := w.Err(); err != nil {
		return err
	}
	st := w.dr.ranks[me]
	dp := &devPost{dev: s.Device(), pieces: pieces, ready: st.ready}
	if err := st.settle(); err != nil {
		return t.fail(err)
	}
	if err := st.stageFor(s, w.devs, dp); err != nil {
		return t.fail(err)
	}
	if err := st.ready.Record(s); err != nil {
		return t.fail(err)
	}
	p.dev = dp
	if err := w.barrier(me, p.op, p); err != nil {
		return err
	}
	posts := slices.Clone(w.posts) // the ranks replace theirs at the next collective
	if err := check(posts); err != nil {
		return t.fail(err)
	}
	if err := w.barrier(me, p.op, nil); err != nil {
		return err
	}
	// Every rank reads from here on: an error is reported once the others are done
	// reading this rank's tensors.
	err := t.receive(s, posts, into)
	if rerr := st.done.Record(s); rerr == nil {
		dp.done = st.done
	} else {
		err = errors.Join(err, rerr, s.Synchronize())
	}
	if berr := w.barrier(me, p.op, nil); berr != nil {
		return berr
	}
	for q, qp := range posts {
		qd := qp.dev
		if q == me || qd.done == nil || !readFrom(pieces, q) {
			continue
		}
		if w.devs[q] == dp.dev {
			err = errors.Join(err, s.Wait(qd.done))
		} else if !slices.Contains(st.readers, qd.done) {
			st.readers = append(st.readers, qd.done)
		}
	}
	if err != nil {
		return t.fail(err)
	}
	return nil
}

// readFrom reports whether rank q receives any bytes of pieces.
func readFrom(pieces [][]*device.Tensor, q int) bool {
	for _, ps := range pieces {
		if ps[q].Bytes() > 0 {
			return true
		}
	}
	return false
}

// stageFor copies on s the pieces of dp for ranks on devices other than dp's into the
// rank's staging memory, grown as needed, and notes where each lies. A piece that goes
// to several ranks is staged once.
func (st *devRank) stageFor(s *device.Stream, devs []*device.Device, dp *devPost) error {
	type staged struct {
		x   *device.Tensor
		off int
	}
	var todo []staged
	need := 0
	dp.stage = make([][]int, len(dp.pieces))
	for i, ps := range dp.pieces {
		at := map[*device.Tensor]int{}
		dp.stage[i] = make([]int, len(ps))
		for q, x := range ps {
			dp.stage[i][q] = -1
			if devs[q] == dp.dev || x.Bytes() == 0 {
				continue
			}
			off, ok := at[x]
			if !ok {
				off, at[x] = need, need
				todo = append(todo, staged{x, off})
				need += (x.Bytes() + winAlign - 1) / winAlign * winAlign
			}
			dp.stage[i][q] = off
		}
	}
	if need == 0 {
		return nil
	}
	if st.stage == nil || st.stage.Bytes() < need {
		if st.stage != nil {
			if err := st.stage.Free(); err != nil {
				return err
			}
			st.stage = nil
		}
		m, err := dp.dev.AllocPeerMemory((need + need/4 + 1<<20 - 1) >> 20 << 20)
		if err != nil {
			return err
		}
		st.stage = m
	}
	dp.base = st.stage.Ptr()
	for _, c := range todo {
		v, err := dp.dev.WrapPeer(dp.base+uintptr(c.off), c.x.DType(), c.x.Shape()...)
		if err == nil {
			err = device.Copy(s, v, c.x)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// settle waits on the host until the ranks on other GPUs that read the staging memory
// in the last collective are done: before the memory is written again, and before they
// record their done events anew, perhaps on other streams.
func (st *devRank) settle() error {
	for _, e := range st.readers {
		if err := e.Synchronize(); err != nil {
			return err
		}
	}
	st.readers = st.readers[:0]
	return nil
}

// receive copies on s, for every rank src and pair i, the bytes rank src sends this one
// into into[i][src], and counts them (see move).
func (t *inproc) receive(s *device.Stream, posts []*post, into [][]*device.Tensor) error {
	me, n, d := t.rank, t.w.n, s.Device()
	for src, q := range posts {
		qd := q.dev
		waited := src == me
		for i, ps := range qd.pieces {
			x, dst := ps[me], into[i][src]
			nb := x.Bytes()
			if nb == 0 || sameBytes(x, dst) { // nothing, or in place
				continue
			}
			var err error
			if !waited {
				if qd.dev == d {
					err = s.Wait(qd.ready)
				} else {
					err = qd.ready.Synchronize()
				}
				waited = true
			}
			if err == nil && qd.dev != d {
				x, err = d.WrapPeer(qd.base+uintptr(qd.stage[i][me]), dst.DType(), dst.Shape()...)
			}
			if err == nil {
				err = copyAs(s, dst, x)
			}
			if err != nil {
				return fmt.Errorf("ep: in-process rank %d receiving from rank %d: %w", me, src, err)
			}
			if src != me {
				t.w.bytes[src*n+me].Add(int64(nb))
			}
		}
	}
	return nil
}

// sameBytes reports whether x and y begin at the same byte of memory.
func sameBytes(x, y *device.Tensor) bool {
	if x.Device().IsCUDA() {
		return x.Ptr() == y.Ptr()
	}
	a, b := x.HostBytes(), y.HostBytes()
	return len(a) > 0 && len(b) > 0 && &a[0] == &b[0]
}

// copyAs copies src into dst on s, src's bytes read as dst's dtype: they hold as many
// bytes, and s's device, a GPU where their dtypes differ, addresses both.
func copyAs(s *device.Stream, dst, src *device.Tensor) error {
	if src.DType() != dst.DType() {
		v, err := s.Device().Wrap(src.Ptr(), dst.DType(), dst.Shape()...)
		if err != nil {
			return err
		}
		src = v
	}
	return device.Copy(s, dst, src)
}

// segments returns the n segments of recv, each of flat's bytes, as tensors shaped as
// flat (views of recv when their dtypes are the same, else wrapped as flat's dtype; nil
// when flat is empty): where AllGather puts each rank's send tensor.
func segments(recv, flat *device.Tensor, n int) ([]*device.Tensor, error) {
	segs := make([]*device.Tensor, n)
	m, nb := flat.Len(), flat.Bytes()
	if nb == 0 {
		return segs, nil
	}
	for q := range segs {
		var err error
		if recv.DType() == flat.DType() {
			segs[q], err = recv.View(q*m, m)
		} else {
			segs[q], err = recv.Device().Wrap(recv.Ptr()+uintptr(q*nb), flat.DType(), m)
		}
		if err != nil {
			return nil, err
		}
	}
	return segs, nil
}
