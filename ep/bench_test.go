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

// benchIn is one rank's inputs of a step: its layout, tokens x ([T, H] of the
// scenario's dtype, all 0.5) and weights w (F32 [T, K], all 0.125).
type benchIn struct {
	*rank
	l    *ep.Layout
	x, w *device.Tensor
}

// newBenchIn makes rank tr's group for sc, its inputs and its layout of the routing idxv.
func newBenchIn(tr ep.Transport, sc scen, idxv []int32) (*benchIn, error) {
	rk, err := newRank(tr, sc, idxv)
	if err != nil {
		return nil, err
	}
	in := &benchIn{rank: rk}
	s, T := rk.s, sc.T[tr.Rank()]
	if in.w, err = s.Alloc(device.F32, T, sc.K); err == nil {
		if in.x, err = s.Alloc(sc.dt, T, sc.H); err == nil {
			err = errors.Join(device.Fill(s, in.w, 0.125), device.Fill(s, in.x, 0.5))
		}
	}
	if err == nil {
		in.l, err = rk.g.Layout(s, rk.idx)
	}
	if err != nil {
		in.close()
		return nil, err
	}
	return in, nil
}

func (in *benchIn) close() {
	in.l.Free()
	for _, t := range []*device.Tensor{in.x, in.w} {
		if t != nil {
			t.Free()
		}
	}
	in.rank.close()
}

// step runs a Dispatch and a Combine of the expert rows unchanged (identity experts),
// calling at(op) on the host before Dispatch ("D"), before Combine ("C") and after both
// ("").
func (in *benchIn) step(at func(op string) error) error {
	if err := at("D"); err != nil {
		return err
	}
	D, err := in.l.Dispatch(in.s, in.x, in.w)
	if err != nil {
		return err
	}
	defer D.Free()
	if err := at("C"); err != nil {
		return err
	}
	out, err := in.l.Combine(in.s, D.X, D.Weights)
	if err != nil {
		return err
	}
	if err := at(""); err != nil {
		return err
	}
	return out.Free()
}

// warm runs two steps, so that kernels are compiled, pools grown and NCCL connected.
func (in *benchIn) warm(tr ep.Transport) error {
	none := func(string) error { return nil }
	for range 2 {
		if err := in.step(none); err != nil {
			return err
		}
	}
	return tr.Sync(in.s)
}

// tracer is a trace hook (ep.SetTrace) that records an event at each mark of the ops on
// the stream that reaches it, and the host's time then.
type tracer struct {
	op    string    // the op of the marks: "D" (Dispatch) or "C" (Combine)
	t0    time.Time // the host's origin
	marks []traceMark
	err   error
}

type traceMark struct {
	op, at string // at is "" for the start of op
	s      *device.Stream
	e      *device.Event
	host   time.Duration
}

func (t *tracer) hook(at string, s *device.Stream) {
	e, err := s.Record()
	if err != nil {
		t.err = errors.Join(t.err, err)
		return
	}
	t.marks = append(t.marks, traceMark{t.op, at, s, e, time.Since(t.t0)})
}

// begin marks the start of op on s, the op's stream: the marks that follow are op's.
func (t *tracer) begin(op string, s *device.Stream) {
	t.op = op
	t.hook("", s)
}

func (t *tracer) close() {
	for _, m := range t.marks {
		m.e.Close()
	}
	t.marks = nil
}

// timeline describes each mark, once the device has reached them all: when the device
// and the host reached it, in ms from the first mark, and the op and mark.
func (t *tracer) timeline() ([]string, error) {
	var out []string
	for _, m := range t.marks {
		d, err := m.e.Since(t.marks[0].e)
		if err != nil {
			return nil, err
		}
		at := m.at
		if at == "" {
			at = "start"
		}
		out = append(out, fmt.Sprintf("%7.3f (host %7.3f) %s %s", float64(d.Microseconds())/1e3,
			float64((m.host-t.marks[0].host).Microseconds())/1e3, m.op, at))
	}
	return out, t.err
}

// phases returns the time of each phase of the traced ops, summed over them, once the
// device has reached every mark. A phase ends at a mark and is named after the op and
// the mark without its piece ("D pack" for "pack 2" in a Dispatch); on the device it
// begins at the mark before on the same stream in the same op, or the op's start, and
// on the host ("host D pack") at the mark before.
func (t *tracer) phases() (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	var start traceMark
	last := map[*device.Stream]*device.Event{}
	var host time.Duration
	for _, m := range t.marks {
		if m.at == "" {
			start, host = m, m.host
			clear(last)
			continue
		}
		from := last[m.s]
		if from == nil {
			from = start.e
		}
		d, err := m.e.Since(from)
		if err != nil {
			return nil, err
		}
		name := m.op + " " + strings.TrimRight(m.at, " 0123456789")
		out[name] += d
		out["host "+name] += m.host - host
		last[m.s], host = m.e, m.host
	}
	return out, t.err
}

func benchRank(tr ep.Transport, sc scen, idxv []int32, n int, ph *phaser) (benchResult, error) {
	var res benchResult
	in, err := newBenchIn(tr, sc, idxv)
	if err != nil {
		return res, err
	}
	defer in.close()
	d, s, l := tr.Device(), in.s, in.l
	T, K, H := sc.T[tr.Rank()], sc.K, sc.H
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
	if err := in.warm(tr); err != nil {
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
	trace := &tracer{}
	defer trace.close()
	t0 := time.Now()
	for i := range n {
		traced := i == n-1
		if traced {
			trace.t0 = time.Now()
			ep.SetTrace(in.g, trace.hook)
		}
		err := in.step(func(op string) error {
			e := map[string]*device.Event{"D": evs[3*i], "C": evs[3*i+1], "": evs[3*i+2]}[op]
			if traced && op != "" {
				trace.begin(op, s)
			}
			return e.Record(s)
		})
		if err != nil {
			return res, err
		}
	}
	res.host = time.Since(t0)
	ep.SetTrace(in.g, nil)
	if err := tr.Sync(s); err != nil {
		return res, err
	}
	if res.timeline, err = trace.timeline(); err != nil {
		return res, err
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

// BenchmarkPhases times the phases of Dispatch and Combine (the setting of
// BenchmarkDispatchCombine, uniform routing) as the real ops run them, through their
// trace marks (ep.SetTrace), and reports on rank 0 the mean per step in ms of each: the
// time from the mark before on the same stream, or the op's start, to the mark that
// ends the phase, named "ms-D-NAME" or "ms-C-NAME" after the op and the mark without
// its piece, summed over the pieces. Through the transport: D-pack the packing of the
// rows for other ranks, D-transfer the transfers on the transfer stream (D-transfer-start
// its wait for the packing), D-place-own the replication of the rank's own rows, D-wait
// the op's stream waiting for the pieces, D-place the replication of the received rows;
// C-pack the weighted sums of the received rows, C-sums-own those of the rank's own,
// C-final-local and C-final the final sums; with direct transfers D-sent and C-sent are
// the packing into the peers' memory. ms-host-... is the host's time from the mark
// before. On GPUs also with the former grid of the row kernels and with transfers in
// one piece.
func BenchmarkPhases(b *testing.B) {
	for _, d := range dt.Devices(b) {
		for _, cfg := range []struct {
			threads int
			perSM   float64
			chunks  int
		}{{0, 0, 0}, {256, 4, 0}, {0, 0, 1}} {
			name := d.String()
			if cfg.threads != 0 || cfg.chunks != 0 {
				if !d.IsCUDA() {
					continue
				}
				name += fmt.Sprintf("/threads=%d/perSM=%g/chunks=%d", cfg.threads, cfg.perSM, cfg.chunks)
			}
			b.Run(name, func(b *testing.B) {
				defer ep.Tune(cfg.threads, cfg.perSM, 0)()
				trs, sc := benchWorld(b, d, "uniform", cfg.chunks)
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

// phasesRank runs n traced steps on rank tr after warming up, and returns the mean time
// of each phase per step.
func phasesRank(tr ep.Transport, sc scen, idxv []int32, n int) (map[string]time.Duration, error) {
	in, err := newBenchIn(tr, sc, idxv)
	if err != nil {
		return nil, err
	}
	defer in.close()
	if err := in.warm(tr); err != nil {
		return nil, err
	}
	trace := &tracer{t0: time.Now()}
	defer trace.close()
	ep.SetTrace(in.g, trace.hook)
	defer ep.SetTrace(in.g, nil)
	for range n {
		err := in.step(func(op string) error {
			if op != "" {
				trace.begin(op, in.s)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	if err := tr.Sync(in.s); err != nil {
		return nil, err
	}
	out, err := trace.phases()
	for name := range out {
		out[name] /= time.Duration(n)
	}
	return out, err
}
