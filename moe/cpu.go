package moe

import "github.com/dropless/dropless/device"

// hostF32 returns a CPU tensor's elements as float32: its own memory for F32, a
// decoded copy for other dtypes.
func hostF32(t *device.Tensor) []float32 {
	if t.DType() == device.F32 {
		return device.Slice[float32](t)
	}
	v := make([]float32, t.Len())
	device.DecodeFloat32(t.DType(), v, t.HostBytes())
	return v
}

// storeF32 writes v into the CPU tensor t, rounded to its dtype. It does nothing when v
// is t's own memory (F32).
func storeF32(t *device.Tensor, v []float32) {
	if t.DType() == device.F32 {
		if dst := device.Slice[float32](t); len(dst) > 0 && &dst[0] == &v[0] {
			return
		}
		copy(device.Slice[float32](t), v)
		return
	}
	device.EncodeFloat32(t.DType(), t.HostBytes(), v)
}

// round returns v rounded to dtype dt (F32 or BF16), as float32.
func round(dt device.DType, v float32) float32 {
	if dt == device.BF16 {
		return device.BF16ToFloat32(device.BF16FromFloat32(v))
	}
	return v
}
