package gemm

import "github.com/dropless/dropless/internal/kernelset"

// The programs of ragged_dot on the GPU, for device.Device.Load; the Hopper kernels'
// register in package hopper.
func init() {
	kernelset.Register(kernelset.Gemm, nil, program)
	kernelset.Register(kernelset.GemmFP8, nil, fp8Program)
}
