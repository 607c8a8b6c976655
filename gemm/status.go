package gemm

import (
	"fmt"
	"sync"

	"github.com/dropless/dropless/device"
)

// Status records the first invalid group sizes that a call met, for calls whose sizes
// are checked after the call returned: every GPU call (the kernels check them on the
// device, so that the host never waits) and CPU calls replayed from a captured Graph.
// It holds an I64[4] tensor on one device; the first error is kept until Reset. A
// Status may be shared by calls on several streams of its device.
type Status struct {
	t *device.Tensor
}

// Status codes, in the first word of the tensor; the op is in bits 8 and up.
const (
	statusNegative = 1 // sizes[g] < 0
	statusOverflow = 2 // sum(sizes) > M
)

// NewStatus allocates a cleared Status on s's device, enqueued on s.
func NewStatus(s *device.Stream) (*Status, error) {
	t, err := s.Alloc(device.I64, 4)
	if err != nil {
		return nil, fmt.Errorf("gemm: NewStatus: %w", err)
	}
	if err := device.Fill(s, t, 0); err != nil {
		t.Free()
		return nil, fmt.Errorf("gemm: NewStatus: %w", err)
	}
	return &Status{t: t}, nil
}

// Check waits for the work enqueued on s and returns the recorded error, if any:
// "gemm: RaggedDot: sizes sum to 70000 > M=65536" or "gemm: RaggedDot: sizes[3] = -2 < 0".
// The record stays until Reset.
func (st *Status) Check(s *device.Stream) error {
	if err := st.usable(s); err != nil {
		return fmt.Errorf("gemm: Status.Check: %w", err)
	}
	v := make([]int64, 4)
	if err := device.Download(s, st.t, v); err != nil {
		return fmt.Errorf("gemm: Status.Check: %w", err)
	}
	return statusError(v)
}

// Reset clears the Status, enqueued on s.
func (st *Status) Reset(s *device.Stream) error {
	if err := st.usable(s); err != nil {
		return fmt.Errorf("gemm: Status.Reset: %w", err)
	}
	return device.Fill(s, st.t, 0)
}

// Free releases the Status's memory (see device.Tensor.Free).
func (st *Status) Free() error {
	if st == nil || st.t == nil {
		return nil
	}
	return st.t.Free()
}

func (st *Status) usable(s *device.Stream) error {
	if st == nil || st.t == nil {
		return fmt.Errorf("status is not from NewStatus")
	}
	return st.t.Check(s, "status")
}

// statusError decodes a status record.
func statusError(v []int64) error {
	if v[0] == 0 {
		return nil
	}
	op := form(v[0] >> 8)
	switch v[0] & 0xff {
	case statusNegative:
		return fmt.Errorf("gemm: %v: sizes[%d] = %d < 0", op, v[1], v[2])
	case statusOverflow:
		return fmt.Errorf("gemm: %v: sizes sum to %d > M=%d", op, v[2], v[3])
	}
	return fmt.Errorf("gemm: unknown status %#x", v[0])
}

// cpuStatus is the CPU device's own status: invalid sizes met by CPU calls replayed
// from a captured Graph when the call named no Status.
var cpuStatus struct {
	sync.Mutex
	v [4]int64
}

// record stores the error (code, group, value) of op in st, or in the device's own
// status when st is nil, unless an error is already recorded there. CPU only.
func record(st *Status, op form, code, g, value, m int64) {
	v := [4]int64{code | int64(op)<<8, g, value, m}
	if st != nil {
		d := device.Slice[int64](st.t)
		if d[0] == 0 {
			copy(d, v[:])
		}
		return
	}
	cpuStatus.Lock()
	if cpuStatus.v[0] == 0 {
		cpuStatus.v = v
	}
	cpuStatus.Unlock()
}

// CheckStatus waits for the work enqueued on s and returns the error recorded in the
// device's own status: the invalid sizes met by calls on s's device that named no
// Options.Status, on any stream (see Status.Check). On the CPU it reports only calls
// replayed from captured Graphs; direct CPU calls return their error.
func CheckStatus(s *device.Stream) error {
	if s == nil {
		return fmt.Errorf("gemm: CheckStatus: nil stream")
	}
	if !s.Device().IsCUDA() {
		cpuStatus.Lock()
		v := cpuStatus.v
		cpuStatus.Unlock()
		return statusError(v[:])
	}
	k, err := s.Device().Kernel(Program, "dl_gemm_status_read")
	if err != nil {
		return err
	}
	t, err := s.Alloc(device.I64, 4)
	if err != nil {
		return fmt.Errorf("gemm: CheckStatus: %w", err)
	}
	defer t.Free()
	if err := k.Launch(s, device.D1(1), device.D1(32), 0, t); err != nil {
		return fmt.Errorf("gemm: CheckStatus: %w", err)
	}
	v := make([]int64, 4)
	if err := device.Download(s, t, v); err != nil {
		return fmt.Errorf("gemm: CheckStatus: %w", err)
	}
	return statusError(v)
}

// ResetStatus clears the device's own status, enqueued on s.
func ResetStatus(s *device.Stream) error {
	if s == nil {
		return fmt.Errorf("gemm: ResetStatus: nil stream")
	}
	if !s.Device().IsCUDA() {
		return s.EnqueueCPU(func() {
			cpuStatus.Lock()
			cpuStatus.v = [4]int64{}
			cpuStatus.Unlock()
		})
	}
	k, err := s.Device().Kernel(Program, "dl_gemm_status_reset")
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(1), device.D1(32), 0)
}
