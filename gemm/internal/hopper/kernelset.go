package hopper

import "github.com/dropless/dropless/internal/kernelset"

// The Hopper kernels' programs, for device.Device.Load on sm_90 GPUs.
func init() {
	kernelset.Register(kernelset.Gemm, kernelset.Hopper, grouped)
	kernelset.Register(kernelset.GemmFP8, kernelset.Hopper, fp8)
}
