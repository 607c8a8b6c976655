package ep_test

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, ep.Kernels) }
