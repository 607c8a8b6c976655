package moe

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, programs()...) }
