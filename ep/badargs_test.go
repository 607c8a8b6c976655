package ep_test

import (
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/quant"
)

func errOf[T any](_ T, err error) error { return err }

func errOf2[T, U any](_ T, _ U, err error) error { return err }

// fixture is one rank of a one-rank CPU world, made anew for each case (a bad call of
// the transport aborts the world): a group of E = 2 experts, top-2, and the layout of
// T = 2 tokens routed {0, 1}, {1, -1}, whose buffers have Capacity = 4 rows; x is F32
// [T, H = 4], wts F32 [T, K], and y, yw what Dispatch made of them (F32 [4, 4], F32 [4]).
type fixture struct {
	t      *testing.T
	w      *ep.World
	tr     ep.Transport
	g      *ep.Group
	s      *device.Stream
	l      *ep.Layout
	idx    *device.Tensor
	x, wts *device.Tensor
	y, yw  *device.Tensor
}

const fxT, fxH, fxK, fxCap = 2, 4, 2, 4

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{t: t, w: dt.Must(ep.NewWorld(1)), s: device.CPU().Stream()}
	f.tr = f.w.Transport(0)
	f.g = dt.Must(ep.NewGroup(f.tr, ep.Config{Experts: 2, TopK: fxK}))
	f.idx = dt.Must(device.FromSlice(f.s, device.I32, []int32{0, 1, 1, -1}, fxT, fxK))
	f.l = dt.Must(f.g.Layout(f.s, f.idx))
	if f.l.Capacity() != fxCap {
		t.Fatalf("fixture capacity %d, want %d", f.l.Capacity(), fxCap)
	}
	f.x = f.alloc(device.F32, fxT, fxH)
	f.wts = f.alloc(device.F32, fxT, fxK)
	D := dt.Must(f.l.Dispatch(f.s, f.x, f.wts))
	f.y, f.yw = D.X, D.Weights
	return f
}

func (f *fixture) alloc(d device.DType, shape ...int) *device.Tensor {
	return dt.Must(f.s.Alloc(d, shape...))
}

// mx returns the MXFP8 quantization of an F32 [m, fxH] tensor with opt.
func (f *fixture) mx(m int, opt quant.Options) *quant.MXFP8 {
	return dt.Must(quant.Quantize(f.s, f.alloc(device.F32, m, fxH), opt))
}

// bw returns the blockwise quantization of an F32 [m, fxH] tensor with opt.
func (f *fixture) bw(m int, opt quant.BlockOptions) *quant.Blockwise {
	return dt.Must(quant.QuantizeBlockwise(f.s, f.alloc(device.F32, m, fxH), opt))
}

// freed returns a tensor that has been freed.
func (f *fixture) freed(d device.DType, shape ...int) *device.Tensor {
	return dt.Freed(f.t, f.s, d, shape...)
}

// freedLayout returns the fixture's layout, freed.
func (f *fixture) freedLayout() *ep.Layout {
	f.l.Free()
	return f.l
}

// exchange returns a valid exchange of one rank's rows of send and recv, for cases to spoil.
func (f *fixture) exchange() *ep.Exchange {
	return &ep.Exchange{Send: []*device.Tensor{f.alloc(device.F32, 3, 2)}, Recv: []*device.Tensor{f.alloc(device.F32, 3, 2)},
		SendOff: []int{0}, SendCount: []int{3}, RecvOff: []int{0}, RecvCount: []int{3}}
}

// TestBadArgs feeds every exported function and method of the package nil, freed,
// wrong-shape, wrong-dtype and out-of-range arguments on the CPU: each must return an
// error, not panic, whose text names the function and the argument.
func TestBadArgs(t *testing.T) {
	f32, bf16 := device.F32, device.BF16
	cpu := device.CPU()
	var nilStream *device.Stream
	cfg := func(c ep.Config) error {
		w := dt.Must(ep.NewWorld(2))
		return errOf(ep.NewGroup(w.Transport(0), c))
	}
	for _, tc := range []struct {
		name string
		call func(f *fixture) error
		want []string // substrings of the error
	}{
		// NewWorld and World.
		{"NewWorld/no ranks", func(*fixture) error { return errOf(ep.NewWorld(0)) }, []string{"NewWorld(0)", "1 to 1024"}},
		{"NewWorld/too many ranks", func(*fixture) error { return errOf(ep.NewWorld(ep.MaxRanks + 1)) }, []string{"NewWorld(1025)"}},
		{"NewWorld/devices", func(*fixture) error { return errOf(ep.NewWorld(2, cpu, cpu, cpu)) }, []string{"3 devices", "0, 1 or 2"}},
		{"NewWorld/nil device", func(*fixture) error { return errOf(ep.NewWorld(2, nil)) }, []string{"NewWorld", "device 0 is nil"}},
		{"World.Run/nil function", func(f *fixture) error { return f.w.Run(nil) }, []string{"World.Run", "nil function"}},
		{"World.Run/nil world", func(*fixture) error { return (*ep.World)(nil).Run(func(ep.Transport) error { return nil }) }, []string{"World.Run", "nil World"}},
		{"World.Transport/rank past the size", func(f *fixture) error { return f.w.Transport(1).Sync(f.s) }, []string{"World.Transport(1)", "1 ranks"}},
		{"World.Transport/negative rank", func(f *fixture) error { return errOf(ep.NewGroup(f.w.Transport(-1), ep.Config{Experts: 1, TopK: 1})) }, []string{"rank -1", "1 ranks"}},

		// NewGroup and Config.
		{"NewGroup/nil transport", func(*fixture) error { return errOf(ep.NewGroup(nil, ep.Config{Experts: 2, TopK: 1})) }, []string{"NewGroup", "nil transport"}},
		{"NewGroup/Experts not a multiple", func(*fixture) error { return cfg(ep.Config{Experts: 3, TopK: 2}) }, []string{"Config.Experts = 3", "multiple of the 2 ranks"}},
		{"NewGroup/Experts 0", func(*fixture) error { return cfg(ep.Config{Experts: 0, TopK: 2}) }, []string{"Config.Experts = 0"}},
		{"NewGroup/Experts too many", func(*fixture) error { return cfg(ep.Config{Experts: ep.MaxExperts + 2, TopK: 2}) }, []string{"Config.Experts = 8194"}},
		{"NewGroup/TopK 0", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 0}) }, []string{"Config.TopK = 0"}},
		{"NewGroup/TopK too many", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: ep.MaxTopK + 1}) }, []string{"Config.TopK = 65"}},
		{"NewGroup/Factor 0", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Capacity: ep.Factor(0)}) }, []string{"capacity Factor(0)", "positive"}},
		{"NewGroup/Factor NaN", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Capacity: ep.Factor(math.NaN())}) }, []string{"capacity Factor(NaN)"}},
		{"NewGroup/Factor Inf", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Capacity: ep.Factor(math.Inf(1))}) }, []string{"capacity Factor(+Inf)"}},
		{"NewGroup/Rows negative", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Capacity: ep.Rows(-1)}) }, []string{"capacity Rows(-1)"}},
		{"NewGroup/Rows too many", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Capacity: ep.Rows(1 << 31)}) }, []string{"capacity Rows(2147483648)"}},
		{"NewGroup/Overflow", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Overflow: 7}) }, []string{"Config.Overflow = Overflow(7)", "FailOnOverflow or DropOverflow"}},
		{"NewGroup/CheckEvery", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, CheckEvery: -1}) }, []string{"Config.CheckEvery = -1"}},
		{"NewGroup/Chunks negative", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Chunks: -1}) }, []string{"Config.Chunks = -1"}},
		{"NewGroup/Chunks too many", func(*fixture) error { return cfg(ep.Config{Experts: 2, TopK: 1, Chunks: 65}) }, []string{"Config.Chunks = 65"}},

		// Group.
		{"Group.Layout/nil group", func(f *fixture) error { return errOf((*ep.Group)(nil).Layout(f.s, f.idx)) }, []string{"Layout", "nil Group"}},
		{"Group.Layout/nil stream", func(f *fixture) error { return errOf(f.g.Layout(nil, f.idx)) }, []string{"Layout", "nil stream"}},
		{"Group.Layout/nil topk_idx", func(f *fixture) error { return errOf(f.g.Layout(f.s, nil)) }, []string{"Layout: topk_idx is nil"}},
		{"Group.Layout/freed topk_idx", func(f *fixture) error { return errOf(f.g.Layout(f.s, f.freed(device.I32, fxT, fxK))) }, []string{"Layout: topk_idx", "freed"}},
		{"Group.Layout/topk_idx dtype", func(f *fixture) error { return errOf(f.g.Layout(f.s, f.alloc(device.I64, fxT, fxK))) }, []string{"Layout: topk_idx is i64[2 2]", "want i32[T 2]"}},
		{"Group.Layout/topk_idx vector", func(f *fixture) error { return errOf(f.g.Layout(f.s, f.alloc(device.I32, fxT*fxK))) }, []string{"Layout: topk_idx is i32[4]"}},
		{"Group.Layout/topk_idx width", func(f *fixture) error { return errOf(f.g.Layout(f.s, f.alloc(device.I32, fxT, fxK+1))) }, []string{"Layout: topk_idx is i32[2 3]"}},
		{"Group.Layout/topk_idx value", func(f *fixture) error {
			return errOf(f.g.Layout(f.s, dt.Must(device.FromSlice(f.s, device.I32, []int32{0, 2}, 1, 2))))
		}, []string{"Layout: this rank's topk_idx[0, 1] is not -1 or an expert in [0, 2)"}},
		{"Group.Layout/closed group", func(f *fixture) error { f.g.Close(); return errOf(f.g.Layout(f.s, f.idx)) }, []string{"Layout", "closed"}},
		{"Group.Close/nil group", func(*fixture) error { return (*ep.Group)(nil).Close() }, []string{"Close", "nil Group"}},

		// Dispatch.
		{"Dispatch/nil layout", func(f *fixture) error { return errOf((*ep.Layout)(nil).Dispatch(f.s, f.x, nil)) }, []string{"Dispatch", "nil Layout"}},
		{"Dispatch/freed layout", func(f *fixture) error { return errOf(f.freedLayout().Dispatch(f.s, f.x, nil)) }, []string{"Dispatch", "layout was freed"}},
		{"Dispatch/closed group", func(f *fixture) error { f.g.Close(); return errOf(f.l.Dispatch(f.s, f.x, nil)) }, []string{"Dispatch", "closed"}},
		{"Dispatch/nil stream", func(f *fixture) error { return errOf(f.l.Dispatch(nilStream, f.x, nil)) }, []string{"Dispatch", "nil stream"}},
		{"Dispatch/nil x", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, nil, nil)) }, []string{"Dispatch: x is nil"}},
		{"Dispatch/freed x", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.freed(f32, fxT, fxH), nil)) }, []string{"Dispatch: x", "freed"}},
		{"Dispatch/x rows", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.alloc(f32, fxT+1, fxH), nil)) }, []string{"Dispatch: x is f32[3 4]", "want [2 _]"}},
		{"Dispatch/x vector", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.alloc(f32, fxT), nil)) }, []string{"Dispatch: x is f32[2]"}},
		{"Dispatch/weights shape", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.x, f.alloc(f32, fxT, fxK+1))) }, []string{"Dispatch: weights is f32[2 3]", "want f32[2 2]"}},
		{"Dispatch/weights dtype", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.x, f.alloc(bf16, fxT, fxK))) }, []string{"Dispatch: weights is bf16[2 2]"}},
		{"Dispatch/freed weights", func(f *fixture) error { return errOf(f.l.Dispatch(f.s, f.x, f.freed(f32, fxT, fxK))) }, []string{"Dispatch: weights", "freed"}},

		// DispatchMXFP8.
		{"DispatchMXFP8/nil layout", func(f *fixture) error {
			return errOf((*ep.Layout)(nil).DispatchMXFP8(f.s, f.mx(fxT, quant.Options{}), nil))
		}, []string{"DispatchMXFP8", "nil Layout"}},
		{"DispatchMXFP8/nil stream", func(f *fixture) error { return errOf(f.l.DispatchMXFP8(nilStream, f.mx(fxT, quant.Options{}), nil)) }, []string{"DispatchMXFP8", "nil stream"}},
		{"DispatchMXFP8/nil q", func(f *fixture) error { return errOf(f.l.DispatchMXFP8(f.s, nil, nil)) }, []string{"DispatchMXFP8: q is nil"}},
		{"DispatchMXFP8/columnwise q", func(f *fixture) error {
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{Dir: quant.Columnwise}), nil))
		}, []string{"DispatchMXFP8: q.Dir is columnwise", "rowwise form"}},
		{"DispatchMXFP8/no Row", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.Row = nil
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q has no rowwise form"}},
		{"DispatchMXFP8/swizzled", func(f *fixture) error {
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{Swizzle: true}), nil))
		}, []string{"DispatchMXFP8: q has swizzled scales"}},
		{"DispatchMXFP8/grouped", func(f *fixture) error {
			gs := dt.Must(device.FromSlice(f.s, device.I32, []int32{fxT}, 1))
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{GroupSizes: gs}), nil))
		}, []string{"DispatchMXFP8: q has a grouped layout (1 groups)"}},
		{"DispatchMXFP8/q.M", func(f *fixture) error { return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT+1, quant.Options{}), nil)) }, []string{"DispatchMXFP8: q.M is 3", "2 tokens"}},
		{"DispatchMXFP8/q.K", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.K++
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.Row is e4m3[2 4]", "want e4m3[2 5]"}},
		{"DispatchMXFP8/q.Format", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.Format = 7
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.Format is Format(7)", "E4M3 or E5M2"}},
		{"DispatchMXFP8/q.Mode", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.Mode = 9
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.Mode is", "RCEIL or FLOOR"}},
		{"DispatchMXFP8/format not Row's", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.Format = quant.E5M2
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.Row is e4m3[2 4]", "want e5m2[2 4]"}},
		{"DispatchMXFP8/RowScale shape", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.RowScale = f.alloc(device.E8M0, 128, 8)
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.RowScale is e8m0[128 8]", "want e8m0[128 4]"}},
		{"DispatchMXFP8/RowScale dtype", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.RowScale = f.alloc(device.E4M3, 128, 4)
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.RowScale is e4m3[128 4]"}},
		{"DispatchMXFP8/freed Row", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.Row.Free()
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.Row", "freed"}},
		{"DispatchMXFP8/weights shape", func(f *fixture) error {
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{}), f.alloc(f32, fxT, fxK+1)))
		}, []string{"DispatchMXFP8: weights is f32[2 3]", "want f32[2 2]"}},
		{"DispatchMXFP8/weights dtype", func(f *fixture) error {
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{}), f.alloc(bf16, fxT, fxK)))
		}, []string{"DispatchMXFP8: weights is bf16[2 2]"}},
		{"DispatchMXFP8/freed weights", func(f *fixture) error {
			return errOf(f.l.DispatchMXFP8(f.s, f.mx(fxT, quant.Options{}), f.freed(f32, fxT, fxK)))
		}, []string{"DispatchMXFP8: weights", "freed"}},
		{"DispatchMXFP8/freed layout", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			return errOf(f.freedLayout().DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8", "layout was freed"}},
		{"DispatchMXFP8/closed group", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			f.g.Close()
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8", "closed"}},
		{"DispatchMXFP8/freed RowScale", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.RowScale.Free()
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.RowScale", "freed"}},
		{"DispatchMXFP8/negative q.K", func(f *fixture) error {
			q := f.mx(fxT, quant.Options{})
			q.K = -1
			return errOf(f.l.DispatchMXFP8(f.s, q, nil))
		}, []string{"DispatchMXFP8: q.K is -1", "want H ≥ 0"}},

		// DispatchBlockwise.
		{"DispatchBlockwise/nil layout", func(f *fixture) error {
			return errOf((*ep.Layout)(nil).DispatchBlockwise(f.s, f.bw(fxT, quant.BlockOptions{}), nil))
		}, []string{"DispatchBlockwise", "nil Layout"}},
		{"DispatchBlockwise/nil stream", func(f *fixture) error {
			return errOf(f.l.DispatchBlockwise(nilStream, f.bw(fxT, quant.BlockOptions{}), nil))
		}, []string{"DispatchBlockwise", "nil stream"}},
		{"DispatchBlockwise/nil q", func(f *fixture) error { return errOf(f.l.DispatchBlockwise(f.s, nil, nil)) }, []string{"DispatchBlockwise: q is nil"}},
		{"DispatchBlockwise/columnwise q", func(f *fixture) error {
			return errOf(f.l.DispatchBlockwise(f.s, f.bw(fxT, quant.BlockOptions{Dir: quant.Columnwise}), nil))
		}, []string{"DispatchBlockwise: q.Dir is columnwise", "rowwise form"}},
		{"DispatchBlockwise/no RowScale", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.RowScale = nil
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q has no rowwise form"}},
		{"DispatchBlockwise/grouped", func(f *fixture) error {
			gs := dt.Must(device.FromSlice(f.s, device.I32, []int32{fxT}, 1))
			return errOf(f.l.DispatchBlockwise(f.s, f.bw(fxT, quant.BlockOptions{GroupSizes: gs}), nil))
		}, []string{"DispatchBlockwise: q has a grouped layout (1 groups)"}},
		{"DispatchBlockwise/q.M", func(f *fixture) error {
			return errOf(f.l.DispatchBlockwise(f.s, f.bw(fxT+1, quant.BlockOptions{}), nil))
		}, []string{"DispatchBlockwise: q.M is 3", "2 tokens"}},
		{"DispatchBlockwise/q.K", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.K++
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.Row is e4m3[2 4]", "want e4m3[2 5]"}},
		{"DispatchBlockwise/negative q.K", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.K = -1
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.K is -1", "want H ≥ 0"}},
		{"DispatchBlockwise/q.Format", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.Format = quant.E5M2
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.Row is e4m3[2 4]", "want e5m2[2 4]"}},
		{"DispatchBlockwise/q.Scale", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.Scale = 5
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.Scale is ScaleKind(5)", "f32 or pow2"}},
		{"DispatchBlockwise/RowScale shape", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.RowScale = f.alloc(f32, 1, 2)
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.RowScale is f32[1 2]", "want f32[1 4]"}},
		{"DispatchBlockwise/RowScale dtype", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.RowScale = f.alloc(device.E8M0, 1, 4)
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.RowScale is e8m0[1 4]"}},
		{"DispatchBlockwise/freed RowScale", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			q.RowScale.Free()
			return errOf(f.l.DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise: q.RowScale", "freed"}},
		{"DispatchBlockwise/weights shape", func(f *fixture) error {
			return errOf(f.l.DispatchBlockwise(f.s, f.bw(fxT, quant.BlockOptions{}), f.alloc(f32, fxT, fxK+1)))
		}, []string{"DispatchBlockwise: weights is f32[2 3]", "want f32[2 2]"}},
		{"DispatchBlockwise/freed layout", func(f *fixture) error {
			q := f.bw(fxT, quant.BlockOptions{})
			return errOf(f.freedLayout().DispatchBlockwise(f.s, q, nil))
		}, []string{"DispatchBlockwise", "layout was freed"}},

		// Combine.
		{"Combine/nil layout", func(f *fixture) error { return errOf((*ep.Layout)(nil).Combine(f.s, f.y, nil)) }, []string{"Combine", "nil Layout"}},
		{"Combine/freed layout", func(f *fixture) error { return errOf(f.freedLayout().Combine(f.s, f.y, nil)) }, []string{"Combine", "layout was freed"}},
		{"Combine/nil stream", func(f *fixture) error { return errOf(f.l.Combine(nilStream, f.y, nil)) }, []string{"Combine", "nil stream"}},
		{"Combine/nil y", func(f *fixture) error { return errOf(f.l.Combine(f.s, nil, nil)) }, []string{"Combine: y is nil"}},
		{"Combine/freed y", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.freed(f32, fxCap, fxH), nil)) }, []string{"Combine: y", "freed"}},
		{"Combine/y rows", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.alloc(f32, fxCap+1, fxH), nil)) }, []string{"Combine: y is f32[5 4]", "want [4 _]"}},
		{"Combine/y vector", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.alloc(f32, fxCap), nil)) }, []string{"Combine: y is f32[4]"}},
		{"Combine/y dtype", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.alloc(device.E4M3, fxCap, fxH), nil)) }, []string{"Combine: y is e4m3[4 4]", "f32, bf16 or f16"}},
		{"Combine/w shape", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.y, f.alloc(f32, fxCap+1))) }, []string{"Combine: w is f32[5]", "want f32[4]"}},
		{"Combine/w dtype", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.y, f.alloc(bf16, fxCap))) }, []string{"Combine: w is bf16[4]"}},
		{"Combine/freed w", func(f *fixture) error { return errOf(f.l.Combine(f.s, f.y, f.freed(f32, fxCap))) }, []string{"Combine: w", "freed"}},

		// CombineBackward.
		{"CombineBackward/nil layout", func(f *fixture) error { return errOf2((*ep.Layout)(nil).CombineBackward(f.s, f.x, nil, nil)) }, []string{"CombineBackward", "nil Layout"}},
		{"CombineBackward/freed layout", func(f *fixture) error { return errOf2(f.freedLayout().CombineBackward(f.s, f.x, nil, nil)) }, []string{"CombineBackward", "layout was freed"}},
		{"CombineBackward/nil stream", func(f *fixture) error { return errOf2(f.l.CombineBackward(nilStream, f.x, nil, nil)) }, []string{"CombineBackward", "nil stream"}},
		{"CombineBackward/nil dout", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, nil, nil, nil)) }, []string{"CombineBackward: dout is nil"}},
		{"CombineBackward/freed dout", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.freed(f32, fxT, fxH), nil, nil)) }, []string{"CombineBackward: dout", "freed"}},
		{"CombineBackward/dout rows", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.alloc(f32, fxT+1, fxH), nil, nil)) }, []string{"CombineBackward: dout is f32[3 4]"}},
		{"CombineBackward/dout dtype", func(f *fixture) error {
			return errOf2(f.l.CombineBackward(f.s, f.alloc(device.I32, fxT, fxH), nil, nil))
		}, []string{"CombineBackward: dout is i32[2 4]"}},
		{"CombineBackward/dout wider than y", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.alloc(f32, fxT, fxH+1), f.y, nil)) }, []string{"CombineBackward: dout is f32[2 5]", "want f32[2 4]", "y f32[4 4]"}},
		{"CombineBackward/dout dtype not y's", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.alloc(bf16, fxT, fxH), f.y, nil)) }, []string{"CombineBackward: dout is bf16[2 4]", "want f32[2 4]"}},
		{"CombineBackward/y rows", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.x, f.alloc(f32, fxCap+1, fxH), nil)) }, []string{"CombineBackward: y is f32[5 4]"}},
		{"CombineBackward/freed y", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.x, f.freed(f32, fxCap, fxH), nil)) }, []string{"CombineBackward: y", "freed"}},
		{"CombineBackward/w shape", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.x, f.y, f.alloc(f32, 1))) }, []string{"CombineBackward: w is f32[1]"}},
		{"CombineBackward/w dtype", func(f *fixture) error { return errOf2(f.l.CombineBackward(f.s, f.x, f.y, f.alloc(bf16, fxCap))) }, []string{"CombineBackward: w is bf16[4]"}},

		// DispatchBackward.
		{"DispatchBackward/nil layout", func(f *fixture) error { return errOf2((*ep.Layout)(nil).DispatchBackward(f.s, f.y, nil)) }, []string{"DispatchBackward", "nil Layout"}},
		{"DispatchBackward/nil stream", func(f *fixture) error { return errOf2(f.l.DispatchBackward(nilStream, f.y, nil)) }, []string{"DispatchBackward", "nil stream"}},
		{"DispatchBackward/nil dX", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, nil, nil)) }, []string{"DispatchBackward: dX is nil"}},
		{"DispatchBackward/freed dX", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, f.freed(f32, fxCap, fxH), nil)) }, []string{"DispatchBackward: dX", "freed"}},
		{"DispatchBackward/dX rows", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, f.alloc(f32, fxCap+1, fxH), nil)) }, []string{"DispatchBackward: dX is f32[5 4]"}},
		{"DispatchBackward/dX dtype", func(f *fixture) error {
			return errOf2(f.l.DispatchBackward(f.s, f.alloc(device.E4M3, fxCap, fxH), nil))
		}, []string{"DispatchBackward: dX is e4m3[4 4]"}},
		{"DispatchBackward/dW shape", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, f.y, f.alloc(f32, fxCap+1))) }, []string{"DispatchBackward: dW is f32[5]"}},
		{"DispatchBackward/dW dtype", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, f.y, f.alloc(bf16, fxCap))) }, []string{"DispatchBackward: dW is bf16[4]"}},
		{"DispatchBackward/freed dW", func(f *fixture) error { return errOf2(f.l.DispatchBackward(f.s, f.y, f.freed(f32, fxCap))) }, []string{"DispatchBackward: dW", "freed"}},

		// Origins.
		{"Origins/nil layout", func(f *fixture) error { return errOf((*ep.Layout)(nil).Origins(f.s)) }, []string{"Origins", "nil Layout"}},
		{"Origins/nil stream", func(f *fixture) error { return errOf(f.l.Origins(nilStream)) }, []string{"Origins", "nil stream"}},
		{"Origins/freed layout", func(f *fixture) error { return errOf(f.freedLayout().Origins(f.s)) }, []string{"Origins", "layout was freed"}},

		// The in-process transport.
		{"AllGather/nil stream", func(f *fixture) error { return f.tr.AllGather(nilStream, f.alloc(f32, 2), f.alloc(f32, 2)) }, []string{"AllGather", "nil stream"}},
		{"AllGather/nil send", func(f *fixture) error { return f.tr.AllGather(f.s, nil, f.alloc(f32, 2)) }, []string{"AllGather", "send is nil"}},
		{"AllGather/nil recv", func(f *fixture) error { return f.tr.AllGather(f.s, f.alloc(f32, 2), nil) }, []string{"AllGather", "recv is nil"}},
		{"AllGather/freed send", func(f *fixture) error { return f.tr.AllGather(f.s, f.freed(f32, 2), f.alloc(f32, 2)) }, []string{"AllGather send", "freed"}},
		{"AllGather/freed recv", func(f *fixture) error { return f.tr.AllGather(f.s, f.alloc(f32, 2), f.freed(f32, 2)) }, []string{"AllGather recv", "freed"}},
		{"AllGather/recv size", func(f *fixture) error { return f.tr.AllGather(f.s, f.alloc(f32, 2), f.alloc(f32, 3)) }, []string{"AllGather: recv f32[3]", "holds 12 bytes, want 1 ranks × 8"}},
		{"AllToAllV/nil stream", func(f *fixture) error { return f.tr.AllToAllV(nilStream, f.exchange()) }, []string{"AllToAllV", "nil stream"}},
		{"AllToAllV/nil exchange", func(f *fixture) error { return f.tr.AllToAllV(f.s, nil) }, []string{"exchange", "want one or more"}},
		{"AllToAllV/no tensors", func(f *fixture) error { x := f.exchange(); x.Send, x.Recv = nil, nil; return f.tr.AllToAllV(f.s, x) }, []string{"exchange", "want one or more"}},
		{"AllToAllV/counts length", func(f *fixture) error { x := f.exchange(); x.RecvCount = nil; return f.tr.AllToAllV(f.s, x) }, []string{"exchange", "1 entries"}},
		{"AllToAllV/nil recv tensor", func(f *fixture) error { x := f.exchange(); x.Recv[0] = nil; return f.tr.AllToAllV(f.s, x) }, []string{"exchange: receive tensor 0 is nil"}},
		{"AllToAllV/freed send tensor", func(f *fixture) error { x := f.exchange(); x.Send[0].Free(); return f.tr.AllToAllV(f.s, x) }, []string{"exchange send tensor 0", "freed"}},
		{"AllToAllV/scalar", func(f *fixture) error { x := f.exchange(); x.Send[0] = f.alloc(f32); return f.tr.AllToAllV(f.s, x) }, []string{"exchange: send tensor 0 is a scalar"}},
		{"AllToAllV/rows out of range", func(f *fixture) error { x := f.exchange(); x.SendOff[0] = 1; return f.tr.AllToAllV(f.s, x) }, []string{"exchange: send rows [1, 4) for rank 0"}},
		{"AllToAllV/negative count", func(f *fixture) error { x := f.exchange(); x.RecvCount[0] = -1; return f.tr.AllToAllV(f.s, x) }, []string{"exchange: receive rows [0, -1) for rank 0"}},
		{"AllToAllV/row sizes", func(f *fixture) error {
			x := f.exchange()
			x.Recv[0] = f.alloc(f32, 3, 3)
			return f.tr.AllToAllV(f.s, x)
		}, []string{"exchange: send f32[3 2]", "receive f32[3 3]", "differ in size"}},
		{"Sync/nil stream", func(f *fixture) error { return f.tr.Sync(nilStream) }, []string{"Sync", "nil stream"}},

		// NCCL, which needs GPUs.
		{"NewNCCL/nil device", func(*fixture) error { return errOf(ep.NewNCCL(nil, ep.UniqueID{}, 0, 1, 0)) }, []string{"NewNCCL", "not a GPU"}},
		{"NewNCCL/CPU", func(*fixture) error { return errOf(ep.NewNCCL(cpu, ep.UniqueID{}, 0, 1, 0)) }, []string{"NewNCCL: device cpu is not a GPU"}},
		{"NewNCCLWorld/no devices", func(*fixture) error { return errOf(ep.NewNCCLWorld(nil, 0)) }, []string{"NewNCCLWorld: 0 devices"}},
		{"NewNCCLWorld/CPU", func(*fixture) error { return errOf(ep.NewNCCLWorld([]*device.Device{cpu}, 0)) }, []string{"NewNCCLWorld: device 0 (cpu) is not a GPU"}},
		{"NewNCCLWorld/nil device", func(*fixture) error { return errOf(ep.NewNCCLWorld([]*device.Device{nil}, 0)) }, []string{"NewNCCLWorld: device 0", "not a GPU"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			if msg := wantErr(noPanic(func() error { return tc.call(f) }), tc.want...); msg != "" {
				t.Error(msg)
			}
		})
	}
}

// TestFreeNil: freeing what a failed op returned (nil) is a no-op.
func TestFreeNil(t *testing.T) {
	for name, free := range map[string]func() error{
		"Dispatched.Free":          (*ep.Dispatched)(nil).Free,
		"DispatchedMXFP8.Free":     (*ep.DispatchedMXFP8)(nil).Free,
		"DispatchedBlockwise.Free": (*ep.DispatchedBlockwise)(nil).Free,
		"Layout.Free":              (*ep.Layout)(nil).Free,
	} {
		if err := noPanic(free); err != nil {
			t.Errorf("%s of nil: %v", name, err)
		}
	}
}
