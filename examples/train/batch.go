package main

import (
	"encoding/binary"
	"errors"
	"sync"

	"github.com/dropless/dropless/device"
)

// batcher prepares one rank's training batches while the steps run: a goroutine fills
// two pinned host buffers in turn, each with the rank's rows of the next global batch,
// and next uploads a filled one on a stream of its own that the step's stream then
// waits for, on the device. Nothing blocks the host but the goroutine, which waits for
// the upload that last read a buffer before refilling it.
type batcher struct {
	up     *device.Stream
	host   [2]*device.HostBuffer
	tok    [2]*device.Tensor // I32 [B, W+1]
	loaded [2]*device.Event  // on up: the upload into tok[i] is done
	used   [2]*device.Event  // on the step's stream: the last step reading tok[i] is done
	ready  chan int          // buffers filled by the goroutine, in step order
	free   chan int          // buffers the goroutine may refill
	errc   chan error
	done   chan struct{}
	wg     sync.WaitGroup
	cur    int // the buffer of the step being enqueued; -1: none
}

// newBatcher starts preparing the batches of steps [first, last) for rank of R ranks:
// rows [rank·B, (rank+1)·B) of trainBatch(text, seed, step, R·B, W), on the device of
// compute, the stream of the steps.
func newBatcher(compute *device.Stream, text []byte, seed uint64, first, last, B, W, rank, R int) (*batcher, error) {
	d := compute.Device()
	b := &batcher{ready: make(chan int, 2), free: make(chan int, 2), errc: make(chan error, 1), done: make(chan struct{}), cur: -1}
	var err error
	if b.up, err = d.NewStream(); err != nil {
		return nil, err
	}
	n := B * (W + 1)
	for i := range 2 {
		if b.host[i], err = d.AllocPinned(4 * n); err != nil {
			return nil, errors.Join(err, b.freeBuffers())
		}
		if b.tok[i], err = compute.Alloc(device.I32, B, W+1); err != nil {
			return nil, errors.Join(err, b.freeBuffers())
		}
		for _, e := range []**device.Event{&b.loaded[i], &b.used[i]} {
			if *e, err = d.NewEvent(); err != nil {
				return nil, errors.Join(err, b.freeBuffers())
			}
		}
		// Recorded once, so that every wait below is on a recorded event.
		if err = errors.Join(b.loaded[i].Record(b.up), b.used[i].Record(compute)); err != nil {
			return nil, errors.Join(err, b.freeBuffers())
		}
		b.free <- i
	}
	b.wg.Go(func() {
		for step := first; step < last; step++ {
			var i int
			select {
			case i = <-b.free:
			case <-b.done:
				return
			}
			if err := b.loaded[i].Synchronize(); err != nil {
				b.errc <- err
				return
			}
			all := trainBatch(text, seed, step, R*B, W)
			dst := b.host[i].Bytes()
			for j, v := range all[rank*n : (rank+1)*n] {
				binary.LittleEndian.PutUint32(dst[4*j:], uint32(v))
			}
			select {
			case b.ready <- i:
			case <-b.done:
				return
			}
		}
	})
	return b, nil
}

// next returns the tensor of the next step's batch: its upload is enqueued on the
// batcher's stream, after the last step that read the tensor, and compute waits for it.
// Call release once the step's work is enqueued.
func (b *batcher) next(compute *device.Stream) (*device.Tensor, error) {
	var i int
	select {
	case i = <-b.ready:
	case err := <-b.errc:
		return nil, err
	}
	err := b.up.Wait(b.used[i])
	if err == nil {
		err = b.tok[i].CopyFromPinned(b.up, b.host[i], 0)
	}
	if err == nil {
		err = b.loaded[i].Record(b.up)
	}
	if err == nil {
		err = compute.Wait(b.loaded[i])
	}
	if err != nil {
		return nil, err
	}
	b.free <- i // the goroutine refills it once the upload is done
	b.cur = i
	return b.tok[i], nil
}

// release marks the end of the step that read the last batch of next, on compute.
func (b *batcher) release(compute *device.Stream) error {
	if b.cur < 0 {
		return nil
	}
	i := b.cur
	b.cur = -1
	return b.used[i].Record(compute)
}

// close stops the goroutine and releases the buffers, after the device is done with
// them.
func (b *batcher) close() error {
	close(b.done)
	b.wg.Wait()
	return b.freeBuffers()
}

func (b *batcher) freeBuffers() error {
	var errs []error
	for i := range 2 {
		for _, e := range []*device.Event{b.loaded[i], b.used[i]} {
			if e != nil {
				errs = append(errs, e.Synchronize(), e.Close())
			}
		}
		if b.tok[i] != nil {
			errs = append(errs, b.tok[i].Free())
		}
		if b.host[i] != nil {
			errs = append(errs, b.host[i].Free())
		}
	}
	if b.up != nil {
		errs = append(errs, b.up.Synchronize(), b.up.Close())
	}
	return errors.Join(errs...)
}
