package quant

import (
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// errString returns err's text, "" for nil.
func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestStatusShared checks that invalid group sizes are recorded in Options.Status when
// one is given, leaving q.Status clear, that the first record stays through later
// quantizations, valid or not, until Reset, and the errors the records decode to.
func TestStatusShared(t *testing.T) {
	const (
		m, k     = 33, 64
		sum      = "quant: invalid GroupSizes: the sizes do not sum to the 33 rows of x; the outputs were set to NaN"
		negative = "quant: invalid GroupSizes: a size is negative; the outputs were set to NaN"
	)
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x := dt.Must(device.FromFloat32(s, device.BF16, testValues(dt.Rand(5), m*k, false), m, k))
		defer x.Free()
		st := dt.Must(device.NewStatus(s))
		defer st.Free()
		gs := groupTensor(t, s, []int32{13, 20})
		defer gs.Free()
		q := dt.Must(Alloc(s, m, k, Options{Dir: Both, GroupSizes: gs}))
		defer q.Free()
		for i, step := range []struct {
			reset bool
			sizes []int32
			want  string
		}{
			{false, []int32{13, 20}, ""},
			{false, []int32{30, 4}, sum},
			{false, []int32{-1, 34}, sum},
			{false, []int32{13, 20}, sum},
			{true, []int32{-1, 34}, negative},
			{true, []int32{33, 0}, ""},
		} {
			if step.reset {
				dt.NoErr(t, st.Reset(s))
			}
			dt.NoErr(t, device.Upload(s, gs, step.sizes))
			dt.NoErr(t, QuantizeInto(s, q, x, Options{Dir: Both, GroupSizes: gs, Status: st}))
			if got := errString(st.Check(s)); got != step.want {
				t.Errorf("step %d, sizes %v: opt.Status.Check() = %q, want %q", i, step.sizes, got, step.want)
			}
			if err := q.Status.Check(s); err != nil {
				t.Errorf("step %d, sizes %v: q.Status.Check() = %v, want nil (opt.Status was given)", i, step.sizes, err)
			}
		}
	})
}

// TestStatusArgs checks the errors of a Status that cannot be used.
func TestStatusArgs(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k = 33, 64
		x := dt.Must(device.FromFloat32(s, device.F32, testValues(dt.Rand(6), m*k, false), m, k))
		defer x.Free()
		gs := groupTensor(t, s, []int32{13, 20})
		defer gs.Free()
		freed := dt.Must(device.NewStatus(s))
		dt.NoErr(t, freed.Free())
		for _, c := range []struct {
			name string
			call func() error
			want []string
		}{
			{"Alloc opt.Status zero", func() error {
				q, err := Alloc(s, m, k, Options{GroupSizes: gs, Status: &device.Status{}})
				q.Free()
				return err
			}, []string{"quant: Alloc:", "opt.Status is not from NewStatus"}},
			{"Quantize opt.Status freed", func() error {
				q, err := Quantize(s, x, Options{GroupSizes: gs, Status: freed})
				q.Free()
				return err
			}, []string{"quant: Quantize:", "opt.Status", "freed"}},
			{"QuantizeInto q.Status freed", func() error {
				q := dt.Must(Alloc(s, m, k, Options{GroupSizes: gs}))
				defer q.Free()
				dt.NoErr(t, q.Status.Free())
				return QuantizeInto(s, q, x, Options{GroupSizes: gs})
			}, []string{"quant: QuantizeInto:", "q.Status", "freed"}},
		} {
			err := c.call()
			for _, w := range c.want {
				if !strings.Contains(errString(err), w) {
					t.Errorf("%s: error %v, want one containing %q", c.name, err, w)
				}
			}
		}
	})
}
