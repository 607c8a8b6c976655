package quant

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// The records of invalid group sizes in a device.Status: domain 2, op 1 (Quantize and
// QuantizeInto), code statusNegative or statusSum, value 0 the rows M. kernels/mxfp8.cu writes
// the same as DL_MX_STATUS_DOMAIN and DL_MX_STATUS_OP.
const (
	statusDomain = 2
	opQuantize   = 1
)

func init() { device.RegisterStatus(statusDomain, statusError) }

// statusError returns the error of a record of one of quant's ops: the blockwise
// quantizations' and the gathers' by their own decoders, MXFP8's group-size validation
// here.
func statusError(op, code int, v [3]int64) error {
	switch op {
	case opQuantizeBlockwise, opQuantizeBlockwiseInto, opQuantizeBlockwiseSource:
		return blockwiseStatusError(op, code, v)
	case opGatherBlockwise, opGatherMXFP8:
		return gatherStatusError(op, code, v)
	}
	switch code {
	case statusNegative:
		return errors.New("quant: invalid GroupSizes: a size is negative; the outputs were set to NaN")
	case statusSum:
		return fmt.Errorf("quant: invalid GroupSizes: the sizes do not sum to the %d rows of x; the outputs were set to NaN", v[0])
	}
	return fmt.Errorf("quant: invalid GroupSizes (status %d); the outputs were set to NaN", code)
}

// recordStatus records the group-size validation status code of a CPU quantization of
// m rows in st, unless it is statusOK.
func recordStatus(st *device.Status, code int32, m int) {
	if code != statusOK {
		// st was checked to be a CPU Status by QuantizeInto: Record cannot fail.
		_ = st.Record(device.StatusCode(statusDomain, opQuantize, int(code)), int64(m), 0, 0)
	}
}
