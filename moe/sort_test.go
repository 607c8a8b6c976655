package moe

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// permRef is the brute-force permutation: for each expert in turn, its assignments in
// order of a, the first capacity of them kept.
type permRef struct {
	Counts, Offsets, Demand, Row, Source []int32
	Dropped                              int32
}

func sortRef(idx []int32, E, capacity, rows int) permRef {
	p := permRef{Counts: make([]int32, E), Offsets: make([]int32, E+1), Demand: make([]int32, E),
		Row: make([]int32, len(idx)), Source: make([]int32, rows)}
	for i := range p.Row {
		p.Row[i] = -1
	}
	for i := range p.Source {
		p.Source[i] = -1
	}
	r := int32(0)
	for e := range int32(E) {
		p.Offsets[e] = r
		for a, x := range idx {
			if x != e {
				continue
			}
			p.Demand[e]++
			if capacity > 0 && int(p.Counts[e]) >= capacity {
				p.Dropped++
				continue
			}
			p.Counts[e]++
			p.Row[a], p.Source[r] = r, int32(a)
			r++
		}
	}
	p.Offsets[E] = r
	return p
}

var sortCases = []struct {
	name         string
	T, K, E, cap int
	gen          func(a, E int, u uint64) int32 // expert of assignment a, from a random u
}{
	{"uniform", 100, 2, 8, 0, func(a, E int, u uint64) int32 { return int32(u % uint64(E)) }},
	{"all_to_one", 300, 4, 16, 0, func(a, E int, u uint64) int32 { return 5 }},
	{"none_entries", 200, 3, 8, 0, func(a, E int, u uint64) int32 { return int32(u%uint64(E+1)) - 1 }},
	{"skewed", 1000, 8, 32, 0, func(a, E int, u uint64) int32 { return int32(min(u%97, u%13, uint64(E-1))) }},
	{"capacity", 100, 2, 8, 10, func(a, E int, u uint64) int32 { return int32(u % uint64(E)) }},
	{"capacity_skewed", 256, 4, 8, 20, func(a, E int, u uint64) int32 { return int32(min(u%11, 7)) }},
	{"capacity_unreached", 64, 2, 4, 1000, func(a, E int, u uint64) int32 { return int32(u % uint64(E)) }},
	{"many_chunks", 40000, 8, 32, 0, func(a, E int, u uint64) int32 { return int32(u % uint64(E)) }},
	{"many_experts", 50, 6, 1000, 0, func(a, E int, u uint64) int32 { return int32(u % uint64(E)) }},
	{"max_experts", 30, 4, 1024, 1, func(a, E int, u uint64) int32 { return int32(u % 3 * 500) }},
	{"one_expert", 33, 1, 1, 0, func(a, E int, u uint64) int32 { return 0 }},
	{"no_tokens", 0, 2, 4, 0, nil},
}

func TestSort(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, tc := range sortCases {
			t.Run(tc.name, func(t *testing.T) {
				r := dt.Rand(uint64(300 + i))
				idx := make([]int32, tc.T*tc.K)
				for a := range idx {
					idx[a] = tc.gen(a, tc.E, r.Uint64())
				}
				it := upI32(t, s, idx, tc.T, tc.K)
				defer it.Free()
				p := dt.Must(Sort(s, it, tc.E, tc.cap))
				defer p.Free()
				dt.NoErr(t, p.Status.Check(s))
				want := sortRef(idx, tc.E, tc.cap, p.Rows)
				if wantRows := min(tc.T*tc.K, max(tc.E*tc.cap, 0)); tc.cap > 0 && p.Rows != wantRows {
					t.Errorf("Rows = %d, want %d", p.Rows, wantRows)
				}
				got := permRef{Counts: downI32(t, s, p.Counts), Offsets: downI32(t, s, p.Offsets), Demand: downI32(t, s, p.Demand),
					Row: downI32(t, s, p.Row), Source: downI32(t, s, p.Source), Dropped: downI32(t, s, p.Dropped)[0]}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Fatalf("permutation (-want +got):\n%s", diff)
				}
				if n, err := p.DroppedCount(s); err != nil || n != int(want.Dropped) {
					t.Errorf("DroppedCount = %d, %v; want %d", n, err, want.Dropped)
				}
			})
		}
	})
}

func TestSortBadIndex(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, bad := range []int32{-2, 8, 1 << 30} {
			idx := []int32{0, 1, 2, bad, 4, 5}
			it := upI32(t, s, idx, 3, 2)
			p, err := Sort(s, it, 8, 0)
			if d.IsCUDA() {
				dt.NoErr(t, err)
				err = p.Status.Check(s)
				// The bad entry counts as no expert.
				if row := downI32(t, s, p.Row); row[3] != -1 {
					t.Errorf("row of the bad entry = %d, want -1", row[3])
				}
				p.Free()
			}
			if !errors.Is(err, ErrBadIndex) {
				t.Errorf("index %d: error %v, want ErrBadIndex", bad, err)
			}
			it.Free()
		}
	})
}

// TestSortCapture runs Sort inside a captured graph: no host synchronization.
func TestSortCapture(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := dt.Must(d.NewStream())
		defer s.Close()
		idx := []int32{3, 1, 3, 0, 2, 3, 1, 1}
		it := upI32(t, s, idx, 4, 2)
		defer it.Free()
		dt.NoErr(t, s.BeginCapture())
		p, err := Sort(s, it, 4, 0)
		g, err2 := s.EndCapture()
		dt.NoErr(t, err)
		dt.NoErr(t, err2)
		defer g.Close()
		defer p.Free()
		dt.NoErr(t, g.Launch(s))
		want := sortRef(idx, 4, 0, 8)
		if diff := cmp.Diff(want.Row, downI32(t, s, p.Row)); diff != "" {
			t.Errorf("Row after graph launch (-want +got):\n%s", diff)
		}
	})
}
