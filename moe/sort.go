package moe

import (
	"errors"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// Permutation maps the T·K assignments of a routing (assignment a = t·K + k, token t's
// k-th expert) to rows grouped by expert: expert 0's rows first, then expert 1's, and
// within an expert in order of a (a stable sort). Rows [Offsets[e], Offsets[e+1])
// belong to expert e; Counts are the group sizes ragged_dot takes. Its tensors live
// on the device of the indices Sort was given.
type Permutation struct {
	Tokens, TopK, Experts int
	Rows                  int // rows of a permuted tensor: at most T·K, and E·Capacity when that is smaller
	Capacity              int // rows per expert at most; 0: no limit (dropless)

	Counts  *device.Tensor // I32[E]: rows of each expert
	Offsets *device.Tensor // I32[E+1]: first row of each expert; Offsets[E] rows are used
	Demand  *device.Tensor // I32[E]: assignments to each expert, dropped ones included
	Row     *device.Tensor // I32[T,K]: row of each assignment; -1 for none (index -1) or dropped
	Source  *device.Tensor // I32[Rows]: assignment of each row; -1 for unused rows
	Dropped *device.Tensor // I32[1]: assignments dropped for capacity

	// Status records an index outside [-1, E) that Sort met (those assignments were
	// treated as -1): Status.Check waits for the device and returns an error wrapping
	// ErrBadIndex. Free frees it.
	Status *device.Status
}

// Free releases the permutation's tensors.
func (p *Permutation) Free() error {
	if p == nil {
		return nil
	}
	return errors.Join(device.FreeAll(p.Counts, p.Offsets, p.Demand, p.Row, p.Source, p.Dropped), p.Status.Free())
}

// check returns an error unless p is a live permutation on s's device whose Row and
// Offsets match its sizes; what names p.
func (p *Permutation) check(s *device.Stream, what string) error {
	switch {
	case p == nil:
		return fmt.Errorf("moe: %s is nil", what)
	case p.Row != nil && p.Row.Freed():
		return fmt.Errorf("moe: %s was freed", what)
	case p.Experts < 1 || p.Experts > MaxExperts || p.TopK < 1 || p.TopK > MaxTopK || p.Rows < 0:
		return fmt.Errorf("moe: %s has %d experts, top-%d and %d rows: want 1 to %d, 1 to %d and ≥ 0",
			what, p.Experts, p.TopK, p.Rows, MaxExperts, MaxTopK)
	}
	if err := checkTensor(s, p.Row, what+".Row", device.I32, p.Tokens, p.TopK); err != nil {
		return err
	}
	return checkTensor(s, p.Offsets, what+".Offsets", device.I32, p.Experts+1)
}

// ErrBadIndex is the error of a Sort given an expert index outside [-1, E).
var ErrBadIndex = errors.New("moe: expert index outside [-1, E)")

// DroppedCount waits for s and returns how many assignments were dropped for capacity.
func (p *Permutation) DroppedCount(s *device.Stream) (int, error) {
	if err := checkStream(s, "Permutation.DroppedCount"); err != nil {
		return 0, err
	}
	if err := p.check(s, "Permutation.DroppedCount p"); err != nil {
		return 0, err
	}
	if err := checkTensor(s, p.Dropped, "Permutation.DroppedCount p.Dropped", device.I32, 1); err != nil {
		return 0, err
	}
	v := make([]int32, 1)
	if err := device.Download(s, p.Dropped, v); err != nil {
		return 0, err
	}
	return int(v[0]), nil
}

// Capacity returns the expert capacity of a capacity factor for T tokens ≥ 0, top-K
// ≥ 1 and E experts ≥ 1: ⌈factor·T·K/E⌉ rows, at least 1 and at most max(T·K, 1).
// factor is finite and ≥ 0; 0 means no limit (dropless), and the capacity is then 0,
// which Sort takes as no limit.
func Capacity(factor float64, tokens, topk, experts int) (int, error) {
	switch {
	case factor < 0 || math.IsNaN(factor) || math.IsInf(factor, 0):
		return 0, fmt.Errorf("moe: Capacity factor = %v, want a finite value ≥ 0 (0: no limit)", factor)
	case tokens < 0:
		return 0, fmt.Errorf("moe: Capacity tokens = %d, want ≥ 0", tokens)
	case topk < 1:
		return 0, fmt.Errorf("moe: Capacity topk = %d, want ≥ 1", topk)
	case experts < 1:
		return 0, fmt.Errorf("moe: Capacity experts = %d, want ≥ 1", experts)
	case factor == 0:
		return 0, nil
	}
	c := math.Ceil(factor * float64(tokens) * float64(topk) / float64(experts))
	if c > float64(tokens*topk) {
		return max(tokens*topk, 1), nil
	}
	return max(int(c), 1), nil
}

// sortChunk is the number of assignments one warp of the sort kernels handles.
func sortChunk(n int) int { return max(1024, (n+255)/256+1023) / 1024 * 1024 }

// Sort builds the Permutation of index I32[T,K] (entries -1 mean no expert) over
// experts, a stable counting sort enqueued on s with no host synchronization.
// capacity > 0 keeps at most capacity rows per expert, the first in assignment
// order, and drops the rest (Row = -1, counted in Dropped); 0 keeps all. Index
// values outside [-1, E) count as -1 and are recorded in the Permutation's Status; on
// the CPU Sort returns that error (it wraps ErrBadIndex) at once unless s is capturing.
// The Permutation's tensors are allocated on s, so they alias nothing.
func Sort(s *device.Stream, index *device.Tensor, experts, capacity int) (*Permutation, error) {
	if err := checkStream(s, "Sort"); err != nil {
		return nil, err
	}
	if err := index.Check(s, "moe: Sort index"); err != nil {
		return nil, err
	}
	if index.DType() != device.I32 || index.Rank() != 2 {
		return nil, fmt.Errorf("moe: Sort index is %v, want i32[T K]", index)
	}
	T, K := index.Dim(0), index.Dim(1)
	E := experts
	switch {
	case E < 1 || E > MaxExperts:
		return nil, fmt.Errorf("moe: Sort experts = %d, want 1 to %d", E, MaxExperts)
	case K < 1 || K > MaxTopK:
		return nil, fmt.Errorf("moe: Sort index is %v: K = %d, want 1 to %d", index, K, MaxTopK)
	case int64(T)*int64(K) >= math.MaxInt32:
		return nil, fmt.Errorf("moe: Sort index is %v: T·K must be below 2^31", index)
	case capacity < 0:
		return nil, fmt.Errorf("moe: Sort capacity = %d, want ≥ 0", capacity)
	}
	n := T * K
	rows := n
	if capacity > 0 && int64(E)*int64(capacity) < int64(rows) {
		rows = E * capacity
	}
	ts := device.NewTemps(s) // only for the first error: p owns the tensors
	p := &Permutation{Tokens: T, TopK: K, Experts: E, Rows: rows, Capacity: capacity,
		Counts: ts.Alloc(device.I32, E), Offsets: ts.Alloc(device.I32, E+1), Demand: ts.Alloc(device.I32, E),
		Row: ts.Alloc(device.I32, T, K), Source: ts.Alloc(device.I32, rows), Dropped: ts.Alloc(device.I32, 1)}
	err := ts.Err()
	if err == nil {
		p.Status, err = device.NewStatus(s)
	}
	switch {
	case err != nil:
	case s.Device().IsCUDA():
		err = sortGPU(s, p, index)
	default:
		var bad bool // set when the sort runs now, not when s is capturing
		err = s.EnqueueCPU(func() { bad = sortCPU(p, index) })
		if err == nil && bad {
			err = p.Status.Check(s)
		}
	}
	if err != nil {
		p.Free()
		return nil, err
	}
	return p, nil
}

func (p *Permutation) cap32() int32 {
	if p.Capacity <= 0 || p.Capacity >= math.MaxInt32 {
		return math.MaxInt32
	}
	return int32(p.Capacity)
}

func sortGPU(s *device.Stream, p *Permutation, index *device.Tensor) error {
	E, n := p.Experts, p.Tokens*p.TopK
	ch := sortChunk(n)
	nchunks := max((n+ch-1)/ch, 1)
	cnt, err := s.Alloc(device.I32, nchunks, E)
	if err != nil {
		return err
	}
	defer cnt.Free()
	const wpb = 4 // warps per block
	grid, block, smem := device.D1((nchunks+wpb-1)/wpb), device.D1(32*wpb), wpb*E*4
	if err := launch(s, sortProg, "dl_moe_sort_count", grid, block, smem,
		index, int64(n), int32(E), int32(ch), int32(nchunks), cnt, p.Status); err != nil {
		return err
	}
	if err := launch(s, sortProg, "dl_moe_sort_scan", device.D1(1), device.D1(blockFor(E)), 0,
		cnt, int32(nchunks), int32(E), p.cap32(), p.Counts, p.Offsets, p.Demand, p.Dropped, p.Source, int64(p.Rows)); err != nil {
		return err
	}
	return launch(s, sortProg, "dl_moe_sort_scatter", grid, block, smem,
		index, int64(n), int32(E), int32(ch), int32(nchunks), cnt, p.Offsets, p.cap32(), p.Row, p.Source)
}

// sortCPU is the reference: the same stable counting sort, sequentially. It records
// the first index outside [-1, E) in p.Status and reports whether there was one.
func sortCPU(p *Permutation, index *device.Tensor) bool {
	E := p.Experts
	idx := device.Slice[int32](index)
	counts, offsets, demand := device.Slice[int32](p.Counts), device.Slice[int32](p.Offsets), device.Slice[int32](p.Demand)
	row, src := device.Slice[int32](p.Row), device.Slice[int32](p.Source)
	bad := -1
	clear(demand)
	for a, e := range idx {
		switch {
		case e >= 0 && int(e) < E:
			demand[e]++
		case e != -1 && bad < 0:
			bad = a
		}
	}
	if bad >= 0 {
		// p.Status is a CPU Status from NewStatus: Record cannot fail.
		_ = p.Status.Record(device.StatusCode(statusDomain, opSort, codeBadIndex), int64(bad), int64(idx[bad]), int64(E))
	}
	cp := p.cap32()
	var total, dropped int32
	for e := range E {
		counts[e] = min(demand[e], cp)
		offsets[e] = total
		total += counts[e]
		dropped += demand[e] - counts[e]
	}
	offsets[E] = total
	device.Slice[int32](p.Dropped)[0] = dropped
	for r := range src {
		src[r] = -1
	}
	rank := make([]int32, E)
	for a, e := range idx {
		row[a] = -1
		if e < 0 || int(e) >= E {
			continue
		}
		if rank[e] < cp {
			r := offsets[e] + rank[e]
			row[a], src[r] = r, int32(a)
		}
		rank[e]++
	}
	return bad >= 0
}
