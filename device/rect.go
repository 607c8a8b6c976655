package device

import (
	"fmt"
	"math"
	"math/bits"

	"github.com/dropless/dropless/internal/par"
)

// Strides locate a batch of row-major matrices in a tensor's elements: row i of matrix b
// starts at element b·Batch + i·Row of the tensor (which may be a view: element 0 is
// its first).
type Strides struct {
	// Row is the number of elements from the start of one row to the next: at least the
	// copy's cols.
	Row int
	// Batch is the number of elements from the start of one matrix to the next: at least
	// rows·Row in a batch of more than one matrix, unused in a batch of one.
	Batch int
}

// CopyRect copies a rows×cols rectangle of src into dst on s: element (i, j) of the
// rectangle is element i·srcStride + j of src and i·dstStride + j of dst, so each tensor
// holds it as a row-major matrix whose rows are its stride apart (in elements; at least
// cols). It is the copy between a matrix and a padded copy of it, whose rows are longer:
//
//	CopyRect(s, x8, 24, x, 17, m, 17) // x[m,17] into the first 17 columns of x8[m,24]
//	CopyRect(s, x, 17, x8, 24, m, 17) // and back
//
// The elements of dst outside the rectangle are left as they are. dst and src must be
// live tensors on s's device with the same dtype (any dtype: elements are copied as
// bits), and each must hold its rectangle: its last element, (rows−1)·stride + cols − 1,
// must be one of the tensor's. The spans of the two rectangles (from their first element
// to their last) must not overlap in memory, unless they are the same elements, which
// CopyRect leaves as they are. Negative sizes and strides are errors. On a GPU one block
// copies each row, with the widest loads and stores (up to 16 bytes) that the alignment
// of each side's rows allows; on the CPU the copy runs at once (or is recorded when s is
// capturing).
func CopyRect(s *Stream, dst *Tensor, dstStride int, src *Tensor, srcStride int, rows, cols int) error {
	return copyRects("CopyRect", s, dst, Strides{Row: dstStride}, src, Strides{Row: srcStride}, 1, rows, cols)
}

// CopyRects copies a batch of rectangles, batch matrices of rows×cols elements, from src
// into dst on s: element (b, i, j) is element b·srcStrides.Batch + i·srcStrides.Row + j
// of src and likewise of dst. With padded copies of weights w[G,K,N] and w8[G,K8,N8]:
//
//	CopyRects(s, w8, Strides{Row: N8, Batch: K8 * N8}, w, Strides{Row: N, Batch: K * N}, G, K, N)
//
// Each side's strides must keep its rectangles apart: Row at least cols and, for a batch
// of more than one, Batch at least rows·Row. Otherwise it is CopyRect, over batch·rows
// rows: the same tensors, checks, aliasing rule and kernels.
func CopyRects(s *Stream, dst *Tensor, dstStrides Strides, src *Tensor, srcStrides Strides, batch, rows, cols int) error {
	return copyRects("CopyRects", s, dst, dstStrides, src, srcStrides, batch, rows, cols)
}

func copyRects(op string, s *Stream, dst *Tensor, ds Strides, src *Tensor, ss Strides, batch, rows, cols int) error {
	if err := dst.usable(s, op+" destination"); err != nil {
		return err
	}
	if err := src.usable(s, op+" source"); err != nil {
		return err
	}
	if dst.dtype != src.dtype {
		return fmt.Errorf("device: %s: destination %v and source %v differ in dtype (use Cast)", op, dst, src)
	}
	for _, v := range []struct {
		name string
		v    int
	}{{"batch", batch}, {"rows", rows}, {"cols", cols}} {
		if v.v < 0 {
			return fmt.Errorf("device: %s: %s = %d < 0", op, v.name, v.v)
		}
	}
	dspan, err := rectSpan(op, "destination", dst, ds, batch, rows, cols)
	if err != nil {
		return err
	}
	sspan, err := rectSpan(op, "source", src, ss, batch, rows, cols)
	if err != nil {
		return err
	}
	if batch == 0 || rows == 0 || cols == 0 {
		return nil
	}
	if dst.st == src.st {
		es := dst.dtype.Size()
		sameRows := ds.Row == ss.Row || rows == 1
		sameBatch := ds.Batch == ss.Batch || batch == 1
		if dst.off == src.off && sameRows && sameBatch {
			return nil // the rectangle onto itself
		}
		if dst.off < src.off+sspan*es && src.off < dst.off+dspan*es {
			return fmt.Errorf("device: %s: destination %v overlaps source %v in memory", op, dst, src)
		}
	}
	return copyRect(s, dst, ds, src, ss, batch, rows, cols)
}

// rectSpan checks one side's strides against the rectangle and t (the side's tensor,
// named side) and returns the span of the rectangle: its last element's index + 1 (0 for
// an empty rectangle).
func rectSpan(op, side string, t *Tensor, st Strides, batch, rows, cols int) (int, error) {
	if st.Row < cols {
		return 0, fmt.Errorf("device: %s: %s row stride %d < cols %d", op, side, st.Row, cols)
	}
	if st.Batch < 0 {
		return 0, fmt.Errorf("device: %s: %s batch stride %d < 0", op, side, st.Batch)
	}
	if batch > 1 {
		if m := satMul(rows, st.Row); st.Batch < m {
			return 0, fmt.Errorf("device: %s: %s batch stride %d < rows·row stride %d·%d", op, side, st.Batch, rows, st.Row)
		}
	}
	if batch == 0 || rows == 0 || cols == 0 {
		return 0, nil
	}
	span := satAdd(satAdd(satMul(batch-1, st.Batch), satMul(rows-1, st.Row)), cols)
	if span > t.n {
		return 0, fmt.Errorf("device: %s: the %s rectangle (%s) ends at element %s of %v, which has %d",
			op, side, rectString(st, batch, rows, cols), spanString(span), t, t.n)
	}
	return span, nil
}

func rectString(st Strides, batch, rows, cols int) string {
	if batch == 1 {
		return fmt.Sprintf("%d×%d, row stride %d", rows, cols, st.Row)
	}
	return fmt.Sprintf("%d×%d×%d, strides %d, %d", batch, rows, cols, st.Batch, st.Row)
}

func spanString(span int) string {
	if span == math.MaxInt {
		return "past 2^63"
	}
	return fmt.Sprint(span)
}

// satMul and satAdd are a·b and a+b of non-negative ints, saturating at math.MaxInt.
func satMul(a, b int) int {
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt {
		return math.MaxInt
	}
	return int(lo)
}

func satAdd(a, b int) int {
	if a > math.MaxInt-b {
		return math.MaxInt
	}
	return a + b
}

// rectAlign returns the largest power of two up to 16 that divides each of vs.
func rectAlign(vs ...uint64) int {
	a := 16
	for _, v := range vs {
		for v%uint64(a) != 0 {
			a /= 2
		}
	}
	return a
}

// copyRect enqueues the checked copy of a non-empty batch of rectangles.
func copyRect(s *Stream, dst *Tensor, ds Strides, src *Tensor, ss Strides, batch, rows, cols int) error {
	es := dst.dtype.Size()
	nrows, rowBytes := batch*rows, cols*es
	if s.dev.kind != KindCUDA {
		return s.run(func() {
			d, sr := dst.HostBytes(), src.HostBytes()
			par.For(nrows, max(1, (1<<20)/rowBytes), func(lo, hi int) {
				for r := lo; r < hi; r++ {
					b, i := r/rows, r%rows
					do := (b*ds.Batch + i*ds.Row) * es
					so := (b*ss.Batch + i*ss.Row) * es
					copy(d[do:do+rowBytes], sr[so:so+rowBytes])
				}
			})
		}, nil)
	}
	// Byte strides; a batch of one has no batch stride, a matrix of one row no row stride.
	dRow, dBatch := uint64(ds.Row*es), uint64(ds.Batch*es)
	sRow, sBatch := uint64(ss.Row*es), uint64(ss.Batch*es)
	if rows == 1 {
		dRow, sRow = 0, 0
	}
	if batch == 1 {
		dBatch, sBatch = 0, 0
	}
	ld := rectAlign(uint64(src.dptr()), sRow, sBatch)
	st := rectAlign(uint64(dst.dptr()), dRow, dBatch)
	k, err := s.dev.Kernel(elementwise, fmt.Sprintf("dl_copy_rect_%d_%d", ld, st))
	if err != nil {
		return err
	}
	// Enough threads for the row's 16-byte chunks, or its bytes past them, in whole warps.
	work := max(rowBytes/16, rowBytes%16)
	block := min(threads, max(32, (work+31)/32*32))
	grid := min(nrows, math.MaxInt32)
	return k.Launch(s, D1(grid), D1(block), 0, dst, src,
		uint64(rows), uint64(nrows), uint64(rowBytes), sRow, sBatch, dRow, dBatch)
}
