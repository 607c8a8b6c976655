package device

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
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

// hostMemory returns the bytes of RAM and swap of the host, 0 when the system does not
// say (it is read from /proc/meminfo).
var hostMemory = sync.OnceValue(func() uint64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	var total uint64
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 3 && f[2] == "kB" && (f[0] == "MemTotal:" || f[0] == "SwapTotal:") {
			if kb, err := strconv.ParseUint(f[1], 10, 64); err == nil {
				total += kb << 10
			}
		}
	}
	return total
})

// errOutOfMemory is wrapped by the errors of CPU allocations that the host cannot hold.
var errOutOfMemory = errors.New("out of memory")

// IsOutOfMemory reports whether err comes from an allocation that the device could not
// satisfy: CUDA_ERROR_OUT_OF_MEMORY on a GPU, a size over the host's memory on the CPU
// (Stream.Alloc, Device.AllocPinned, and the ops that return their errors). A caller
// with a way to do the work in less memory can take it on such an error.
func IsOutOfMemory(err error) bool {
	return errors.Is(err, errOutOfMemory) || cuda.IsCode(err, "CUDA_ERROR_OUT_OF_MEMORY")
}

// hostBytes returns n zeroed bytes of Go memory, or an out-of-memory error for a size
// over the host's memory or beyond what Go can allocate. Go ends the process, rather
// than failing, on an allocation it cannot meet, so a size within the host's memory but
// over what is free still ends it.
func hostBytes(n int) (b []byte, err error) {
	if m := hostMemory(); m > 0 && uint64(n) > m {
		return nil, fmt.Errorf("%w: the host has %d bytes of memory", errOutOfMemory, m)
	}
	defer func() {
		if r := recover(); r != nil {
			b, err = nil, fmt.Errorf("%w: %v", errOutOfMemory, r)
		}
	}()
	return make([]byte, n), nil
}

// AllocPinned allocates n bytes of host memory pinned for d. A size the host cannot
// hold is an out-of-memory error naming it (see Stream.Alloc).
func (d *Device) AllocPinned(n int) (*HostBuffer, error) {
	if err := d.check("AllocPinned"); err != nil {
		return nil, err
	}
	if n < 0 || n > maxBytes {
		return nil, fmt.Errorf("device: AllocPinned(%d): size out of range [0, 2^60]", n)
	}
	h := &HostBuffer{dev: d}
	if d.kind != KindCUDA || n == 0 {
		var err error
		if h.b, err = hostBytes(n); err != nil {
			return nil, fmt.Errorf("device: AllocPinned(%d) on %v: %w", n, d, err)
		}
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

// Bytes returns the buffer's memory (nil once freed, and for a nil buffer).
func (h *HostBuffer) Bytes() []byte {
	if h == nil {
		return nil
	}
	return h.b
}

// Len returns the buffer's size in bytes (0 once freed, and for a nil buffer).
func (h *HostBuffer) Len() int { return len(h.Bytes()) }

// Free releases the buffer. No copy may still be using it. Freeing twice is not an
// error; freeing a nil buffer is.
func (h *HostBuffer) Free() error {
	if h == nil {
		return errors.New("device: HostBuffer.Free: nil buffer")
	}
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
	if h == nil {
		return fmt.Errorf("device: %s: nil host buffer", op)
	}
	if h.freed.Load() {
		return fmt.Errorf("device: %s: host buffer was freed", op)
	}
	if off < 0 || n > len(h.b)-off {
		return fmt.Errorf("device: %s: bytes [%d, %d) out of the host buffer's [0, %d)", op, off, off+n, len(h.b))
	}
	return nil
}

// CopyFromPinned enqueues on s a copy of t.Bytes() bytes from h at byte offset off into
// t, and returns without waiting. h must not change until the copy is done (record an
// event). t cannot alias h.
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
// waiting. Read h only after the copy is done (record an event, or synchronize s). t
// cannot alias h.
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
