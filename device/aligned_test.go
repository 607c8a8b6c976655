package device_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestAligned checks Aligned on views that start one element into their allocations: on a
// GPU they are not 16-byte aligned; CPU tensors and nil ones count as aligned.
func TestAligned(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x := dt.Must(s.Alloc(device.BF16, 64))
		defer x.Free()
		v := dt.Must(x.View(1, 8))
		if !device.Aligned(16, x, nil) {
			t.Errorf("Aligned(16, %v, nil) = false", x)
		}
		if got, want := device.Aligned(16, x, v), !d.IsCUDA(); got != want {
			t.Errorf("Aligned(16, %v, a view at element 1) = %v, want %v", x, got, want)
		}
		if !device.Aligned(2, v) {
			t.Errorf("Aligned(2, a bf16 view) = false")
		}
		for _, n := range []int{0, -16} {
			if device.Aligned(n, x) {
				t.Errorf("Aligned(%d, %v) = true, want false", n, x)
			}
		}
	})
}
