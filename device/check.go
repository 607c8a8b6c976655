package device

import (
	"fmt"
	"strconv"
	"strings"
)

// CheckShape returns an error unless t is a live tensor on s's device with dtype dt and
// the given shape; what names t in the error ("moe: Permute x"). dt Invalid accepts any
// dtype, and a negative dimension any size:
//
//	"moe: Permute x is bf16[3 4]@cpu, want f32[5 4]"
//
// Ops of other packages call it on each operand whose shape they know.
func (t *Tensor) CheckShape(s *Stream, what string, dt DType, shape ...int) error {
	if err := t.Check(s, what); err != nil {
		return err
	}
	if t.HasShape(dt, shape...) {
		return nil
	}
	return fmt.Errorf("%s is %v, want %s", what, t, ShapeString(dt, shape...))
}

// HasShape reports whether t has dtype dt and the given shape, with the wildcards of
// CheckShape: dt Invalid for any dtype, a negative dimension for any size.
func (t *Tensor) HasShape(dt DType, shape ...int) bool {
	if t == nil || len(t.shape) != len(shape) || (dt != Invalid && t.dtype != dt) {
		return false
	}
	for i, n := range shape {
		if n >= 0 && t.shape[i] != n {
			return false
		}
	}
	return true
}

// ShapeString describes a wanted dtype and shape as CheckShape does: "f32[5 _]" (any
// size of the second dimension), "[5 4]" when any dtype will do.
func ShapeString(dt DType, shape ...int) string {
	var b strings.Builder
	if dt != Invalid {
		b.WriteString(dt.String())
	}
	b.WriteByte('[')
	for i, n := range shape {
		if i > 0 {
			b.WriteByte(' ')
		}
		if n < 0 {
			b.WriteByte('_')
		} else {
			b.WriteString(strconv.Itoa(n))
		}
	}
	b.WriteByte(']')
	return b.String()
}
