package moe

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/kernelset"
)

// Load compiles and loads on d the CUDA programs that Forward and Backward run for the
// layer's Config with activations of dtype dt (F32 or BF16): those of the router, the
// permutation, SwiGLU and the expert GEMMs, of the quantizations in an FP8 precision
// and of dispatch and combine with Config.EP, concurrently (see device.Device.Load).
// Without it each compiles when first needed, one after the other, inside the first
// Forward and Backward; on a cold kernel cache that is minutes for an FP8 layer.
// Calling it is optional and changes no result. Layers of one Config share the
// programs, so one call serves them all. On the CPU it checks its arguments and does
// nothing.
func (l *Layer) Load(d *device.Device, dt device.DType) error {
	if l == nil {
		return errors.New("moe: Layer.Load: nil Layer")
	}
	if d == nil {
		return errors.New("moe: Layer.Load: nil Device")
	}
	if dt != device.F32 && dt != device.BF16 {
		return fmt.Errorf("moe: Layer.Load: dtype %v: want f32 or bf16", dt)
	}
	return d.Load(l.programs(d, dt)...)
}

// programs returns the CUDA programs the layer runs on d for activations of dtype dt.
func (l *Layer) programs(d *device.Device, dt device.DType) []*device.Program {
	c := l.cfg
	keys := []string{kernelset.Gemm}
	if c.EP != nil {
		keys = append(keys, kernelset.EP)
	}
	ps := []*device.Program{routerProg, sortProg, permuteProg, swigluProg}
	if c.Precision.fp8() {
		keys = append(keys, kernelset.GemmFP8)
		if c.EP == nil {
			keys = append(keys, kernelset.QuantGather)
		}
		e := &experts{cfg: c}
		p, _ := e.gradKernels("rows", dt) // the dh and rows loaders of dt
		ps = append(ps, p)
		if c.EP != nil {
			p, _ := e.gradKernels("fp8rows", device.F32)
			ps = append(ps, p)
		}
		if c.Precision == PrecisionBlockwise {
			keys = append(keys, kernelset.QuantBlockwise)
			ps = append(ps, swigluBwProg)
		} else {
			keys = append(keys, kernelset.QuantMXFP8)
			ps = append(ps, swigluMXProg)
		}
	}
	return append(kernelset.For(d, keys...), ps...)
}
