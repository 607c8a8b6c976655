package offload

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
)

// TestArena checks the pool allocator against a model of the pool's units: ranges never
// overlap and stay in bounds, the free list stays sorted and coalesced, used and peak
// are exact, and a fragment-free pool satisfies any request that fits.
func TestArena(t *testing.T) {
	for _, tc := range []struct{ size, maxN, ops int }{
		{0, 4, 100}, {Align, 1, 200}, {64 * Align, 8, 5000}, {1000 * Align, 300, 5000},
	} {
		r := dt.Rand(uint64(tc.size))
		a := newArena(tc.size)
		owner := make([]int, tc.size/Align) // 0: free, else id of the live range
		type live struct{ off, n, id int }
		var lives []live
		peak := 0
		for op := range tc.ops {
			if len(lives) > 0 && r.IntN(2) == 0 {
				k := r.IntN(len(lives))
				l := lives[k]
				a.release(l.off, l.n)
				for u := l.off / Align; u < (l.off+l.n)/Align; u++ {
					owner[u] = 0
				}
				lives = append(lives[:k], lives[k+1:]...)
			} else {
				n := (1 + r.IntN(tc.maxN)) * Align
				off, ok := a.alloc(n)
				if !ok {
					// First fit must fail only when no run of free units is long enough.
					if run := longestFree(owner); run*Align >= n {
						t.Fatalf("size %d op %d: alloc(%d) failed with a free run of %d units", tc.size, op, n, run)
					}
					continue
				}
				if off%Align != 0 || off < 0 || off+n > tc.size {
					t.Fatalf("size %d: alloc(%d) = %d out of bounds", tc.size, n, off)
				}
				for u := off / Align; u < (off+n)/Align; u++ {
					if owner[u] != 0 {
						t.Fatalf("size %d op %d: alloc(%d) = %d overlaps range %d", tc.size, op, n, off, owner[u])
					}
					owner[u] = op + 1
				}
				lives = append(lives, live{off, n, op + 1})
			}
			used := 0
			for _, l := range lives {
				used += l.n
			}
			peak = max(peak, used)
			if a.used != used || a.peak != peak {
				t.Fatalf("size %d op %d: used %d peak %d, want %d %d", tc.size, op, a.used, a.peak, used, peak)
			}
			free := 0
			for i, f := range a.free {
				free += f.n
				if f.n <= 0 || (i > 0 && a.free[i-1].off+a.free[i-1].n >= f.off) {
					t.Fatalf("size %d op %d: free list %v not sorted and coalesced", tc.size, op, a.free)
				}
			}
			if free+used != tc.size {
				t.Fatalf("size %d op %d: free %d + used %d ≠ size", tc.size, op, free, used)
			}
		}
		for _, l := range lives {
			a.release(l.off, l.n)
		}
		if a.used != 0 || (tc.size > 0 && (len(a.free) != 1 || a.free[0] != span{0, tc.size})) {
			t.Errorf("size %d: after releasing everything: used %d, free %v", tc.size, a.used, a.free)
		}
	}
}

func longestFree(owner []int) int {
	best, run := 0, 0
	for _, o := range owner {
		if o == 0 {
			run++
			best = max(best, run)
		} else {
			run = 0
		}
	}
	return best
}

func TestAlignUp(t *testing.T) {
	for _, tc := range [][2]int{{0, 0}, {1, Align}, {Align, Align}, {Align + 1, 2 * Align}, {1 << 30, 1 << 30}} {
		if got := alignUp(tc[0]); got != tc[1] {
			t.Errorf("alignUp(%d) = %d, want %d", tc[0], got, tc[1])
		}
	}
}
