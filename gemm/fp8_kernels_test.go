package gemm

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
)

func TestFP8KernelsCompile(t *testing.T) { dt.CheckCompiles(t, fp8Program) }
