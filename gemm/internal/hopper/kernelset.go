package hopper

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/kernelset"
)

// The Hopper kernels' programs, for device.Device.Load on the GPUs that run them.
func init() {
	on := func(d *device.Device) bool { return target(d) == nil }
	kernelset.Register(kernelset.Gemm, on, grouped)
	kernelset.Register(kernelset.GemmFP8, on, fp8)
}
