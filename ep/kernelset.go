package ep

import "github.com/dropless/dropless/internal/kernelset"

// The program of dispatch and combine on the GPU, for device.Device.Load.
func init() { kernelset.Register(kernelset.EP, nil, kernels) }
