// Package par runs loops in parallel on the CPU.
package par

import (
	"runtime"
	"sync"
)

// For calls fn(lo, hi) over [0, n) in contiguous chunks of at least grain items,
// on up to GOMAXPROCS goroutines, and returns when all calls have returned.
func For(n, grain int, fn func(lo, hi int)) {
	if n <= 0 {
		return
	}
	if grain < 1 {
		grain = 1
	}
	w := runtime.GOMAXPROCS(0)
	chunks := (n + grain - 1) / grain
	if chunks < w {
		w = chunks
	}
	if w <= 1 {
		fn(0, n)
		return
	}
	step := (n + w - 1) / w
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += step {
		hi := min(lo+step, n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}

// Each calls fn(i) for every i in [0, n) on up to GOMAXPROCS goroutines, handing out
// indices one at a time, so that uneven items balance.
func Each(n int, fn func(i int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var mu sync.Mutex
	next := 0
	var wg sync.WaitGroup
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= n {
					return
				}
				fn(i)
			}
		}()
	}
	wg.Wait()
}
