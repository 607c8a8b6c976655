package gemm_test

import (
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// badCase is one call with a bad argument: it must return an error, without a
// panic, whose text names arg.
type badCase struct {
	name string
	call func() error
	arg  string
}

// runBad runs each case in a subtest of its own.
func runBad(t *testing.T, cases []badCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { dt.WantErrorNaming(t, c.call, c.arg) })
	}
}

// TestBadArgs feeds every exported function nil, freed, wrong-shape, wrong-dtype and
// out-of-range arguments on the CPU: each returns an error naming the argument.
func TestBadArgs(t *testing.T) {
	s := device.CPU().Stream()
	al := func(typ device.DType, shape ...int) *device.Tensor { return dt.Must(s.Alloc(typ, shape...)) }
	freed := func(x *device.Tensor) *device.Tensor { return dt.Freed(t, s, x.DType(), x.Shape()...) }
	const big = math.MaxInt32 // a dimension the kernels cannot index
	bf := device.BF16
	sizes := dt.Must(device.FromSlice(s, device.I32, []int32{4, 6}, 2))
	type fn func(s *device.Stream, out, a, b, sizes *device.Tensor, opt *gemm.Options) error
	type arg struct {
		i int            // argument: 0 out, 1 a, 2 b, 3 sizes
		t *device.Tensor // of a wrong shape
	}
	// huge holds the shapes of out, a and b in a call whose M, K or N is too large (of
	// no elements), and the argument the error must name.
	type huge struct {
		shapes [][]int
		arg    string
	}
	ops := []struct {
		name  string
		call  fn
		names [4]string
		args  [4]*device.Tensor // valid arguments: out, a, b, sizes
		shape []arg
		huge  [3]huge
	}{
		{
			name: "RaggedDot", call: gemm.RaggedDot, names: [4]string{"y", "x", "w", "sizes"},
			args:  [4]*device.Tensor{al(bf, 10, 6), al(bf, 10, 8), al(bf, 2, 8, 6), sizes},
			shape: []arg{{0, al(bf, 10, 5)}, {0, al(bf, 9, 6)}, {0, al(bf, 10, 6, 1)}, {1, al(bf, 10, 7)}, {1, al(bf, 10)}, {2, al(bf, 2, 8, 5)}, {2, al(bf, 3, 8, 6)}, {2, al(bf, 16, 6)}, {3, al(device.I32, 2, 1)}},
			huge:  [3]huge{{[][]int{{big, 0}, {big, 0}, {1, 0, 0}}, "x"}, {[][]int{{0, 0}, {0, big}, {1, big, 0}}, "x"}, {[][]int{{0, big}, {0, 0}, {1, 0, big}}, "y"}},
		},
		{
			name: "RaggedDotInputGrad", call: gemm.RaggedDotInputGrad, names: [4]string{"dx", "dy", "w", "sizes"},
			args:  [4]*device.Tensor{al(bf, 10, 8), al(bf, 10, 6), al(bf, 2, 8, 6), sizes},
			shape: []arg{{0, al(bf, 10, 7)}, {0, al(bf, 9, 8)}, {1, al(bf, 10, 5)}, {2, al(bf, 2, 8, 5)}, {2, al(bf, 1, 8, 6)}, {3, al(device.I32, 2, 1)}},
			huge:  [3]huge{{[][]int{{big, 0}, {big, 0}, {1, 0, 0}}, "dy"}, {[][]int{{0, big}, {0, 0}, {1, big, 0}}, "dx"}, {[][]int{{0, 0}, {0, big}, {1, 0, big}}, "dy"}},
		},
		{
			name: "RaggedDotWeightGrad", call: gemm.RaggedDotWeightGrad, names: [4]string{"dw", "x", "dy", "sizes"},
			args:  [4]*device.Tensor{al(bf, 2, 8, 6), al(bf, 10, 8), al(bf, 10, 6), sizes},
			shape: []arg{{0, al(bf, 2, 8, 5)}, {0, al(bf, 2, 6, 8)}, {0, al(bf, 3, 8, 6)}, {1, al(bf, 10, 7)}, {1, al(bf, 10, 8, 1)}, {2, al(bf, 10, 5)}, {2, al(bf, 9, 6)}, {3, al(device.I32, 3)}},
			huge:  [3]huge{{[][]int{{1, 0, 0}, {big, 0}, {big, 0}}, "x"}, {[][]int{{1, big, 0}, {0, big}, {0, 0}}, "x"}, {[][]int{{1, 0, big}, {0, 0}, {0, big}}, "dy"}},
		},
	}
	var cases []badCase
	for _, op := range ops {
		valid := op.args
		if err := op.call(s, valid[0], valid[1], valid[2], valid[3], nil); err != nil {
			t.Fatalf("%s with valid arguments: %v", op.name, err)
		}
		// with returns a call of op with argument i replaced by x.
		with := func(i int, x *device.Tensor, opt *gemm.Options) func() error {
			a := valid
			if i >= 0 {
				a[i] = x
			}
			return func() error { return op.call(s, a[0], a[1], a[2], a[3], opt) }
		}
		add := func(name string, call func() error, arg string) {
			cases = append(cases, badCase{name: op.name + "/" + name, call: call, arg: arg})
		}
		add("nil stream", func() error { return op.call(nil, valid[0], valid[1], valid[2], valid[3], nil) }, "stream")
		for i, x := range valid {
			n := op.names[i]
			add("nil "+n, with(i, nil, nil), n)
			add("freed "+n, with(i, freed(x), nil), n)
			wrong := device.F16
			if i == 3 {
				wrong = device.I64
			}
			add(n+" "+wrong.String(), with(i, al(wrong, x.Shape()...), nil), n)
		}
		for _, a := range op.shape {
			add(op.names[a.i]+" "+a.t.String(), with(a.i, a.t, nil), op.names[a.i])
		}
		for d, h := range op.huge {
			one := dt.Must(device.FromSlice(s, device.I32, []int32{0}, 1))
			x := [3]*device.Tensor{al(bf, h.shapes[0]...), al(bf, h.shapes[1]...), al(bf, h.shapes[2]...)}
			add("huge "+"MKN"[d:d+1], func() error { return op.call(s, x[0], x[1], x[2], one, nil) }, h.arg)
		}
		add("layout 7", with(-1, nil, &gemm.Options{Layout: 7}), "opt.Layout")
		add("layout -1", with(-1, nil, &gemm.Options{Layout: -1}), "opt.Layout")
		add("status not from NewStatus", with(-1, nil, &gemm.Options{Status: &device.Status{}}), "opt.Status")
		add("freed status", with(-1, nil, &gemm.Options{Status: dt.FreedStatus(t, s)}), "opt.Status")
		if op.names[0] != "dw" {
			add("accumulate", with(-1, nil, &gemm.Options{Accumulate: true}), "opt.Accumulate")
		}
	}

	cases = append(cases,
		badCase{name: "CheckStatus/nil stream", call: func() error { return gemm.CheckStatus(nil) }, arg: "stream"},
		badCase{name: "ResetStatus/nil stream", call: func() error { return gemm.ResetStatus(nil) }, arg: "stream"},
	)
	runBad(t, cases)
}
