package cu

import (
	"fmt"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/dropless/dropless/device"
)

// gpu returns an error of fn unless d is a CUDA device; what names d in the error.
func gpu(fn, what string, d *device.Device) error {
	if d == nil {
		return fmt.Errorf("cu: %s: %s is nil", fn, what)
	}
	if !d.IsCUDA() {
		return fmt.Errorf("cu: %s: %s is %v: want a CUDA device", fn, what, d)
	}
	return nil
}

// Device returns the cu.Device of the GPU d.
func Device(d *device.Device) (cu.Device, error) {
	if err := gpu("Device", "d", d); err != nil {
		return cu.BadDevice, err
	}
	dev, err := cu.GetDevice(d.Ordinal())
	if err != nil {
		return cu.BadDevice, fmt.Errorf("cu: Device: %v: %w", d, err)
	}
	return dev, nil
}

// Context returns the primary context of the GPU d, the context of every dropless call
// on d. Make it current on a locked OS thread (runtime.LockOSThread, then
// cu.SetCurrentContext) before calling cu there, or call cu inside d.Do, which does both.
// dropless holds the context for the life of the process: Context retains nothing, and
// the context must not be released, reset or destroyed.
func Context(d *device.Device) (cu.CUContext, error) {
	var ctx cu.CUContext
	if err := gpu("Context", "d", d); err != nil {
		return ctx, err
	}
	err := d.Do(func() error {
		var err error
		ctx, err = cu.CurrentContext()
		return err
	})
	if err != nil {
		return cu.CUContext{}, fmt.Errorf("cu: Context: %v: %w", d, err)
	}
	return ctx, nil
}

// Wrap returns a tensor of dtype dt and shape over the memory at p on the GPU d, without
// a copy: memory that cu allocated (cu.MemAlloc) in d's primary context, p being the
// allocation's start or an address inside it. The tensor's elements must lie within the
// allocation. The memory stays cu's: the tensor's Free does nothing, and the caller
// frees it with cu.MemFree once the work that uses the tensor, on any stream, is done.
func Wrap(d *device.Device, p cu.DevicePtr, dt device.DType, shape ...int) (*device.Tensor, error) {
	if err := gpu("Wrap", "d", d); err != nil {
		return nil, err
	}
	if p == 0 {
		return nil, fmt.Errorf("cu: Wrap: p is 0: want device memory from cu.MemAlloc")
	}
	t, err := d.Wrap(uintptr(p), dt, shape...)
	if err != nil {
		return nil, fmt.Errorf("cu: Wrap: %w", err)
	}
	var base cu.DevicePtr
	var size int64
	var ctx, primary uintptr
	err = d.Do(func() error {
		var err error
		if ctx, err = pointerContext(uintptr(p)); err != nil {
			return err
		}
		if primary, err = currentContext(); err != nil {
			return err
		}
		size, base, err = p.AddressRange()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("cu: Wrap: %v on %v: %w", p, d, err)
	}
	// Memory from a stream-ordered pool or the virtual memory calls has no context.
	if ctx != 0 && ctx != primary {
		return nil, fmt.Errorf("cu: Wrap: %v belongs to context %#x, not to %v's primary context %#x: allocate it with the primary context current (see Context)", p, ctx, d, primary)
	}
	if end := int64(p-base) + int64(t.Bytes()); end > size {
		return nil, fmt.Errorf("cu: Wrap: %v%v needs %d bytes from %v, the allocation holds %d bytes from %v", dt, shape, t.Bytes(), p, size, base)
	}
	return t, nil
}

// Ptr returns the device address of t's first element as a cu.DevicePtr, for cu calls
// in t's device's primary context. The memory stays dropless's: it is valid until t's
// storage is freed (Tensor.Free, in stream order on the stream that allocated t, so cu
// work on other streams must be ordered before that stream's free), and cu must not free
// it. t must be a live GPU tensor with at least one element.
func Ptr(t *device.Tensor) (cu.DevicePtr, error) {
	switch {
	case t == nil || t.Device() == nil:
		return 0, fmt.Errorf("cu: Ptr: t is nil")
	case !t.Device().IsCUDA():
		return 0, fmt.Errorf("cu: Ptr: t is %v: want a tensor on a CUDA device", t)
	case t.Freed():
		return 0, fmt.Errorf("cu: Ptr: t %v was freed", t)
	case t.Ptr() == 0:
		return 0, fmt.Errorf("cu: Ptr: t %v holds no device memory", t)
	}
	return cu.DevicePtr(t.Ptr()), nil
}

// WrapStream returns a *device.Stream for the cu stream s of the GPU d, without a new
// CUDA stream: dropless ops enqueued on the result are ordered with cu's work on s.
// s must have been created (cu.MakeStream) with d's primary context current. Closing the
// result ends the *device.Stream only; the CUDA stream stays cu's, destroyed by its
// creator (Stream.Destroy) once no dropless work on it is pending.
func WrapStream(d *device.Device, s cu.Stream) (*device.Stream, error) {
	if err := gpu("WrapStream", "d", d); err != nil {
		return nil, err
	}
	h := streamHandle(s)
	if h == 0 {
		return nil, fmt.Errorf("cu: WrapStream: s is the zero cu.Stream (CUDA's legacy stream): want a stream from cu.MakeStream")
	}
	var ctx, primary uintptr
	err := d.Do(func() error {
		var err error
		if ctx, err = streamContext(h); err != nil {
			return err
		}
		primary, err = currentContext()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("cu: WrapStream: stream %#x on %v: %w", h, d, err)
	}
	if ctx != primary {
		return nil, fmt.Errorf("cu: WrapStream: stream %#x belongs to context %#x, not to %v's primary context %#x: create it with the primary context current (see Context)", h, ctx, d, primary)
	}
	ds, err := d.WrapStream(h)
	if err != nil {
		return nil, fmt.Errorf("cu: WrapStream: %w", err)
	}
	return ds, nil
}

// Stream returns the CUDA stream of s, a stream of a GPU, as a cu.Stream, for cu calls in
// the GPU's primary context: cu work enqueued on it is ordered with dropless's on s.
// The stream stays dropless's: it is valid until s is closed, and cu must not destroy
// it. s must not be closed.
func Stream(s *device.Stream) (cu.Stream, error) {
	if s == nil {
		return cu.Stream{}, fmt.Errorf("cu: Stream: s is nil")
	}
	d := s.Device()
	if !d.IsCUDA() {
		return cu.Stream{}, fmt.Errorf("cu: Stream: s is a %v stream: want a stream of a CUDA device", d)
	}
	if s.Closed() {
		return cu.Stream{}, fmt.Errorf("cu: Stream: s was closed")
	}
	if s.Handle() == 0 {
		return cu.Stream{}, fmt.Errorf("cu: Stream: s wraps CUDA's legacy stream: want a stream with a handle")
	}
	return makeStream(s.Handle()), nil
}

// cu.Stream is a struct of one CUstream; makeStream and streamHandle depend on it.
var _ = [1]struct{}{}[unsafe.Sizeof(cu.Stream{})-unsafe.Sizeof(uintptr(0))]

// streamHandle returns the CUstream of s as an address.
func streamHandle(s cu.Stream) uintptr { return uintptr(unsafe.Pointer(s.C())) }

// makeStream returns the cu.Stream of the CUstream h. cu has no constructor from a
// handle: its Stream holds the handle as its only field.
func makeStream(h uintptr) cu.Stream {
	var s cu.Stream
	*(*uintptr)(unsafe.Pointer(&s)) = h
	return s
}
