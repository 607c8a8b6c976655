package quant_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// TestBlockwiseBadArgs feeds every exported blockwise function and method nil, freed,
// wrong-shape, wrong-dtype and out-of-range arguments on the CPU: each returns an error
// naming the argument, without a panic.
func TestBlockwiseBadArgs(t *testing.T) {
	s, al, freed, x, y, gs := badArgsFixture(t)
	grouped := quant.BlockOptions{Dir: quant.Both, GroupSizes: gs}
	q := dt.Must(quant.QuantizeBlockwise(s, x, quant.BlockOptions{}))
	qg := dt.Must(quant.QuantizeBlockwise(s, x, grouped))
	gone := dt.Must(quant.QuantizeBlockwise(s, x, quant.BlockOptions{}))
	dt.NoErr(t, gone.Free())
	w := al(device.BF16, 2, 64, 32)
	qw := dt.Must(quant.QuantizeWeights(s, w, quant.BlockOptions{}))
	goneW := dt.Must(quant.QuantizeWeights(s, w, quant.BlockOptions{}))
	dt.NoErr(t, goneW.Free())
	wdst := al(device.F32, 2, 64, 32)

	// changed returns a copy of q changed by edit, as a caller might.
	changed := func(edit func(c *quant.Blockwise)) *quant.Blockwise {
		c := *q
		edit(&c)
		return &c
	}
	changedW := func(edit func(c *quant.BlockwiseWeights)) *quant.BlockwiseWeights {
		c := *qw
		edit(&c)
		return &c
	}
	quantize := func(x *device.Tensor, opt quant.BlockOptions) func() error {
		return func() error { return dt.ErrOf(quant.QuantizeBlockwise(s, x, opt)) }
	}
	alloc := func(s *device.Stream, m, k int, opt quant.BlockOptions) func() error {
		return func() error { return dt.ErrOf(quant.AllocBlockwise(s, m, k, opt)) }
	}
	into := func(q *quant.Blockwise, x *device.Tensor, opt quant.BlockOptions) func() error {
		return func() error { return quant.QuantizeBlockwiseInto(s, q, x, opt) }
	}
	deq := func(dst *device.Tensor, q *quant.Blockwise, dir quant.Direction) func() error {
		return func() error { return quant.DequantizeBlockwise(s, dst, q, dir) }
	}
	weights := func(w *device.Tensor, opt quant.BlockOptions) func() error {
		return func() error { return dt.ErrOf(quant.QuantizeWeights(s, w, opt)) }
	}
	deqW := func(dst *device.Tensor, q *quant.BlockwiseWeights) func() error {
		return func() error { return quant.DequantizeWeights(s, dst, q) }
	}
	// badOptions are opt values that every function quantizing activations refuses.
	badOptions := []struct {
		name string
		opt  quant.BlockOptions
		arg  string
	}{
		{"format 7", quant.BlockOptions{Format: 7}, "opt.Format"},
		{"scale 5", quant.BlockOptions{Scale: 5}, "opt.Scale"},
		{"dir 9", quant.BlockOptions{Dir: 9}, "opt.Dir"},
		{"NK", quant.BlockOptions{NK: true}, "opt.NK"},
	}
	for _, b := range badGroupArgs(al, freed) {
		badOptions = append(badOptions, struct {
			name string
			opt  quant.BlockOptions
			arg  string
		}{b.name, quant.BlockOptions{GroupSizes: b.gs, Status: b.st}, b.arg})
	}
	cases := []badCase{
		{"AllocBlockwise/nil stream", alloc(nil, 64, 64, quant.BlockOptions{}), "stream"},
		{"AllocBlockwise/m -1", alloc(s, -1, 64, quant.BlockOptions{}), "m"},
		{"AllocBlockwise/k -1", alloc(s, 64, -1, quant.BlockOptions{}), "k"},
		{"AllocBlockwise/m 2^31", alloc(s, 1<<31, 0, quant.BlockOptions{}), "m"},
		{"AllocBlockwise/k 2^31", alloc(s, 0, 1<<31, quant.BlockOptions{}), "k"},

		{"QuantizeBlockwise/nil stream", func() error { _, err := quant.QuantizeBlockwise(nil, x, quant.BlockOptions{}); return err }, "stream"},
		{"QuantizeBlockwise/nil x", quantize(nil, quant.BlockOptions{}), "x"},
		{"QuantizeBlockwise/freed x", quantize(freed(device.BF16, 64, 64), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwise/i32 x", quantize(al(device.I32, 64, 64), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwise/f16 x", quantize(al(device.F16, 64, 64), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwise/rank-3 x", quantize(al(device.BF16, 2, 32, 32), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwise/x of 2^31 rows", quantize(al(device.BF16, 1<<31, 0), quant.BlockOptions{}), "x"},

		{"QuantizeBlockwiseInto/nil stream", func() error { return quant.QuantizeBlockwiseInto(nil, q, x, quant.BlockOptions{}) }, "stream"},
		{"QuantizeBlockwiseInto/nil q", into(nil, x, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/freed q", into(gone, x, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/q.M changed", into(changed(func(c *quant.Blockwise) { c.M = 32 }), al(device.BF16, 32, 64), quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/q.Groups changed", into(changed(func(c *quant.Blockwise) { c.Groups = 3 }), x, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/q.Format changed", into(changed(func(c *quant.Blockwise) { c.Format = quant.E5M2 }), x, quant.BlockOptions{Format: quant.E5M2}), "q"},
		{"QuantizeBlockwiseInto/q.Dir changed", into(changed(func(c *quant.Blockwise) { c.Dir = quant.Both }), x, quant.BlockOptions{Dir: quant.Both}), "q"},
		{"QuantizeBlockwiseInto/q.Row replaced", into(changed(func(c *quant.Blockwise) { c.Row = al(device.E4M3, 64, 32) }), x, quant.BlockOptions{}), "q.Row"},
		{"QuantizeBlockwiseInto/q.RowScale of E8M0", into(changed(func(c *quant.Blockwise) { c.RowScale = al(device.E8M0, 1, 64) }), x, quant.BlockOptions{}), "q.RowScale"},
		{"QuantizeBlockwiseInto/q.ColT set", into(changed(func(c *quant.Blockwise) { c.ColT = al(device.E4M3, 64, 128) }), x, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/q of zero value", into(&quant.Blockwise{}, al(device.BF16, 0, 0), quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseInto/nil x", into(q, nil, quant.BlockOptions{}), "x"},
		{"QuantizeBlockwiseInto/freed x", into(q, freed(device.BF16, 64, 64), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwiseInto/i32 x", into(q, al(device.I32, 64, 64), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwiseInto/x of another shape", into(q, al(device.BF16, 64, 32), quant.BlockOptions{}), "x"},
		{"QuantizeBlockwiseInto/opt.Format of another q", into(q, x, quant.BlockOptions{Format: quant.E5M2}), "opt.Format"},
		{"QuantizeBlockwiseInto/opt.Dir of another q", into(q, x, quant.BlockOptions{Dir: quant.Columnwise}), "opt.Dir"},
		{"QuantizeBlockwiseInto/groups into ungrouped q", into(q, x, quant.BlockOptions{GroupSizes: gs}), "opt.GroupSizes"},
		{"QuantizeBlockwiseInto/no groups into grouped q", into(qg, x, quant.BlockOptions{Dir: quant.Both}), "opt.GroupSizes"},
		{"QuantizeBlockwiseInto/too many groups", into(qg, x, quant.BlockOptions{Dir: quant.Both, GroupSizes: al(device.I32, 3)}), "opt.GroupSizes"},

		{"DequantizeBlockwise/nil stream", func() error { return quant.DequantizeBlockwise(nil, y, q, quant.Rowwise) }, "stream"},
		{"DequantizeBlockwise/nil dst", deq(nil, q, quant.Rowwise), "dst"},
		{"DequantizeBlockwise/freed dst", deq(freed(device.F32, 64, 64), q, quant.Rowwise), "dst"},
		{"DequantizeBlockwise/i32 dst", deq(al(device.I32, 64, 64), q, quant.Rowwise), "dst"},
		{"DequantizeBlockwise/dst of another shape", deq(al(device.F32, 64, 32), q, quant.Rowwise), "dst"},
		{"DequantizeBlockwise/rank-3 dst", deq(al(device.F32, 2, 32, 64), q, quant.Rowwise), "dst"},
		{"DequantizeBlockwise/nil q", deq(y, nil, quant.Rowwise), "q"},
		{"DequantizeBlockwise/freed q", deq(y, gone, quant.Rowwise), "q"},
		{"DequantizeBlockwise/q.K changed", deq(al(device.F32, 64, 32), changed(func(c *quant.Blockwise) { c.K = 32 }), quant.Rowwise), "q"},
		{"DequantizeBlockwise/q.RowScale replaced", deq(y, changed(func(c *quant.Blockwise) { c.RowScale = al(device.F32, 4, 4) }), quant.Rowwise), "q.RowScale"},
		{"DequantizeBlockwise/q.ColTScale replaced", deq(y, changed(func(c *quant.Blockwise) { c.ColT, c.ColTScale, c.Dir = qg.ColT, al(device.F32, 1, 64), quant.Both }), quant.Columnwise), "q"},
		{"DequantizeBlockwise/dir 9", deq(y, q, 9), "dir"},
		{"DequantizeBlockwise/dir Both", deq(y, q, quant.Both), "dir"},
		{"DequantizeBlockwise/dir missing from q", deq(y, q, quant.Columnwise), "dir"},

		{"QuantizeWeights/nil stream", func() error { _, err := quant.QuantizeWeights(nil, w, quant.BlockOptions{}); return err }, "stream"},
		{"QuantizeWeights/nil w", weights(nil, quant.BlockOptions{}), "w"},
		{"QuantizeWeights/freed w", weights(freed(device.BF16, 2, 64, 32), quant.BlockOptions{}), "w"},
		{"QuantizeWeights/i32 w", weights(al(device.I32, 2, 64, 32), quant.BlockOptions{}), "w"},
		{"QuantizeWeights/rank-2 w", weights(al(device.BF16, 64, 32), quant.BlockOptions{}), "w"},
		{"QuantizeWeights/K 40", weights(al(device.BF16, 2, 40, 32), quant.BlockOptions{}), "K"},
		{"QuantizeWeights/N 40", weights(al(device.F32, 2, 64, 40), quant.BlockOptions{}), "N"},
		{"QuantizeWeights/NK with K 40", weights(al(device.BF16, 2, 64, 40), quant.BlockOptions{NK: true}), "K"},
		{"QuantizeWeights/NK with N 8", weights(al(device.BF16, 1, 8, 64), quant.BlockOptions{NK: true}), "N"},
		{"QuantizeWeights/format 7", weights(w, quant.BlockOptions{Format: 7}), "opt.Format"},
		{"QuantizeWeights/scale 5", weights(w, quant.BlockOptions{Scale: 5}), "opt.Scale"},
		{"QuantizeWeights/group sizes", weights(w, quant.BlockOptions{GroupSizes: gs}), "opt.GroupSizes"},

		{"DequantizeWeights/nil stream", func() error { return quant.DequantizeWeights(nil, wdst, qw) }, "stream"},
		{"DequantizeWeights/nil dst", deqW(nil, qw), "dst"},
		{"DequantizeWeights/freed dst", deqW(freed(device.F32, 2, 64, 32), qw), "dst"},
		{"DequantizeWeights/i32 dst", deqW(al(device.I32, 2, 64, 32), qw), "dst"},
		{"DequantizeWeights/dst [G, N, K]", deqW(al(device.F32, 2, 32, 64), qw), "dst"},
		{"DequantizeWeights/nil q", deqW(wdst, nil), "q"},
		{"DequantizeWeights/freed q", deqW(wdst, goneW), "q"},
		{"DequantizeWeights/q.K changed", deqW(wdst, changedW(func(c *quant.BlockwiseWeights) { c.K = 32 })), "q"},
		{"DequantizeWeights/q.Format changed", deqW(wdst, changedW(func(c *quant.BlockwiseWeights) { c.Format = 9 })), "q"},
		{"DequantizeWeights/q.Scales replaced", deqW(wdst, changedW(func(c *quant.BlockwiseWeights) { c.Scales = al(device.F32, 2, 1, 2) })), "q.Scales"},
		{"DequantizeWeights/q.NMajor nil", deqW(wdst, changedW(func(c *quant.BlockwiseWeights) { c.NMajor = nil })), "q.NMajor"},
	}
	for _, b := range badOptions {
		cases = append(cases,
			badCase{"AllocBlockwise/" + b.name, alloc(s, 64, 64, b.opt), b.arg},
			badCase{"QuantizeBlockwise/" + b.name, quantize(x, b.opt), b.arg},
			badCase{"QuantizeBlockwiseInto/" + b.name, into(q, x, b.opt), b.arg})
	}
	runBadCases(t, cases)

	var none *quant.Blockwise
	var noneW *quant.BlockwiseWeights
	if err, errW := none.Free(), noneW.Free(); err != nil || errW != nil {
		t.Errorf("Free of nil: %v, %v, want nil", err, errW)
	}
	for _, c := range []*quant.Blockwise{q, qg} {
		if err := quant.DequantizeBlockwise(s, y, c, quant.Rowwise); err != nil {
			t.Errorf("DequantizeBlockwise with valid arguments: %v", err)
		}
		c.Free()
	}
	if err := quant.DequantizeWeights(s, wdst, qw); err != nil {
		t.Errorf("DequantizeWeights with valid arguments: %v", err)
	}
	qw.Free()
}
