package moe

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// up uploads v, rounded to dtype typ, as a tensor of the given shape.
func up(t testing.TB, s *device.Stream, typ device.DType, v []float32, shape ...int) *device.Tensor {
	t.Helper()
	return dt.Must(device.FromFloat32(s, typ, v, shape...))
}

func upI32(t testing.TB, s *device.Stream, v []int32, shape ...int) *device.Tensor {
	t.Helper()
	return dt.Must(device.FromSlice(s, device.I32, v, shape...))
}

func down(t testing.TB, s *device.Stream, x *device.Tensor) []float32 {
	t.Helper()
	return dt.Must(x.Float32s(s))
}

func downI32(t testing.TB, s *device.Stream, x *device.Tensor) []int32 {
	t.Helper()
	v := make([]int32, x.Len())
	dt.NoErr(t, device.Download(s, x, v))
	return v
}

// alloc allocates a poisoned tensor.
func alloc(t testing.TB, s *device.Stream, typ device.DType, shape ...int) *device.Tensor {
	t.Helper()
	x := dt.Must(s.Alloc(typ, shape...))
	dt.Poison(t, s, x)
	return x
}

// rounded returns v rounded to typ.
func rounded(typ device.DType, v []float32) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = round(typ, x)
	}
	return out
}

// randn returns n samples of N(0, scale²) rounded to typ.
func randn(r *rand.Rand, typ device.DType, n int, scale float32) []float32 {
	return rounded(typ, dt.Normal(r, n, scale))
}

func f64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func rms(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x * x
	}
	return math.Sqrt(s / float64(max(len(v), 1)))
}

// closeTo fails t unless |got[i] - want[i]| ≤ tol·(|want[i]| + rms(want)) for all i.
func closeTo(t testing.TB, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	scale := rms(want)
	bad := 0
	for i, g := range got {
		d := math.Abs(float64(g) - want[i])
		if !(d <= tol*(math.Abs(want[i])+scale)) {
			if bad < 5 {
				t.Errorf("%s[%d] = %v, want %v (|diff| %.3g > %.3g)", what, i, g, want[i], d, tol*(math.Abs(want[i])+scale))
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d of %d values off (tolerance %g, rms %.3g)", what, bad, len(got), tol, scale)
	}
}

// tol is the comparison tolerance of a dtype's results.
func tol(typ device.DType) float64 {
	if typ == device.BF16 {
		return 3e-2
	}
	return 2e-4
}

func dtypes() []device.DType { return []device.DType{device.F32, device.BF16} }

func name(parts ...any) string { return fmt.Sprint(parts...) }
