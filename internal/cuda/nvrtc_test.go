package cuda

import (
	"os"
	"strings"
	"testing"
)

// nvrtcOrSkip loads NVRTC or skips; DROPLESS_REQUIRE_NVRTC=1 or DROPLESS_REQUIRE_GPU=1 make it fail.
func nvrtcOrSkip(t *testing.T) {
	t.Helper()
	if err := LoadNVRTC(); err != nil {
		if os.Getenv("DROPLESS_REQUIRE_NVRTC") == "1" || os.Getenv("DROPLESS_REQUIRE_GPU") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

func TestCompile(t *testing.T) {
	nvrtcOrSkip(t)
	major, minor, err := NVRTCVersion()
	if err != nil {
		t.Fatal(err)
	}
	archs, err := NVRTCSupportedArchs()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("NVRTC %d.%d, archs %v", major, minor, archs)
	src := `#include "two.cuh"
extern "C" __global__ void k(float *p) { p[threadIdx.x] = TWO; }`
	hdr := []Header{{"two.cuh", "#define TWO 2.0f\n"}}
	a := archs[len(archs)-1]
	out, err := Compile("k.cu", src, hdr, []string{"--gpu-architecture=compute_" + itoa(a)})
	if err != nil {
		t.Fatal(err)
	}
	if !out.PTX || !strings.Contains(string(out.Image), ".entry k") {
		t.Fatalf("no PTX entry for k in:\n%s", out.Image)
	}
	out, err = Compile("k.cu", src, hdr, []string{"--gpu-architecture=sm_" + itoa(a)})
	if err != nil {
		t.Fatal(err)
	}
	if out.PTX || len(out.Image) < 4 || string(out.Image[1:4]) != "ELF" {
		t.Fatalf("want a CUBIN (ELF) image, got %d bytes, PTX=%v", len(out.Image), out.PTX)
	}
}

func TestCompileError(t *testing.T) {
	nvrtcOrSkip(t)
	_, err := Compile("bad.cu", `extern "C" __global__ void k(float *p) { p[0] = undeclared_name; }`, nil, nil)
	if !IsCode(err, "NVRTC_ERROR_COMPILATION") {
		t.Fatalf("got %v, want NVRTC_ERROR_COMPILATION", err)
	}
	if !strings.Contains(err.Error(), "undeclared_name") || !strings.Contains(err.Error(), "bad.cu") {
		t.Errorf("error lacks NVRTC's log naming the file and identifier:\n%v", err)
	}
}

func TestMissingLibraries(t *testing.T) {
	err := OpenDriver("/nonexistent/libcuda.so.1")
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/libcuda.so.1") {
		t.Fatalf("OpenDriver of a missing path: got %v", err)
	}
	var r nvrtcLib
	err = r.load([]string{"/nonexistent/libnvrtc.so"})
	if err == nil || !strings.Contains(err.Error(), "DROPLESS_NVRTC") {
		t.Fatalf("loading a missing NVRTC: got %v", err)
	}
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}
