package device

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/dropless/dropless/internal/cuda"
)

// HostBuffer is page-locked (pinned) host memory that a GPU copies to and from at full
// link speed and asynchronously. On the CPU device it is ordinary Go memory. Allocate
// pinned memory once and reuse it: pinning is slow.
type HostBuffer struct {
	dev   *Device
	p     unsafe.Pointer
	b     []byte
	freed atomic.Bool
}

// AllocPinned allocates n bytes of host memory pinned for d.
func (d *Device) AllocPinned(n int) (*HostBuffer, error) {
	if n < 0 || n > maxBytes {
		return nil, fmt.Errorf("device: AllocPinned(%d): size out of range [0, 2^60]", n)
	}
	h := &HostBuffer{dev: d}
	if d.kind != KindCUDA || n == 0 {
		h.b = make([]byte, n)
		return h, nil
	}
	err := d.Do(func() error {
		var err error
		h.p, err = cuda.MemHostAlloc(uint64(n), cuda.MemHostAllocPortable)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("device: AllocPinned(%d): %w", n, err)
	}
	h.b = unsafe.Slice((*byte)(h.p), n)
	return h, nil
}

// Bytes returns the buffer's memory.
func (h *HostBuffer) Bytes() []byte { return h.b }

// Len returns the buffer's size in bytes.
func (h *HostBuffer) Len() int { return len(h.b) }

// Free releases the buffer. No copy may still be using it.
func (h *HostBuffer) Free() error {
	if h.freed.Swap(true) {
		return nil
	}
	h.b = nil
	if h.p == nil {
		return nil
	}
	return h.dev.Do(func() error { return cuda.MemFreeHost(h.p) })
}

func (h *HostBuffer) span(op string, off, n int) error {
	if h.freed.Load() {
		return fmt.Errorf("device: %s: host buffer was freed", op)
	}
	if off < 0 || n > len(h.b)-off {
		return fmt.Errorf("device: %s: bytes [%d, %d) out of the host buffer's [0, %d)", op, off, off+n, len(h.b))
	}
	return nil
}

// CopyFromPinned enqueues on s a copy of t.Bytes() bytes from h at byte offset off into
// t, and returns without waiting. h must not change until the copy is done (record an event).
func (t *Tensor) CopyFromPinned(s *Stream, h *HostBuffer, off int) error {
	if err := t.usable(s, "CopyFromPinned destination"); err != nil {
		return err
	}
	n := t.Bytes()
	if err := h.span("CopyFromPinned", off, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	return s.run(func() { copy(t.HostBytes(), h.b[off:off+n]) }, func() error {
		return cuda.MemcpyHtoDAsync(t.dptr(), unsafe.Pointer(&h.b[off]), uint64(n), s.h)
	})
}

// CopyToPinned enqueues on s a copy of t into h at byte offset off, and returns without
// waiting. Read h only after the copy is done (record an event, or synchronize s).
func (t *Tensor) CopyToPinned(s *Stream, h *HostBuffer, off int) error {
	if err := t.usable(s, "CopyToPinned source"); err != nil {
		return err
	}
	n := t.Bytes()
	if err := h.span("CopyToPinned", off, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	return s.run(func() { copy(h.b[off:off+n], t.HostBytes()) }, func() error {
		return cuda.MemcpyDtoHAsync(unsafe.Pointer(&h.b[off]), t.dptr(), uint64(n), s.h)
	})
}
