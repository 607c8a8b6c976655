package device

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/dropless/dropless/internal/cuda"
)

// storage is the memory behind one or more tensors.
type storage struct {
	dev    *Device
	host   []byte         // CPU memory
	ptr    cuda.DevicePtr // GPU memory
	nbytes int
	stream *Stream // the stream it was allocated on; frees go there
	owned  bool    // false for wrapped foreign pointers
	freed  atomic.Bool
}

// Tensor is a dense row-major array of one dtype on one device. A tensor may be a view
// into another's storage (see View). Tensors on a GPU hold stream-ordered memory: free
// them with Free; CPU tensors are garbage collected.
type Tensor struct {
	dtype DType
	shape []int
	n     int // elements
	st    *storage
	off   int // bytes from the start of st
}

// maxBytes bounds a tensor's size so byte counts never overflow.
const maxBytes = 1 << 60

// numel checks shape and returns its element count.
func numel(dt DType, shape []int) (int, error) {
	if !dt.Valid() {
		return 0, fmt.Errorf("device: invalid dtype %v", dt)
	}
	n := 1
	for i, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("device: shape %v: dimension %d is negative", shape, i)
		}
		if d != 0 && n > maxBytes/dt.Size()/d {
			return 0, fmt.Errorf("device: shape %v of %v overflows: more than 2^60 bytes", shape, dt)
		}
		n *= d
	}
	return n, nil
}

// Alloc returns an uninitialised tensor of the given dtype and shape on s's device,
// allocated in stream order on s (on the CPU: zeroed Go memory). A size the device
// cannot hold is an out-of-memory error naming it; on the CPU that is a size over the
// host's memory, as far as the system tells, since Go ends the process on an allocation
// it cannot meet.
func (s *Stream) Alloc(dt DType, shape ...int) (*Tensor, error) {
	if err := s.live("Alloc"); err != nil {
		return nil, err
	}
	n, err := numel(dt, shape)
	if err != nil {
		return nil, err
	}
	nb := n * dt.Size()
	st := &storage{dev: s.dev, nbytes: nb, stream: s, owned: true}
	if s.dev.kind != KindCUDA {
		st.host, err = hostBytes(nb)
	} else if nb > 0 {
		err = s.dev.Do(func() error {
			var err error
			st.ptr, err = cuda.MemAllocAsync(uint64(nb), s.h)
			return err
		})
	}
	if err != nil {
		return nil, fmt.Errorf("device: Alloc %v %v (%d bytes) on %v: %w", dt, shape, nb, s.dev, err)
	}
	return &Tensor{dtype: dt, shape: append([]int(nil), shape...), n: n, st: st}, nil
}

// Alloc is d.Stream().Alloc.
func (d *Device) Alloc(dt DType, shape ...int) (*Tensor, error) {
	if err := d.check("Alloc"); err != nil {
		return nil, err
	}
	return d.Stream().Alloc(dt, shape...)
}

// Wrap returns a tensor over size bytes of device memory at ptr that something else
// allocated (gorgonia.org/cu, another binding) on d, without copying. The tensor does not
// own the memory: Free does nothing and the caller keeps the memory alive.
func (d *Device) Wrap(ptr uintptr, dt DType, shape ...int) (*Tensor, error) {
	return d.wrap("Wrap", ptr, dt, shape, true)
}

// wrap makes the tensor of Wrap (own is true: ptr must be d's memory) and WrapPeer.
func (d *Device) wrap(what string, ptr uintptr, dt DType, shape []int, own bool) (*Tensor, error) {
	if err := d.check(what); err != nil {
		return nil, err
	}
	if d.kind != KindCUDA {
		return nil, fmt.Errorf("device: %s on %v: foreign pointers are CUDA device pointers", what, d)
	}
	n, err := numel(dt, shape)
	if err != nil {
		return nil, err
	}
	if ptr == 0 && n > 0 {
		return nil, fmt.Errorf("device: %s: nil device pointer", what)
	}
	if own && n > 0 {
		var ord int
		err := d.Do(func() error {
			var err error
			ord, err = cuda.PointerDeviceOrdinal(cuda.DevicePtr(ptr))
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("device: %s: %#x is not device memory: %w", what, ptr, err)
		}
		if ord != d.ordinal {
			return nil, fmt.Errorf("device: %s: %#x belongs to cuda:%d, not %v", what, ptr, ord, d)
		}
	}
	st := &storage{dev: d, ptr: cuda.DevicePtr(ptr), nbytes: n * dt.Size(), stream: d.stream}
	return &Tensor{dtype: dt, shape: append([]int(nil), shape...), n: n, st: st}, nil
}

// Free releases the tensor's memory in stream order on the stream that allocated it,
// so work enqueued before on that stream still sees it. Work on other streams must be
// ordered before it by the caller (Stream.Wait). Free on a view frees the whole storage.
// Using a freed tensor is an error; freeing twice is not. Freeing a nil tensor, or one
// whose allocating stream was closed (free it with FreeOn), is an error.
func (t *Tensor) Free() error {
	if !t.ok() {
		return errors.New("device: Free: nil tensor")
	}
	st := t.st
	if !st.owned || st.freed.Load() {
		return nil
	}
	if st.stream.closed.Load() {
		return fmt.Errorf("device: Free of %v: the stream that allocated it was closed (use FreeOn)", t)
	}
	return t.FreeOn(st.stream)
}

// FreeOn is Free ordered on s instead of the allocating stream.
func (t *Tensor) FreeOn(s *Stream) error {
	if !t.ok() {
		return errors.New("device: FreeOn: nil tensor")
	}
	if err := s.live("FreeOn"); err != nil {
		return err
	}
	st := t.st
	if s.dev != st.dev {
		return fmt.Errorf("device: FreeOn: tensor on %v, stream on %v", st.dev, s.dev)
	}
	if !st.owned || st.freed.Swap(true) {
		return nil
	}
	if st.dev.kind != KindCUDA {
		st.host = nil
		return nil
	}
	if st.nbytes == 0 {
		return nil
	}
	return st.dev.Do(func() error { return cuda.MemFreeAsync(st.ptr, s.h) })
}

// ok reports whether t is a tensor made by this package, not nil nor a zero Tensor.
// The accessors below return zero values for the others.
func (t *Tensor) ok() bool { return t != nil && t.st != nil }

// DType returns the element type (Invalid for a nil tensor).
func (t *Tensor) DType() DType {
	if !t.ok() {
		return Invalid
	}
	return t.dtype
}

// Shape returns a copy of the shape (nil for a nil tensor).
func (t *Tensor) Shape() []int {
	if !t.ok() {
		return nil
	}
	return append([]int(nil), t.shape...)
}

// Rank returns the number of dimensions (0 for a nil tensor).
func (t *Tensor) Rank() int {
	if !t.ok() {
		return 0
	}
	return len(t.shape)
}

// Dim returns the size of dimension i; negative i counts from the end, -1 being the
// last. It returns 0 for a dimension t does not have (i ≥ Rank or i < -Rank) and for a
// nil tensor: check i against Rank where 0 would be taken for a size.
func (t *Tensor) Dim(i int) int {
	if !t.ok() {
		return 0
	}
	if i < 0 {
		i += len(t.shape)
	}
	if i < 0 || i >= len(t.shape) {
		return 0
	}
	return t.shape[i]
}

// Len returns the number of elements (0 for a nil tensor).
func (t *Tensor) Len() int {
	if !t.ok() {
		return 0
	}
	return t.n
}

// Bytes returns the size of the data in bytes (0 for a nil tensor).
func (t *Tensor) Bytes() int {
	if !t.ok() {
		return 0
	}
	return t.n * t.dtype.Size()
}

// Device returns the tensor's device (nil for a nil tensor).
func (t *Tensor) Device() *Device {
	if !t.ok() {
		return nil
	}
	return t.st.dev
}

// Freed reports whether the tensor's storage was freed (false for a nil tensor).
func (t *Tensor) Freed() bool { return t.ok() && t.st.freed.Load() }

// String describes the tensor: "bf16[4096 7168]@cuda:0" ("<nil>" for a nil tensor).
func (t *Tensor) String() string {
	if !t.ok() {
		return "<nil>"
	}
	return fmt.Sprintf("%v%v@%v", t.dtype, t.shape, t.st.dev)
}

// Ptr returns the device address of the first element (0 for CPU and nil tensors), for
// passing to other bindings.
func (t *Tensor) Ptr() uintptr {
	if !t.ok() || t.st.dev.kind != KindCUDA {
		return 0
	}
	return uintptr(t.st.ptr) + uintptr(t.off)
}

// Aligned reports whether each tensor of ts that is not nil starts on a multiple of n
// bytes on its GPU (Ptr), as loads and stores n bytes wide need: kernels choose their
// access width by it. CPU tensors, whose Ptr is 0, count as aligned. An n below 1 is no
// alignment: false.
func Aligned(n int, ts ...*Tensor) bool {
	if n < 1 {
		return false
	}
	for _, t := range ts {
		if t != nil && t.Ptr()%uintptr(n) != 0 {
			return false
		}
	}
	return true
}

// HostBytes returns the CPU tensor's bytes, aliasing its storage; nil for GPU, freed
// and nil tensors.
func (t *Tensor) HostBytes() []byte {
	if !t.ok() || t.st.dev.kind == KindCUDA || t.st.host == nil {
		return nil
	}
	return t.st.host[t.off : t.off+t.Bytes()]
}

// Elem is a Go type that can stand for a dtype's raw elements.
type Elem interface {
	~float32 | ~uint16 | ~uint8 | ~int8 | ~int32 | ~uint32 | ~int64 | ~uint64
}

// Slice returns a CPU tensor's elements as a []T aliasing its storage. T's size must
// be the dtype's size (float32 for F32, uint16 for BF16 and F16, uint8 for the 8-bit
// types, int32 for I32, int64 for I64). It panics for nil and GPU tensors and size
// mismatches: it is the accessor of CPU kernels, which have checked all three (with
// Tensor.Check and the dtype).
func Slice[T Elem](t *Tensor) []T {
	var z T
	if !t.ok() {
		panic(fmt.Sprintf("device.Slice: []%T of a nil tensor", z))
	}
	if int(unsafe.Sizeof(z)) != t.dtype.Size() {
		panic(fmt.Sprintf("device.Slice: %T for %v elements", z, t.dtype))
	}
	b := t.HostBytes()
	if b == nil {
		if t.st.dev.kind == KindCUDA {
			panic("device.Slice: tensor " + t.String() + " is not on the CPU")
		}
		return nil
	}
	if len(b) == 0 {
		return []T{}
	}
	return unsafe.Slice((*T)(unsafe.Pointer(&b[0])), t.n)
}

// viewable returns an error unless t is a live tensor to take views of; op names the caller.
func (t *Tensor) viewable(op string) error {
	if !t.ok() {
		return fmt.Errorf("device: %s of a nil tensor", op)
	}
	if t.st.freed.Load() {
		return fmt.Errorf("device: %s of %v: tensor was freed", op, t)
	}
	return nil
}

// View returns a tensor of the given shape over t's storage, starting offset elements
// into t. It must lie within t.
func (t *Tensor) View(offset int, shape ...int) (*Tensor, error) {
	if err := t.viewable("View"); err != nil {
		return nil, err
	}
	n, err := numel(t.dtype, shape)
	if err != nil {
		return nil, err
	}
	if offset < 0 || offset > t.n || n > t.n-offset {
		return nil, fmt.Errorf("device: View(%d, %v) of %v: elements [%d, %d) out of [0, %d)", offset, shape, t, offset, offset+n, t.n)
	}
	return &Tensor{dtype: t.dtype, shape: append([]int(nil), shape...), n: n, st: t.st, off: t.off + offset*t.dtype.Size()}, nil
}

// Reshape returns a view of t with another shape of the same element count.
func (t *Tensor) Reshape(shape ...int) (*Tensor, error) {
	if err := t.viewable("Reshape"); err != nil {
		return nil, err
	}
	n, err := numel(t.dtype, shape)
	if err != nil {
		return nil, err
	}
	if n != t.n {
		return nil, fmt.Errorf("device: Reshape %v to %v: %d elements, want %d", t, shape, n, t.n)
	}
	return t.View(0, shape...)
}

// Rows returns rows [lo, hi) of t along its first dimension, as a view.
func (t *Tensor) Rows(lo, hi int) (*Tensor, error) {
	if err := t.viewable("Rows"); err != nil {
		return nil, err
	}
	if len(t.shape) == 0 || lo < 0 || hi < lo || hi > t.shape[0] {
		return nil, fmt.Errorf("device: Rows(%d, %d) of %v", lo, hi, t)
	}
	inner := 1
	if t.shape[0] > 0 {
		inner = t.n / t.shape[0]
	}
	shape := append([]int{hi - lo}, t.shape[1:]...)
	return t.View(lo*inner, shape...)
}

// usable checks that t may be used on s: both not nil, s not closed, t not freed and
// on s's device.
func (t *Tensor) usable(s *Stream, what string) error {
	if !t.ok() {
		return fmt.Errorf("device: %s is nil", what)
	}
	if err := s.live(what); err != nil {
		return err
	}
	if t.st.freed.Load() {
		return fmt.Errorf("device: %s %v was freed", what, t)
	}
	if t.st.dev != s.dev {
		return fmt.Errorf("device: %s is on %v, the stream on %v", what, t.st.dev, s.dev)
	}
	return nil
}

// Check returns an error unless t is a live tensor on s's device and s a stream that is
// not closed; what names t in the error. Ops of other packages call it on each operand.
func (t *Tensor) Check(s *Stream, what string) error { return t.usable(s, what) }

func (t *Tensor) dptr() cuda.DevicePtr { return t.st.ptr + cuda.DevicePtr(t.off) }

// CopyFromHost copies len(src) bytes, which must be t.Bytes(), into t. It is ordered
// after the work on s and returns when the copy is done; src may then be reused. src may
// alias t's own bytes (HostBytes).
func (t *Tensor) CopyFromHost(s *Stream, src []byte) error {
	if err := t.usable(s, "CopyFromHost destination"); err != nil {
		return err
	}
	if len(src) != t.Bytes() {
		return fmt.Errorf("device: CopyFromHost: %d bytes into %v, which holds %d", len(src), t, t.Bytes())
	}
	if len(src) == 0 {
		return nil
	}
	return s.run(func() { copy(t.HostBytes(), src) }, func() error {
		if err := cuda.MemcpyHtoDAsync(t.dptr(), unsafe.Pointer(&src[0]), uint64(len(src)), s.h); err != nil {
			return err
		}
		return cuda.StreamSynchronize(s.h)
	})
}

// CopyToHost copies t into dst, which must hold t.Bytes() bytes. It waits for the work
// on s before it and returns when dst holds the data. dst may alias t's own bytes.
func (t *Tensor) CopyToHost(s *Stream, dst []byte) error {
	if err := t.usable(s, "CopyToHost source"); err != nil {
		return err
	}
	if len(dst) != t.Bytes() {
		return fmt.Errorf("device: CopyToHost: %v holds %d bytes, destination %d", t, t.Bytes(), len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	if s.dev.kind != KindCUDA && s.isCapturing() {
		return errors.New("device: CopyToHost on a capturing CPU stream")
	}
	return s.run(func() { copy(dst, t.HostBytes()) }, func() error {
		if err := cuda.MemcpyDtoHAsync(unsafe.Pointer(&dst[0]), t.dptr(), uint64(len(dst)), s.h); err != nil {
			return err
		}
		return cuda.StreamSynchronize(s.h)
	})
}

func asBytes[T Elem](v []T) []byte {
	if len(v) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*int(unsafe.Sizeof(z)))
}

// Upload copies raw elements into t (see Slice for which T fits which dtype); len(src)
// must be t.Len(). It returns when the copy is done. src may alias t's own elements.
func Upload[T Elem](s *Stream, t *Tensor, src []T) error {
	if err := t.usable(s, "Upload destination"); err != nil {
		return err
	}
	var z T
	if int(unsafe.Sizeof(z)) != t.dtype.Size() {
		return fmt.Errorf("device: Upload of []%T into %v: element sizes differ", z, t)
	}
	if len(src) != t.n {
		return fmt.Errorf("device: Upload of %d elements into %v (%d)", len(src), t, t.n)
	}
	return t.CopyFromHost(s, asBytes(src))
}

// Download copies t's raw elements into dst; len(dst) must be t.Len(). dst may alias
// t's own elements.
func Download[T Elem](s *Stream, t *Tensor, dst []T) error {
	if err := t.usable(s, "Download source"); err != nil {
		return err
	}
	var z T
	if int(unsafe.Sizeof(z)) != t.dtype.Size() {
		return fmt.Errorf("device: Download of %v into []%T: element sizes differ", t, z)
	}
	if len(dst) != t.n {
		return fmt.Errorf("device: Download of %v (%d elements) into %d", t, t.n, len(dst))
	}
	return t.CopyToHost(s, asBytes(dst))
}

// FromSlice allocates a tensor of dtype dt and shape on s's device holding a copy of
// data's raw elements: the tensor does not alias data. T's size must match dt (see Slice).
func FromSlice[T Elem](s *Stream, dt DType, data []T, shape ...int) (*Tensor, error) {
	t, err := s.Alloc(dt, shape...)
	if err != nil {
		return nil, err
	}
	if err := Upload(s, t, data); err != nil {
		t.Free()
		return nil, err
	}
	return t, nil
}

// FromFloat32 allocates a tensor of dtype dt and shape on s's device holding data
// converted to dt (round to nearest even, saturating as dt's conversion says). The
// tensor does not alias data.
func FromFloat32(s *Stream, dt DType, data []float32, shape ...int) (*Tensor, error) {
	t, err := s.Alloc(dt, shape...)
	if err != nil {
		return nil, err
	}
	if err := t.SetFloat32(s, data); err != nil {
		t.Free()
		return nil, err
	}
	return t, nil
}

// SetFloat32 writes data, converted to t's dtype, into t; len(data) must be t.Len().
// data is converted into a buffer of its own first, so it may alias t's bytes.
func (t *Tensor) SetFloat32(s *Stream, data []float32) error {
	if err := t.usable(s, "SetFloat32 destination"); err != nil {
		return err
	}
	if len(data) != t.n {
		return fmt.Errorf("device: SetFloat32: %d values into %v (%d elements)", len(data), t, t.n)
	}
	b := make([]byte, t.Bytes())
	EncodeFloat32(t.dtype, b, data)
	return t.CopyFromHost(s, b)
}

// Float32s returns t's elements converted to float32 (exactly for every dtype but I64
// beyond 2^24, which rounds to nearest even). It waits for the work on s. The result is
// a new slice: it does not alias t.
func (t *Tensor) Float32s(s *Stream) ([]float32, error) {
	if err := t.usable(s, "Float32s source"); err != nil {
		return nil, err
	}
	b := make([]byte, t.Bytes())
	if err := t.CopyToHost(s, b); err != nil {
		return nil, err
	}
	out := make([]float32, t.n)
	DecodeFloat32(t.dtype, out, b)
	return out, nil
}

// checkSameLen returns an error unless dst and src have the same element count.
func checkSameLen(op string, dst, src *Tensor) error {
	if dst.n != src.n {
		return fmt.Errorf("device: %s: destination %v has %d elements, source %v has %d", op, dst, dst.n, src, src.n)
	}
	return nil
}
