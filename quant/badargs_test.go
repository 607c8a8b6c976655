package quant_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// TestBadArgs feeds every exported function and method nil, freed, wrong-shape,
// wrong-dtype and out-of-range arguments on the CPU: each returns an error naming the
// argument, without a panic.
func TestBadArgs(t *testing.T) {
	s, al, freed, x, y, gs := badArgsFixture(t)
	grouped := quant.Options{GroupSizes: gs}
	q := dt.Must(quant.Quantize(s, x, quant.Options{}))
	qg := dt.Must(quant.Quantize(s, x, grouped))
	trOpt := quant.Options{Dir: quant.Both, Transpose: true}
	qt := dt.Must(quant.Quantize(s, x, trOpt))
	gone := dt.Must(quant.Quantize(s, x, quant.Options{}))
	dt.NoErr(t, gone.Free())
	// changed returns a copy of q changed by edit, as a caller might.
	changed := func(edit func(c *quant.MXFP8)) *quant.MXFP8 {
		c := *q
		edit(&c)
		return &c
	}
	changedT := func(edit func(c *quant.MXFP8)) *quant.MXFP8 {
		c := *qt
		edit(&c)
		return &c
	}
	quantize := func(x *device.Tensor, opt quant.Options) func() error {
		return func() error { _, err := quant.Quantize(s, x, opt); return err }
	}
	alloc := func(s *device.Stream, m, k int, opt quant.Options) func() error {
		return func() error { _, err := quant.Alloc(s, m, k, opt); return err }
	}
	into := func(q *quant.MXFP8, x *device.Tensor, opt quant.Options) func() error {
		return func() error { return quant.QuantizeInto(s, q, x, opt) }
	}
	deq := func(dst *device.Tensor, q *quant.MXFP8, dir quant.Direction) func() error {
		return func() error { return quant.Dequantize(s, dst, q, dir) }
	}
	// badOptions are opt values that every function taking Options refuses.
	badOptions := []struct {
		name string
		opt  quant.Options
		arg  string
	}{
		{"format 7", quant.Options{Format: 7}, "opt.Format"},
		{"mode 5", quant.Options{Mode: 5}, "opt.Mode"},
		{"dir 9", quant.Options{Dir: 9}, "opt.Dir"},
		{"dir -1", quant.Options{Dir: -1}, "opt.Dir"},
		{"transpose rowwise", quant.Options{Transpose: true}, "opt.Transpose"},
		{"NK", quant.Options{NK: true}, "opt.NK"},
	}
	for _, b := range badGroupArgs(al, freed) {
		badOptions = append(badOptions, struct {
			name string
			opt  quant.Options
			arg  string
		}{b.name, quant.Options{GroupSizes: b.gs, Status: b.st}, b.arg})
	}
	cases := []badCase{
		{"Alloc/nil stream", alloc(nil, 64, 64, quant.Options{}), "stream"},
		{"Alloc/m -1", alloc(s, -1, 64, quant.Options{}), "m"},
		{"Alloc/k -1", alloc(s, 64, -1, quant.Options{}), "k"},
		{"Alloc/m 2^31", alloc(s, 1<<31, 0, quant.Options{}), "m"},
		{"Alloc/k 2^31", alloc(s, 0, 1<<31, quant.Options{}), "k"},

		{"Quantize/nil stream", func() error { _, err := quant.Quantize(nil, x, quant.Options{}); return err }, "stream"},
		{"Quantize/nil x", quantize(nil, quant.Options{}), "x"},
		{"Quantize/freed x", quantize(freed(device.BF16, 64, 64), quant.Options{}), "x"},
		{"Quantize/i32 x", quantize(al(device.I32, 64, 64), quant.Options{}), "x"},
		{"Quantize/f16 x", quantize(al(device.F16, 64, 64), quant.Options{}), "x"},
		{"Quantize/rank-3 x", quantize(al(device.BF16, 2, 32, 32), quant.Options{}), "x"},
		{"Quantize/rank-1 x", quantize(al(device.BF16, 64), quant.Options{}), "x"},
		{"Quantize/x of 2^31 rows", quantize(al(device.BF16, 1<<31, 0), quant.Options{}), "x"},

		{"QuantizeInto/nil stream", func() error { return quant.QuantizeInto(nil, q, x, quant.Options{}) }, "stream"},
		{"QuantizeInto/nil q", into(nil, x, quant.Options{}), "q"},
		{"QuantizeInto/freed q", into(gone, x, quant.Options{}), "q"},
		{"QuantizeInto/q.M changed", into(changed(func(c *quant.MXFP8) { c.M = 32 }), al(device.BF16, 32, 64), quant.Options{}), "q"},
		{"QuantizeInto/q.Groups changed", into(changed(func(c *quant.MXFP8) { c.Groups = 3 }), x, quant.Options{}), "q"},
		{"QuantizeInto/q.Format changed", into(changed(func(c *quant.MXFP8) { c.Format = quant.E5M2 }), x, quant.Options{Format: quant.E5M2}), "q"},
		{"QuantizeInto/q.Dir changed", into(changed(func(c *quant.MXFP8) { c.Dir = quant.Both }), x, quant.Options{Dir: quant.Both}), "q"},
		{"QuantizeInto/q.Row replaced", into(changed(func(c *quant.MXFP8) { c.Row = al(device.E4M3, 64, 32) }), x, quant.Options{}), "q.Row"},
		{"QuantizeInto/q.RowScale replaced", into(changed(func(c *quant.MXFP8) { c.RowScale = al(device.E4M3, q.RowScale.Shape()...) }), x, quant.Options{}), "q.RowScale"},
		{"QuantizeInto/q.Col set", into(changed(func(c *quant.MXFP8) { c.Col = al(device.E4M3, 64, 64) }), x, quant.Options{}), "q"},
		{"QuantizeInto/q of zero value", into(&quant.MXFP8{}, al(device.BF16, 0, 0), quant.Options{}), "q"},
		{"QuantizeInto/nil x", into(q, nil, quant.Options{}), "x"},
		{"QuantizeInto/freed x", into(q, freed(device.BF16, 64, 64), quant.Options{}), "x"},
		{"QuantizeInto/i32 x", into(q, al(device.I32, 64, 64), quant.Options{}), "x"},
		{"QuantizeInto/x of another shape", into(q, al(device.BF16, 64, 32), quant.Options{}), "x"},
		{"QuantizeInto/rank-3 x", into(q, al(device.BF16, 2, 32, 64), quant.Options{}), "x"},
		{"QuantizeInto/opt.Format of another q", into(q, x, quant.Options{Format: quant.E5M2}), "opt.Format"},
		{"QuantizeInto/opt.Dir of another q", into(q, x, quant.Options{Dir: quant.Columnwise}), "opt.Dir"},
		{"QuantizeInto/opt.Swizzle of another q", into(q, x, quant.Options{Swizzle: true}), "opt.Swizzle"},
		{"QuantizeInto/opt.Transpose of another q", into(q, x, quant.Options{Dir: quant.Both, Transpose: true}), "opt.Dir"},
		{"QuantizeInto/opt.Transpose into untransposed q", into(changed(func(c *quant.MXFP8) { c.Dir, c.Col, c.ColScale = quant.Both, qt.ColT, qt.ColScale }), x, trOpt), "q"},
		{"QuantizeInto/no opt.Transpose into transposed q", into(qt, x, quant.Options{Dir: quant.Both}), "opt.Transpose"},
		{"QuantizeInto/q.Transposed cleared", into(changedT(func(c *quant.MXFP8) { c.Transposed = false }), x, quant.Options{Dir: quant.Both}), "q"},
		{"QuantizeInto/q.Transposed set on rowwise q", into(changed(func(c *quant.MXFP8) { c.Transposed = true }), x, quant.Options{Transpose: true}), "opt.Transpose"},
		{"QuantizeInto/q.Transposed set on rowwise q, valid opt", into(changed(func(c *quant.MXFP8) { c.Transposed = true }), x, quant.Options{}), "q"},
		{"QuantizeInto/q.ColT replaced", into(changedT(func(c *quant.MXFP8) { c.ColT = al(device.E4M3, 64, 64) }), x, trOpt), "q.ColT"},
		{"QuantizeInto/q.ColT of E5M2", into(changedT(func(c *quant.MXFP8) { c.ColT = al(device.E5M2, qt.ColT.Shape()...) }), x, trOpt), "q.ColT"},
		{"QuantizeInto/q.ColT nil", into(changedT(func(c *quant.MXFP8) { c.ColT = nil }), x, trOpt), "q"},
		{"QuantizeInto/q.ColT freed", into(changedT(func(c *quant.MXFP8) { c.ColT = freed(device.E4M3, qt.ColT.Shape()...) }), x, trOpt), "q.ColT"},
		{"QuantizeInto/q.Col set on transposed q", into(changedT(func(c *quant.MXFP8) { c.Col = al(device.E4M3, 64, 64) }), x, trOpt), "q"},
		{"QuantizeInto/groups into ungrouped q", into(q, x, grouped), "opt.GroupSizes"},
		{"QuantizeInto/no groups into grouped q", into(qg, x, quant.Options{}), "opt.GroupSizes"},
		{"QuantizeInto/too many groups", into(qg, x, quant.Options{GroupSizes: al(device.I32, 3)}), "opt.GroupSizes"},

		{"Dequantize/nil stream", func() error { return quant.Dequantize(nil, y, q, quant.Rowwise) }, "stream"},
		{"Dequantize/nil dst", deq(nil, q, quant.Rowwise), "dst"},
		{"Dequantize/freed dst", deq(freed(device.F32, 64, 64), q, quant.Rowwise), "dst"},
		{"Dequantize/i32 dst", deq(al(device.I32, 64, 64), q, quant.Rowwise), "dst"},
		{"Dequantize/dst of another shape", deq(al(device.F32, 64, 32), q, quant.Rowwise), "dst"},
		{"Dequantize/rank-3 dst", deq(al(device.F32, 2, 32, 64), q, quant.Rowwise), "dst"},
		{"Dequantize/nil q", deq(y, nil, quant.Rowwise), "q"},
		{"Dequantize/freed q", deq(y, gone, quant.Rowwise), "q"},
		{"Dequantize/q.K changed", deq(al(device.F32, 64, 32), changed(func(c *quant.MXFP8) { c.K = 32 }), quant.Rowwise), "q"},
		{"Dequantize/q.RowScale replaced", deq(y, changed(func(c *quant.MXFP8) { c.RowScale = al(device.E8M0, 4, 4) }), quant.Rowwise), "q.RowScale"},
		{"Dequantize/dir 9", deq(y, q, 9), "dir"},
		{"Dequantize/dir Both", deq(y, q, quant.Both), "dir"},
		{"Dequantize/dir missing from q", deq(y, q, quant.Columnwise), "dir"},
		{"Dequantize/q.ColT nil", deq(y, changedT(func(c *quant.MXFP8) { c.ColT = nil }), quant.Columnwise), "q.ColT"},
		{"Dequantize/q.ColT replaced", deq(y, changedT(func(c *quant.MXFP8) { c.ColT = al(device.E4M3, 64, 64) }), quant.Columnwise), "q.ColT"},
		{"Dequantize/q.ColT freed", deq(y, changedT(func(c *quant.MXFP8) { c.ColT = freed(device.E4M3, qt.ColT.Shape()...) }), quant.Columnwise), "q.ColT"},
		{"Dequantize/q.Transposed set on rowwise q", deq(y, changed(func(c *quant.MXFP8) { c.Transposed = true }), quant.Rowwise), "q"},
	}
	for _, b := range badOptions {
		cases = append(cases,
			badCase{"Alloc/" + b.name, alloc(s, 64, 64, b.opt), b.arg},
			badCase{"Quantize/" + b.name, quantize(x, b.opt), b.arg},
			badCase{"QuantizeInto/" + b.name, into(q, x, b.opt), b.arg})
	}
	runBadCases(t, cases)

	var none *quant.MXFP8
	if err := none.Free(); err != nil || none.Tiles() != 0 {
		t.Errorf("nil MXFP8: Free() = %v, Tiles() = %d, want nil and 0", err, none.Tiles())
	}
	for _, c := range []*quant.MXFP8{q, qg, qt} {
		if err := quant.Dequantize(s, y, c, quant.Rowwise); err != nil {
			t.Errorf("Dequantize with valid arguments: %v", err)
		}
	}
	if err := quant.Dequantize(s, y, qt, quant.Columnwise); err != nil {
		t.Errorf("Dequantize from ColT with valid arguments: %v", err)
	}
	for _, c := range []*quant.MXFP8{q, qg, qt} {
		c.Free()
	}
}

// badCase is a call with a bad argument.
type badCase struct {
	name string
	call func() error
	arg  string // the argument the error must name
}

// runBadCases checks that each case's call returns an error naming its argument.
func runBadCases(t *testing.T, cases []badCase) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { dt.WantErrorNaming(t, c.call, c.arg) })
	}
}

// badArgsFixture returns the CPU stream of the bad-argument tests, allocators of live
// and of freed tensors on it, a bf16 x and an f32 y of 64×64, and valid group sizes
// {40, 24} for x's rows.
func badArgsFixture(t *testing.T) (s *device.Stream, al, freed func(device.DType, ...int) *device.Tensor, x, y, gs *device.Tensor) {
	s = device.CPU().Stream()
	al = func(typ device.DType, shape ...int) *device.Tensor { return dt.Must(s.Alloc(typ, shape...)) }
	freed = func(typ device.DType, shape ...int) *device.Tensor { return dt.Freed(t, s, typ, shape...) }
	return s, al, freed, al(device.BF16, 64, 64), al(device.F32, 64, 64), dt.Must(device.FromSlice(s, device.I32, []int32{40, 24}, 2))
}

// badGroup is a bad value of the options' group sizes or Status, which arg names.
type badGroup struct {
	name string
	gs   *device.Tensor
	st   *device.Status
	arg  string
}

// badGroupArgs returns the bad group sizes and Status that every quantization of
// activations refuses, allocated with al and freed.
func badGroupArgs(al, freed func(device.DType, ...int) *device.Tensor) []badGroup {
	return []badGroup{
		{"freed group sizes", freed(device.I32, 2), nil, "opt.GroupSizes"},
		{"f32 group sizes", al(device.F32, 2), nil, "opt.GroupSizes"},
		{"rank-2 group sizes", al(device.I32, 2, 1), nil, "opt.GroupSizes"},
		{"no groups", al(device.I32, 0), nil, "opt.GroupSizes"},
		{"status not from NewStatus", nil, &device.Status{}, "opt.Status"},
	}
}
