package ep

import (
	"cmp"
	"errors"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// Group is one rank's side of an expert-parallel layer: a transport and the Config. It
// makes a Layout per step from the routing. A Group is used from one goroutine, like
// its transport.
type Group struct {
	tr   Transport
	cfg  Config
	dev  *device.Device
	be   backend
	cs   *device.Stream // the stream transfers run on, beside the caller's
	rank int
	r    int // ranks
	e    int // experts
	l    int // experts per rank
	k    int // top-k

	trace func(at string, s *device.Stream) // test hook: marks points of Dispatch and Combine

	win    *window // direct transfers (peer.go), set up by the first op
	noPeer bool    // payload goes through the transport

	agreed bool // the ranks' settings were found alike (agree), at the first Layout
	closed bool

	step    int // layouts since the last capacity check (CheckEvery > 1)
	pending *CapacityError
	dropped int64
}

// NewGroup returns rank tr.Rank()'s group. It checks cfg: E must be a multiple of the
// ranks, TopK in [1, MaxTopK]. Every rank's cfg must be the same (the first Layout
// checks it). The group holds a second stream of tr's device for transfers; Close
// releases it.
func NewGroup(tr Transport, cfg Config) (*Group, error) {
	if tr == nil {
		return nil, errors.New("ep: NewGroup: nil transport")
	}
	if err := cfg.check(tr.Size()); err != nil {
		return nil, err
	}
	if r, n := tr.Rank(), tr.Size(); r < 0 || r >= n {
		return nil, fmt.Errorf("ep: NewGroup: the transport's rank %d is not one of its %d ranks", r, n)
	}
	if tr.Device() == nil {
		return nil, fmt.Errorf("ep: NewGroup: rank %d's transport has no device", tr.Rank())
	}
	g := &Group{tr: tr, cfg: cfg, dev: tr.Device(), rank: tr.Rank(), r: tr.Size(), e: cfg.Experts, l: cfg.Experts / tr.Size(), k: cfg.TopK}

	// Transfers run on a stream of the highest priority, so that their kernels start as
	// soon as multiprocessors free up.
	var err error
	if g.cs, err = g.dev.NewPriorityStream(); err != nil {
		return nil, err
	}
	if g.dev.IsCUDA() {
		g.be = &gpuBackend{dev: g.dev, g: g}
	} else {
		g.be = cpuBackend{}
	}
	// Direct transfers are for GPUs of NCCL ranks; an in-process World moves (and
	// counts) every byte itself, as does any other transport.
	_, nccl := tr.(*ncclTransport)
	g.noPeer = !g.dev.IsCUDA() || g.r == 1 || !nccl
	return g, nil
}

// Close releases the group's stream and, after the work of its ops is done, its window.
// It does not close the transport. With direct transfers (Direct) Close is collective:
// it waits for the other ranks through the transport, since they write into this rank's
// window, and the ranks close their groups together.
func (g *Group) Close() error {
	if g == nil {
		return errors.New("ep: Close: nil Group")
	}
	if g.closed {
		return nil
	}
	g.closed = true
	var err error
	if g.win != nil {
		err = g.dropWindow(g.cs)
	}
	if cerr := g.cs.Close(); err == nil {
		err = cerr
	}
	return err
}

// Direct reports whether the group moves payload by writing into the other ranks'
// memory (see Config.TransportOnly) rather than through its transport. Ranks decide it
// together at their first Dispatch, Combine or backward pass; before, it reports false.
func (g *Group) Direct() bool { return g.win != nil }

// Config returns the group's configuration, with defaults filled in (Chunks as the
// ops use it now: with direct transfers, once the first op has decided on them).
func (g *Group) Config() Config {
	c := g.cfg
	c.Chunks = g.chunks()
	return c
}

// chunks is the number of pieces of a transfer: Config.Chunks, or by default 1 on the
// CPU, 4 on GPUs through the transport and directChunks with direct transfers.
func (g *Group) chunks() int {
	switch {
	case g.cfg.Chunks > 0:
		return g.cfg.Chunks
	case !g.dev.IsCUDA():
		return 1
	case g.win != nil:
		return directChunks
	}
	return 4
}

// Transport returns the group's transport.
func (g *Group) Transport() Transport { return g.tr }

// LocalExperts returns the number of experts on each rank, E/R; this rank holds
// experts [Rank·E/R, (Rank+1)·E/R).
func (g *Group) LocalExperts() int { return g.l }

// Dropped returns the expert rows this rank has dropped over all layouts.
func (g *Group) Dropped() int64 { return g.dropped }

// Layout is what one step's routing means for one rank: which tokens go to which rank
// (each token once per rank that holds any of its experts), where each received row
// lands in the expert-major buffers, and how many rows each local expert gets. It holds
// device tensors of the group's device; Free releases them. Dispatch, Combine and the
// backward passes reuse it.
type Layout struct {
	g *Group
	t int // tokens of this rank

	idx     *device.Tensor // I32 [T, K], a copy of topk_idx
	sendRow *device.Tensor // I32 [T, R]: row of (t, d) in the send order, -1 if t does not go to d
	sendTok *device.Tensor // I32 [S]: the token of each send row
	meta    *device.Tensor // I32 [Rv, K+1]: per received row, the local expert of each k (-1: none), then the source token
	slot    *device.Tensor // I32 [Rv, K]: expert-major row of each (received row, k), -1 if none or dropped
	counts  *device.Tensor // I32 [L]: rows kept per local expert
	offs    *device.Tensor // I32 [2(R+1) + E]: recvOff, sendOff and groupLd on the device
	recvOfs *device.Tensor // a view of offs: recvOff, for Origins
	sendOfs *device.Tensor // a view of offs: sendOff, for Combine's final sums
	groupLd *device.Tensor // a view of offs: the routing entries of all ranks per expert

	tokTo, tokFrom   []int // [R] tokens sent to / received from each rank
	pair             []int // [R·R] tokens from rank s to rank d at s·R+d
	sendOff, recvOff []int // [R+1] prefix sums of tokTo and tokFrom
	expTo            []int // [E] routing entries of this rank per expert
	expAll           []int // [E] routing entries of all ranks per expert
	countsHost       []int // [L]
	tokens           []int // [R] tokens of each rank
	demand, capacity int
}

// Layout computes the layout of topkIdx (I32 [T, K] on the group's device: expert ids,
// -1 for none) on s: on the device, which ranks and experts each token goes to; then one
// small all-gather of counts tells every rank what every rank will receive, so demand is
// known before any payload moves, and every rank makes the same capacity decision; then
// each rank learns the routing of the rows it will receive and places them. It waits
// for the count exchange (one host synchronization). Invalid expert ids (outside [-1,
// E), or repeated within a row) on any rank fail Layout on every rank, as does overflow
// under the FailOnOverflow policy (a *CapacityError). The first Layout of a group also
// checks that every rank's group has the same Config (but Config.TransportOnly),
// failing on every rank with an error that names the setting and the ranks of each
// value. topkIdx is only read (Layout keeps a copy); the layout's tensors are new, on
// the group's device, allocated and freed in stream order on s. Work is enqueued on s.
func (g *Group) Layout(s *device.Stream, topkIdx *device.Tensor) (*Layout, error) {
	if err := g.usable(s, "Layout"); err != nil {
		return nil, err
	}
	if topkIdx == nil {
		return nil, errors.New("ep: Layout: topk_idx is nil")
	}
	if err := topkIdx.Check(s, "ep: Layout: topk_idx"); err != nil {
		return nil, err
	}
	if topkIdx.DType() != device.I32 || topkIdx.Rank() != 2 || topkIdx.Dim(1) != g.k {
		return nil, fmt.Errorf("ep: Layout: topk_idx is %v: want i32[T %d]", topkIdx, g.k)
	}
	T, R, K, L := topkIdx.Dim(0), g.r, g.k, g.l
	if T*K >= math.MaxInt32 || T*R >= math.MaxInt32 {
		return nil, fmt.Errorf("ep: Layout: %d tokens: too many for %d ranks and top-%d", T, R, K)
	}
	if !g.agreed {
		if err := g.agree(s); err != nil {
			return nil, err
		}
		g.agreed = true
	}
	l := &Layout{g: g, t: T}
	ok := false
	defer func() {
		if !ok {
			l.Free()
		}
	}()
	var err error
	// own holds the layout's tensors, which l.Free frees after a failure; tmp this
	// call's temporaries.
	own, tmp := device.NewTemps(s), device.NewTemps(s)
	defer tmp.Free()
	W := 4 + L
	l.idx, l.sendRow = own.Alloc(device.I32, T, K), own.Alloc(device.I32, T, R)
	vec, all := tmp.Alloc(device.I32, R, W), tmp.Alloc(device.I32, R*R, W)
	if err := cmp.Or(own.Err(), tmp.Err()); err != nil {
		return nil, err
	}
	if err := device.Copy(s, l.idx, topkIdx); err != nil {
		return nil, err
	}
	if err := g.be.localCounts(s, l.idx, l.sendRow, vec, g.e, L); err != nil {
		return nil, err
	}
	if err := g.tr.AllGather(s, vec, all); err != nil {
		return nil, err
	}
	if err := g.tr.Sync(s); err != nil {
		return nil, err
	}
	host := make([]int32, R*R*W)
	if err := device.Download(s, all, host); err != nil {
		return nil, err
	}
	if err := l.plan(host); err != nil {
		return nil, err
	}
	// recvOff on the device for Origins, sendOff for Combine and the group's loads for
	// GroupLoad, uploaded now that s is idle: the upload waits for s, which later may
	// hold transfers that only a peer can complete.
	off := make([]int32, 2*(R+1)+g.e)
	for i := range R + 1 {
		off[i], off[R+1+i] = int32(l.recvOff[i]), int32(l.sendOff[i])
	}
	for e, n := range l.expAll {
		off[2*(R+1)+e] = int32(n)
	}
	if l.offs, err = device.FromSlice(s, device.I32, off, len(off)); err != nil {
		return nil, err
	}
	if l.recvOfs, err = l.offs.View(0, R+1); err != nil {
		return nil, err
	}
	if l.sendOfs, err = l.offs.View(R+1, R+1); err != nil {
		return nil, err
	}
	if l.groupLd, err = l.offs.View(2*(R+1), g.e); err != nil {
		return nil, err
	}

	// Tell each rank the routing of the rows it will receive, and place them.
	r := g.rank
	S, Rv := l.sendOff[R], l.recvOff[R]
	l.sendTok, l.meta, l.slot, l.counts = own.Alloc(device.I32, S), own.Alloc(device.I32, Rv, K+1), own.Alloc(device.I32, Rv, K), own.Alloc(device.I32, L)
	sendMeta := tmp.Alloc(device.I32, S, K+1)
	if err := cmp.Or(own.Err(), tmp.Err()); err != nil {
		return nil, err
	}
	if err := g.be.packMeta(s, l.idx, l.sendRow, l.sendTok, sendMeta, L); err != nil {
		return nil, err
	}
	if n := l.tokTo[r]; n > 0 {
		dst, _ := l.meta.Rows(l.recvOff[r], l.recvOff[r]+n)
		src, _ := sendMeta.Rows(l.sendOff[r], l.sendOff[r]+n)
		if err := device.Copy(s, dst, src); err != nil {
			return nil, err
		}
	}
	x := &Exchange{Send: []*device.Tensor{sendMeta}, Recv: []*device.Tensor{l.meta},
		SendOff: l.sendOff[:R], SendCount: others(l.tokTo, r), RecvOff: l.recvOff[:R], RecvCount: others(l.tokFrom, r),
		op: "Layout", names: []string{"routing"}}
	if err := g.tr.AllToAllV(s, x); err != nil {
		return nil, err
	}
	if err := g.be.assignSlots(s, l.meta, l.slot, l.counts, L, l.capacity); err != nil {
		return nil, err
	}
	ok = true
	return l, nil
}

// others returns counts with rank r's entry zeroed: transfers leave a rank's rows to
// itself in place.
func others(counts []int, r int) []int {
	c := append([]int(nil), counts...)
	c[r] = 0
	return c
}

// plan reads the gathered counts (for each source s and destination d: s's tokens, its
// first bad entries, tokens from s to d, and entries from s to each expert of d) and
// makes the decisions every rank makes alike: input errors, capacities, overflow.
func (l *Layout) plan(host []int32) error {
	g := l.g
	R, K, L, me := g.r, g.k, g.l, g.rank
	W := 4 + L
	at := func(src, dst, j int) int { return int(host[(src*R+dst)*W+j]) }
	l.tokens = make([]int, R)
	tokens := 0
	for s := range R {
		l.tokens[s] = at(s, 0, 0)
		tokens += l.tokens[s]
	}
	for s := range R {
		who := "this rank's"
		if s != me {
			who = fmt.Sprintf("rank %d's", s)
		}
		if p := at(s, 0, 1); p != math.MaxInt32 {
			return fmt.Errorf("ep: Layout: %s topk_idx[%d, %d] is not -1 or an expert in [0, %d)", who, p/K, p%K, g.e)
		}
		if p := at(s, 0, 2); p != math.MaxInt32 {
			return fmt.Errorf("ep: Layout: %s topk_idx[%d, %d] repeats an expert of row %d", who, p/K, p%K, p/K)
		}
	}
	l.pair = make([]int, R*R)
	for s := range R {
		for d := range R {
			l.pair[s*R+d] = at(s, d, 3)
		}
	}
	l.tokTo, l.tokFrom = make([]int, R), make([]int, R)
	l.sendOff, l.recvOff = make([]int, R+1), make([]int, R+1)
	for d := range R {
		l.tokTo[d], l.tokFrom[d] = l.pair[me*R+d], l.pair[d*R+me]
		l.sendOff[d+1] = l.sendOff[d] + l.tokTo[d]
		l.recvOff[d+1] = l.recvOff[d] + l.tokFrom[d]
	}
	l.expTo, l.expAll = make([]int, g.e), make([]int, g.e)
	for e := range g.e {
		l.expTo[e] = at(me, e/L, 4+e%L)
		for s := range R {
			l.expAll[e] += at(s, e/L, 4+e%L)
		}
	}
	// Every rank's demand and capacity, so that all decide alike.
	worst := -1
	var over *CapacityError
	for d := range R {
		demand := 0
		for s := range R {
			for j := range L {
				demand += at(s, d, 4+j)
			}
		}
		c := g.cfg.Capacity.rowsFor(demand, tokens, K, L, R)
		if d == me {
			l.demand, l.capacity = demand, c
		}
		if demand > c && demand-c > worst {
			worst = demand - c
			f := math.Inf(1)
			if b := balanced(tokens, K, R); b > 0 {
				f = math.Ceil(float64(demand)/b*1000) / 1000 // rounded up: it must suffice
			}
			over = &CapacityError{Rank: d, Need: demand, Capacity: c, Policy: g.cfg.Capacity, Factor: f, Steps: 1}
		}
	}
	if g.cfg.Overflow == FailOnOverflow {
		if n := g.cfg.CheckEvery; n <= 1 {
			if over != nil {
				return over
			}
		} else {
			g.step++
			if over != nil && (g.pending == nil || over.Need > g.pending.Need) {
				g.pending = over
			}
			if g.step%n == 0 {
				err := g.pending
				g.pending = nil
				if err != nil {
					err.Steps = n
					return err
				}
			}
		}
	}
	l.countsHost = make([]int, L)
	off := 0
	for j := range L {
		c := 0
		for s := range R {
			c += at(s, me, 4+j)
		}
		l.countsHost[j] = max(0, min(off+c, l.capacity)-min(off, l.capacity))
		off += c
	}
	g.dropped += int64(l.Dropped())
	return nil
}

// Free releases the layout's device memory, in stream order on the stream it was made
// on. Freeing a nil layout does nothing.
func (l *Layout) Free() error {
	if l == nil {
		return nil
	}
	var errs []error
	for _, x := range []*device.Tensor{l.idx, l.sendRow, l.sendTok, l.meta, l.slot, l.counts, l.offs} {
		if x != nil {
			errs = append(errs, x.Free())
		}
	}
	return errors.Join(errs...)
}

// Tokens returns this rank's number of tokens, T.
func (l *Layout) Tokens() int { return l.t }

// Capacity returns the rows of the expert-major buffers on this rank.
func (l *Layout) Capacity() int { return l.capacity }

// Demand returns the expert rows routed to this rank, before any drop.
func (l *Layout) Demand() int { return l.demand }

// Rows returns the expert rows this rank keeps: the sum of Counts, at most Capacity.
func (l *Layout) Rows() int { return min(l.demand, l.capacity) }

// Dropped returns the expert rows routed to this rank that did not fit its capacity.
func (l *Layout) Dropped() int { return l.demand - l.Rows() }

// Counts returns the rows kept per local expert, in expert order: the group sizes of
// the expert-major buffers.
func (l *Layout) Counts() []int { return append([]int(nil), l.countsHost...) }

// ExpertCounts returns Counts on the device: I32, one entry per local expert, owned by
// the layout (Layout.Free frees it).
func (l *Layout) ExpertCounts() *device.Tensor { return l.counts }

// TokensTo returns how many tokens this rank sends to each rank (itself included): a
// token counts once per rank that holds any of its experts.
func (l *Layout) TokensTo() []int { return append([]int(nil), l.tokTo...) }

// TokensFrom returns how many tokens this rank receives from each rank.
func (l *Layout) TokensFrom() []int { return append([]int(nil), l.tokFrom...) }

// ExpertEntries returns how many routing entries of this rank go to each expert, [E].
func (l *Layout) ExpertEntries() []int { return append([]int(nil), l.expTo...) }

// RankTokens returns the number of tokens of every rank.
func (l *Layout) RankTokens() []int { return append([]int(nil), l.tokens...) }

// GroupEntries returns how many routing entries of all ranks together go to each
// expert, [E]: the sum of every rank's ExpertEntries, the experts' loads over the
// group's batch of Σ RankTokens tokens.
func (l *Layout) GroupEntries() []int { return append([]int(nil), l.expAll...) }

// GroupLoad returns GroupEntries on the device: I32 [E], owned by the layout
// (Layout.Free frees it), for a load-balancing loss over the group's batch (see
// moe.Routing.BalanceOver). It comes with the count exchange of Layout, at no cost of
// its own: the same upload brings it to the device.
func (l *Layout) GroupLoad() *device.Tensor { return l.groupLd }

// SendRows returns I32 [T, R], owned by the layout (Layout.Free frees it): for token t
// and rank d, the row of (t, d) in the order tokens are sent (by rank, then token), or
// -1 when t does not go to d. SendRows ≥ 0 is DeepEP's is_token_in_rank.
func (l *Layout) SendRows() *device.Tensor { return l.sendRow }

// Origins returns I32 [Capacity, 3] on s's device: for each row of the expert-major
// buffers, the (source rank, source token, k) it holds, or (-1, -1, -1) for rows past
// the kept ones. It is the map back from the experts to the tokens: a new tensor,
// allocated and computed on s, that aliases none of the layout's.
func (l *Layout) Origins(s *device.Stream) (*device.Tensor, error) {
	if err := l.usable(s, "Origins"); err != nil {
		return nil, err
	}
	out, err := s.Alloc(device.I32, l.capacity, 3)
	if err != nil {
		return nil, err
	}
	if err := device.Fill(s, out, -1); err != nil {
		out.Free()
		return nil, err
	}
	if err := l.g.be.origins(s, out, l.slot, l.meta, l.recvOfs); err != nil {
		out.Free()
		return nil, err
	}
	return out, nil
}

// usable returns an error unless l is a live layout of an open group and s a stream
// of its device.
func (l *Layout) usable(s *device.Stream, op string) error {
	if l == nil {
		return fmt.Errorf("ep: %s: nil Layout", op)
	}
	if err := l.g.usable(s, op); err != nil {
		return err
	}
	if l.slot == nil || l.slot.Freed() {
		return fmt.Errorf("ep: %s: layout was freed", op)
	}
	return nil
}

// usable returns an error unless g is an open group and s a stream of its device.
func (g *Group) usable(s *device.Stream, op string) error {
	switch {
	case g == nil:
		return fmt.Errorf("ep: %s: nil Group", op)
	case g.closed:
		return fmt.Errorf("ep: %s: the group was closed", op)
	case s == nil:
		return fmt.Errorf("ep: %s: nil stream", op)
	case s.Device() != g.dev:
		return fmt.Errorf("ep: %s: stream of %v, want one of the group's device %v", op, s.Device(), g.dev)
	}
	return nil
}
