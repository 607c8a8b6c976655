package ep_test

import (
	"bytes"
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

// mxScen is a case of TestDispatchMXFP8: a scenario and the MXFP8 rows it dispatches.
type mxScen struct {
	scen
	format quant.Format
	mode   quant.ScaleMode
	dir    quant.Direction
}

// mxOut is what DispatchMXFP8 and the reference (Dispatch, then Quantize) gave on a
// rank, on the host: the kept rows' elements and scale rows, and the weights.
type mxOut struct {
	capacity, rows    int
	row, wantRow      []byte
	scale, wantScale  []byte // the first rows scale rows
	pad               []byte // DispatchMXFP8's scale rows past Capacity
	w, wantW          []float32
	bytesFP8, bytesBF []int64 // bytes this rank sent each rank during each dispatch
	m, k, tiles       int
	format            quant.Format
	mode              quant.ScaleMode
	swizzled, grouped bool
}

func downloadBytes(s *device.Stream, x *device.Tensor, lo, hi int) ([]byte, error) {
	v, err := x.Rows(lo, hi)
	if err != nil {
		return nil, err
	}
	b := make([]byte, v.Len())
	return b, device.Download(s, v, b)
}

// runMXFP8Rank dispatches one rank's tokens twice: as they are with Dispatch, whose X
// it then quantizes, and quantized with DispatchMXFP8.
func runMXFP8Rank(tr ep.Transport, sc mxScen, in rankIn, world *ep.World, ph *phaser) (*mxOut, error) {
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
	o := &mxOut{capacity: l.Capacity(), rows: l.Rows()}
	opt := quant.Options{Format: sc.format, Mode: sc.mode}
	var D *ep.Dispatched
	if o.bytesBF, err = sent(func() (err error) { D, err = l.Dispatch(s, x, w); return err }); err != nil {
		return nil, err
	}
	defer D.Free()
	kept, err := D.X.Rows(0, l.Rows())
	if err != nil {
		return nil, err
	}
	want, err := quant.Quantize(s, kept, opt)
	if err != nil {
		return nil, err
	}
	defer want.Free()
	opt.Dir = sc.dir
	q, err := quant.Quantize(s, x, opt)
	if err != nil {
		return nil, err
	}
	defer q.Free()
	var M *ep.DispatchedMXFP8
	if o.bytesFP8, err = sent(func() (err error) { M, err = l.DispatchMXFP8(s, q, w); return err }); err != nil {
		return nil, err
	}
	defer M.Free()
	X, n := M.X, l.Rows()
	o.m, o.k, o.tiles, o.format, o.mode, o.swizzled, o.grouped = X.M, X.K, X.Tiles(), X.Format, X.Mode, X.Swizzled, X.Groups != 0
	if X.Row == nil || X.RowScale == nil || X.Col != nil || X.ColScale != nil || X.ColT != nil || X.Dir != quant.Rowwise {
		return nil, fmt.Errorf("rank %d: DispatchMXFP8's X has Dir %v, Row %v, RowScale %v, Col %v, ColScale %v, ColT %v: want rowwise only",
			r, X.Dir, X.Row, X.RowScale, X.Col, X.ColScale, X.ColT)
	}
	if M.Counts != l.ExpertCounts() {
		return nil, fmt.Errorf("rank %d: Counts is not the layout's ExpertCounts", r)
	}
	for _, c := range []struct {
		dst    *[]byte
		x      *device.Tensor
		lo, hi int
	}{
		{&o.row, X.Row, 0, n}, {&o.wantRow, want.Row, 0, n},
		{&o.scale, X.RowScale, 0, n}, {&o.wantScale, want.RowScale, 0, n},
		{&o.pad, X.RowScale, l.Capacity(), X.RowScale.Dim(0)},
	} {
		if *c.dst, err = downloadBytes(s, c.x, c.lo, c.hi); err != nil {
			return nil, err
		}
	}
	if o.w, err = download(s, M.Weights, n); err != nil {
		return nil, err
	}
	if o.wantW, err = download(s, D.Weights, n); err != nil {
		return nil, err
	}
	return o, s.Synchronize()
}

// runMXFP8 runs sc on the ranks of trs (those of world, if not nil, whose byte counts
// it then reads), each in its own goroutine.
func runMXFP8(trs []ep.Transport, sc mxScen, ins []rankIn, world *ep.World) ([]*mxOut, error) {
	outs, errs := eachRank(trs, func(r int, ph *phaser) (*mxOut, error) { return runMXFP8Rank(trs[r], sc, ins[r], world, ph) })
	return outs, errors.Join(errs...)
}

// checkMXFP8 checks the outputs of runMXFP8: DispatchMXFP8's X is the ungrouped rowwise
// layout of Capacity rows whose kept rows and scale rows equal, bit for bit, those of
// Quantize of Dispatch's X, with the padding scale rows 0; its weights are Dispatch's;
// and, with byte counts, each row moved H + roundup(ceil(H/32), 4) + 4K bytes.
func checkMXFP8(t *testing.T, sc mxScen, ins []rankIn, outs []*mxOut) {
	t.Helper()
	refs := reference(sc.scen, ins)
	cp := 4 * ((sc.H + 127) / 128)
	for r, o := range outs {
		if o.capacity != refs[r].capacity || o.rows != refs[r].rows {
			t.Errorf("rank %d: capacity %d, rows %d: want %d, %d", r, o.capacity, o.rows, refs[r].capacity, refs[r].rows)
		}
		if tiles := 4 * ((o.capacity + 127) / 128); o.m != o.capacity || o.k != sc.H || o.tiles != tiles || o.format != sc.format || o.mode != sc.mode || o.swizzled || o.grouped {
			t.Errorf("rank %d: X is %d×%d, %d tiles, %v %v, swizzled %v, grouped %v: want %d×%d, %d tiles, %v %v, plain, ungrouped",
				r, o.m, o.k, o.tiles, o.format, o.mode, o.swizzled, o.grouped, o.capacity, sc.H, tiles, sc.format, sc.mode)
		}
		var b strings.Builder
		diffElems(&b, fmt.Sprintf("rank %d: X.Row", r), o.wantRow, o.row)
		diffElems(&b, fmt.Sprintf("rank %d: X.RowScale", r), o.wantScale, o.scale)
		diffElems(&b, fmt.Sprintf("rank %d: Weights", r), o.wantW, o.w)
		if b.Len() > 0 {
			t.Errorf("DispatchMXFP8 differs from Quantize(Dispatch) (got, want):\n%s", b.String())
		}
		if !bytes.Equal(o.pad, make([]byte, len(o.pad))) {
			t.Errorf("rank %d: padding scale rows past Capacity are not all 0", r)
		}
		if o.bytesFP8 == nil {
			continue
		}
		for q := range sc.R {
			n := int64(refs[r].tokTo[q])
			if q == r {
				n = 0
			}
			if want := n * int64(sc.H+cp+4*sc.K); o.bytesFP8[q] != want {
				t.Errorf("bytes %d→%d during DispatchMXFP8 = %d, want %d tokens × (%d + %d + 4·%d)", r, q, o.bytesFP8[q], n, sc.H, cp, sc.K)
			}
			if want := n * int64(sc.H*sc.dt.Size()+4*sc.K); o.bytesBF[q] != want {
				t.Errorf("bytes %d→%d during Dispatch = %d, want %d", r, q, o.bytesBF[q], want)
			}
		}
	}
}

// mxScenarios are the cases of the MXFP8 dispatch tests: uniform and skewed routings, a
// rank without tokens, dropped rows, both formats and scale rules, short rows and
// blocks, and element and scale rows whose widths take each of the row kernels' units.
func mxScenarios() []mxScen {
	bf16, f32 := device.BF16, device.F32
	return []mxScen{
		{scen: scen{name: "R2/uniform", R: 2, E: 8, K: 3, H: 512, T: []int{40, 33}, dt: bf16, route: "uniform", seed: 41}},
		{scen: scen{name: "R4/zipf/zero-token rank/chunks2", R: 4, E: 16, K: 4, H: 160, T: []int{30, 0, 25, 41}, dt: bf16, route: "zipf", chunks: 2, seed: 42},
			format: quant.E5M2},
		{scen: scen{name: "R4/one expert/Drop/FLOOR", R: 4, E: 8, K: 2, H: 48, T: []int{16, 20, 12, 18}, dt: bf16, route: "one",
			cap: ep.Rows(24), capFn: func(int, int) int { return 24 }, over: ep.DropOverflow, seed: 43}, mode: quant.FLOOR},
		{scen: scen{name: "R2/short rows/f32/Both", R: 2, E: 4, K: 2, H: 13, T: []int{11, 140}, dt: f32, route: "sparse", chunks: 3, seed: 44},
			dir: quant.Both},
	}
}

// TestDispatchMXFP8 checks that dispatching MXFP8 rows gives, bit for bit, the
// quantization of the dispatched bf16 (or f32) rows, with the same weights, and moves H
// element bytes and roundup(ceil(H/32), 4) scale bytes per row, on in-process worlds:
// on the CPU, and on the GPU when present.
func TestDispatchMXFP8(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, sc := range mxScenarios() {
			t.Run(sc.name, func(t *testing.T) {
				ins := sc.inputs()
				w, err := ep.NewWorld(sc.R, d)
				dt.NoErr(t, err)
				w.SetTimeout(20 * time.Second)
				trs := make([]ep.Transport, sc.R)
				for r := range trs {
					trs[r] = w.Transport(r)
				}
				outs, err := runMXFP8(trs, sc, ins, w)
				dt.NoErr(t, err)
				checkMXFP8(t, sc, ins, outs)
			})
		}
	})
}

// TestNCCLDispatchMXFP8 is TestDispatchMXFP8 over NCCL on two GPUs driven from this
// process, with direct transfers (when the GPUs can address each other's memory) and
// through NCCL only.
func TestNCCLDispatchMXFP8(t *testing.T) {
	devs := twoGPUs(t)
	trs, err := ep.NewNCCLWorld(devs, 60*time.Second)
	dt.NoErr(t, err)
	defer func() {
		for _, tr := range trs {
			tr.Close()
		}
	}()
	cases := []mxScen{
		{scen: scen{name: "R2/large/zipf/chunks3", R: 2, E: 32, K: 8, H: 2048, T: []int{1500, 2048}, dt: device.BF16, route: "zipf", chunks: 3, seed: 45}},
	}
	for _, sc := range mxScenarios() {
		if sc.R == 2 {
			cases = append(cases, sc)
		}
	}
	for _, only := range []bool{false, true} {
		for _, sc := range cases {
			sc.transportOnly = only
			t.Run(fmt.Sprintf("%s/transport-only=%v", sc.name, only), func(t *testing.T) {
				ins := sc.inputs()
				outs, err := runMXFP8(trs, sc, ins, nil)
				dt.NoErr(t, err)
				checkMXFP8(t, sc, ins, outs)
			})
		}
	}
}
