package gemm

import (
	"fmt"
	"sync"

	"github.com/dropless/dropless/device"
)

// Invalid sizes are recorded in a device.Status (Options.Status, else the device's own)
// as records of the package's domain: word 0 is device.StatusCode(statusDomain, op,
// code) with op the call's form, the values follow the code. kernels/gemm.cu
// (DL_GEMM_DOMAIN) and the Hopper kernels write the same records.
const (
	statusDomain   = 1
	statusNegative = 1 // sizes[g] < 0: values g, sizes[g], M
	statusOverflow = 2 // sum(sizes) > M: values G, the sum, M
)

func init() { device.RegisterStatus(statusDomain, decodeStatus) }

// decodeStatus words a record of the package: "gemm: RaggedDot: sizes[3] = -2 < 0" or
// "gemm: RaggedDot: sizes sum to 70000 > M=65536"; nil for a code it does not know.
func decodeStatus(op, code int, v [3]int64) error {
	switch code {
	case statusNegative:
		return fmt.Errorf("gemm: %v: sizes[%d] = %d < 0", form(op), v[0], v[1])
	case statusOverflow:
		return fmt.Errorf("gemm: %v: sizes sum to %d > M=%d", form(op), v[1], v[2])
	}
	return nil
}

// sizesRecord returns the status record of invalid sizes met by op.
func sizesRecord(op form, code, g, value, m int64) [4]int64 {
	return [4]int64{device.StatusCode(statusDomain, int(op), int(code)), g, value, m}
}

// cpuStatus is the CPU device's own status: invalid sizes met by CPU calls replayed
// from a captured Graph when the call named no Status.
var cpuStatus struct {
	sync.Mutex
	v [4]int64
}

// record stores the error (code, group, value) of op in st, or in the device's own
// status when st is nil, unless an error is already recorded there. CPU only.
func record(st *device.Status, op form, code, g, value, m int64) {
	v := sizesRecord(op, code, g, value, m)
	if st != nil {
		// check made st a Status of the call's CPU device, so Record fails only for a
		// Status freed since the capture; a replayed call has nobody to tell.
		_ = st.Record(v[0], v[1], v[2], v[3])
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
// Options.Status, on any stream (see device.Status.Check). On the CPU it reports only
// calls replayed from captured Graphs; direct CPU calls return their error.
func CheckStatus(s *device.Stream) error {
	if s == nil {
		return fmt.Errorf("gemm: CheckStatus: nil stream")
	}
	if !s.Device().IsCUDA() {
		cpuStatus.Lock()
		v := cpuStatus.v
		cpuStatus.Unlock()
		return device.StatusError(v)
	}
	k, err := s.Device().Kernel(program, "dl_gemm_status_read")
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
	return device.StatusError([4]int64(v))
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
	k, err := s.Device().Kernel(program, "dl_gemm_status_reset")
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(1), device.D1(32), 0)
}
