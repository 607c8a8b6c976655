package gemm_test

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, gemm.Program) }
