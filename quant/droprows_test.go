package quant_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// TestDropRows quantizes in both directions, in groups, drops the rowwise form and
// checks on every device that the columnwise one is what it was (dequantized), that q
// takes a columnwise quantization again, and that FreeOn releases it on another stream.
func TestDropRows(t *testing.T) {
	const m, k = 150, 64
	vals := dt.Normal(dt.Rand(31), m*k, 1)
	sizes := []int32{20, 0, 130}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		x := dt.Must(device.FromFloat32(s, device.BF16, vals, m, k))
		gs := dt.Must(device.FromSlice(s, device.I32, sizes, len(sizes)))
		defer device.FreeAll(x, gs)
		cols := func(deq func(y *device.Tensor) error) []float32 {
			y := dt.Must(s.Alloc(device.F32, m, k))
			defer y.Free()
			dt.NoErr(t, deq(y))
			return dt.Must(y.Float32s(s))
		}
		other := dt.Must(d.NewStream())
		defer other.Close()

		bopt := quant.BlockOptions{Dir: quant.Both, GroupSizes: gs}
		b := dt.Must(quant.QuantizeBlockwise(s, x, bopt))
		want := cols(func(y *device.Tensor) error { return quant.DequantizeBlockwise(s, y, b, quant.Columnwise) })
		dt.NoErr(t, b.DropRows())
		if b.Row != nil || b.RowScale != nil || b.Dir != quant.Columnwise {
			t.Errorf("blockwise: after DropRows Row %v, RowScale %v, Dir %v: want nil, nil, columnwise", b.Row, b.RowScale, b.Dir)
		}
		got := cols(func(y *device.Tensor) error { return quant.DequantizeBlockwise(s, y, b, quant.Columnwise) })
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("blockwise: ColT dequantized (-before +after DropRows):\n%s", diff)
		}
		dt.NoErr(t, b.DropRows()) // nothing left to drop
		bopt.Dir = quant.Columnwise
		dt.NoErr(t, quant.QuantizeBlockwiseInto(s, b, x, bopt))
		ev := dt.Must(s.Record())
		defer ev.Close()
		dt.NoErr(t, other.Wait(ev))
		dt.NoErr(t, b.FreeOn(other))

		mopt := quant.Options{Dir: quant.Both, Transpose: true, GroupSizes: gs}
		q := dt.Must(quant.Quantize(s, x, mopt))
		want = cols(func(y *device.Tensor) error { return quant.Dequantize(s, y, q, quant.Columnwise) })
		dt.NoErr(t, q.DropRows())
		if q.Row != nil || q.RowScale != nil || q.Dir != quant.Columnwise {
			t.Errorf("MXFP8: after DropRows Row %v, RowScale %v, Dir %v: want nil, nil, columnwise", q.Row, q.RowScale, q.Dir)
		}
		got = cols(func(y *device.Tensor) error { return quant.Dequantize(s, y, q, quant.Columnwise) })
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("MXFP8: ColT dequantized (-before +after DropRows):\n%s", diff)
		}
		mopt.Dir = quant.Columnwise
		dt.NoErr(t, quant.QuantizeInto(s, q, x, mopt))
		ev2 := dt.Must(s.Record())
		defer ev2.Close()
		dt.NoErr(t, other.Wait(ev2))
		dt.NoErr(t, q.FreeOn(other))
		dt.NoErr(t, other.Synchronize())
	})
}

// TestDropRowsBadArgs checks the errors of DropRows and FreeOn: a nil q, a q without a
// columnwise form, a nil stream; freeing a nil q does nothing.
func TestDropRowsBadArgs(t *testing.T) {
	s, _, _, x, _, _ := badArgsFixture(t)
	b := dt.Must(quant.QuantizeBlockwise(s, x, quant.BlockOptions{}))
	q := dt.Must(quant.Quantize(s, x, quant.Options{}))
	defer b.Free()
	defer q.Free()
	var nb *quant.Blockwise
	var nq *quant.MXFP8
	runBadCases(t, []badCase{
		{"Blockwise.DropRows/nil q", nb.DropRows, "q"},
		{"Blockwise.DropRows/rowwise q", b.DropRows, "q.Dir"},
		{"Blockwise.FreeOn/nil stream", func() error { return b.FreeOn(nil) }, "stream"},
		{"MXFP8.DropRows/nil q", nq.DropRows, "q"},
		{"MXFP8.DropRows/rowwise q", q.DropRows, "q.Dir"},
		{"MXFP8.FreeOn/nil stream", func() error { return q.FreeOn(nil) }, "stream"},
	})
	if b.Row == nil || q.Row == nil {
		t.Error("a refused DropRows dropped the rowwise form")
	}
	if err := errorsOf(nb.FreeOn(s), nq.FreeOn(s)); err != nil {
		t.Errorf("FreeOn of nil: %v", err)
	}
}

func errorsOf(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}
