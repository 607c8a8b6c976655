package cuda

import (
	"os"
	"strings"
	"testing"
	"unsafe"
)

// ncclOrSkip loads NCCL or skips; DROPLESS_REQUIRE_GPU=1 makes it fail.
func ncclOrSkip(t *testing.T) {
	t.Helper()
	if err := LoadNCCL(); err != nil {
		if os.Getenv("DROPLESS_REQUIRE_GPU") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// TestNCCLConfigLayout checks the Go mirror of ncclConfig_t against the C layout.
func TestNCCLConfigLayout(t *testing.T) {
	var c ncclConfig
	for _, f := range []struct {
		name      string
		got, want uintptr
	}{
		{"magic", unsafe.Offsetof(c.magic), 8},
		{"version", unsafe.Offsetof(c.version), 12},
		{"blocking", unsafe.Offsetof(c.blocking), 16},
		{"cgaClusterSize", unsafe.Offsetof(c.cgaClusterSize), 20},
		{"minCTAs", unsafe.Offsetof(c.minCTAs), 24},
		{"maxCTAs", unsafe.Offsetof(c.maxCTAs), 28},
		{"netName", unsafe.Offsetof(c.netName), 32},
		{"splitShare", unsafe.Offsetof(c.splitShare), 40},
		{"commName", unsafe.Offsetof(c.commName), 48},
		{"rest", unsafe.Offsetof(c.rest), 56},
	} {
		if f.got != f.want {
			t.Errorf("offset of %s = %d, want %d", f.name, f.got, f.want)
		}
	}
	nb := newNCCLConfig(false)
	if nb.size != ncclConfigSize || nb.magic != 0xcafebeef || nb.version != 21700 || nb.blocking != 0 || nb.minCTAs != ncclUndefInt || nb.rest[31] != ncclUndefInt {
		t.Errorf("non-blocking config: %+v", nb)
	}
	if b := newNCCLConfig(true); b.blocking != 1 {
		t.Errorf("blocking config has blocking = %d", b.blocking)
	}
	if unsafe.Sizeof(NCCLUniqueID{}) != 128 {
		t.Errorf("NCCLUniqueID is %d bytes, want 128", unsafe.Sizeof(NCCLUniqueID{}))
	}
}

func TestNCCLNames(t *testing.T) {
	for code, want := range map[int]string{
		0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
		4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress", 42: "ncclResult_t(42)",
	} {
		if got := NCCLResultName(code); got != want {
			t.Errorf("NCCLResultName(%d) = %q, want %q", code, got, want)
		}
	}
	if err := checkNCCL("ncclSend", NCCLInProgress, 0); err != nil {
		t.Errorf("ncclInProgress is an error: %v", err)
	}
	err := checkNCCL("ncclSend", NCCLInvalidUsage, 0)
	if !IsCode(err, "ncclInvalidUsage") || !strings.HasPrefix(err.Error(), "ncclSend: ncclInvalidUsage") {
		t.Errorf("checkNCCL(ncclInvalidUsage) = %v", err)
	}
	for v, want := range map[int]string{22803: "2.28.3", 22300: "2.23.0", 2708: "2.7.8"} {
		if got := NCCLVersionString(v); got != want {
			t.Errorf("NCCLVersionString(%d) = %q, want %q", v, got, want)
		}
	}
}

func TestNCCLMissing(t *testing.T) {
	var n ncclLib
	err := n.load("/nonexistent/libnccl.so.2")
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/libnccl.so.2") || !strings.Contains(err.Error(), "DROPLESS_NCCL") {
		t.Fatalf("loading a missing NCCL: got %v", err)
	}
}

// TestNCCLLoad runs where NCCL is installed: the version and a unique id.
func TestNCCLLoad(t *testing.T) {
	ncclOrSkip(t)
	v, err := NCCLVersion()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("NCCL %s from %s", NCCLVersionString(v), NCCLPath())
	if v < NCCLMinVersion {
		t.Fatalf("version %d below %d", v, NCCLMinVersion)
	}
	id, err := NCCLGetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	if id == (NCCLUniqueID{}) {
		t.Fatal("unique id is all zero")
	}
}
