package ep_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/quant"
)

// fp8Scen is a case of the FP8 dispatch tests: a scenario and the quantized rows it
// dispatches, MXFP8 or, with blockwise, blockwise FP8 (scale then sets the scale kind
// and mode is not used).
type fp8Scen struct {
	scen
	format    quant.Format
	mode      quant.ScaleMode
	dir       quant.Direction
	blockwise bool
	scale     quant.ScaleKind
}

// fp8Out is what an FP8 dispatch and the reference (Dispatch, then the quantization)
// gave on a rank, on the host: the kept rows' elements and scales, and the weights.
type fp8Out struct {
	capacity, rows   int
	row, wantRow     []byte
	scale, wantScale []byte // the kept rows' scales
	pad              []byte // scales that must be 0: past Capacity (MXFP8), past the kept rows (blockwise)
	w, wantW         []float32
	bytesFP8         []int64 // bytes this rank sent each rank during each dispatch
	bytesBF          []int64
	layout           string // what is wrong with the dispatched X's layout, "" if nothing
}

func downloadBytes(s *device.Stream, x *device.Tensor, lo, hi int) ([]byte, error) {
	v, err := x.Rows(lo, hi)
	if err != nil {
		return nil, err
	}
	if v.DType().Size() == 4 { // F32 blockwise scales, as their bits
		u := make([]uint32, v.Len())
		if err := device.Download(s, v, u); err != nil {
			return nil, err
		}
		b := make([]byte, 0, 4*len(u))
		for _, e := range u {
			b = binary.LittleEndian.AppendUint32(b, e)
		}
		return b, nil
	}
	b := make([]byte, v.Len())
	return b, device.Download(s, v, b)
}

// scaleColumns returns, from the host bytes of blockwise scales [nb, width] (F32), the
// columns [lo, hi) of each row, row after row.
func scaleColumns(b []byte, nb, width, lo, hi int) []byte {
	var out []byte
	for i := range nb {
		out = append(out, b[4*(i*width+lo):4*(i*width+hi)]...)
	}
	return out
}

// fp8Dispatch quantizes x as sc says and dispatches it inside sent with l's FP8 dispatch
// for sc, and quantizes kept (the kept rows of Dispatch's X) the same way, filling o with
// what both gave; it returns what to free.
func fp8Dispatch(s *device.Stream, l *ep.Layout, sc fp8Scen, x, w, kept *device.Tensor, sent func(func() error) ([]int64, error), o *fp8Out) (func(), error) {
	n, r := l.Rows(), l.Capacity()
	var frees []func() error
	free := func() {
		for _, f := range frees {
			f()
		}
	}
	type part struct {
		dst    *[]byte
		x      *device.Tensor
		lo, hi int
	}
	var parts []part
	var Weights *device.Tensor
	if sc.blockwise {
		opt := quant.BlockOptions{Format: sc.format, Scale: sc.scale}
		want, err := quant.QuantizeBlockwise(s, kept, opt)
		if err != nil {
			return free, err
		}
		frees = append(frees, want.Free)
		opt.Dir = sc.dir
		q, err := quant.QuantizeBlockwise(s, x, opt)
		if err != nil {
			return free, err
		}
		frees = append(frees, q.Free)
		var B *ep.DispatchedBlockwise
		if o.bytesFP8, err = sent(func() (err error) { B, err = l.DispatchBlockwise(s, q, w); return err }); err != nil {
			return free, err
		}
		frees = append(frees, B.Free)
		X := B.X
		nb, cp := (sc.H+127)/128, 4*((r+3)/4)
		if X.M != r || X.K != sc.H || X.Format != sc.format || X.Scale != sc.scale || X.Dir != quant.Rowwise || X.Groups != 0 ||
			X.ColT != nil || X.ColTScale != nil || X.RowScale.Dim(0) != nb || X.RowScale.Dim(1) != cp {
			o.layout = fmt.Sprintf("X is %d×%d %v %v %v, %d groups, ColT %v, RowScale %v: want %d×%d %v %v rowwise, ungrouped, RowScale [%d, %d]",
				X.M, X.K, X.Format, X.Scale, X.Dir, X.Groups, X.ColT, X.RowScale, r, sc.H, sc.format, sc.scale, nb, cp)
			return free, nil
		}
		if B.Counts != l.ExpertCounts() {
			o.layout = "Counts is not the layout's ExpertCounts"
		}
		all, err := downloadBytes(s, X.RowScale, 0, nb)
		if err != nil {
			return free, err
		}
		allWant, err := downloadBytes(s, want.RowScale, 0, nb)
		if err != nil {
			return free, err
		}
		o.scale, o.wantScale = scaleColumns(all, nb, cp, 0, n), scaleColumns(allWant, nb, want.RowScale.Dim(1), 0, n)
		o.pad = scaleColumns(all, nb, cp, n, cp)
		parts = []part{{&o.row, X.Row, 0, n}, {&o.wantRow, want.Row, 0, n}}
		Weights = B.Weights
	} else {
		opt := quant.Options{Format: sc.format, Mode: sc.mode}
		want, err := quant.Quantize(s, kept, opt)
		if err != nil {
			return free, err
		}
		frees = append(frees, want.Free)
		opt.Dir = sc.dir
		q, err := quant.Quantize(s, x, opt)
		if err != nil {
			return free, err
		}
		frees = append(frees, q.Free)
		var M *ep.DispatchedMXFP8
		if o.bytesFP8, err = sent(func() (err error) { M, err = l.DispatchMXFP8(s, q, w); return err }); err != nil {
			return free, err
		}
		frees = append(frees, M.Free)
		X := M.X
		if tiles := 4 * ((r + 127) / 128); X.M != r || X.K != sc.H || X.Tiles() != tiles || X.Format != sc.format || X.Mode != sc.mode || X.Swizzled || X.Groups != 0 {
			o.layout = fmt.Sprintf("X is %d×%d, %d tiles, %v %v, swizzled %v, %d groups: want %d×%d, %d tiles, %v %v, plain, ungrouped",
				X.M, X.K, X.Tiles(), X.Format, X.Mode, X.Swizzled, X.Groups, r, sc.H, tiles, sc.format, sc.mode)
			return free, nil
		}
		if X.Row == nil || X.RowScale == nil || X.Col != nil || X.ColScale != nil || X.ColT != nil || X.Dir != quant.Rowwise {
			o.layout = fmt.Sprintf("X has Dir %v, Row %v, RowScale %v, Col %v, ColScale %v, ColT %v: want rowwise only",
				X.Dir, X.Row, X.RowScale, X.Col, X.ColScale, X.ColT)
			return free, nil
		}
		if M.Counts != l.ExpertCounts() {
			o.layout = "Counts is not the layout's ExpertCounts"
		}
		parts = []part{
			{&o.row, X.Row, 0, n}, {&o.wantRow, want.Row, 0, n},
			{&o.scale, X.RowScale, 0, n}, {&o.wantScale, want.RowScale, 0, n},
			{&o.pad, X.RowScale, r, X.RowScale.Dim(0)},
		}
		Weights = M.Weights
	}
	for _, c := range parts {
		var err error
		if *c.dst, err = downloadBytes(s, c.x, c.lo, c.hi); err != nil {
			return free, err
		}
	}
	var err error
	o.w, err = download(s, Weights, n)
	return free, err
}

// runFP8Rank dispatches one rank's tokens twice: as they are with Dispatch, whose X it
// then quantizes, and quantized with the FP8 dispatch of sc's recipe.
func runFP8Rank(tr ep.Transport, sc fp8Scen, in rankIn, world *ep.World, ph *phaser) (*fp8Out, error) {
	rk, err := newRank(tr, sc.scen, in.idx)
	if err != nil {
		return nil, err
	}
	defer rk.close()
	s, g, idx := rk.s, rk.g, rk.idx
	r, T, K, H := tr.Rank(), sc.T[tr.Rank()], sc.K, sc.H
	w, _ := device.FromFloat32(s, device.F32, in.w, T, K)
	x, _ := device.FromFloat32(s, sc.dt, in.x, T, H)
	defer w.Free()
	defer x.Free()
	l, err := g.Layout(s, idx)
	if err != nil {
		return nil, err
	}
	defer l.Free()
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	// sent runs a dispatch and returns the bytes this rank sent each rank during it (nil
	// without an in-process world).
	sent := func(f func() error) ([]int64, error) {
		if world == nil {
			if err := f(); err != nil {
				return nil, err
			}
			return nil, tr.Sync(s)
		}
		if err := ph.wait(); err != nil {
			return nil, err
		}
		if r == 0 {
			world.ResetBytes()
		}
		if err := ph.wait(); err != nil {
			return nil, err
		}
		if err := f(); err != nil {
			return nil, err
		}
		if err := tr.Sync(s); err != nil {
			return nil, err
		}
		if err := ph.wait(); err != nil {
			return nil, err
		}
		b := world.Bytes()[r]
		return b, ph.wait()
	}
	o := &fp8Out{capacity: l.Capacity(), rows: l.Rows()}
	var D *ep.Dispatched
	if o.bytesBF, err = sent(func() (err error) { D, err = l.Dispatch(s, x, w); return err }); err != nil {
		return nil, err
	}
	defer D.Free()
	kept, err := D.X.Rows(0, l.Rows())
	if err != nil {
		return nil, err
	}
	free, err := fp8Dispatch(s, l, sc, x, w, kept, sent, o)
	defer free()
	if err != nil {
		return nil, fmt.Errorf("rank %d: %w", r, err)
	}
	if o.wantW, err = download(s, D.Weights, l.Rows()); err != nil {
		return nil, err
	}
	return o, s.Synchronize()
}

// runFP8 runs sc on the ranks of trs (those of world, if not nil, whose byte counts it
// then reads), each in its own goroutine.
func runFP8(trs []ep.Transport, sc fp8Scen, ins []rankIn, world *ep.World) ([]*fp8Out, error) {
	outs, errs := eachRank(trs, func(r int, ph *phaser) (*fp8Out, error) { return runFP8Rank(trs[r], sc, ins[r], world, ph) })
	return outs, errors.Join(errs...)
}

// checkFP8 checks the outputs of runFP8: the dispatched X is the ungrouped rowwise
// layout of Capacity rows whose kept rows and scales equal, bit for bit, those of the
// quantization of Dispatch's X, with the padding scales 0; its weights are Dispatch's;
// and, with byte counts, each row moved H element bytes, its scale bytes
// (roundup(ceil(H/32), 4) for MXFP8, 4·ceil(H/128) for blockwise) and 4K bytes of weights.
func checkFP8(t *testing.T, sc fp8Scen, ins []rankIn, outs []*fp8Out) {
	t.Helper()
	refs := reference(sc.scen, ins)
	op, sb := "DispatchMXFP8", 4*((sc.H+127)/128)
	if sc.blockwise {
		op, sb = "DispatchBlockwise", 4*((sc.H+127)/128)
	}
	for r, o := range outs {
		if o.capacity != refs[r].capacity || o.rows != refs[r].rows {
			t.Errorf("rank %d: capacity %d, rows %d: want %d, %d", r, o.capacity, o.rows, refs[r].capacity, refs[r].rows)
		}
		if o.layout != "" {
			t.Errorf("rank %d: %s: %s", r, op, o.layout)
			continue
		}
		var b strings.Builder
		diffElems(&b, fmt.Sprintf("rank %d: X.Row", r), o.wantRow, o.row)
		diffElems(&b, fmt.Sprintf("rank %d: X.RowScale", r), o.wantScale, o.scale)
		diffElems(&b, fmt.Sprintf("rank %d: Weights", r), o.wantW, o.w)
		if b.Len() > 0 {
			t.Errorf("%s differs from the quantization of Dispatch's X (got, want):\n%s", op, b.String())
		}
		if !bytes.Equal(o.pad, make([]byte, len(o.pad))) {
			t.Errorf("rank %d: %s: padding scales are not all 0", r, op)
		}
		if o.bytesFP8 == nil {
			continue
		}
		for q := range sc.R {
			n := int64(refs[r].tokTo[q])
			if q == r {
				n = 0
			}
			if want := n * int64(sc.H+sb+4*sc.K); o.bytesFP8[q] != want {
				t.Errorf("bytes %d→%d during %s = %d, want %d tokens × (%d + %d + 4·%d)", r, q, op, o.bytesFP8[q], n, sc.H, sb, sc.K)
			}
			if want := n * int64(sc.H*sc.dt.Size()+4*sc.K); o.bytesBF[q] != want {
				t.Errorf("bytes %d→%d during Dispatch = %d, want %d", r, q, o.bytesBF[q], want)
			}
		}
	}
}

// fp8Scenarios are the cases of the FP8 dispatch tests, for MXFP8 or blockwise: uniform
// and skewed routings, a rank without tokens, dropped rows, both formats and scale
// rules, short rows and blocks, and element and scale rows whose widths take each of
// the row kernels' units.
func fp8Scenarios(blockwise bool) []fp8Scen {
	bf16, f32 := device.BF16, device.F32
	cs := []fp8Scen{
		{scen: scen{name: "R2/uniform", R: 2, E: 8, K: 3, H: 512, T: []int{40, 33}, dt: bf16, route: "uniform", seed: 41}},
		{scen: scen{name: "R4/zipf/zero-token rank/chunks2", R: 4, E: 16, K: 4, H: 160, T: []int{30, 0, 25, 41}, dt: bf16, route: "zipf", chunks: 2, seed: 42},
			format: quant.E5M2},
		{scen: scen{name: "R4/one expert/Drop/FLOOR", R: 4, E: 8, K: 2, H: 48, T: []int{16, 20, 12, 18}, dt: bf16, route: "one",
			cap: ep.Rows(24), capFn: func(int, int) int { return 24 }, over: ep.DropOverflow, seed: 43}, mode: quant.FLOOR, scale: quant.ScalePow2},
		{scen: scen{name: "R2/short rows/f32/Both", R: 2, E: 4, K: 2, H: 13, T: []int{11, 140}, dt: f32, route: "sparse", chunks: 3, seed: 44},
			dir: quant.Both},
	}
	if blockwise {
		cs = append(cs, fp8Scen{scen: scen{name: "R2/three blocks/pow2", R: 2, E: 6, K: 2, H: 300, T: []int{70, 45}, dt: bf16, route: "zipf", seed: 46},
			scale: quant.ScalePow2})
	}
	for i := range cs {
		cs[i].blockwise = blockwise
		if blockwise {
			cs[i].name = strings.Replace(cs[i].name, "/FLOOR", "/pow2", 1)
		}
	}
	return cs
}

// testDispatchFP8 runs the FP8 dispatch scenarios of one recipe on in-process worlds:
// on the CPU, and on the GPU when present.
func testDispatchFP8(t *testing.T, blockwise bool) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, sc := range fp8Scenarios(blockwise) {
			t.Run(sc.name, func(t *testing.T) {
				ins := sc.inputs()
				w, err := ep.NewWorld(sc.R, d)
				dt.NoErr(t, err)
				w.SetTimeout(20 * time.Second)
				trs := make([]ep.Transport, sc.R)
				for r := range trs {
					trs[r] = w.Transport(r)
				}
				outs, err := runFP8(trs, sc, ins, w)
				dt.NoErr(t, err)
				checkFP8(t, sc, ins, outs)
			})
		}
	})
}

// TestDispatchMXFP8 checks that dispatching MXFP8 rows gives, bit for bit, the
// quantization of the dispatched bf16 (or f32) rows, with the same weights, and moves H
// element bytes and roundup(ceil(H/32), 4) scale bytes per row.
func TestDispatchMXFP8(t *testing.T) { testDispatchFP8(t, false) }

// TestDispatchBlockwise checks the same for blockwise FP8 rows, which move H element
// bytes and 4·ceil(H/128) scale bytes per row.
func TestDispatchBlockwise(t *testing.T) { testDispatchFP8(t, true) }

// TestNCCLDispatchFP8 is TestDispatchMXFP8 and TestDispatchBlockwise over NCCL on two
// GPUs driven from this process, with direct transfers (when the GPUs can address each
// other's memory) and through NCCL only.
func TestNCCLDispatchFP8(t *testing.T) {
	devs := twoGPUs(t)
	trs, err := ep.NewNCCLWorld(devs, 60*time.Second)
	dt.NoErr(t, err)
	defer func() {
		for _, tr := range trs {
			tr.Close()
		}
	}()
	for _, blockwise := range []bool{false, true} {
		cases := []fp8Scen{
			{scen: scen{name: "R2/large/zipf/chunks3", R: 2, E: 32, K: 8, H: 2048, T: []int{1500, 2048}, dt: device.BF16, route: "zipf", chunks: 3, seed: 45},
				blockwise: blockwise},
		}
		for _, sc := range fp8Scenarios(blockwise) {
			if sc.R == 2 {
				cases = append(cases, sc)
			}
		}
		for _, only := range []bool{false, true} {
			for _, sc := range cases {
				sc.transportOnly = only
				t.Run(fmt.Sprintf("blockwise=%v/%s/transport-only=%v", blockwise, sc.name, only), func(t *testing.T) {
					ins := sc.inputs()
					outs, err := runFP8(trs, sc, ins, nil)
					dt.NoErr(t, err)
					checkFP8(t, sc, ins, outs)
				})
			}
		}
	}
}
