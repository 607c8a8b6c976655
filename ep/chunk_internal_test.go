package ep

import "testing"

// TestChunk: the C pieces of a segment of n rows tile [0, n) in order, each within a
// row of its weight (one unit at the ends, three between), and chunkOf finds the piece
// of every row; a sender and its receiver, which both know n, cut it alike.
func TestChunk(t *testing.T) {
	for n := range 70 {
		for C := 1; C <= maxChunks; C++ {
			next := 0
			for c := range C {
				lo, hi := chunk(n, c, C)
				if lo != next || hi < lo {
					t.Fatalf("chunk(%d, %d, %d) = [%d, %d), want it to start at %d", n, c, C, lo, hi, next)
				}
				w := float64(chunkStart(c+1, C)-chunkStart(c, C)) * float64(n) / float64(chunkUnits(C))
				if d := float64(hi-lo) - w; d <= -1 || d >= 1 {
					t.Fatalf("chunk(%d, %d, %d) has %d rows, want %.2f", n, c, C, hi-lo, w)
				}
				for i := lo; i < hi; i++ {
					if got := chunkOf(i, n, C); got != c {
						t.Fatalf("chunkOf(%d, %d, %d) = %d, want %d", i, n, C, got, c)
					}
				}
				next = hi
			}
			if next != n {
				t.Fatalf("%d rows in %d chunks end at %d", n, C, next)
			}
		}
	}
}
