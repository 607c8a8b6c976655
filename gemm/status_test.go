package gemm

import (
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
)

// TestStatusMessages checks the words of the records that the kernels and the CPU path
// write, decoded by device.StatusError through the package's registered decoder.
func TestStatusMessages(t *testing.T) {
	for _, tc := range []struct {
		name string
		rec  [4]int64
		want string
	}{
		{"negative", sizesRecord(forward, statusNegative, 3, -2, 65536), "gemm: RaggedDot: sizes[3] = -2 < 0"},
		{"overflow", sizesRecord(forward, statusOverflow, 8, 70000, 65536), "gemm: RaggedDot: sizes sum to 70000 > M=65536"},
		{"input_grad", sizesRecord(inputGrad, statusNegative, 0, -1, 40), "gemm: RaggedDotInputGrad: sizes[0] = -1 < 0"},
		{"weight_grad", sizesRecord(weightGrad, statusOverflow, 3, 41, 40), "gemm: RaggedDotWeightGrad: sizes sum to 41 > M=40"},
		{"mxfp8", sizesRecord(mxWeightGrad, statusNegative, 2, -3, 40), "gemm: RaggedDotMXFP8WeightGrad: sizes[2] = -3 < 0"},
		// The word DL_STATUS_CODE(1, 2, 1) of the kernels: domain 1, op 2, code 1.
		{"kernel_word", [4]int64{1<<16 | 2<<8 | 1, 5, -7, 9}, "gemm: RaggedDotInputGrad: sizes[5] = -7 < 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := device.StatusError(tc.rec)
			if err == nil || err.Error() != tc.want {
				t.Errorf("StatusError(%v) = %v, want %q", tc.rec, err, tc.want)
			}
		})
	}
	// A code the package does not write is left to device's wording.
	if err := device.StatusError(sizesRecord(forward, 9, 0, 0, 0)); err == nil || !strings.Contains(err.Error(), "unknown kind") {
		t.Errorf("StatusError of code 9 = %v, want an unknown kind", err)
	}
}
