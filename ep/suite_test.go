package ep_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// scen is one case of the shared suite: a world of R ranks and its routing.
type scen struct {
	name    string
	R, E, K int
	H       int
	T       []int // tokens per rank
	dt      device.DType
	route   string // uniform, zipf, one (every token to expert 0), sparse (30% of entries -1)
	cap     ep.Capacity
	capFn   func(demand, tokens int) int // the capacity cap gives, when not Dropless or Exact
	over    ep.Overflow
	chunks  int
	seed    uint64

	transportOnly bool // Config.TransportOnly
}

func (sc scen) cfg() ep.Config {
	return ep.Config{Experts: sc.E, TopK: sc.K, Capacity: sc.cap, Overflow: sc.over, Chunks: sc.chunks, TransportOnly: sc.transportOnly}
}

// rankIn is one rank's inputs.
type rankIn struct {
	idx  []int32   // [T, K]
	w    []float32 // [T, K]
	x    []float32 // [T, H], values of the dtype
	gout []float32 // [T, H]: the gradient of Combine's output
}

// roundTo rounds v to values of dtype d.
func roundTo(d device.DType, v []float32) []float32 {
	b := make([]byte, len(v)*d.Size())
	device.EncodeFloat32(d, b, v)
	out := make([]float32, len(v))
	device.DecodeFloat32(d, out, b)
	return out
}

// route returns K distinct experts (or -1s) for one token.
func route(r *rand.Rand, sc scen, zipf []float64) []int32 {
	row := make([]int32, sc.K)
	used := map[int32]bool{}
	for k := range row {
		var e int32
		switch sc.route {
		case "one":
			if k > 0 {
				row[k] = -1
				continue
			}
		case "zipf":
			for {
				u := r.Float64() * zipf[len(zipf)-1]
				e = int32(len(zipf) - 1)
				for i, c := range zipf {
					if u < c {
						e = int32(i)
						break
					}
				}
				if !used[e] {
					break
				}
			}
		default:
			for e = int32(r.IntN(sc.E)); used[e]; e = int32(r.IntN(sc.E)) {
			}
			if sc.route == "sparse" && r.Float64() < 0.3 {
				row[k] = -1
				continue
			}
		}
		used[e] = true
		row[k] = e
	}
	return row
}

// zipfWeights returns the cumulative weights of Zipf(1.1) over a random order of n experts.
func zipfWeights(r *rand.Rand, n int) []float64 {
	perm := r.Perm(n)
	zipf := make([]float64, n)
	acc := 0.0
	for i := range zipf {
		acc += 1 / math.Pow(float64(perm[i]+1), 1.1)
		zipf[i] = acc
	}
	return zipf
}

func (sc scen) inputs() []rankIn {
	r := dt.Rand(sc.seed)
	zipf := zipfWeights(r, sc.E)
	ins := make([]rankIn, sc.R)
	for p := range ins {
		T := sc.T[p]
		in := rankIn{}
		for range T {
			in.idx = append(in.idx, route(r, sc, zipf)...)
		}
		in.w = make([]float32, T*sc.K)
		for i := range in.w {
			in.w[i] = float32(r.IntN(17)-8) / 8 // exact in every float dtype
		}
		in.x = roundTo(sc.dt, dt.Normal(r, T*sc.H, 1))
		in.gout = roundTo(sc.dt, dt.Normal(r, T*sc.H, 1))
		ins[p] = in
	}
	return ins
}

// rankOut is what a rank's run produced, on the host.
type rankOut struct {
	TokTo, TokFrom, Counts, Entries []int
	GroupEntries                    []int
	Capacity, Demand, Rows          int
	SendRows, GroupLoad             []int32
	X                               []float32 // kept rows of Dispatched.X
	W                               []float32 // kept rows of Dispatched.Weights
	Origins                         []int32   // [Capacity, 3]
	Out                             []float32 // Combine(X, W): identity experts
	Dy                              []float32 // CombineBackward(gout, X, W): kept rows
	Dw                              []float32
	Dx                              []float32 // DispatchBackward(Dy, Dw)
	Dweights                        []float32
	Bytes                           [][]int64 // bytes sent during Dispatch (in-process worlds)
}

// diffOuts compares two runs' outputs field by field and describes the differences, ""
// when there are none. Elements compare with == as cmp.Diff compares them, but cmp.Diff
// walks them by reflection at about 1.6 µs each: the 1.2e8 elements of a large NCCL
// scenario took it 4 to 7 minutes, which looked like a hang of TestNCCLInProcess.
func diffOuts(want, got []*rankOut) string {
	if len(want) != len(got) {
		return fmt.Sprintf("%d ranks, want %d", len(got), len(want))
	}
	var b strings.Builder
	for r := range want {
		if want[r] == nil || got[r] == nil {
			if want[r] != got[r] {
				fmt.Fprintf(&b, "rank %d: output %v, want %v\n", r, got[r], want[r])
			}
			continue
		}
		wv, gv := reflect.ValueOf(want[r]).Elem(), reflect.ValueOf(got[r]).Elem()
		for i := range wv.NumField() {
			what := fmt.Sprintf("rank %d: %s", r, wv.Type().Field(i).Name)
			switch w := wv.Field(i).Interface().(type) {
			case int:
				diffElems(&b, what, []int{w}, []int{int(gv.Field(i).Int())})
			case []int:
				diffElems(&b, what, w, gv.Field(i).Interface().([]int))
			case []int32:
				diffElems(&b, what, w, gv.Field(i).Interface().([]int32))
			case []float32:
				diffElems(&b, what, w, gv.Field(i).Interface().([]float32))
			case [][]int64:
				g := gv.Field(i).Interface().([][]int64)
				if len(w) != len(g) {
					fmt.Fprintf(&b, "%s: %d rows, want %d\n", what, len(g), len(w))
					continue
				}
				for q := range w {
					diffElems(&b, fmt.Sprintf("%s[%d]", what, q), w[q], g[q])
				}
			default:
				panic(fmt.Sprintf("diffOuts: field %s of type %T", what, w))
			}
		}
	}
	return b.String()
}

// diffElems describes how got differs from want: the length, or the number of elements
// that differ and the first few.
func diffElems[T comparable](b *strings.Builder, what string, want, got []T) {
	if len(want) != len(got) {
		fmt.Fprintf(b, "%s: %d elements, want %d\n", what, len(got), len(want))
		return
	}
	n := 0
	for i := range want {
		if want[i] != got[i] {
			if n < 5 {
				fmt.Fprintf(b, "%s[%d] = %v, want %v\n", what, i, got[i], want[i])
			}
			n++
		}
	}
	if n > 5 {
		fmt.Fprintf(b, "%s: %d elements of %d differ\n", what, n, len(want))
	}
}

// rank is one rank's stream and group for a scenario, with its routing idx (I32 [T,
// K]) on the rank's device.
type rank struct {
	s   *device.Stream
	g   *ep.Group
	idx *device.Tensor
}

// newRank makes rank tr's stream and group for sc and uploads its routing idxv.
func newRank(tr ep.Transport, sc scen, idxv []int32) (*rank, error) {
	s, err := tr.Device().NewStream()
	if err != nil {
		return nil, err
	}
	g, err := ep.NewGroup(tr, sc.cfg())
	if err != nil {
		s.Close()
		return nil, err
	}
	idx, err := device.FromSlice(s, device.I32, idxv, sc.T[tr.Rank()], sc.K)
	if err != nil {
		g.Close()
		s.Close()
		return nil, err
	}
	return &rank{s, g, idx}, nil
}

// close releases the routing, the group and the stream.
func (r *rank) close() {
	r.idx.Free()
	r.g.Close()
	r.s.Close()
}

// phaser is a cyclic barrier for the ranks of a test, failing instead of hanging.
type phaser struct {
	mu    sync.Mutex
	n, at int
	ch    chan struct{}
}

func newPhaser(n int) *phaser { return &phaser{n: n, ch: make(chan struct{})} }

func (p *phaser) wait() error {
	p.mu.Lock()
	ch := p.ch
	p.at++
	if p.at == p.n {
		p.at = 0
		p.ch = make(chan struct{})
		close(ch)
	}
	p.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-time.After(30 * time.Second):
		return errors.New("test barrier: a rank did not arrive")
	}
}

func download(s *device.Stream, x *device.Tensor, rows int) ([]float32, error) {
	if x == nil {
		return nil, nil
	}
	v, err := x.Rows(0, rows)
	if err != nil {
		return nil, err
	}
	return v.Float32s(s)
}

func downloadI32(s *device.Stream, x *device.Tensor) ([]int32, error) {
	v := make([]int32, x.Len())
	return v, device.Download(s, x, v)
}

// runRank runs the whole chain on one rank: Layout, Dispatch, Combine with identity
// experts, CombineBackward, DispatchBackward. world, if not nil, is the in-process world
// whose bytes are read around Dispatch; ph synchronizes the ranks for that. After each
// op it waits with tr.Sync, which fails within the transport's timeout when a peer's
// transfers never come, before reading anything on the host: a plain stream
// synchronization there would wait forever.
func runRank(tr ep.Transport, sc scen, in rankIn, world *ep.World, ph *phaser) (*rankOut, error) {
	rk, err := newRank(tr, sc, in.idx)
	if err != nil {
		return nil, err
	}
	defer rk.close()
	s, g, idx := rk.s, rk.g, rk.idx
	T, K, H := sc.T[tr.Rank()], sc.K, sc.H
	w, _ := device.FromFloat32(s, device.F32, in.w, T, K)
	x, _ := device.FromFloat32(s, sc.dt, in.x, T, H)
	gout, _ := device.FromFloat32(s, sc.dt, in.gout, T, H)
	defer func() {
		for _, t := range []*device.Tensor{w, x, gout} {
			t.Free()
		}
	}()
	l, err := g.Layout(s, idx)
	if err != nil {
		return nil, err
	}
	defer l.Free()
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	ov, err := newOverlapLog(s)
	if err != nil {
		return nil, err
	}
	defer ov.free()
	o := &rankOut{TokTo: l.TokensTo(), TokFrom: l.TokensFrom(), Counts: l.Counts(), Entries: l.ExpertEntries(),
		GroupEntries: l.GroupEntries(), Capacity: l.Capacity(), Demand: l.Demand(), Rows: l.Rows()}
	if o.SendRows, err = downloadI32(s, l.SendRows()); err != nil {
		return nil, err
	}
	if o.GroupLoad, err = downloadI32(s, l.GroupLoad()); err != nil {
		return nil, err
	}
	if world != nil {
		if err := ph.wait(); err != nil {
			return nil, err
		}
		if tr.Rank() == 0 {
			world.ResetBytes()
		}
		if err := ph.wait(); err != nil {
			return nil, err
		}
	}
	D, err := l.Dispatch(s, x, w, ov.during("Dispatch")...)
	if err != nil {
		return nil, err
	}
	defer D.Free()
	// NCCL ranks on GPUs that address each other's memory (the GPU machines the suite
	// requires) take the direct path unless told not to; in-process worlds, whose ranks
	// share a device, never do.
	if want := world == nil && !sc.transportOnly; tr.Device().IsCUDA() && sc.R > 1 && dt.RequireGPU() && g.Direct() != want {
		return nil, fmt.Errorf("rank %d: direct transfers %v with TransportOnly %v", tr.Rank(), g.Direct(), sc.transportOnly)
	}
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	if world != nil {
		if err := ph.wait(); err != nil {
			return nil, err
		}
		o.Bytes = world.Bytes()
		if err := ph.wait(); err != nil {
			return nil, err
		}
	}
	// Poison what Dispatch left unwritten, so that reading it would show.
	if rest := l.Capacity() - l.Rows(); rest > 0 {
		v, _ := D.X.Rows(l.Rows(), l.Capacity())
		wv, _ := D.Weights.Rows(l.Rows(), l.Capacity())
		device.Memset(s, v, 0xFF)
		device.Memset(s, wv, 0xFF)
	}
	if o.X, err = download(s, D.X, l.Rows()); err != nil {
		return nil, err
	}
	if o.W, err = download(s, D.Weights, l.Rows()); err != nil {
		return nil, err
	}
	org, err := l.Origins(s)
	if err != nil {
		return nil, err
	}
	o.Origins, err = downloadI32(s, org)
	org.Free()
	if err != nil {
		return nil, err
	}
	out, err := l.Combine(s, D.X, D.Weights, ov.during("Combine")...)
	if err != nil {
		return nil, err
	}
	defer out.Free()
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	if o.Out, err = out.Float32s(s); err != nil {
		return nil, err
	}
	dy, dw, err := l.CombineBackward(s, gout, D.X, D.Weights, ov.during("CombineBackward")...)
	if err != nil {
		return nil, err
	}
	defer dy.Free()
	defer dw.Free()
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	if rest := l.Capacity() - l.Rows(); rest > 0 {
		v, _ := dy.Rows(l.Rows(), l.Capacity())
		wv, _ := dw.Rows(l.Rows(), l.Capacity())
		device.Memset(s, v, 0xFF)
		device.Memset(s, wv, 0xFF)
	}
	if o.Dy, err = download(s, dy, l.Rows()); err != nil {
		return nil, err
	}
	if o.Dw, err = download(s, dw, l.Rows()); err != nil {
		return nil, err
	}
	dx, dwts, err := l.DispatchBackward(s, dy, dw, ov.during("DispatchBackward")...)
	if err != nil {
		return nil, err
	}
	defer dx.Free()
	defer dwts.Free()
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	if o.Dx, err = dx.Float32s(s); err != nil {
		return nil, err
	}
	if o.Dweights, err = dwts.Float32s(s); err != nil {
		return nil, err
	}
	if err := ov.check("Dispatch", "Combine", "CombineBackward", "DispatchBackward"); err != nil {
		return nil, fmt.Errorf("rank %d: %w", tr.Rank(), err)
	}
	return o, s.Synchronize()
}

// overlapLog gives each op two functions to run while its transfers move, which log
// their calls and enqueue work on the rank's stream: each sets a scratch tensor to the
// number of its call.
type overlapLog struct {
	s       *device.Stream
	scratch *device.Tensor
	calls   []string
}

func newOverlapLog(s *device.Stream) (*overlapLog, error) {
	t, err := s.Alloc(device.E4M3, 4096) // bytes
	return &overlapLog{s: s, scratch: t}, err
}

func (o *overlapLog) free() { o.scratch.Free() }

// during returns op's two functions.
func (o *overlapLog) during(op string) []func() error {
	f := func(i int) func() error {
		return func() error {
			o.calls = append(o.calls, fmt.Sprintf("%s/%d", op, i))
			return device.Memset(o.s, o.scratch, byte(len(o.calls)))
		}
	}
	return []func() error{f(0), f(1)}
}

// check returns an error unless each of ops called its two functions once, in order,
// and the work of the last ran.
func (o *overlapLog) check(ops ...string) error {
	var want []string
	for _, op := range ops {
		want = append(want, op+"/0", op+"/1")
	}
	if !reflect.DeepEqual(o.calls, want) {
		return fmt.Errorf("the ops' during functions ran as %q, want %q", o.calls, want)
	}
	b := make([]byte, o.scratch.Len())
	if err := o.scratch.CopyToHost(o.s, b); err != nil {
		return err
	}
	for i, v := range b {
		if v != byte(len(want)) {
			return fmt.Errorf("byte %d of the during functions' scratch is %d after the ops, want %d", i, v, len(want))
		}
	}
	return nil
}

// runAll runs sc on the ranks of trs, each in its own goroutine, and returns their
// outputs and errors.
func runAll(trs []ep.Transport, sc scen, ins []rankIn, world *ep.World) ([]*rankOut, []error) {
	return eachRank(trs, func(r int, ph *phaser) (*rankOut, error) { return runRank(trs[r], sc, ins[r], world, ph) })
}

// eachRank runs rank(r, ph) for every rank r of trs, each in its own goroutine sharing one
// phaser, and returns their outputs and errors by rank.
func eachRank[O any](trs []ep.Transport, rank func(r int, ph *phaser) (O, error)) ([]O, []error) {
	outs := make([]O, len(trs))
	errs := make([]error, len(trs))
	ph := newPhaser(len(trs))
	var wg sync.WaitGroup
	for r := range trs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[r], errs[r] = rank(r, ph)
		}()
	}
	wg.Wait()
	return outs, errs
}

// newWorld returns an in-process world of R ranks on d, with a timeout for tests, and
// its ranks' transports.
func newWorld(t *testing.T, d *device.Device, R int) (*ep.World, []ep.Transport) {
	t.Helper()
	w, err := ep.NewWorld(R, d)
	dt.NoErr(t, err)
	w.SetTimeout(20 * time.Second)
	trs := make([]ep.Transport, R)
	for r := range trs {
		trs[r] = w.Transport(r)
	}
	return w, trs
}

// runWorld runs sc on an in-process world with every rank on d.
func runWorld(t *testing.T, d *device.Device, sc scen, ins []rankIn, wrap func(ep.Transport) ep.Transport) []*rankOut {
	t.Helper()
	w, trs := newWorld(t, d, sc.R)
	for r := range trs {
		if wrap != nil {
			trs[r] = wrap(trs[r])
		}
	}
	outs, errs := runAll(trs, sc, ins, w)
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("%s on %v: %v", sc.name, d, err)
	}
	return outs
}

// ref is the brute-force answer for one rank.
type ref struct {
	tokTo, tokFrom, counts, entries []int
	capacity, demand, rows          int
	origins                         [][3]int // per kept row: source rank, token, k
	kept                            map[[3]int]int
}

// capacity returns the capacity a rank asked for demand rows has, the ranks holding
// tokens tokens.
func (sc scen) capacity(demand, tokens int) int {
	if sc.capFn != nil {
		return sc.capFn(demand, tokens)
	}
	if sc.cap == ep.Exact {
		return demand
	}
	return tokens * min(sc.K, sc.E/sc.R)
}

// reference computes every rank's layout by brute force.
func reference(sc scen, ins []rankIn) []ref {
	R, K, L := sc.R, sc.K, sc.E/sc.R
	refs := make([]ref, R)
	tokens := 0
	for _, T := range sc.T {
		tokens += T
	}
	for d := range R {
		rf := ref{tokTo: make([]int, R), tokFrom: make([]int, R), counts: make([]int, L), entries: make([]int, sc.E), kept: map[[3]int]int{}}
		for s := range R {
			for t := range sc.T[s] {
				on := map[int]bool{}
				for k := range K {
					if e := int(ins[s].idx[t*K+k]); e >= 0 {
						on[e/L] = true
						if s == d {
							rf.entries[e]++
						}
					}
				}
				for q := range on {
					if s == d {
						rf.tokTo[q]++
					}
					if q == d {
						rf.tokFrom[s]++
					}
				}
			}
		}
		// Expert-major order: expert, source rank, token, k.
		var order [][3]int
		for j := range L {
			for s := range R {
				for t := range sc.T[s] {
					for k := range K {
						if int(ins[s].idx[t*K+k]) == d*L+j {
							order = append(order, [3]int{s, t, k})
						}
					}
				}
			}
		}
		rf.demand = len(order)
		rf.capacity = sc.capacity(rf.demand, tokens)
		rf.rows = min(rf.demand, rf.capacity)
		rf.origins = order[:rf.rows]
		for i, o := range rf.origins {
			rf.kept[o] = i
			e := int(ins[o[0]].idx[o[1]*K+o[2]])
			rf.counts[e-d*L]++
		}
		refs[d] = rf
	}
	return refs
}

// tolerance is the error bound of a sum of terms whose magnitudes add to mag, rounded
// to dtype d once per partial sum and once at the end.
func tolerance(d device.DType, mag float64, terms int) float64 {
	eps := math.Pow(2, -24)
	switch d {
	case device.BF16:
		eps = math.Pow(2, -8)
	case device.F16:
		eps = math.Pow(2, -11)
	}
	return (2.5*eps+float64(terms+2)*math.Pow(2, -24))*mag + 1e-30
}

// check verifies every invariant of one run against the brute-force reference.
func check(t *testing.T, sc scen, ins []rankIn, outs []*rankOut) {
	t.Helper()
	R, K, H, L := sc.R, sc.K, sc.H, sc.E/sc.R
	refs := reference(sc, ins)
	rowB := int64(H*sc.dt.Size() + 4*K)
	var adjD, adjDt, adjC, adjCt, adjW float64 // ⟨D x, Y⟩, ⟨x, D* Y⟩, ⟨C y, g⟩, ⟨y, C* g⟩, Σ W·dW
	var magD, magC float64
	group := make([]int, sc.E) // the entries of all ranks per expert
	for _, rf := range refs {
		for e, n := range rf.entries {
			group[e] += n
		}
	}
	for r, o := range outs {
		rf := refs[r]
		groupLoad := make([]int, len(o.GroupLoad))
		for e, n := range o.GroupLoad {
			groupLoad[e] = int(n)
		}
		// Invariant 1: counts.
		for _, c := range []struct {
			what      string
			got, want any
		}{
			{"tokens to each rank", o.TokTo, rf.tokTo}, {"tokens from each rank", o.TokFrom, rf.tokFrom},
			{"kept rows per expert", o.Counts, rf.counts}, {"entries per expert", o.Entries, rf.entries},
			{"entries of all ranks per expert", o.GroupEntries, group}, {"GroupLoad", groupLoad, group},
			{"demand", o.Demand, rf.demand}, {"rows", o.Rows, rf.rows}, {"capacity", o.Capacity, rf.capacity},
		} {
			if fmt.Sprint(c.got) != fmt.Sprint(c.want) {
				t.Errorf("rank %d: %s = %v, want %v", r, c.what, c.got, c.want)
			}
		}
		// is_token_in_rank, with rows in send order.
		next := make([]int32, R)
		off := make([]int32, R+1)
		for q := range R {
			off[q+1] = off[q] + int32(rf.tokTo[q])
		}
		for tk := range sc.T[r] {
			for q := range R {
				in := false
				for k := range K {
					if e := int(ins[r].idx[tk*K+k]); e >= 0 && e/L == q {
						in = true
					}
				}
				want := int32(-1)
				if in {
					want = off[q] + next[q]
					next[q]++
				}
				if got := o.SendRows[tk*R+q]; got != want {
					t.Fatalf("rank %d: SendRows[%d, %d] = %d, want %d", r, tk, q, got, want)
				}
			}
		}
		// Invariant 2: each kept (token, k) arrives once, bit-exact, with its weight.
		for i, org := range rf.origins {
			s, tk, k := org[0], org[1], org[2]
			if got := [3]int{int(o.Origins[3*i]), int(o.Origins[3*i+1]), int(o.Origins[3*i+2])}; got != org {
				t.Fatalf("rank %d: origin of row %d = %v, want %v", r, i, got, org)
			}
			for h := range H {
				if g, w := o.X[i*H+h], ins[s].x[tk*H+h]; math.Float32bits(g) != math.Float32bits(w) {
					t.Fatalf("rank %d: X[%d, %d] = %v, want x of rank %d token %d: %v", r, i, h, g, s, tk, w)
				}
			}
			if g, w := o.W[i], ins[s].w[tk*K+k]; g != w {
				t.Fatalf("rank %d: Weights[%d] = %v, want %v", r, i, g, w)
			}
		}
		for i := len(rf.origins); i < o.Capacity; i++ {
			if o.Origins[3*i] != -1 || o.Origins[3*i+1] != -1 || o.Origins[3*i+2] != -1 {
				t.Fatalf("rank %d: origin of unkept row %d = %v", r, i, o.Origins[3*i:3*i+3])
			}
		}
		// Invariant 5: bytes, with deduplication.
		if o.Bytes != nil && r == 0 {
			for s := range R {
				for q := range R {
					want := int64(refs[s].tokTo[q]) * rowB
					if s == q {
						want = 0
					}
					if got := o.Bytes[s][q]; got != want {
						t.Errorf("bytes %d→%d during Dispatch = %d, want %d tokens × %d", s, q, got, refs[s].tokTo[q], rowB)
					}
				}
			}
		}
		// Invariant 3: round trip with identity experts, and the gradients.
		for tk := range sc.T[r] {
			gdot := 0.0
			for h := range H {
				gdot += float64(ins[r].x[tk*H+h]) * float64(ins[r].gout[tk*H+h])
			}
			keptW, keptAbs := 0.0, 0.0
			for k := range K {
				e := int(ins[r].idx[tk*K+k])
				if e < 0 {
					continue
				}
				if _, ok := refs[e/L].kept[[3]int{r, tk, k}]; ok {
					keptW += float64(ins[r].w[tk*K+k])
					keptAbs += math.Abs(float64(ins[r].w[tk*K+k]))
				}
				// dweights: ⟨x[t], gout[t]⟩ where kept, else 0.
				want, mag := 0.0, 0.0
				if _, ok := refs[e/L].kept[[3]int{r, tk, k}]; ok {
					want = gdot
					for h := range H {
						mag += math.Abs(float64(ins[r].x[tk*H+h]) * float64(ins[r].gout[tk*H+h]))
					}
				}
				if got := float64(o.Dweights[tk*K+k]); math.Abs(got-want) > tolerance(device.F32, mag, H) {
					t.Fatalf("rank %d: dweights[%d, %d] = %v, want %v", r, tk, k, got, want)
				}
			}
			for h := range H {
				xv, gv := float64(ins[r].x[tk*H+h]), float64(ins[r].gout[tk*H+h])
				if got, want := float64(o.Out[tk*H+h]), keptW*xv; math.Abs(got-want) > tolerance(sc.dt, keptAbs*math.Abs(xv), K) {
					t.Fatalf("rank %d: out[%d, %d] = %v, want Σw·x = %v", r, tk, h, got, want)
				}
				// dx = Σ over kept entries of w·gout, rounded to the dtype per row.
				if got, want := float64(o.Dx[tk*H+h]), keptW*gv; math.Abs(got-want) > tolerance(sc.dt, keptAbs*math.Abs(gv), K)*2 {
					t.Fatalf("rank %d: dx[%d, %d] = %v, want Σw·gout = %v", r, tk, h, got, want)
				}
				adjC += float64(o.Out[tk*H+h]) * gv
				adjDt += xv * float64(o.Dx[tk*H+h])
				magC += math.Abs(float64(o.Out[tk*H+h]) * gv)
				magD += math.Abs(xv * float64(o.Dx[tk*H+h]))
			}
		}
		for i, org := range rf.origins {
			s, tk, k := org[0], org[1], org[2]
			wv := float64(ins[s].w[tk*K+k])
			dot, mag := 0.0, 0.0
			for h := range H {
				xv, gv := float64(ins[s].x[tk*H+h]), float64(ins[s].gout[tk*H+h])
				if got, want := float64(o.Dy[i*H+h]), wv*gv; math.Abs(got-want) > tolerance(sc.dt, math.Abs(want), 1) {
					t.Fatalf("rank %d: dy[%d, %d] = %v, want w·gout = %v", r, i, h, got, want)
				}
				dot += xv * gv
				mag += math.Abs(xv * gv)
				adjD += float64(o.X[i*H+h]) * float64(o.Dy[i*H+h])
				adjCt += float64(o.X[i*H+h]) * float64(o.Dy[i*H+h])
			}
			if got := float64(o.Dw[i]); math.Abs(got-dot) > tolerance(device.F32, mag, H) {
				t.Fatalf("rank %d: dw[%d] = %v, want ⟨y, gout⟩ = %v", r, i, got, dot)
			}
			adjW += wv * float64(o.Dw[i])
		}
	}
	// Invariant 4: adjoints, over all ranks. In f32 they hold to rounding; in narrower
	// dtypes the rounding of each output to the dtype dominates.
	tol := 1e-5
	if sc.dt != device.F32 {
		tol = 2e-2
	}
	if math.Abs(adjD-adjDt) > tol*(magD+1e-9) {
		t.Errorf("adjoint of Dispatch: ⟨D x, Y⟩ = %v, ⟨x, D* Y⟩ = %v", adjD, adjDt)
	}
	if math.Abs(adjC-adjCt) > tol*(magC+1e-9) {
		t.Errorf("adjoint of Combine: ⟨C y, g⟩ = %v, ⟨y, C* g⟩ = %v", adjC, adjCt)
	}
	if math.Abs(adjC-adjW) > tol*(magC+1e-9) {
		t.Errorf("weight gradient: ⟨C(y, W), g⟩ = %v, Σ W·dW = %v", adjC, adjW)
	}
}
