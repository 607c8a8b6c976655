package par

import (
	"sync/atomic"
	"testing"
)

func TestForCoversOnce(t *testing.T) {
	for _, tc := range []struct{ n, grain int }{{0, 1}, {1, 1}, {7, 2}, {1000, 1}, {1000, 300}, {5, 0}} {
		hits := make([]int32, tc.n)
		For(tc.n, tc.grain, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				atomic.AddInt32(&hits[i], 1)
			}
		})
		for i, h := range hits {
			if h != 1 {
				t.Fatalf("For(%d, %d): index %d visited %d times", tc.n, tc.grain, i, h)
			}
		}
	}
}

func TestEachCoversOnce(t *testing.T) {
	for _, n := range []int{0, 1, 3, 100} {
		hits := make([]int32, n)
		Each(n, func(i int) { atomic.AddInt32(&hits[i], 1) })
		for i, h := range hits {
			if h != 1 {
				t.Fatalf("Each(%d): index %d visited %d times", n, i, h)
			}
		}
	}
}
