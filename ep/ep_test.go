package ep_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// scenarios is the shared suite: invariants 1–7 of the spec over R = 1, 2, 3, 4, 8.
func scenarios() []scen {
	f32, bf16, f16 := device.F32, device.BF16, device.F16
	rows := func(n int) func(int, int) int { return func(int, int) int { return n } }
	factor := func(f float64, K, R int) func(int, int) int {
		return func(_, tokens int) int { return int(math.Ceil(f * float64(K) * float64(tokens) / float64(R))) }
	}
	return []scen{
		{name: "R1", R: 1, E: 4, K: 2, H: 16, T: []int{23}, dt: f32, route: "uniform", seed: 1},
		{name: "R2", R: 2, E: 8, K: 3, H: 24, T: []int{40, 33}, dt: f32, route: "uniform", seed: 2},
		{name: "R2/bf16/chunks3", R: 2, E: 8, K: 4, H: 40, T: []int{57, 61}, dt: bf16, route: "uniform", chunks: 3, seed: 3},
		{name: "R3/zipf", R: 3, E: 12, K: 4, H: 16, T: []int{30, 41, 25}, dt: f32, route: "zipf", seed: 4},
		{name: "R4/sparse/f16", R: 4, E: 16, K: 4, H: 20, T: []int{19, 27, 31, 8}, dt: f16, route: "sparse", seed: 5},
		{name: "R8", R: 8, E: 16, K: 4, H: 8, T: []int{12, 9, 14, 11, 10, 13, 7, 15}, dt: f32, route: "uniform", chunks: 2, seed: 6},
		{name: "R8/zipf/bf16", R: 8, E: 32, K: 6, H: 64, T: []int{20, 20, 20, 20, 20, 20, 20, 20}, dt: bf16, route: "zipf", seed: 7},
		// Edge cases.
		{name: "zero-token rank", R: 3, E: 6, K: 2, H: 12, T: []int{14, 0, 9}, dt: f32, route: "uniform", seed: 8},
		{name: "all to one expert", R: 4, E: 8, K: 3, H: 16, T: []int{10, 12, 9, 11}, dt: f32, route: "one", seed: 9},
		{name: "K over local experts", R: 2, E: 4, K: 3, H: 16, T: []int{21, 17}, dt: f32, route: "uniform", seed: 10},
		{name: "Exact", R: 3, E: 9, K: 3, H: 8, T: []int{15, 16, 17}, dt: f32, route: "zipf", cap: ep.Exact, seed: 11},
		{name: "Factor fits", R: 2, E: 8, K: 2, H: 8, T: []int{30, 30}, dt: f32, route: "uniform",
			cap: ep.Factor(3), capFn: factor(3, 2, 2), seed: 12},
		{name: "Drop", R: 3, E: 6, K: 3, H: 8, T: []int{20, 25, 15}, dt: f32, route: "zipf",
			cap: ep.Rows(17), capFn: rows(17), over: ep.DropOverflow, chunks: 2, seed: 13},
		{name: "Drop/Factor/bf16", R: 4, E: 8, K: 2, H: 16, T: []int{16, 16, 16, 16}, dt: bf16, route: "one",
			cap: ep.Factor(1.5), capFn: factor(1.5, 2, 4), over: ep.DropOverflow, seed: 14},
		{name: "unaligned hidden", R: 2, E: 4, K: 2, H: 13, T: []int{11, 9}, dt: bf16, route: "uniform", seed: 15},
	}
}

// TestInvariants runs the shared suite on in-process worlds: on the CPU, and on the GPU
// when present (every rank on GPU 0), where results must equal the CPU's bit for bit.
func TestInvariants(t *testing.T) {
	cpu := map[string][]*rankOut{}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, sc := range scenarios() {
			t.Run(sc.name, func(t *testing.T) {
				ins := sc.inputs()
				outs := runWorld(t, d, sc, ins, nil)
				check(t, sc, ins, outs)
				if !d.IsCUDA() {
					cpu[sc.name] = outs
				} else if want := cpu[sc.name]; want != nil {
					if diff := diffOuts(want, outs); diff != "" {
						t.Errorf("GPU differs from the CPU (got, want CPU):\n%s", diff)
					}
				}
			})
		}
	})
}

// jitter is a transport that sleeps a random while before each call, to shuffle the
// ranks' schedules.
type jitter struct {
	ep.Transport
	mu sync.Mutex
	r  *rand.Rand
}

func (j *jitter) pause() {
	j.mu.Lock()
	d := time.Duration(j.r.IntN(300)) * time.Microsecond
	j.mu.Unlock()
	time.Sleep(d)
	runtime.Gosched()
}

func (j *jitter) AllGather(s *device.Stream, send, recv *device.Tensor) error {
	j.pause()
	return j.Transport.AllGather(s, send, recv)
}

func (j *jitter) AllToAllV(s *device.Stream, x *ep.Exchange) error {
	j.pause()
	return j.Transport.AllToAllV(s, x)
}

// TestDeterminism (invariant 6): repeated runs under shuffled scheduling and other
// GOMAXPROCS give bit-identical results, chunked or not.
func TestDeterminism(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		sc := scen{name: "det", R: 4, E: 8, K: 3, H: 24, T: []int{30, 22, 35, 18}, dt: device.F32, route: "zipf", seed: 21}
		ins := sc.inputs()
		want := runWorld(t, d, sc, ins, nil)
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
		for rep, procs := range []int{1, 3, 8} {
			runtime.GOMAXPROCS(procs)
			seed := uint64(100 + rep)
			got := runWorld(t, d, sc, ins, func(tr ep.Transport) ep.Transport {
				return &jitter{Transport: tr, r: dt.Rand(seed + uint64(tr.Rank()))}
			})
			if diff := diffOuts(want, got); diff != "" {
				t.Fatalf("run %d (GOMAXPROCS %d) differs (got, want the first run):\n%s", rep, procs, diff)
			}
		}
		sc.chunks = 3
		if diff := diffOuts(want, runWorld(t, d, sc, ins, nil)); diff != "" {
			t.Fatalf("3 chunks differ from 1 (got, want 1 chunk):\n%s", diff)
		}
	})
}

// layoutAll runs Layout on every rank of a CPU world with the given routing and returns
// the errors.
func layoutAll(t *testing.T, cfg ep.Config, idx [][]int32, steps int) []error {
	t.Helper()
	R := len(idx)
	w, err := ep.NewWorld(R)
	dt.NoErr(t, err)
	w.SetTimeout(10 * time.Second)
	errs := make([]error, R)
	var wg sync.WaitGroup
	for r := range R {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := ep.NewGroup(w.Transport(r), cfg)
			if err != nil {
				errs[r] = err
				return
			}
			s := device.CPU().Stream()
			x := dt.Must(device.FromSlice(s, device.I32, idx[r], len(idx[r])/cfg.TopK, cfg.TopK))
			for range steps {
				l, err := g.Layout(s, x)
				if err != nil {
					errs[r] = err
					return
				}
				l.Free()
			}
		}()
	}
	wg.Wait()
	return errs
}

// TestCapacityError (invariant 7): under Error, overflow fails Layout on every rank with
// the same *CapacityError, which names the rows needed.
func TestCapacityError(t *testing.T) {
	idx := [][]int32{{0, 1, 0, 2, 0, 3}, {0, 1, 1, 2}} // rank 0 gets 7 rows for experts 0 and 1
	for _, tc := range []struct {
		name  string
		cap   ep.Capacity
		steps int
		every int
		need  int
	}{
		{"Rows", ep.Rows(4), 1, 0, 7},
		{"Factor", ep.Factor(1), 1, 0, 7},
		{"every 3 steps", ep.Rows(5), 3, 3, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ep.Config{Experts: 4, TopK: 2, Capacity: tc.cap, CheckEvery: tc.every}
			errs := layoutAll(t, cfg, idx, tc.steps)
			for r, err := range errs {
				var ce *ep.CapacityError
				if !errors.As(err, &ce) {
					t.Fatalf("rank %d: got %v, want a *CapacityError", r, err)
				}
				if ce.Rank != 0 || ce.Need != tc.need || !strings.Contains(err.Error(), "Rows(7)") {
					t.Errorf("rank %d: %+v: %v", r, *ce, err)
				}
				if tc.every > 1 && ce.Steps != tc.every {
					t.Errorf("rank %d: Steps = %d, want %d", r, ce.Steps, tc.every)
				}
				t.Log(err)
			}
		})
	}
	// Checked every 3 steps: the first two layouts pass (dropping), the third fails.
	cfg := ep.Config{Experts: 4, TopK: 2, Capacity: ep.Rows(5), CheckEvery: 3}
	for _, err := range layoutAll(t, cfg, idx, 2) {
		if err != nil {
			t.Fatalf("two steps of three: %v", err)
		}
	}
}

// TestBadRouting: invalid expert ids on one rank fail Layout on every rank, naming them.
func TestBadRouting(t *testing.T) {
	for _, tc := range []struct {
		name string
		idx  [][]int32
		want string
	}{
		{"out of range", [][]int32{{0, 1, 2, 3}, {1, 9, -1, 0}}, "rank 1's topk_idx[0, 1] is not -1 or an expert in [0, 4)"},
		{"below -1", [][]int32{{0, -2, 2, 3}, {1, 2, -1, 0}}, "topk_idx[0, 1] is not -1"},
		{"repeated", [][]int32{{0, 1, 3, 3}, {1, 2, -1, 0}}, "topk_idx[1, 1] repeats an expert of row 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := layoutAll(t, ep.Config{Experts: 4, TopK: 2}, tc.idx, 1)
			for r, err := range errs {
				if err == nil || !strings.Contains(err.Error(), strings.TrimPrefix(tc.want, "rank 1's ")) {
					t.Errorf("rank %d: got %v, want %q", r, err, tc.want)
				}
			}
		})
	}
}

// TestWorldMismatch: ranks whose calls disagree fail instead of moving wrong data.
func TestWorldMismatch(t *testing.T) {
	w, _ := ep.NewWorld(2)
	w.SetTimeout(5 * time.Second)
	err := w.Run(func(tr ep.Transport) error {
		s := device.CPU().Stream()
		send := dt.Must(s.Alloc(device.F32, 4, 2))
		recv := dt.Must(s.Alloc(device.F32, 4, 2))
		n := 1 + tr.Rank() // rank 0 sends 1 row, rank 1 expects 1 but rank 0 expects 2
		return tr.AllToAllV(s, &ep.Exchange{Send: []*device.Tensor{send}, Recv: []*device.Tensor{recv},
			SendOff: []int{0, 0}, SendCount: []int{1, 1}, RecvOff: []int{0, 0}, RecvCount: []int{n, n}})
	})
	if err == nil || !strings.Contains(err.Error(), "expects") {
		t.Fatalf("got %v", err)
	}
}
