package quant

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompileGather(t *testing.T) { dt.CheckCompiles(t, gatherKernels) }

// gatherCase is one gather: m source rows of k columns, r destination rows from per
// copies of each source row; holes of them -1.
type gatherCase struct {
	name           string
	m, k, r, per   int
	holes, grouped bool
}

var gatherCases = []gatherCase{
	{name: "rows", m: 37, k: 256, r: 37, per: 1},
	{name: "copies_holes", m: 33, k: 384, r: 150, per: 4, holes: true},
	{name: "k100_w1", m: 20, k: 100, r: 61, per: 3, holes: true},
	{name: "k7_short", m: 5, k: 7, r: 9, per: 2, holes: true},
	{name: "r130_pad", m: 64, k: 160, r: 130, per: 2, holes: true},
	{name: "grouped_src", m: 140, k: 128, r: 90, per: 1, holes: true, grouped: true},
	{name: "no_rows", m: 16, k: 128, r: 0, per: 2},
	{name: "all_holes", m: 8, k: 64, r: 12, per: 1, holes: true},
}

// gatherIndex returns c's index: copies of the source rows in random order, with about
// a quarter -1 when c has holes (all of them for all_holes).
func gatherIndex(r *rand.Rand, c gatherCase) []int32 {
	ix := make([]int32, c.r)
	for i := range ix {
		ix[i] = int32(r.IntN(c.m * c.per))
		if c.holes && (c.name == "all_holes" || r.IntN(4) == 0) {
			ix[i] = -1
		}
	}
	return ix
}

// gatherRows returns the rows of x [m, k] that index picks (zeros for -1).
func gatherRows(x []float32, k, per int, index []int32) []float32 {
	out := make([]float32, len(index)*k)
	for r, e := range index {
		if e >= 0 {
			i := int(e) / per
			copy(out[r*k:(r+1)*k], x[i*k:(i+1)*k])
		}
	}
	return out
}

// poisonPool allocates and poisons tensors like the gather's outputs and frees them,
// so that the gather's new tensors are likely to start from their bytes.
func poisonPool(t *testing.T, s *device.Stream, shapes ...[]int) {
	t.Helper()
	for _, sh := range shapes {
		p := dt.Must(s.Alloc(device.E8M0, sh...))
		dt.Poison(t, s, p)
		dt.NoErr(t, p.Free())
	}
}

// TestGather checks GatherBlockwise and GatherMXFP8 bit for bit against quantizing the
// gathered source rows, over random values, per-row magnitudes spread over 2^±20, holes,
// rows past a multiple of 4 or 128 and an index of copies.
func TestGather(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range gatherCases {
			r := dt.Rand(uint64(700 + ci))
			vals := make([]float32, c.m*c.k)
			for i := range c.m {
				sc := float32(math.Ldexp(1, r.IntN(41)-20))
				for j := range c.k {
					vals[i*c.k+j] = float32(r.NormFloat64()) * sc
				}
			}
			index := gatherIndex(r, c)
			x := dt.Must(device.FromFloat32(s, device.BF16, vals, c.m, c.k))
			xv := dt.Must(x.Float32s(s))
			gx := dt.Must(device.FromFloat32(s, device.BF16, gatherRows(xv, c.k, c.per, index), c.r, c.k))
			ix := dt.Must(device.FromSlice(s, device.I32, index, c.r))
			st := dt.Must(device.NewStatus(s))
			var gs *device.Tensor
			if c.grouped {
				gs = dt.Must(device.FromSlice(s, device.I32, []int32{int32(c.m / 2), 0, int32(c.m - c.m/2)}, 3))
			}
			for _, f := range []Format{E4M3, E5M2} {
				t.Run(c.name+"/blockwise_"+f.String(), func(t *testing.T) {
					for _, kind := range []ScaleKind{ScaleF32, ScalePow2} {
						src := dt.Must(QuantizeBlockwise(s, x, BlockOptions{Format: f, Scale: kind, Dir: Both, GroupSizes: gs}))
						want := dt.Must(QuantizeBlockwise(s, gx, BlockOptions{Format: f, Scale: kind, Dir: Rowwise}))
						poisonPool(t, s, []int{c.r, c.k}, []int{want.RowScale.Bytes()})
						got := dt.Must(GatherBlockwise(s, src, ix, c.per, st))
						if got.M != c.r || got.K != c.k || got.Format != f || got.Scale != kind || got.Dir != Rowwise || got.Groups != 0 {
							t.Errorf("%v: result %d×%d %v %v %v groups %d", kind, got.M, got.K, got.Format, got.Scale, got.Dir, got.Groups)
						}
						sameRows(t, s, kind.String(), [2]*device.Tensor{got.Row, got.RowScale}, [2]*device.Tensor{want.Row, want.RowScale}, 4)
						dt.NoErr(t, st.Check(s))
						dt.NoErr(t, freeAllOf(src, want, got))
					}
				})
				if c.grouped {
					continue // MXFP8's grouped layouts place scale rows by group: not gathered
				}
				t.Run(c.name+"/mxfp8_"+f.String(), func(t *testing.T) {
					for _, mode := range []ScaleMode{RCEIL, FLOOR} {
						src := dt.Must(Quantize(s, x, Options{Format: f, Mode: mode, Dir: Rowwise}))
						want := dt.Must(Quantize(s, gx, Options{Format: f, Mode: mode, Dir: Rowwise}))
						poisonPool(t, s, []int{c.r, c.k}, []int{want.RowScale.Bytes()})
						got := dt.Must(GatherMXFP8(s, src, ix, c.per, st))
						if got.M != c.r || got.K != c.k || got.Format != f || got.Mode != mode || got.Dir != Rowwise || got.Swizzled || got.Groups != 0 {
							t.Errorf("%v: result %d×%d %v %v %v swizzled %v groups %d", mode, got.M, got.K, got.Format, got.Mode, got.Dir, got.Swizzled, got.Groups)
						}
						sameRows(t, s, mode.String(), [2]*device.Tensor{got.Row, got.RowScale}, [2]*device.Tensor{want.Row, want.RowScale}, 1)
						dt.NoErr(t, st.Check(s))
						dt.NoErr(t, freeAllOf(src, want, got))
					}
				})
			}
			dt.NoErr(t, device.FreeAll(x, gx, ix, gs))
			dt.NoErr(t, st.Free())
		}
	})
}

// sameRows reports the first difference of got's rowwise codes and scales (of size
// bytes each) from want's.
func sameRows(t *testing.T, s *device.Stream, what string, got, want [2]*device.Tensor, size int) {
	t.Helper()
	for i, name := range []string{"Row", "RowScale"} {
		sz := 1
		if i == 1 {
			sz = size
		}
		if d := firstDiff(download(t, s, got[i]), download(t, s, want[i]), sz); d != "" {
			t.Errorf("%s: %s: %s", what, name, d)
		}
	}
}

// freer is a quantized layout.
type freer interface{ Free() error }

// freeAllOf frees each of qs.
func freeAllOf(qs ...freer) error {
	var err error
	for _, q := range qs {
		if e := q.Free(); e != nil && err == nil {
			err = e
		}
	}
	return err
}

// TestGatherBadIndex checks that entries outside [-1, M·per) give zero rows and are
// recorded in the Status, while the other rows are gathered.
func TestGatherBadIndex(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const m, k, per = 6, 128, 2
		r := dt.Rand(720)
		x := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(r, m*k, 1), m, k))
		defer x.Free()
		xv := dt.Must(x.Float32s(s))
		for _, bad := range []int32{m * per, -2, 1 << 30} {
			index := []int32{3, bad, 11, -1}
			ix := dt.Must(device.FromSlice(s, device.I32, index, len(index)))
			good := []int32{3, -1, 11, -1}
			gx := dt.Must(device.FromFloat32(s, device.BF16, gatherRows(xv, k, per, good), len(good), k))
			for _, rec := range []string{"blockwise", "mxfp8"} {
				st := dt.Must(device.NewStatus(s))
				what := fmt.Sprint(rec, " index ", index)
				if rec == "blockwise" {
					src := dt.Must(QuantizeBlockwise(s, x, BlockOptions{}))
					w := dt.Must(QuantizeBlockwise(s, gx, BlockOptions{}))
					g := dt.Must(GatherBlockwise(s, src, ix, per, st))
					sameRows(t, s, what, [2]*device.Tensor{g.Row, g.RowScale}, [2]*device.Tensor{w.Row, w.RowScale}, 4)
					dt.NoErr(t, freeAllOf(src, w, g))
				} else {
					src := dt.Must(Quantize(s, x, Options{}))
					w := dt.Must(Quantize(s, gx, Options{}))
					g := dt.Must(GatherMXFP8(s, src, ix, per, st))
					sameRows(t, s, what, [2]*device.Tensor{g.Row, g.RowScale}, [2]*device.Tensor{w.Row, w.RowScale}, 1)
					dt.NoErr(t, freeAllOf(src, w, g))
				}
				err := st.Check(s)
				if err == nil || !strings.Contains(err.Error(), "index[1] =") {
					t.Errorf("%s index %v: Status.Check = %v, want the error of index[1]", rec, index, err)
				}
				dt.NoErr(t, st.Free())
			}
			dt.NoErr(t, device.FreeAll(ix, gx))
		}
	})
}

// gatherBadCases are the bad-argument cases both gathers share, for gather on the
// source q (Dir Rowwise), its freed twin and its columnwise form cols, named with pfx.
func gatherBadCases[Q any](pfx string, gather func(*device.Stream, *Q, *device.Tensor, int, *device.Status) (*Q, error),
	s *device.Stream, q, freedQ, cols *Q, ix, f32ix, ix2, freedIx *device.Tensor, st, freedSt *device.Status) []gatherBadCase {
	call := func(s *device.Stream, q *Q, ix *device.Tensor, per int, st *device.Status) func() error {
		return func() error { _, err := gather(s, q, ix, per, st); return err }
	}
	return []gatherBadCase{
		{pfx + " nil stream", call(nil, q, ix, 1, st), "nil stream"},
		{pfx + " nil src", call(s, nil, ix, 1, st), "q is nil"},
		{pfx + " freed src", call(s, freedQ, ix, 1, st), "freed"},
		{pfx + " columnwise src", call(s, cols, ix, 1, st), "q.Row is nil"},
		{pfx + " nil index", call(s, q, nil, 1, st), "index"},
		{pfx + " f32 index", call(s, q, f32ix, 1, st), "want i32[R]"},
		{pfx + " 2-d index", call(s, q, ix2, 1, st), "want i32[R]"},
		{pfx + " freed index", call(s, q, freedIx, 1, st), "freed"},
		{pfx + " per 0", call(s, q, ix, 0, st), "per = 0"},
		{pfx + " per -1", call(s, q, ix, -1, st), "per = -1"},
		{pfx + " per past int32", call(s, q, ix, math.MaxInt32+1, st), "per = 2147483648"},
		{pfx + " nil status", call(s, q, ix, 1, nil), "st is nil"},
		{pfx + " freed status", call(s, q, ix, 1, freedSt), "st"},
		{pfx + " unmade status", call(s, q, ix, 1, &device.Status{}), "st"},
	}
}

type gatherBadCase struct {
	name string
	call func() error
	want string
}

// TestGatherBadArgs checks the gathers' errors for bad arguments.
func TestGatherBadArgs(t *testing.T) {
	s := device.CPU().Stream()
	x := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(730), 8*64, 1), 8, 64))
	gs := dt.Must(device.FromSlice(s, device.I32, []int32{8}, 1))
	ix := dt.Must(device.FromSlice(s, device.I32, []int32{0, 1, -1}, 3))
	f32ix, ix2 := dt.Must(s.Alloc(device.F32, 3)), dt.Must(s.Alloc(device.I32, 3, 1))
	freedIx := dt.Freed(t, s, device.I32, 3)
	defer device.FreeAll(x, gs, ix, f32ix, ix2)
	st := dt.Must(device.NewStatus(s))
	defer st.Free()
	bw := dt.Must(QuantizeBlockwise(s, x, BlockOptions{}))
	bwCols := dt.Must(QuantizeBlockwise(s, x, BlockOptions{Dir: Columnwise}))
	mx := dt.Must(Quantize(s, x, Options{}))
	mxSwz := dt.Must(Quantize(s, x, Options{Swizzle: true}))
	mxGrp := dt.Must(Quantize(s, x, Options{GroupSizes: gs}))
	mxCols := dt.Must(Quantize(s, x, Options{Dir: Columnwise}))
	freedBw := dt.Must(QuantizeBlockwise(s, x, BlockOptions{}))
	freedMx := dt.Must(Quantize(s, x, Options{}))
	dt.NoErr(t, freeAllOf(freedBw, freedMx))
	defer freeAllOf(bw, bwCols, mx, mxSwz, mxGrp, mxCols)
	freedSt := dt.FreedStatus(t, s)
	cases := gatherBadCases("bw", GatherBlockwise, s, bw, freedBw, bwCols, ix, f32ix, ix2, freedIx, st, freedSt)
	cases = append(cases, gatherBadCases("mx", GatherMXFP8, s, mx, freedMx, mxCols, ix, f32ix, ix2, freedIx, st, freedSt)...)
	cases = append(cases,
		gatherBadCase{"mx swizzled src", func() error { _, err := GatherMXFP8(s, mxSwz, ix, 1, st); return err }, "swizzled"},
		gatherBadCase{"mx grouped src", func() error { _, err := GatherMXFP8(s, mxGrp, ix, 1, st); return err }, "grouped"})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { dt.WantError(t, c.call, c.want) })
	}
}
