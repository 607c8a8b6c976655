package cuda

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unsafe"
)

type nvrtcLib struct {
	lib *library

	nvrtcGetErrorString       func(res int32) string
	nvrtcVersion              func(major, minor *int32) int32
	nvrtcGetNumSupportedArchs func(n *int32) int32
	nvrtcGetSupportedArchs    func(archs *int32) int32
	nvrtcCreateProgram        func(p *uintptr, src *byte, name *byte, nh int32, headers, names unsafe.Pointer) int32
	nvrtcDestroyProgram       func(p *uintptr) int32
	nvrtcCompileProgram       func(p uintptr, nopt int32, opts unsafe.Pointer) int32
	nvrtcGetProgramLogSize    func(p uintptr, n *uint64) int32
	nvrtcGetProgramLog        func(p uintptr, log *byte) int32
	nvrtcGetPTXSize           func(p uintptr, n *uint64) int32
	nvrtcGetPTX               func(p uintptr, ptx *byte) int32
	nvrtcGetCUBINSize         func(p uintptr, n *uint64) int32
	nvrtcGetCUBIN             func(p uintptr, cubin *byte) int32
	hasCUBIN                  bool
}

var (
	rtc     nvrtcLib
	rtcOnce sync.Once
	rtcErr  error
)

// NVRTCPaths lists the NVRTC libraries LoadNVRTC tries, in order: $DROPLESS_NVRTC if set,
// else libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so.11.2.
func NVRTCPaths() []string {
	if p := os.Getenv("DROPLESS_NVRTC"); p != "" {
		return []string{p}
	}
	return []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"}
}

// LoadNVRTC loads NVRTC once per process. It needs no GPU.
func LoadNVRTC() error {
	rtcOnce.Do(func() { rtcErr = rtc.load(NVRTCPaths()) })
	return rtcErr
}

func (r *nvrtcLib) load(paths []string) error {
	lib, err := open("NVRTC", paths...)
	if err != nil {
		return fmt.Errorf("%w (install the CUDA runtime compiler, or set DROPLESS_NVRTC)", err)
	}
	r.lib = lib
	lib.bind(&r.nvrtcGetErrorString, "nvrtcGetErrorString")
	lib.bind(&r.nvrtcVersion, "nvrtcVersion")
	lib.bind(&r.nvrtcGetNumSupportedArchs, "nvrtcGetNumSupportedArchs")
	lib.bind(&r.nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs")
	lib.bind(&r.nvrtcCreateProgram, "nvrtcCreateProgram")
	lib.bind(&r.nvrtcDestroyProgram, "nvrtcDestroyProgram")
	lib.bind(&r.nvrtcCompileProgram, "nvrtcCompileProgram")
	lib.bind(&r.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize")
	lib.bind(&r.nvrtcGetProgramLog, "nvrtcGetProgramLog")
	lib.bind(&r.nvrtcGetPTXSize, "nvrtcGetPTXSize")
	lib.bind(&r.nvrtcGetPTX, "nvrtcGetPTX")
	r.hasCUBIN = lib.optional(&r.nvrtcGetCUBINSize, "nvrtcGetCUBINSize") &&
		lib.optional(&r.nvrtcGetCUBIN, "nvrtcGetCUBIN")
	return lib.err()
}

// nvrtcNames are NVRTC's names for its result codes (nvrtcResult).
var nvrtcNames = []string{
	"NVRTC_SUCCESS", "NVRTC_ERROR_OUT_OF_MEMORY", "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	"NVRTC_ERROR_INVALID_INPUT", "NVRTC_ERROR_INVALID_PROGRAM", "NVRTC_ERROR_INVALID_OPTION",
	"NVRTC_ERROR_COMPILATION", "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
	"NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION", "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
	"NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID", "NVRTC_ERROR_INTERNAL_ERROR",
}

func checkRTC(call string, res int32) error {
	if res == 0 {
		return nil
	}
	e := &Error{Call: call, Code: int(res), Desc: rtc.nvrtcGetErrorString(res)}
	if int(res) < len(nvrtcNames) {
		e.Name = nvrtcNames[res]
	} else {
		e.Name = fmt.Sprintf("nvrtcResult(%d)", res)
	}
	return e
}

// NVRTCVersion returns NVRTC's major and minor version.
func NVRTCVersion() (major, minor int, err error) {
	var a, b int32
	err = checkRTC("nvrtcVersion", rtc.nvrtcVersion(&a, &b))
	return int(a), int(b), err
}

// NVRTCSupportedArchs returns the compute capabilities NVRTC can target, as 10·major+minor, ascending.
func NVRTCSupportedArchs() ([]int, error) {
	var n int32
	if err := checkRTC("nvrtcGetNumSupportedArchs", rtc.nvrtcGetNumSupportedArchs(&n)); err != nil {
		return nil, err
	}
	a := make([]int32, n)
	if n > 0 {
		if err := checkRTC("nvrtcGetSupportedArchs", rtc.nvrtcGetSupportedArchs(&a[0])); err != nil {
			return nil, err
		}
	}
	out := make([]int, n)
	for i, v := range a {
		out[i] = int(v)
	}
	sort.Ints(out)
	return out, nil
}

// Header is a source file that a program may #include by Name.
type Header struct {
	Name, Source string
}

// Compiled is what Compile returns: CUBIN when the target was a real architecture (sm_XX),
// PTX when it was a virtual one (compute_XX), and the compile log.
type Compiled struct {
	Image []byte // CUBIN or NUL-terminated PTX, ready for ModuleLoadData
	PTX   bool
	Log   string
}

// Compile compiles one CUDA C source with NVRTC. A failed compile returns an *Error
// (NVRTC_ERROR_COMPILATION) whose Log holds NVRTC's log.
func Compile(name, src string, headers []Header, opts []string) (*Compiled, error) {
	if err := LoadNVRTC(); err != nil {
		return nil, err
	}
	csrc, cname := cString(src), cString(name)
	var hp, np []*byte
	var keep [][]byte
	for _, h := range headers {
		s, n := cString(h.Source), cString(h.Name)
		keep = append(keep, s, n)
		hp = append(hp, &s[0])
		np = append(np, &n[0])
	}
	var hptr, nptr unsafe.Pointer
	if len(hp) > 0 {
		hptr, nptr = unsafe.Pointer(&hp[0]), unsafe.Pointer(&np[0])
	}
	var prog uintptr
	if err := checkRTC("nvrtcCreateProgram", rtc.nvrtcCreateProgram(&prog, &csrc[0], &cname[0], int32(len(hp)), hptr, nptr)); err != nil {
		return nil, err
	}
	defer rtc.nvrtcDestroyProgram(&prog)
	var op []*byte
	for _, o := range opts {
		b := cString(o)
		keep = append(keep, b)
		op = append(op, &b[0])
	}
	var optr unsafe.Pointer
	if len(op) > 0 {
		optr = unsafe.Pointer(&op[0])
	}
	res := rtc.nvrtcCompileProgram(prog, int32(len(op)), optr)
	log := programLog(prog)
	if err := checkRTC("nvrtcCompileProgram("+name+")", res); err != nil {
		err.(*Error).Log = log
		return nil, err
	}
	out := &Compiled{Log: log}
	cubin := false
	for _, o := range opts {
		if strings.HasPrefix(o, "--gpu-architecture=sm_") || strings.HasPrefix(o, "-arch=sm_") {
			cubin = true
		}
	}
	if cubin && rtc.hasCUBIN {
		var n uint64
		if err := checkRTC("nvrtcGetCUBINSize", rtc.nvrtcGetCUBINSize(prog, &n)); err != nil {
			return nil, err
		}
		out.Image = make([]byte, n)
		if err := checkRTC("nvrtcGetCUBIN", rtc.nvrtcGetCUBIN(prog, &out.Image[0])); err != nil {
			return nil, err
		}
	} else {
		var n uint64
		if err := checkRTC("nvrtcGetPTXSize", rtc.nvrtcGetPTXSize(prog, &n)); err != nil {
			return nil, err
		}
		out.Image = make([]byte, n)
		if err := checkRTC("nvrtcGetPTX", rtc.nvrtcGetPTX(prog, &out.Image[0])); err != nil {
			return nil, err
		}
		out.PTX = true
	}
	runtime.KeepAlive(keep)
	return out, nil
}

func programLog(prog uintptr) string {
	var n uint64
	if rtc.nvrtcGetProgramLogSize(prog, &n) != 0 || n <= 1 {
		return ""
	}
	b := make([]byte, n)
	if rtc.nvrtcGetProgramLog(prog, &b[0]) != 0 {
		return ""
	}
	return goString(&b[0])
}
