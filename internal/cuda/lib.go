package cuda

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// library is a shared object opened with dlopen and the symbols bound from it.
type library struct {
	name   string
	handle uintptr
	errs   []string
}

// open dlopens the first of paths that loads. It returns an error listing every
// attempt when none does.
func open(name string, paths ...string) (*library, error) {
	var msgs []string
	for _, p := range paths {
		h, err := purego.Dlopen(p, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err == nil {
			return &library{name: p, handle: h}, nil
		}
		msgs = append(msgs, err.Error())
	}
	return nil, fmt.Errorf("cannot load %s: %s", name, strings.Join(msgs, "; "))
}

// bind sets *fptr to call the first symbol of names found in the library. A missing
// symbol is recorded and reported by err, so that one load reports all of them.
func (l *library) bind(fptr any, names ...string) {
	for _, n := range names {
		sym, err := purego.Dlsym(l.handle, n)
		if err == nil && sym != 0 {
			purego.RegisterFunc(fptr, sym)
			return
		}
	}
	l.errs = append(l.errs, names[0])
}

// sym returns the address of the first of names found, recording a miss like bind.
func (l *library) sym(names ...string) uintptr {
	for _, n := range names {
		if p, err := purego.Dlsym(l.handle, n); err == nil && p != 0 {
			return p
		}
	}
	l.errs = append(l.errs, names[0])
	return 0
}

// optional is bind for a symbol that older libraries lack. It reports whether it was found.
func (l *library) optional(fptr any, names ...string) bool {
	n := len(l.errs)
	l.bind(fptr, names...)
	if len(l.errs) > n {
		l.errs = l.errs[:n]
		return false
	}
	return true
}

func (l *library) err() error {
	if len(l.errs) == 0 {
		return nil
	}
	return fmt.Errorf("%s lacks %s", l.name, strings.Join(l.errs, ", "))
}

// goString copies the NUL-terminated C string at p.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// cString returns s as a NUL-terminated byte slice; pass &b[0] to C.
func cString(s string) []byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return b
}

// Error is a failed call into CUDA, NVRTC or NCCL.
type Error struct {
	Call string // the function called, e.g. "cuMemAllocAsync"
	Code int    // the library's numeric result code
	Name string // the library's name for Code, e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Desc string // the library's description of Code, if it has one
	Log  string // extra text: the NVRTC compile log, for example
}

func (e *Error) Error() string {
	s := e.Call + ": " + e.Name
	if e.Desc != "" && e.Desc != e.Name {
		s += " (" + e.Desc + ")"
	}
	if e.Log != "" {
		s += "\n" + e.Log
	}
	return s
}

// IsCode reports whether err is an *Error with the given library name for its code.
func IsCode(err error, name string) bool {
	var e *Error
	return errors.As(err, &e) && e.Name == name
}
