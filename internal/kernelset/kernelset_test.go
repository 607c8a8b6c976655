package kernelset

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
)

// TestFor checks that For returns the programs of the keys asked for, in registration
// order, each once, leaving out those whose condition fails on the device.
func TestFor(t *testing.T) {
	a, b, c := device.NewProgram("a.cu", ""), device.NewProgram("b.cu", ""), device.NewProgram("c.cu", "")
	Register("test/x", nil, a, b)
	Register("test/y", nil, b)
	Register("test/y", (*device.Device).IsCUDA, c) // not on the CPU
	Register("test/z", func(d *device.Device) bool { return !d.IsCUDA() }, c)
	names := func(ps []*device.Program) []string {
		var out []string
		for _, p := range ps {
			out = append(out, p.Name)
		}
		return out
	}
	cpu := device.CPU()
	for _, tc := range []struct {
		keys []string
		want []string
	}{
		{[]string{"test/x"}, []string{"a.cu", "b.cu"}},
		{[]string{"test/y", "test/x"}, []string{"b.cu", "a.cu"}},
		{[]string{"test/y", "test/z"}, []string{"b.cu", "c.cu"}},
		{[]string{"test/none"}, nil},
	} {
		if diff := cmp.Diff(tc.want, names(For(cpu, tc.keys...))); diff != "" {
			t.Errorf("For(%q): (-want +got)\n%s", tc.keys, diff)
		}
	}
}
