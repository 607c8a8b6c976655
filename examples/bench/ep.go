package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
)

// ep times Dispatch followed by Combine (identity experts) with uniform routing under
// the Dropless capacity, and reports the rate of the bytes rank 0 sends.
func (b *bench) ep(o options) ([]row, error) {
	d := b.s.Device()
	R := o.EPRanks
	kind := o.EPTransport
	if kind == "auto" {
		kind = "world"
		if n, err := device.CUDACount(); err == nil && n >= 2 && d.IsCUDA() {
			kind = "nccl"
		}
	}
	var trs []ep.Transport
	switch kind {
	case "world":
		w, err := ep.NewWorld(R, d)
		if err != nil {
			return nil, err
		}
		for r := range R {
			trs = append(trs, w.Transport(r))
		}
	case "nccl":
		devs := make([]*device.Device, R)
		for i := range devs {
			var err error
			if devs[i], err = device.Open(fmt.Sprintf("cuda:%d", i)); err != nil {
				return nil, fmt.Errorf("-ep-transport nccl with %d ranks: %w", R, err)
			}
		}
		var err error
		if trs, err = ep.NewNCCLWorld(devs, 0); err != nil {
			return nil, err
		}
		defer func() {
			for _, tr := range trs {
				tr.Close()
			}
		}()
	default:
		return nil, fmt.Errorf("-ep-transport %q: want auto, world or nccl", o.EPTransport)
	}
	type result struct {
		t          time.Duration
		sent, base int64
	}
	res := make([]result, R)
	errs := make([]error, R)
	var wg sync.WaitGroup
	for i, tr := range trs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].t, res[i].sent, res[i].base, errs[i] = epRank(tr, o)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("rank %d: %w", i, errs[i])
				tr.Close() // the others fail instead of waiting
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	r0 := res[0]
	name := fmt.Sprintf("%s R=%d T=%d H=%d bf16 E=%d K=%d, sent %.2f× T·K rows", kind, R, o.EPT, o.EPH, o.EPE, o.EPK, float64(r0.sent)/float64(r0.base))
	base := ""
	// The peer's shape: all_to_all_single moves every (token, expert) row, whatever E is.
	if kind == "nccl" && R == 2 && o.EPT == gpuEPT && o.EPH == gpuEPH && o.EPK == gpuEPK {
		base = "2.82 ms all_to_all_single (one way, every entry)"
	}
	return []row{{"ep dispatch+combine", name, r0.t, float64(r0.sent) / r0.t.Seconds() / 1e9, "GB/s (rank 0 sent)", base}}, nil
}

// epRank runs one rank of the ep benchmark: its time per dispatch+combine, the bytes it
// sends in one (rows and weights to other ranks, partial sums back), and T·K·row bytes.
func epRank(tr ep.Transport, o options) (time.Duration, int64, int64, error) {
	d := tr.Device()
	s, err := d.NewStream()
	if err != nil {
		return 0, 0, 0, err
	}
	defer s.Close()
	T, H, E, K := o.EPT, o.EPH, o.EPE, o.EPK
	g, err := ep.NewGroup(tr, ep.Config{Experts: E, TopK: K})
	if err != nil {
		return 0, 0, 0, err
	}
	defer g.Close()
	r := rand.New(rand.NewPCG(42, uint64(tr.Rank())))
	idxv := make([]int32, 0, T*K)
	for range T {
		for _, e := range r.Perm(E)[:K] {
			idxv = append(idxv, int32(e))
		}
	}
	ts := newTensors(s)
	defer ts.Free()
	idx, err := device.FromSlice(s, device.I32, idxv, T, K)
	if err != nil {
		return 0, 0, 0, err
	}
	ts.Add(idx)
	w := ts.Alloc(device.F32, T, K)
	x := ts.random(7, 1, device.BF16, T, H)
	if err := ts.Err(); err != nil {
		return 0, 0, 0, err
	}
	if err := device.Fill(s, w, 1/float64(K)); err != nil {
		return 0, 0, 0, err
	}
	l, err := g.Layout(s, idx)
	if err != nil {
		return 0, 0, 0, err
	}
	defer l.Free()
	rowB := int64(H * device.BF16.Size())
	var sent int64
	for p, c := range l.TokensTo() {
		if p != tr.Rank() {
			sent += int64(c) * (rowB + int64(4*K))
		}
	}
	for p, c := range l.TokensFrom() {
		if p != tr.Rank() {
			sent += int64(c) * rowB
		}
	}
	step := func() error {
		D, err := l.Dispatch(s, x, w)
		if err != nil {
			return err
		}
		out, err := l.Combine(s, D.X, D.Weights)
		err = errors.Join(err, D.Free())
		if out != nil {
			err = errors.Join(err, out.Free())
		}
		return err
	}
	for range 2 {
		if err := step(); err != nil {
			return 0, 0, 0, err
		}
	}
	if err := tr.Sync(s); err != nil {
		return 0, 0, 0, err
	}
	// Every rank runs the same number of steps: collective calls must match.
	const n = 20
	start, err := d.NewEvent()
	if err != nil {
		return 0, 0, 0, err
	}
	defer start.Close()
	stop, err := d.NewEvent()
	if err != nil {
		return 0, 0, 0, err
	}
	defer stop.Close()
	if err := start.Record(s); err != nil {
		return 0, 0, 0, err
	}
	for range n {
		if err := step(); err != nil {
			return 0, 0, 0, err
		}
	}
	if err := stop.Record(s); err != nil {
		return 0, 0, 0, err
	}
	if err := tr.Sync(s); err != nil {
		return 0, 0, 0, err
	}
	if err := stop.Synchronize(); err != nil {
		return 0, 0, 0, err
	}
	el, err := stop.Since(start)
	return el / n, sent, int64(T*K) * rowB, err
}
