package device

import (
	"fmt"
	"sync"
)

// Status records the first error that ops found after they returned: invalid group sizes
// checked by kernels on the device, so that the host never waits, or by CPU ops replayed
// from a captured Graph. It holds an I64[4] tensor on one device: word 0 is the record's
// code (0: no error), words 1 to 3 its values. The first error is kept until Reset. A
// Status may be shared by ops on several streams of its device, and by ops of several
// packages.
//
// Kernels record with dl_status_set of dl.cuh and pass the Status to Kernel.Launch as an
// argument; CPU ops call Record. Check turns the record into an error through the decoder
// that the writing package registered with RegisterStatus.
type Status struct {
	t  *Tensor
	mu sync.Mutex // orders CPU records
}

// NewStatus allocates a cleared Status on s's device, enqueued on s.
func NewStatus(s *Stream) (*Status, error) {
	if s == nil {
		return nil, fmt.Errorf("device: NewStatus: nil stream")
	}
	t, err := s.Alloc(I64, 4)
	if err != nil {
		return nil, fmt.Errorf("device: NewStatus: %w", err)
	}
	if err := Fill(s, t, 0); err != nil {
		t.Free()
		return nil, fmt.Errorf("device: NewStatus: %w", err)
	}
	return &Status{t: t}, nil
}

// Check waits for the work enqueued on s and returns the recorded error, if any, as the
// registered decoder of its package words it ("gemm: RaggedDot: sizes[3] = -2 < 0"). The
// record stays until Reset.
func (st *Status) Check(s *Stream) error {
	if err := st.Usable(s, "status"); err != nil {
		return fmt.Errorf("device: Status.Check: %w", err)
	}
	v := make([]int64, 4)
	if err := Download(s, st.t, v); err != nil {
		return fmt.Errorf("device: Status.Check: %w", err)
	}
	return StatusError([4]int64(v))
}

// Reset clears the Status, enqueued on s.
func (st *Status) Reset(s *Stream) error {
	if err := st.Usable(s, "status"); err != nil {
		return fmt.Errorf("device: Status.Reset: %w", err)
	}
	return Fill(s, st.t, 0)
}

// Free releases the Status's memory (see Tensor.Free). Freeing a nil Status does nothing.
func (st *Status) Free() error {
	if st == nil || st.t == nil {
		return nil
	}
	return st.t.Free()
}

// Device returns the Status's device.
func (st *Status) Device() *Device { return st.t.Device() }

// Usable returns an error unless st is a live Status on s's device; what names it in the
// error. Ops call it on a Status argument before they use it.
func (st *Status) Usable(s *Stream, what string) error {
	if st == nil || st.t == nil {
		return fmt.Errorf("device: %s is not from NewStatus", what)
	}
	if s == nil {
		return fmt.Errorf("device: %s used with a nil stream", what)
	}
	return st.t.Check(s, what)
}

// Record stores the record (code, a, b, c) unless a record is already there. It is for
// CPU ops, which run where the Status's memory is: on a GPU Status it is an error.
// code must be nonzero (see StatusCode).
func (st *Status) Record(code, a, b, c int64) error {
	if st == nil || st.t == nil {
		return fmt.Errorf("device: Status.Record: status is not from NewStatus")
	}
	if st.t.Device().IsCUDA() {
		return fmt.Errorf("device: Status.Record: %v is not a CPU status", st.t)
	}
	if code == 0 {
		return fmt.Errorf("device: Status.Record: code 0 records nothing")
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	v := Slice[int64](st.t)
	if v[0] == 0 {
		v[0], v[1], v[2], v[3] = code, a, b, c
	}
	return nil
}

// StatusCode returns word 0 of a record: the package's domain (see RegisterStatus), the
// op (0 to 255) and the error code (1 to 255). DL_STATUS_CODE of dl.cuh is its twin.
func StatusCode(domain, op, code int) int64 {
	return int64(domain)<<16 | int64(op&0xff)<<8 | int64(code&0xff)
}

// A StatusDecoder turns a record of its package into an error: op and code from word 0,
// v from words 1 to 3.
type StatusDecoder func(op, code int, v [3]int64) error

var statusDecoders sync.Map // int → StatusDecoder

// RegisterStatus registers the decoder of the records of domain (1 to 32767), from a
// package's init; registering a domain twice panics, as the package's init is wrong.
// Domains in use: 1 gemm, 2 quant, 3 moe.
func RegisterStatus(domain int, dec StatusDecoder) {
	if domain < 1 || domain > 32767 || dec == nil {
		panic(fmt.Sprintf("device: RegisterStatus(%d): want a domain of 1 to 32767 and a decoder", domain))
	}
	if _, dup := statusDecoders.LoadOrStore(domain, dec); dup {
		panic(fmt.Sprintf("device: RegisterStatus: domain %d registered twice", domain))
	}
}

// StatusError returns the error of a record read from a Status, nil for no record.
func StatusError(v [4]int64) error {
	if v[0] == 0 {
		return nil
	}
	domain, op, code := int(v[0]>>16), int(v[0]>>8&0xff), int(v[0]&0xff)
	if dec, ok := statusDecoders.Load(domain); ok {
		if err := dec.(StatusDecoder)(op, code, [3]int64{v[1], v[2], v[3]}); err != nil {
			return err
		}
	}
	return fmt.Errorf("device: status record %#x (%d, %d, %d) of an unknown kind", v[0], v[1], v[2], v[3])
}
