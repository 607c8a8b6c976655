package device

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestPackStructLayout(t *testing.T) {
	type inner struct {
		A   int32
		B   int64 // padded to 8
		C   bool  // an int
		D   [3]float32
		E   *Tensor
		F   uint32
		Tag uintptr
	}
	s := CPU().Stream()
	buf := make([]byte, 128)
	n, err := packStruct(s, buf, inner{A: -1, B: 1 << 40, C: true, D: [3]float32{1, 2, 3}, F: 7, Tag: 9})
	if err != nil {
		t.Fatal(err)
	}
	// A@0 B@8 C@16 D@20,24,28 E@32 F@40 Tag@48: 56 bytes.
	if n != 56 {
		t.Fatalf("size %d, want 56", n)
	}
	le := binary.LittleEndian
	got := []uint64{uint64(le.Uint32(buf[0:])), le.Uint64(buf[8:]), uint64(le.Uint32(buf[16:])),
		uint64(le.Uint32(buf[20:])), uint64(le.Uint32(buf[28:])), le.Uint64(buf[32:]), uint64(le.Uint32(buf[40:])), le.Uint64(buf[48:])}
	want := []uint64{0xffffffff, 1 << 40, 1, 0x3f800000, 0x40400000, 0, 7, 9}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("layout (-want +got):\n%s", d)
	}
}

func TestPackStructRejects(t *testing.T) {
	s := CPU().Stream()
	buf := make([]byte, 64)
	type bad struct{ N int }
	type private struct{ n int32 }
	type big struct{ V [16]int64 }
	freed, _ := s.Alloc(F32, 1)
	freed.Free()
	type withTensor struct{ T *Tensor }
	for _, tc := range []struct {
		name string
		arg  any
		want string
	}{
		{"int field", bad{}, "field N of type int"},
		{"unexported", private{n: 1}, "unexported field n"},
		{"too big", big{}, "128 bytes"},
		{"not a struct", "x", "unsupported type string"},
		{"freed tensor", withTensor{freed}, "was freed"},
	} {
		if _, err := packStruct(s, buf, tc.arg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

func TestStatusRecordAndDecode(t *testing.T) {
	const domain = 32000
	RegisterStatus(domain, func(op, code int, v [3]int64) error {
		if code == 1 {
			return errors.New("test: op " + string(rune('A'+op)) + " failed")
		}
		return nil
	})
	s := CPU().Stream()
	st, err := NewStatus(s)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Free()
	if err := st.Check(s); err != nil {
		t.Fatalf("fresh status: %v", err)
	}
	if err := st.Record(StatusCode(domain, 2, 1), 4, 5, 6); err != nil {
		t.Fatal(err)
	}
	if err := st.Record(StatusCode(domain, 3, 1), 0, 0, 0); err != nil { // the first record wins
		t.Fatal(err)
	}
	if err := st.Check(s); err == nil || err.Error() != "test: op C failed" {
		t.Errorf("Check = %v, want test: op C failed", err)
	}
	if err := st.Reset(s); err != nil {
		t.Fatal(err)
	}
	st.Record(StatusCode(domain, 0, 2), 1, 2, 3)
	if err := st.Check(s); err == nil || !strings.Contains(err.Error(), "unknown kind") {
		t.Errorf("undecoded record: %v", err)
	}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"nil status Check", (*Status)(nil).Check(s), "not from NewStatus"},
		{"nil stream", st.Check(nil), "nil"},
		{"code 0", st.Record(0, 0, 0, 0), "code 0"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, tc.err, tc.want)
		}
	}
	if _, err := NewStatus(nil); err == nil {
		t.Error("NewStatus(nil) succeeded")
	}
}

func TestTemps(t *testing.T) {
	s := CPU().Stream()
	ts := NewTemps(s)
	a, b := ts.Alloc(F32, 2, 3), ts.Alloc(I32, 4)
	if ts.Err() != nil || a == nil || b == nil {
		t.Fatalf("Alloc: %v", ts.Err())
	}
	if c := ts.Alloc(F32, -1); c != nil || ts.Err() == nil {
		t.Fatalf("Alloc of a negative shape: %v, %v", c, ts.Err())
	}
	if d := ts.Alloc(F32, 1); d != nil {
		t.Error("Alloc after an error allocated")
	}
	if err := ts.Free(); err != nil {
		t.Fatal(err)
	}
	if !a.Freed() || !b.Freed() {
		t.Error("Free left tensors allocated")
	}
	kept := NewTemps(s)
	x := kept.Alloc(F32, 1)
	kept.Keep()
	kept.Free()
	if x.Freed() {
		t.Error("Keep did not keep")
	}
	x.Free()
	if err := FreeAll(nil, nil); err != nil {
		t.Error(err)
	}
}

func TestCheckShape(t *testing.T) {
	s := CPU().Stream()
	x, _ := s.Alloc(BF16, 3, 4)
	defer x.Free()
	for _, tc := range []struct {
		name  string
		t     *Tensor
		dt    DType
		shape []int
		want  string // "" for no error
	}{
		{"exact", x, BF16, []int{3, 4}, ""},
		{"any dtype", x, Invalid, []int{3, -1}, ""},
		{"dtype", x, F32, []int{3, 4}, "op x is bf16[3 4]@cpu, want f32[3 4]"},
		{"shape", x, BF16, []int{5, -1}, "op x is bf16[3 4]@cpu, want bf16[5 _]"},
		{"rank", x, Invalid, []int{12}, "op x is bf16[3 4]@cpu, want [12]"},
		{"nil", nil, F32, []int{1}, "op x is nil"},
	} {
		err := tc.t.CheckShape(s, "op x", tc.dt, tc.shape...)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if !strings.Contains(got, tc.want) || (tc.want == "") != (err == nil) {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
