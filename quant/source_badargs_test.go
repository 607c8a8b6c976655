package quant_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

// TestSourceBadArgs feeds QuantizeSource and QuantizeBlockwiseSource nil, freed,
// wrong-shape, wrong-dtype and incomplete arguments on the CPU: each returns an error
// naming the argument, without a panic.
func TestSourceBadArgs(t *testing.T) {
	s, al, freed, x, _, gs := badArgsFixture(t)
	q := dt.Must(quant.Alloc(s, 64, 64, quant.Options{}))
	bq := dt.Must(quant.AllocBlockwise(s, 64, 64, quant.BlockOptions{}))
	gone := dt.Must(quant.Alloc(s, 64, 64, quant.Options{}))
	bgone := dt.Must(quant.AllocBlockwise(s, 64, 64, quant.BlockOptions{}))
	dt.NoErr(t, gone.Free())
	dt.NoErr(t, bgone.Free())
	defer q.Free()
	defer bq.Free()
	// src returns a complete source of m×k values (all 1) that edit changes.
	src := func(m, k int, edit func(*quant.Source)) quant.Source {
		c := quant.Source{M: m, K: k, DType: device.BF16, Inputs: []*device.Tensor{x},
			Fill: func(v []float32) {
				for i := range v {
					v[i] = 1
				}
			},
			Program: device.NewProgram("never_compiled.cu", ""), Kernels: "none", Loader: struct{ N int32 }{1}}
		if edit != nil {
			edit(&c)
		}
		return c
	}
	mx := func(q *quant.MXFP8, c quant.Source, opt quant.Options) func() error {
		return func() error { return quant.QuantizeSource(s, q, c, opt) }
	}
	bw := func(q *quant.Blockwise, c quant.Source, opt quant.BlockOptions) func() error {
		return func() error { return quant.QuantizeBlockwiseSource(s, q, c, opt) }
	}
	// The source's own faults, refused by both.
	srcCases := []struct {
		name string
		src  quant.Source
		arg  string
	}{
		{"src.M of another q", src(32, 64, nil), "src"},
		{"src.K of another q", src(64, 63, nil), "src"},
		{"src.DType f16", src(64, 64, func(c *quant.Source) { c.DType = device.F16 }), "src.DType"},
		{"src.DType invalid", src(64, 64, func(c *quant.Source) { c.DType = device.Invalid }), "src.DType"},
		{"nil src.Fill", src(64, 64, func(c *quant.Source) { c.Fill = nil }), "src.Fill"},
		{"nil src.Program", src(64, 64, func(c *quant.Source) { c.Program = nil }), "src.Program"},
		{"empty src.Kernels", src(64, 64, func(c *quant.Source) { c.Kernels = "" }), "src.Kernels"},
		{"nil src.Loader", src(64, 64, func(c *quant.Source) { c.Loader = nil }), "src.Loader"},
		{"nil input", src(64, 64, func(c *quant.Source) { c.Inputs = []*device.Tensor{nil} }), "src.Inputs"},
		{"freed input", src(64, 64, func(c *quant.Source) { c.Inputs = []*device.Tensor{freed(device.BF16, 4)} }), "src.Inputs"},
	}
	ok := src(64, 64, nil)
	cases := []badCase{
		{"QuantizeSource/nil stream", func() error { return quant.QuantizeSource(nil, q, ok, quant.Options{}) }, "stream"},
		{"QuantizeSource/nil q", mx(nil, ok, quant.Options{}), "q"},
		{"QuantizeSource/freed q", mx(gone, ok, quant.Options{}), "q"},
		{"QuantizeSource/opt.Format of another q", mx(q, ok, quant.Options{Format: quant.E5M2}), "opt.Format"},
		{"QuantizeSource/opt.Dir of another q", mx(q, ok, quant.Options{Dir: quant.Both}), "opt.Dir"},
		{"QuantizeSource/groups into ungrouped q", mx(q, ok, quant.Options{GroupSizes: gs}), "opt.GroupSizes"},
		{"QuantizeSource/opt.Mode 5", mx(q, ok, quant.Options{Mode: 5}), "opt.Mode"},
		{"QuantizeSource/opt.NK", mx(q, ok, quant.Options{NK: true}), "opt.NK"},
		{"QuantizeSource/f32 group sizes", mx(q, ok, quant.Options{GroupSizes: al(device.F32, 2)}), "opt.GroupSizes"},

		{"QuantizeBlockwiseSource/nil stream", func() error { return quant.QuantizeBlockwiseSource(nil, bq, ok, quant.BlockOptions{}) }, "stream"},
		{"QuantizeBlockwiseSource/nil q", bw(nil, ok, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseSource/freed q", bw(bgone, ok, quant.BlockOptions{}), "q"},
		{"QuantizeBlockwiseSource/opt.Format of another q", bw(bq, ok, quant.BlockOptions{Format: quant.E5M2}), "opt.Format"},
		{"QuantizeBlockwiseSource/opt.Dir of another q", bw(bq, ok, quant.BlockOptions{Dir: quant.Both}), "opt.Dir"},
		{"QuantizeBlockwiseSource/groups into ungrouped q", bw(bq, ok, quant.BlockOptions{GroupSizes: gs}), "opt.GroupSizes"},
		{"QuantizeBlockwiseSource/opt.Scale 5", bw(bq, ok, quant.BlockOptions{Scale: 5}), "opt.Scale"},
		{"QuantizeBlockwiseSource/opt.NK", bw(bq, ok, quant.BlockOptions{NK: true}), "opt.NK"},
	}
	for _, c := range srcCases {
		cases = append(cases,
			badCase{"QuantizeSource/" + c.name, mx(q, c.src, quant.Options{}), c.arg},
			badCase{"QuantizeBlockwiseSource/" + c.name, bw(bq, c.src, quant.BlockOptions{}), c.arg})
	}
	runBadCases(t, cases)

	// The valid source quantizes on the CPU without its kernels.
	dt.NoErr(t, quant.QuantizeSource(s, q, ok, quant.Options{}))
	dt.NoErr(t, quant.QuantizeBlockwiseSource(s, bq, ok, quant.BlockOptions{}))
}

// TestExampleKernelsCompile compiles the program of ExampleQuantizeSource.
func TestExampleKernelsCompile(t *testing.T) { dt.CheckCompiles(t, sumProgram) }
