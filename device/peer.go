package device

import (
	"errors"
	"fmt"
	"sync"

	"github.com/dropless/dropless/internal/cuda"
)

// PeerMemory is device memory that other GPUs address directly: kernels of another
// device of this process once it has peer access to the owner (EnablePeerAccess), and
// kernels of another process on the same host that maps it by its Handle
// (OpenPeerMemory). It comes from the driver's allocator, not the stream-ordered pool
// (whose memory peers cannot map this way), and lives until Free. Reads and writes by
// peers go over NVLink or PCIe at the speed of the link.
type PeerMemory struct {
	dev *Device
	ptr cuda.DevicePtr
	n   int

	mu    sync.Mutex
	freed bool
}

// PeerHandle names a PeerMemory to other processes (a CUDA IPC memory handle).
type PeerHandle [64]byte

// AllocPeerMemory allocates n bytes of PeerMemory on d, zeroed. It waits for the
// allocation and the zeroing.
func (d *Device) AllocPeerMemory(n int) (*PeerMemory, error) {
	if err := d.check("AllocPeerMemory"); err != nil {
		return nil, err
	}
	if d.kind != KindCUDA {
		return nil, fmt.Errorf("device: AllocPeerMemory on %v: peer memory is GPU memory", d)
	}
	if n <= 0 || n > maxBytes {
		return nil, fmt.Errorf("device: AllocPeerMemory(%d): want 1 to 2^60 bytes", n)
	}
	m := &PeerMemory{dev: d, n: n}
	err := d.Do(func() error {
		var err error
		if m.ptr, err = cuda.MemAlloc(uint64(n)); err != nil {
			return err
		}
		if err = cuda.MemsetD8Async(m.ptr, 0, uint64(n), d.stream.h); err == nil {
			err = cuda.StreamSynchronize(d.stream.h)
		}
		if err != nil {
			cuda.MemFree(m.ptr)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("device: AllocPeerMemory(%d) on %v: %w", n, d, err)
	}
	return m, nil
}

// Ptr returns the memory's address on its device (0 for nil memory).
func (m *PeerMemory) Ptr() uintptr {
	if m == nil {
		return 0
	}
	return uintptr(m.ptr)
}

// Bytes returns the size of the memory (0 for nil memory).
func (m *PeerMemory) Bytes() int {
	if m == nil {
		return 0
	}
	return m.n
}

// Device returns the device that owns the memory (nil for nil memory).
func (m *PeerMemory) Device() *Device {
	if m == nil {
		return nil
	}
	return m.dev
}

// Handle returns the name another process passes to OpenPeerMemory to map the memory.
// Nil and freed memory have none.
func (m *PeerMemory) Handle() (PeerHandle, error) {
	if m == nil {
		return PeerHandle{}, errors.New("device: PeerMemory.Handle: nil memory")
	}
	m.mu.Lock()
	freed := m.freed
	m.mu.Unlock()
	if freed {
		return PeerHandle{}, errors.New("device: PeerMemory.Handle: memory was freed")
	}
	var h cuda.IPCMemHandle
	err := m.dev.Do(func() error {
		var err error
		h, err = cuda.IpcGetMemHandle(m.ptr)
		return err
	})
	if err != nil {
		return PeerHandle{}, fmt.Errorf("device: PeerMemory.Handle on %v: %w", m.dev, err)
	}
	return PeerHandle(h.Reserved), nil
}

// Free releases the memory. It waits until the device's work that may use it is done
// (the driver synchronizes). Peers must be done with it too. Freeing twice is not an
// error; freeing nil memory is.
func (m *PeerMemory) Free() error {
	if m == nil {
		return errors.New("device: PeerMemory.Free: nil memory")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.freed {
		return nil
	}
	m.freed = true
	return m.dev.Do(func() error { return cuda.MemFree(m.ptr) })
}

// OpenPeerMemory maps into d's address space the PeerMemory that another process on
// this host named by h, and returns its address there and the function that unmaps it
// (call it once the work that uses the address is done). The memory of this process
// cannot be opened this way: use its Ptr on a device with peer access.
func (d *Device) OpenPeerMemory(h PeerHandle) (ptr uintptr, close func() error, err error) {
	if err := d.check("OpenPeerMemory"); err != nil {
		return 0, nil, err
	}
	if d.kind != KindCUDA {
		return 0, nil, fmt.Errorf("device: OpenPeerMemory on %v: peer memory is GPU memory", d)
	}
	var p cuda.DevicePtr
	err = d.Do(func() error {
		var err error
		p, err = cuda.IpcOpenMemHandle(cuda.IPCMemHandle{Reserved: h})
		return err
	})
	if err != nil {
		return 0, nil, fmt.Errorf("device: OpenPeerMemory on %v: %w", d, err)
	}
	var once sync.Once
	return uintptr(p), func() error {
		var err error
		once.Do(func() { err = d.Do(func() error { return cuda.IpcCloseMemHandle(p) }) })
		return err
	}, nil
}

// CanAccessPeer reports whether d's kernels can address peer's memory directly. A
// device can always address its own. A nil device or peer is an error.
func (d *Device) CanAccessPeer(peer *Device) (bool, error) {
	if err := d.check("CanAccessPeer"); err != nil {
		return false, err
	}
	if peer == nil {
		return false, errors.New("device: CanAccessPeer: nil peer")
	}
	if d.kind != KindCUDA || peer.kind != KindCUDA {
		return false, nil
	}
	if d == peer {
		return true, nil
	}
	return cuda.DeviceCanAccessPeer(d.cu, peer.cu)
}

// EnablePeerAccess lets d's kernels read and write memory that the driver's allocator
// gave peer (PeerMemory, not the stream-ordered pool), at peer's addresses. Enabling it
// again, or for d itself, does nothing. It fails when the GPUs cannot.
func (d *Device) EnablePeerAccess(peer *Device) error {
	ok, err := d.CanAccessPeer(peer)
	if err != nil {
		return fmt.Errorf("device: EnablePeerAccess(%v, %v): %w", d, peer, err)
	}
	if !ok {
		return fmt.Errorf("device: %v cannot address the memory of %v (no peer-to-peer path)", d, peer)
	}
	if d == peer {
		return nil
	}
	if err := d.Do(func() error { return cuda.CtxEnablePeerAccess(peer.ctx) }); err != nil {
		return fmt.Errorf("device: EnablePeerAccess(%v, %v): %w", d, peer, err)
	}
	return nil
}

// WrapPeer is Wrap for memory that d's kernels address but another device owns: a
// peer's PeerMemory (with peer access enabled) or one mapped by OpenPeerMemory. The
// tensor is d's, for d's streams; it does not own the memory.
func (d *Device) WrapPeer(ptr uintptr, dt DType, shape ...int) (*Tensor, error) {
	return d.wrap("WrapPeer", ptr, dt, shape, false)
}

// WaitAtLeast makes the work enqueued on s after it wait until the 32-bit word at ptr
// (d's memory or a peer's that d addresses) holds at least v, compared as unsigned. The
// host does not wait. Another device sets the word. Loading a kernel module (a
// program's first launch on a device) waits for all of the device's streams: launch
// the kernels once before a wait that only another device can end.
func (s *Stream) WaitAtLeast(ptr uintptr, v uint32) error {
	if err := s.live("WaitAtLeast"); err != nil {
		return err
	}
	if s.dev.kind != KindCUDA {
		return fmt.Errorf("device: WaitAtLeast on %v: a wait on device memory", s.dev)
	}
	if ptr == 0 {
		return errors.New("device: WaitAtLeast: nil device pointer")
	}
	return s.dev.Do(func() error {
		ok, err := cuda.StreamWaitValueGEQ(s.h, cuda.DevicePtr(ptr), v)
		if err == nil && !ok {
			err = errors.New("the CUDA driver lacks cuStreamWaitValue32")
		}
		if err != nil {
			return fmt.Errorf("device: WaitAtLeast on %v: %w", s.dev, err)
		}
		return nil
	})
}

// CanWaitOnMemory reports whether streams of d support WaitAtLeast.
func (d *Device) CanWaitOnMemory() bool {
	return d.IsCUDA() && cuda.HasStreamWaitValue()
}
