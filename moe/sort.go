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
	status  *device.Tensor // I32[1]: bit 0: an index outside [-1, E)
}

// Free releases the permutation's tensors.
func (p *Permutation) Free() error {
	if p == nil {
		return nil
	}
	return freeAll(p.Counts, p.Offsets, p.Demand, p.Row, p.Source, p.Dropped, p.status)
}

// ErrBadIndex is the error of a Sort given an expert index outside [-1, E).
var ErrBadIndex = errors.New("moe: expert index outside [-1, E)")

// Err waits for s and returns ErrBadIndex if the indices Sort was given held a value
// outside [-1, E) (those assignments were treated as -1), else nil.
func (p *Permutation) Err(s *device.Stream) error {
	v, err := p.status.Float32s(s)
	if err != nil {
		return err
	}
	if v[0] != 0 {
		return ErrBadIndex
	}
	return nil
}

// DroppedCount waits for s and returns how many assignments were dropped for capacity.
func (p *Permutation) DroppedCount(s *device.Stream) (int, error) {
	v := make([]int32, 1)
	if err := device.Download(s, p.Dropped, v); err != nil {
		return 0, err
	}
	return int(v[0]), nil
}

// Capacity returns the expert capacity of a capacity factor: ⌈factor·T·K/E⌉ rows, at
// least 1. factor ≤ 0 means none (0).
func Capacity(factor float64, tokens, topk, experts int) int {
	if factor <= 0 || math.IsNaN(factor) {
		return 0
	}
	c := math.Ceil(factor * float64(tokens) * float64(topk) / float64(experts))
	if c > float64(tokens*topk) {
		return max(tokens*topk, 1)
	}
	return max(int(c), 1)
}

// sortChunk is the number of assignments one warp of the sort kernels handles.
func sortChunk(n int) int { return max(1024, (n+255)/256+1023) / 1024 * 1024 }

// Sort builds the Permutation of index I32[T,K] (entries -1 mean no expert) over
// experts, a stable counting sort enqueued on s with no host synchronization.
// capacity > 0 keeps at most capacity rows per expert, the first in assignment
// order, and drops the rest (Row = -1, counted in Dropped); 0 keeps all. Index
// values outside [-1, E) count as -1 and are reported by Err; on the CPU Sort
// returns ErrBadIndex at once unless s is capturing.
func Sort(s *device.Stream, index *device.Tensor, experts, capacity int) (*Permutation, error) {
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
	ts, err := allocAll(s, spec(device.I32, E), spec(device.I32, E+1), spec(device.I32, E), spec(device.I32, T, K),
		spec(device.I32, rows), spec(device.I32, 1), spec(device.I32, 1))
	if err != nil {
		return nil, err
	}
	p := &Permutation{Tokens: T, TopK: K, Experts: E, Rows: rows, Capacity: capacity,
		Counts: ts[0], Offsets: ts[1], Demand: ts[2], Row: ts[3], Source: ts[4], Dropped: ts[5], status: ts[6]}
	if s.Device().IsCUDA() {
		err = sortGPU(s, p, index)
	} else {
		err = s.EnqueueCPU(func() { sortCPU(p, index) })
		if err == nil && device.Slice[int32](p.status)[0] != 0 {
			err = ErrBadIndex
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
	if err := device.Fill(s, p.status, 0); err != nil {
		return err
	}
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
		index, int64(n), int32(E), int32(ch), int32(nchunks), cnt, p.status); err != nil {
		return err
	}
	if err := launch(s, sortProg, "dl_moe_sort_scan", device.D1(1), device.D1(blockFor(E)), 0,
		cnt, int32(nchunks), int32(E), p.cap32(), p.Counts, p.Offsets, p.Demand, p.Dropped, p.Source, int64(p.Rows)); err != nil {
		return err
	}
	return launch(s, sortProg, "dl_moe_sort_scatter", grid, block, smem,
		index, int64(n), int32(E), int32(ch), int32(nchunks), cnt, p.Offsets, p.cap32(), p.Row, p.Source)
}

// sortCPU is the reference: the same stable counting sort, sequentially.
func sortCPU(p *Permutation, index *device.Tensor) {
	E := p.Experts
	idx := device.Slice[int32](index)
	counts, offsets, demand := device.Slice[int32](p.Counts), device.Slice[int32](p.Offsets), device.Slice[int32](p.Demand)
	row, src := device.Slice[int32](p.Row), device.Slice[int32](p.Source)
	status := device.Slice[int32](p.status)
	status[0] = 0
	clear(demand)
	for _, e := range idx {
		switch {
		case e >= 0 && int(e) < E:
			demand[e]++
		case e != -1:
			status[0] = 1
		}
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
}
