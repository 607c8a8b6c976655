package quant_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// TestMXFP8WeightsBadArgs feeds QuantizeMXFP8Weights, DequantizeMXFP8Weights and Free nil,
// freed, wrong-shape, wrong-dtype and out-of-range arguments on the CPU: each returns an
// error naming the argument, without a panic.
func TestMXFP8WeightsBadArgs(t *testing.T) {
	s, al, freed, _, _, gs := badArgsFixture(t)
	w := al(device.BF16, 2, 64, 32) // [G, K, N]
	q := dt.Must(quant.QuantizeMXFP8Weights(s, w, quant.Options{}))
	gone := dt.Must(quant.QuantizeMXFP8Weights(s, w, quant.Options{}))
	dt.NoErr(t, gone.Free())
	dst := al(device.F32, 2, 64, 32)
	st := dt.Must(device.NewStatus(s))
	defer st.Free()

	changed := func(edit func(c *quant.MXFP8Weights)) *quant.MXFP8Weights {
		c := *q
		edit(&c)
		return &c
	}
	weights := func(w *device.Tensor, opt quant.Options) func() error {
		return func() error { return dt.ErrOf(quant.QuantizeMXFP8Weights(s, w, opt)) }
	}
	deq := func(dst *device.Tensor, q *quant.MXFP8Weights, kMajor bool) func() error {
		return func() error { return quant.DequantizeMXFP8Weights(s, dst, q, kMajor) }
	}
	cases := []badCase{
		{"QuantizeMXFP8Weights/nil stream", func() error { return dt.ErrOf(quant.QuantizeMXFP8Weights(nil, w, quant.Options{})) }, "stream"},
		{"QuantizeMXFP8Weights/nil w", weights(nil, quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/freed w", weights(freed(device.BF16, 2, 64, 32), quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/i32 w", weights(al(device.I32, 2, 64, 32), quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/e4m3 w", weights(al(device.E4M3, 2, 64, 32), quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/rank-2 w", weights(al(device.BF16, 64, 32), quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/rank-4 w", weights(al(device.BF16, 1, 2, 64, 32), quant.Options{}), "w"},
		{"QuantizeMXFP8Weights/K 40", weights(al(device.BF16, 2, 40, 32), quant.Options{}), "K"},
		{"QuantizeMXFP8Weights/N 40", weights(al(device.F32, 2, 64, 40), quant.Options{}), "N"},
		{"QuantizeMXFP8Weights/N 8", weights(al(device.F32, 1, 64, 8), quant.Options{}), "N"},
		{"QuantizeMXFP8Weights/NK with K 40", weights(al(device.BF16, 2, 64, 40), quant.Options{NK: true}), "K"},
		{"QuantizeMXFP8Weights/NK with N 8", weights(al(device.BF16, 1, 8, 64), quant.Options{NK: true}), "N"},
		{"QuantizeMXFP8Weights/format 7", weights(w, quant.Options{Format: 7}), "opt.Format"},
		{"QuantizeMXFP8Weights/mode 5", weights(w, quant.Options{Mode: 5}), "opt.Mode"},
		{"QuantizeMXFP8Weights/group sizes", weights(w, quant.Options{GroupSizes: gs}), "opt.GroupSizes"},
		{"QuantizeMXFP8Weights/status", weights(w, quant.Options{Status: st}), "opt.Status"},
		{"QuantizeMXFP8Weights/swizzle", weights(w, quant.Options{Swizzle: true}), "opt.Swizzle"},
		{"QuantizeMXFP8Weights/transpose", weights(w, quant.Options{Dir: quant.Both, Transpose: true}), "opt.Transpose"},

		{"DequantizeMXFP8Weights/nil stream", func() error { return quant.DequantizeMXFP8Weights(nil, dst, q, true) }, "stream"},
		{"DequantizeMXFP8Weights/nil dst", deq(nil, q, true), "dst"},
		{"DequantizeMXFP8Weights/freed dst", deq(freed(device.F32, 2, 64, 32), q, false), "dst"},
		{"DequantizeMXFP8Weights/i32 dst", deq(al(device.I32, 2, 64, 32), q, true), "dst"},
		{"DequantizeMXFP8Weights/dst [G, N, K]", deq(al(device.F32, 2, 32, 64), q, true), "dst"},
		{"DequantizeMXFP8Weights/rank-2 dst", deq(al(device.F32, 128, 32), q, false), "dst"},
		{"DequantizeMXFP8Weights/nil q", deq(dst, nil, true), "q"},
		{"DequantizeMXFP8Weights/freed q", deq(dst, gone, true), "q"},
		{"DequantizeMXFP8Weights/freed q, NMajor", deq(dst, gone, false), "q"},
		{"DequantizeMXFP8Weights/q.K changed", deq(dst, changed(func(c *quant.MXFP8Weights) { c.K = 32 }), true), "q"},
		{"DequantizeMXFP8Weights/q.G changed", deq(dst, changed(func(c *quant.MXFP8Weights) { c.G = 3 }), false), "q"},
		{"DequantizeMXFP8Weights/q.Format changed", deq(dst, changed(func(c *quant.MXFP8Weights) { c.Format = 9 }), true), "q"},
		{"DequantizeMXFP8Weights/q.Mode changed", deq(dst, changed(func(c *quant.MXFP8Weights) { c.Mode = 4 }), true), "q"},
		{"DequantizeMXFP8Weights/q of zero value", deq(al(device.F32, 0, 0, 0), &quant.MXFP8Weights{}, true), "q"},
		{"DequantizeMXFP8Weights/q.KMajor nil", deq(dst, changed(func(c *quant.MXFP8Weights) { c.KMajor = nil }), true), "q.KMajor"},
		{"DequantizeMXFP8Weights/q.KMajor [G, K, N]", deq(dst, changed(func(c *quant.MXFP8Weights) { c.KMajor = q.NMajor }), true), "q.KMajor"},
		{"DequantizeMXFP8Weights/q.KScale replaced", deq(dst, changed(func(c *quant.MXFP8Weights) { c.KScale = q.NScale }), true), "q.KScale"},
		{"DequantizeMXFP8Weights/q.KScale of f32", deq(dst, changed(func(c *quant.MXFP8Weights) { c.KScale = al(device.F32, q.KScale.Shape()...) }), true), "q.KScale"},
		{"DequantizeMXFP8Weights/q.NMajor nil", deq(dst, changed(func(c *quant.MXFP8Weights) { c.NMajor = nil }), false), "q.NMajor"},
		{"DequantizeMXFP8Weights/q.NMajor of e5m2", deq(dst, changed(func(c *quant.MXFP8Weights) { c.NMajor = al(device.E5M2, 2, 64, 32) }), false), "q.NMajor"},
		{"DequantizeMXFP8Weights/q.NScale freed", deq(dst, changed(func(c *quant.MXFP8Weights) { c.NScale = freed(device.E8M0, q.NScale.Shape()...) }), false), "q.NScale"},
	}
	runBadCases(t, cases)

	var none *quant.MXFP8Weights
	if err := none.Free(); err != nil {
		t.Errorf("Free of nil: %v, want nil", err)
	}
	// Each orientation reads only its own tensors.
	for _, c := range []struct {
		kMajor bool
		q      *quant.MXFP8Weights
	}{{true, changed(func(c *quant.MXFP8Weights) { c.NMajor, c.NScale = nil, nil })}, {false, changed(func(c *quant.MXFP8Weights) { c.KMajor, c.KScale = nil, nil })}} {
		if err := quant.DequantizeMXFP8Weights(s, dst, c.q, c.kMajor); err != nil {
			t.Errorf("DequantizeMXFP8Weights kMajor %v with valid arguments: %v", c.kMajor, err)
		}
	}
	// opt.Dir is not read: any direction gives the same weights.
	for _, dir := range []quant.Direction{quant.Columnwise, quant.Both, 9} {
		qd, err := quant.QuantizeMXFP8Weights(s, w, quant.Options{Dir: dir})
		if err != nil {
			t.Errorf("QuantizeMXFP8Weights with opt.Dir %v: %v", dir, err)
			continue
		}
		qd.Free()
	}
	q.Free()
}
