package gemm_test

import (
	"bytes"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// TestFewerMultiprocessors checks that every form gives the same bytes on a stream whose
// persistent kernels run on three multiprocessors (Stream.SetMultiprocessors) as on
// the device's default stream, which uses all of them: bf16 and f32 on the dense shapes
// of several tiles, and both FP8 families.
func TestFewerMultiprocessors(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		all := d.Stream()
		few := dt.Must(d.NewStream())
		defer few.Close()
		n := min(3, d.Multiprocessors())
		dt.NoErr(t, few.SetMultiprocessors(n))
		if got := few.Multiprocessors(); got != n {
			t.Fatalf("Multiprocessors() = %d after SetMultiprocessors(%d)", got, n)
		}
		var cases []runner
		for i, sh := range []shape{shapes[4], shapes[5], shapes[6]} {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, p := range [][2]device.DType{{device.BF16, device.BF16}, {device.BF16, device.F32}, {device.F32, device.F32}} {
					cases = append(cases, newOperands(uint64(2100+i), sh, f, gemm.NK, p[0], p[1], false))
				}
			}
		}
		for _, fam := range []family{blockwiseFam, mxFam} {
			for i, bf := range blockForms {
				for _, sh := range []shape{blockShapes[3], blockShapes[4]} {
					cases = append(cases, newBop(fam, uint64(2200+i), sh, bf.f, bf.layout, device.BF16, e4m3F32, e5m2Pow2, false))
				}
			}
		}
		for _, o := range cases {
			want := o.run(t, all, nil, false)
			got := o.run(t, few, nil, false)
			if !bytes.Equal(want.out, got.out) || !allBytes(got.guard, 0xFF) {
				t.Fatalf("%v: the result on %d multiprocessors differs from the one on all of them", o, n)
			}
		}
	})
}
