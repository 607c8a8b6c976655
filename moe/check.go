package moe

import (
	"fmt"

	"github.com/dropless/dropless/device"
)

// checkStream returns an error if s is nil; fn names the op.
func checkStream(s *device.Stream, fn string) error {
	if s == nil {
		return fmt.Errorf("moe: %s: nil stream", fn)
	}
	return nil
}

// checkTensor returns an error unless t is live on s's device with dtype dt and shape.
func checkTensor(s *device.Stream, t *device.Tensor, what string, dt device.DType, shape ...int) error {
	return t.CheckShape(s, "moe: "+what, dt, shape...)
}

// checkShape returns an error unless t has the given shape, of any dtype.
func checkShape(t *device.Tensor, what string, shape ...int) error {
	if !t.HasShape(device.Invalid, shape...) {
		return fmt.Errorf("moe: %s is %v, want shape %v", what, t, shape)
	}
	return nil
}

// checkFloat returns an error unless t is live on s's device, F32 or BF16, rank 2.
func checkFloat(s *device.Stream, t *device.Tensor, what string) error {
	if err := t.Check(s, "moe: "+what); err != nil {
		return err
	}
	if dt := t.DType(); dt != device.F32 && dt != device.BF16 {
		return fmt.Errorf("moe: %s is %v, want f32 or bf16", what, t)
	}
	if t.Rank() != 2 {
		return fmt.Errorf("moe: %s is %v, want rank 2", what, t)
	}
	return nil
}

// checkRows checks a [rows, cols] F32 or BF16 tensor of dtype dt.
func checkRows(s *device.Stream, t *device.Tensor, what string, dt device.DType, rows, cols int) error {
	if err := t.Check(s, "moe: "+what); err != nil {
		return err
	}
	if t.DType() != dt || (dt != device.F32 && dt != device.BF16) {
		return fmt.Errorf("moe: %s is %v, want %v[%d %d] (f32 or bf16)", what, t, dt, rows, cols)
	}
	return checkShape(t, what, rows, cols)
}

// checkWeight returns an error unless t is live on s's device, F32 or BF16, of the
// given shape.
func checkWeight(s *device.Stream, t *device.Tensor, what string, shape ...int) error {
	if err := t.Check(s, "moe: "+what); err != nil {
		return err
	}
	if dt := t.DType(); dt != device.F32 && dt != device.BF16 {
		return fmt.Errorf("moe: %s is %v, want f32 or bf16 %v", what, t, shape)
	}
	return checkShape(t, what, shape...)
}
