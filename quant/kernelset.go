package quant

import "github.com/dropless/dropless/internal/kernelset"

// The programs of the quantizations on the GPU, for device.Device.Load.
func init() {
	kernelset.Register(kernelset.QuantMXFP8, nil, kernels)
	kernelset.Register(kernelset.QuantBlockwise, nil, blockwiseKernels)
	kernelset.Register(kernelset.QuantGather, nil, gatherKernels)
}
