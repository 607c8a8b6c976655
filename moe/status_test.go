package moe

import (
	"errors"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestSortStatus checks the record of an index outside [-1, E) in the Permutation's
// Status, on the device and in a replayed graph: its error wraps ErrBadIndex and names
// the value, the assignment and E; on the CPU, Sort outside a capture returns it.
func TestSortStatus(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		for _, c := range []struct {
			name    string
			capture bool
			idx     []int32
			want    string
		}{
			{"above", false, []int32{0, 1, 2, 8, 4, 5}, "moe: expert index outside [-1, E): Sort index holds 8 at assignment 3 (E = 8)"},
			{"below", false, []int32{0, -1, -2, 3, 4, 5}, "moe: expert index outside [-1, E): Sort index holds -2 at assignment 2 (E = 8)"},
			{"none", false, []int32{0, -1, 7, 3, 4, 5}, ""},
			{"captured", true, []int32{0, 1, 2, 3, 4, 1 << 30}, "moe: expert index outside [-1, E): Sort index holds 1073741824 at assignment 5 (E = 8)"},
		} {
			t.Run(c.name, func(t *testing.T) {
				it := upI32(t, s, c.idx, 3, 2)
				defer it.Free()
				var g *device.Graph
				if c.capture {
					dt.NoErr(t, s.BeginCapture())
				}
				p, err := Sort(s, it, 8, 0)
				if c.capture {
					g = dt.Must(s.EndCapture())
					defer g.Close()
					dt.NoErr(t, err)
					dt.NoErr(t, g.Launch(s))
				}
				if err == nil {
					defer p.Free()
					err = p.Status.Check(s)
				} else if d.IsCUDA() {
					t.Fatalf("Sort on %v: %v, want the error recorded in p.Status", d, err)
				}
				if got := errText(err); got != c.want {
					t.Errorf("error %q, want %q", got, c.want)
				}
				if c.want != "" && !errors.Is(err, ErrBadIndex) {
					t.Errorf("error %v does not wrap ErrBadIndex", err)
				}
			})
		}
	})
}

// errText returns err's text, "" for nil.
func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
