// Package devicetest holds what the library's tests share: the devices to run a suite
// on (the CPU always, the GPU when present), the rule for GPU tests (skip without a GPU
// unless DROPLESS_REQUIRE_GPU=1, then fail), random data and poisoning.
package devicetest

import (
	"math/rand/v2"
	"os"
	"testing"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/cuda"
)

// RequireGPU reports whether GPU tests must run: DROPLESS_REQUIRE_GPU=1.
func RequireGPU() bool { return os.Getenv("DROPLESS_REQUIRE_GPU") == "1" }

// GPU returns CUDA device 0, or skips t when there is none (fails it when RequireGPU).
func GPU(t testing.TB) *device.Device {
	t.Helper()
	d, err := device.Open("cuda:0")
	if err != nil {
		if RequireGPU() {
			t.Fatalf("DROPLESS_REQUIRE_GPU=1 but no GPU: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	return d
}

// Devices returns the devices a shared suite runs on: the CPU, and GPU 0 when present.
// Without a GPU it fails t when RequireGPU.
func Devices(t testing.TB) []*device.Device {
	t.Helper()
	devs := []*device.Device{device.CPU()}
	d, err := device.Open("cuda:0")
	switch {
	case err == nil:
		devs = append(devs, d)
	case RequireGPU():
		t.Fatalf("DROPLESS_REQUIRE_GPU=1 but no GPU: %v", err)
	}
	return devs
}

// Run runs fn as a subtest per device of Devices, named by the device ("cpu", "cuda:0").
func Run(t *testing.T, fn func(t *testing.T, d *device.Device)) {
	t.Helper()
	for _, d := range Devices(t) {
		t.Run(d.String(), func(t *testing.T) { fn(t, d) })
	}
}

// RequireNVRTC skips t when NVRTC cannot be loaded; it fails t instead when
// DROPLESS_REQUIRE_NVRTC=1 or RequireGPU.
func RequireNVRTC(t testing.TB) {
	t.Helper()
	if err := cuda.LoadNVRTC(); err != nil {
		if os.Getenv("DROPLESS_REQUIRE_NVRTC") == "1" || RequireGPU() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// CheckCompiles compiles each program with NVRTC for the GPU present, or without one
// for the newest target NVRTC supports up to sm_90. CI uses it to catch kernel compile
// errors on machines with no GPU.
func CheckCompiles(t *testing.T, progs ...*device.Program) {
	t.Helper()
	RequireNVRTC(t)
	for _, p := range progs {
		if err := p.CheckCompile(""); err != nil {
			t.Errorf("%s: %v", p.Name, err)
		}
	}
}

// Rand returns a generator seeded from seed, so failures reproduce.
func Rand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

// Normal returns n samples of N(0, scale²).
func Normal(r *rand.Rand, n int, scale float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64()) * scale
	}
	return v
}

// Bytes returns n random bytes.
func Bytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		u := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(u >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

// Poison sets every byte of each tensor to 0xFF (NaN in every float dtype, -1 in the
// integer ones), so an output the op under test fails to write shows up.
func Poison(t testing.TB, s *device.Stream, ts ...*device.Tensor) {
	t.Helper()
	for _, x := range ts {
		if err := device.Memset(s, x, 0xFF); err != nil {
			t.Fatal(err)
		}
	}
}

// Must returns v, or panics with err: a test's shorthand for calls that must not fail.
func Must[V any](v V, err error) V {
	if err != nil {
		panic(err)
	}
	return v
}

// NoErr fails t on a non-nil error.
func NoErr(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
