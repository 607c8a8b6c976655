package device

import (
	"os"
	"testing"

	"github.com/dropless/dropless/internal/cuda"
)

// TestKernelsCompile compiles the package's kernels with NVRTC. Without NVRTC it is
// skipped, or fails when DROPLESS_REQUIRE_NVRTC=1 or DROPLESS_REQUIRE_GPU=1, as
// devicetest.CheckCompiles does (the package cannot import devicetest: it imports device).
func TestKernelsCompile(t *testing.T) {
	if err := cuda.LoadNVRTC(); err != nil {
		if os.Getenv("DROPLESS_REQUIRE_NVRTC") == "1" || os.Getenv("DROPLESS_REQUIRE_GPU") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	if err := elementwise.CheckCompile(""); err != nil {
		t.Errorf("%s: %v", elementwise.Name, err)
	}
}
