package devicetest

import (
	"regexp"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
)

// Recover calls fn and returns the value it panicked with, or its error.
func Recover(fn func() error) (panicked any, err error) {
	defer func() { panicked = recover() }()
	return nil, fn()
}

// ErrOf returns the error of a call's two results, so that a call returning a value and
// an error fits a table of func() error.
func ErrOf[T any](_ T, err error) error { return err }

// WantError fails t unless fn returns, without panicking, an error whose text holds
// every piece of want: the check of a bad-argument table's row.
func WantError(t testing.TB, fn func() error, want ...string) {
	t.Helper()
	p, err := Recover(fn)
	switch {
	case p != nil:
		t.Fatalf("panic: %v", p)
	case err == nil:
		t.Fatalf("no error, want one containing %q", want)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("error %q, want one containing %q", err, w)
		}
	}
}

// WantErrorNaming fails t unless fn returns, without panicking, an error that names arg
// as a word: "x" is named in "x is nil" and in "q.Row" but not in "dx" or "max".
func WantErrorNaming(t testing.TB, fn func() error, arg string) {
	t.Helper()
	p, err := Recover(fn)
	word := regexp.MustCompile(`(^|[^A-Za-z.])` + regexp.QuoteMeta(arg) + `([^A-Za-z]|$)`)
	switch {
	case p != nil:
		t.Fatalf("panic: %v", p)
	case err == nil:
		t.Fatalf("no error, want one naming %s", arg)
	case !word.MatchString(err.Error()):
		t.Fatalf("error %q does not name %s", err, arg)
	}
}

// Freed returns a tensor of dtype and shape allocated on s and freed: an argument that
// every op must refuse with an error.
func Freed(t testing.TB, s *device.Stream, dtype device.DType, shape ...int) *device.Tensor {
	t.Helper()
	x, err := s.Alloc(dtype, shape...)
	if err == nil {
		err = x.Free()
	}
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// FreedStatus returns a device.Status made on s and freed.
func FreedStatus(t testing.TB, s *device.Stream) *device.Status {
	t.Helper()
	st, err := device.NewStatus(s)
	if err == nil {
		err = st.Free()
	}
	if err != nil {
		t.Fatal(err)
	}
	return st
}
