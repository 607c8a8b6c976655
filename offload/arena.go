package offload

import "slices"

// Align is the alignment, in bytes, of every slot of the pinned pool.
const Align = 256

// alignUp rounds n up to a multiple of Align.
func alignUp(n int) int { return (n + Align - 1) &^ (Align - 1) }

// span is the byte range [off, off+n).
type span struct{ off, n int }

// arena hands out ranges of a fixed-size buffer: first fit over a free list sorted by
// offset, coalesced on release. Sizes are multiples of Align. It allocates Go memory
// only when its free list outgrows its capacity.
type arena struct {
	size int
	free []span // disjoint, sorted, never adjacent
	used int
	peak int
}

func newArena(size int) arena {
	a := arena{size: size, free: make([]span, 0, 64)}
	if size > 0 {
		a.free = append(a.free, span{0, size})
	}
	return a
}

// alloc returns the offset of n free bytes (n > 0), or false when no free range is
// large enough.
func (a *arena) alloc(n int) (int, bool) {
	for i, f := range a.free {
		if f.n < n {
			continue
		}
		if f.n == n {
			a.free = slices.Delete(a.free, i, i+1)
		} else {
			a.free[i] = span{f.off + n, f.n - n}
		}
		a.used += n
		a.peak = max(a.peak, a.used)
		return f.off, true
	}
	return 0, false
}

// release returns [off, off+n), which alloc handed out, to the free list.
func (a *arena) release(off, n int) {
	i, _ := slices.BinarySearchFunc(a.free, off, func(f span, off int) int { return f.off - off })
	prev := i > 0 && a.free[i-1].off+a.free[i-1].n == off
	next := i < len(a.free) && off+n == a.free[i].off
	switch {
	case prev && next:
		a.free[i-1].n += n + a.free[i].n
		a.free = slices.Delete(a.free, i, i+1)
	case prev:
		a.free[i-1].n += n
	case next:
		a.free[i] = span{off, n + a.free[i].n}
	default:
		a.free = slices.Insert(a.free, i, span{off, n})
	}
	a.used -= n
}
