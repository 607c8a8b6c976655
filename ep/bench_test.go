package ep_test

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

var (
	benchOnce sync.Once
	benchNCCL []ep.Transport
	benchErr  error
)

// BenchmarkDispatchCombine times Dispatch followed by Combine (identity experts) with
// uniform and Zipf(1.1)-skewed routing under the Dropless capacity. On the CPU: two
// in-process ranks, T = 512 tokens each, H = 256 bf16, E = 16, K = 4. On GPUs: two GPUs
// over NCCL, T = 16384 tokens per rank, H = 7168 bf16, E = 64, K = 8. It reports per
// step the milliseconds of dispatch + combine and of each, the bytes rank 0 sent in
// Dispatch (rows and their weights) and their ratio to T·K·row bytes (the rows of all
// routing entries, which an all-to-all without deduplication moves, (R-1)/R of them to
// other ranks), the rate of the bytes rank 0 sent in both, and the host's time to
// enqueue a step. On GPUs it runs both with direct transfers and through NCCL only
// (Config.TransportOnly), and the uniform case with 4 and 1 chunks and with three
// quarters of the multiprocessors for each stream's row kernels; with -v it logs each
// rank's timeline of the last step: when each point of the ops was reached on the
// device and on the host.
func BenchmarkDispatchCombine(b *testing.B) {
	for _, d := range dt.Devices(b) {
		for _, v := range []struct {
			route     string
			chunks    int     // 0: the default
			threads   int     // row kernels' block; 0: the default
			perSM     float64 // row kernels' blocks per multiprocessor; 0: the default
			pack      float64 // the same for the packing of direct transfers
			transport bool    // Config.TransportOnly
		}{{"uniform", 0, 0, 0, 0, false}, {"zipf", 0, 0, 0, 0, false}, {"uniform", 0, 0, 0, 0, true}, {"zipf", 0, 0, 0, 0, true},
			{"uniform", 4, 0, 0, 0, false}, {"uniform", 1, 0, 0, 0, false}, {"uniform", 0, 0, 0.75, 0.75, false}} {
			route := v.route
			name := fmt.Sprintf("%v/%s", d, route)
			if v.chunks != 0 || v.threads != 0 || v.perSM != 0 || v.transport {
				if !d.IsCUDA() {
					continue
				}
				name += fmt.Sprintf("/chunks=%d/threads=%d/perSM=%g/pack=%g/transport-only=%v", v.chunks, v.threads, v.perSM, v.pack, v.transport)
			}
			b.Run(name, func(b *testing.B) {
				defer ep.Tune(v.threads, v.perSM, v.pack)()
				trs, sc := benchWorld(b, d, route, v.chunks)
				sc.transportOnly = v.transport
				benchDC(b, trs, sc)
			})
		}
	}
}

type benchResult struct {
	dispatch, combine time.Duration
	sentD, sentC      int64         // bytes sent by Dispatch and by Combine
	plain             int64         // T·K·row bytes
	host              time.Duration // the host's time to enqueue the steps
	timeline          []string      // the marks of one traced step, in ms from its start
}

// benchWorld returns the ranks of the benchmarks on d and their scenario: on the CPU two
// in-process ranks, T = 512 tokens each, H = 256 bf16, E = 16, K = 4; on GPUs two GPUs
// over NCCL (one world for all benchmarks), T = 16384 tokens per rank, H = 7168 bf16,
// E = 64, K = 8. chunks 0 leaves Config.Chunks at its default.
func benchWorld(b *testing.B, d *device.Device, route string, chunks int) ([]ep.Transport, scen) {
	if d.IsCUDA() {
		devs := twoGPUs(b)
		benchOnce.Do(func() { benchNCCL, benchErr = ep.NewNCCLWorld(devs, 120*time.Second) })
		dt.NoErr(b, benchErr)
		return benchNCCL, scen{R: 2, E: 64, K: 8, H: 7168, T: []int{16384, 16384}, dt: device.BF16, route: route, seed: 42, chunks: chunks}
	}
	sc := scen{R: 2, E: 16, K: 4, H: 256, T: []int{512, 512}, dt: device.BF16, route: route, seed: 41, chunks: chunks}
	w, err := ep.NewWorld(sc.R)
	dt.NoErr(b, err)
	var trs []ep.Transport
	for r := range sc.R {
		trs = append(trs, w.Transport(r))
	}
	return trs, sc
}

// onRanks draws each rank's routing for sc and runs f for every rank at once, a
// goroutine each.
func onRanks[R any](trs []ep.Transport, sc scen, f func(tr ep.Transport, idx []int32) (R, error)) ([]R, error) {
	r := dt.Rand(sc.seed)
	zipf := zipfWeights(r, sc.E)
	res := make([]R, len(trs))
	errs := make([]error, len(trs))
	var wg sync.WaitGroup
	for i, tr := range trs {
		idx := make([]int32, 0, sc.T[i]*sc.K)
		for range sc.T[i] {
			idx = append(idx, route(r, sc, zipf)...)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], errs[i] = f(tr, idx)
		}()
	}
	wg.Wait()
	return res, errors.Join(errs...)
}

func benchDC(b *testing.B, trs []ep.Transport, sc scen) {
	ph := newPhaser(len(trs))
	res, err := onRanks(trs, sc, func(tr ep.Transport, idx []int32) (benchResult, error) {
		return benchRank(tr, sc, idx, b.N, ph)
	})
	if err != nil {
		b.Fatal(err)
	}
	n := float64(b.N)
	r0 := res[0]
	total := r0.dispatch + r0.combine
	b.ReportMetric(float64(total.Microseconds())/1e3/n, "ms/step")
	b.ReportMetric(float64(r0.dispatch.Microseconds())/1e3/n, "ms/dispatch")
	b.ReportMetric(float64(r0.combine.Microseconds())/1e3/n, "ms/combine")
	b.ReportMetric(float64(r0.sentD)/1e6, "MB-sent/dispatch")
	b.ReportMetric(float64(r0.sentD)/float64(r0.plain), "dispatch/TKrows")
	b.ReportMetric(float64(r0.sentD+r0.sentC)*n/total.Seconds()/1e9, "GB/s")
	b.ReportMetric(float64(r0.host.Microseconds())/1e3/n, "host-ms/step")
	for r, res := range res {
		sort.Strings(res.timeline)
		b.Logf("rank %d, one step (ms from its start, D: dispatch, C: combine):\n%s", r, strings.Join(res.timeline, "\n"))
	}
}

func benchRank(tr ep.Transport, sc scen, idxv []int32, n int, ph *phaser) (benchResult, error) {
	var res benchResult
	rk, err := newRank(tr, sc, idxv)
	if err != nil {
		return res, err
	}
	defer rk.close()
	d, s, g, idx := tr.Device(), rk.s, rk.g, rk.idx
	T, K, H := sc.T[tr.Rank()], sc.K, sc.H
	w, err := s.Alloc(device.F32, T, K)
	if err != nil {
		return res, err
	}
	defer w.Free()
	x, err := s.Alloc(sc.dt, T, H)
	if err != nil {
		return res, err
	}
	defer x.Free()
	if err := device.Fill(s, w, 0.125); err != nil {
		return res, err
	}
	if err := device.Fill(s, x, 0.5); err != nil {
		return res, err
	}
	l, err := g.Layout(s, idx)
	if err != nil {
		return res, err
	}
	defer l.Free()
	rowB := int64(H * sc.dt.Size())
	for p, c := range l.TokensTo() {
		if p != tr.Rank() {
			res.sentD += int64(c) * (rowB + int64(4*K))
		}
	}
	for p, c := range l.TokensFrom() {
		if p != tr.Rank() {
			res.sentC += int64(c) * rowB
		}
	}
	res.plain = int64(T*K) * rowB
	op := "" // the op a trace mark belongs to
	step := func(e0, e1, e2 *device.Event) error {
		if e0 != nil {
			if err := e0.Record(s); err != nil {
				return err
			}
		}
		op = "D"
		D, err := l.Dispatch(s, x, w)
		if err != nil {
			return err
		}
		op = "C"
		if e1 != nil {
			if err := e1.Record(s); err != nil {
				return err
			}
		}
		out, err := l.Combine(s, D.X, D.Weights)
		if err != nil {
			return err
		}
		if e2 != nil {
			if err := e2.Record(s); err != nil {
				return err
			}
		}
		D.Free()
		return out.Free()
	}
	for range 2 { // warm up: kernels compiled, pool grown, NCCL connected
		if err := step(nil, nil, nil); err != nil {
			return res, err
		}
	}
	if err := tr.Sync(s); err != nil {
		return res, err
	}
	evs := make([]*device.Event, 3*n)
	for i := range evs {
		if evs[i], err = d.NewEvent(); err != nil {
			return res, err
		}
		defer evs[i].Close()
	}
	if err := ph.wait(); err != nil {
		return res, err
	}
	// The last step has its points marked: the timeline of the overlap, on the device
	// and (when the host reached each point) on the host, from the step's start.
	type mark struct {
		at   string
		e    *device.Event
		host time.Duration
	}
	var marks []mark
	var hostStart time.Time
	trace := func(at string, ms *device.Stream) {
		if e, err := ms.Record(); err == nil {
			marks = append(marks, mark{op + " " + at, e, time.Since(hostStart)})
		}
	}
	t0 := time.Now()
	for i := range n {
		if i == n-1 {
			hostStart = time.Now()
			ep.SetTrace(g, trace)
		}
		if err := step(evs[3*i], evs[3*i+1], evs[3*i+2]); err != nil {
			return res, err
		}
	}
	res.host = time.Since(t0)
	ep.SetTrace(g, nil)
	if err := tr.Sync(s); err != nil {
		return res, err
	}
	for _, m := range marks {
		d, err := m.e.Since(evs[3*(n-1)])
		m.e.Close()
		if err != nil {
			return res, err
		}
		res.timeline = append(res.timeline, fmt.Sprintf("%7.3f (host %7.3f) %s", float64(d.Microseconds())/1e3,
			float64(m.host.Microseconds())/1e3, m.at))
	}
	for i := range n {
		a, err1 := evs[3*i+1].Since(evs[3*i])
		c, err2 := evs[3*i+2].Since(evs[3*i+1])
		if err := errors.Join(err1, err2); err != nil {
			return res, err
		}
		res.dispatch += a
		res.combine += c
	}
	return res, nil
}

// BenchmarkPhases times each phase of Dispatch and Combine alone on rank 0 (the same
// setting as BenchmarkDispatchCombine, uniform routing): packing, the transfer in one
// piece and in Config.Chunks pieces, the chunked transfer beside the replication of the
// rank's own rows, replication, weighted and final sums, in ms, and the host's time to
// enqueue each (ms-host-...). On GPUs also with the former grid of the row kernels.
func BenchmarkPhases(b *testing.B) {
	for _, d := range dt.Devices(b) {
		for _, cfg := range []struct {
			threads int
			perSM   float64
		}{{0, 0}, {256, 4}} {
			name := d.String()
			if cfg.threads != 0 {
				if !d.IsCUDA() {
					continue
				}
				name += fmt.Sprintf("/threads=%d/perSM=%g", cfg.threads, cfg.perSM)
			}
			b.Run(name, func(b *testing.B) {
				defer ep.Tune(cfg.threads, cfg.perSM, 0)()
				trs, sc := benchWorld(b, d, "uniform", 0)
				res, err := onRanks(trs, sc, func(tr ep.Transport, idx []int32) (map[string]time.Duration, error) {
					return phasesRank(tr, sc, idx, b.N)
				})
				dt.NoErr(b, err)
				for name, t := range res[0] {
					b.ReportMetric(float64(t.Microseconds())/1e3, "ms-"+strings.ReplaceAll(name, " ", "-"))
				}
			})
		}
	}
}

func phasesRank(tr ep.Transport, sc scen, idxv []int32, n int) (map[string]time.Duration, error) {
	rk, err := newRank(tr, sc, idxv)
	if err != nil {
		return nil, err
	}
	defer rk.close()
	s := rk.s
	x, err := s.Alloc(sc.dt, sc.T[tr.Rank()], sc.H)
	if err != nil {
		return nil, err
	}
	defer x.Free()
	if err := device.Fill(s, x, 0.5); err != nil {
		return nil, err
	}
	l, err := rk.g.Layout(s, rk.idx)
	if err != nil {
		return nil, err
	}
	defer l.Free()
	return l.Phases(s, x, n)
}
