package moe

import (
	"fmt"

	"github.com/dropless/dropless/device"
)

// The package's records in a device.Status: domain 3; op opSort, code codeBadIndex,
// values the assignment, its expert index and E. kernels/sort.cu writes the same as
// DL_MOE_STATUS_DOMAIN, DL_MOE_STATUS_SORT and DL_MOE_BAD_INDEX.
const (
	statusDomain = 3
	opSort       = 1
	codeBadIndex = 1
)

func init() { device.RegisterStatus(statusDomain, statusError) }

// statusError returns the error of a record, nil for one it does not know.
func statusError(op, code int, v [3]int64) error {
	if op == opSort && code == codeBadIndex {
		return fmt.Errorf("%w: Sort index holds %d at assignment %d (E = %d)", ErrBadIndex, v[1], v[0], v[2])
	}
	return nil
}
