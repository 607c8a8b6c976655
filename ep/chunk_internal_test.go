package ep

import "testing"

// TestChunk: the C pieces of a segment of n rows tile [0, n) in order and differ in size
// by at most one; a sender and its receiver, which both know n, cut it alike.
func TestChunk(t *testing.T) {
	for n := range 70 {
		for C := 1; C <= maxChunks; C++ {
			next, small, large := 0, n, 0
			for c := range C {
				lo, hi := chunk(n, c, C)
				if lo != next || hi < lo {
					t.Fatalf("chunk(%d, %d, %d) = [%d, %d), want it to start at %d", n, c, C, lo, hi, next)
				}
				small, large, next = min(small, hi-lo), max(large, hi-lo), hi
			}
			if next != n || large-small > 1 {
				t.Fatalf("%d rows in %d chunks: end %d, sizes %d to %d", n, C, next, small, large)
			}
		}
	}
}
