package device

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/dropless/dropless/internal/par"
)

//go:embed kernels/elementwise.cu
var elementwiseSrc string

// elementwise is the program of the device package's own kernels (fill, copy, cast,
// CopyRect).
var elementwise = NewProgram("elementwise.cu", elementwiseSrc)

const threads = 256

// elemBits returns v in dtype dt's encoding, little-endian, dt.Size() bytes. Floats are
// rounded to float32 first; integers truncate toward zero and saturate.
func elemBits(dt DType, v float64) []byte {
	b := make([]byte, dt.Size())
	switch dt {
	case I32:
		binary.LittleEndian.PutUint32(b, uint32(int32(math.Max(math.Min(math.Trunc(nanToZero(v)), math.MaxInt32), math.MinInt32))))
	case I64:
		x := math.Trunc(nanToZero(v))
		var i int64
		switch {
		case x >= math.MaxInt64:
			i = math.MaxInt64
		case x <= math.MinInt64:
			i = math.MinInt64
		default:
			i = int64(x)
		}
		binary.LittleEndian.PutUint64(b, uint64(i))
	default:
		EncodeFloat32(dt, b, []float32{float32(v)})
	}
	return b
}

func nanToZero(v float64) float64 {
	if v != v {
		return 0
	}
	return v
}

// Fill sets every element of t to v, converted to t's dtype (floats are rounded to
// float32, then to the dtype; integers truncate toward zero and saturate). It is
// enqueued on s. t is its only operand: there is nothing to alias.
func Fill(s *Stream, t *Tensor, v float64) error {
	if err := t.usable(s, "Fill destination"); err != nil {
		return err
	}
	return fillPattern(s, t, elemBits(t.dtype, v))
}

// Memset sets every byte of t to b: 0xFF, say, to poison an output (NaN in every float
// dtype) before a test writes it. It is enqueued on s; t is its only operand.
func Memset(s *Stream, t *Tensor, b byte) error {
	if err := t.usable(s, "Memset destination"); err != nil {
		return err
	}
	return fillPattern(s, t, []byte{b})
}

func fillPattern(s *Stream, t *Tensor, elem []byte) error {
	var pat [16]byte
	for i := range pat {
		pat[i] = elem[i%len(elem)]
	}
	nb := t.Bytes()
	if nb == 0 {
		return nil
	}
	if s.dev.kind != KindCUDA {
		return s.run(func() {
			b := t.HostBytes()
			par.For(nb, 1<<20, func(lo, hi int) {
				for i := lo; i < hi; i++ {
					b[i] = pat[(t.off+i)%len(elem)]
				}
			})
		}, nil)
	}
	// The kernel phases the pattern by address: element boundaries are multiples of
	// the element size because allocations are 256-byte aligned.
	k, err := s.dev.Kernel(elementwise, "dl_fill")
	if err != nil {
		return err
	}
	le := binary.LittleEndian
	grid := min(max(nb/16/threads, 1), s.dev.sms*32)
	return k.Launch(s, D1(grid), D1(threads), 0, t, uint64(nb),
		le.Uint32(pat[0:]), le.Uint32(pat[4:]), le.Uint32(pat[8:]), le.Uint32(pat[12:]))
}

// Copy copies src into dst on s. They must be on s's device, with the same dtype and
// element count (shapes may differ). dst may be src itself (the same elements of the same
// storage, which Copy leaves as they are) but must not otherwise overlap it: that is an
// error. Moving data between devices goes through host copies (CopyToHost,
// CopyFromPinned, ...).
func Copy(s *Stream, dst, src *Tensor) error {
	if err := dst.usable(s, "Copy destination"); err != nil {
		return err
	}
	if err := src.usable(s, "Copy source"); err != nil {
		return err
	}
	if dst.dtype != src.dtype {
		return fmt.Errorf("device: Copy: destination %v and source %v differ in dtype (use Cast)", dst, src)
	}
	if err := checkSameLen("Copy", dst, src); err != nil {
		return err
	}
	if err := checkAlias("Copy", dst, src); err != nil {
		return err
	}
	return copyBytes(s, dst, src, dst.Bytes())
}

// checkAlias returns an error if dst and src share bytes of one storage, unless they are
// the same elements of one dtype (an element-wise op may then write where it reads).
func checkAlias(op string, dst, src *Tensor) error {
	if dst.st != src.st || dst.off >= src.off+src.Bytes() || src.off >= dst.off+dst.Bytes() {
		return nil
	}
	if dst.off == src.off && dst.dtype == src.dtype && dst.n == src.n {
		return nil
	}
	return fmt.Errorf("device: %s: destination %v overlaps source %v in memory", op, dst, src)
}

func copyBytes(s *Stream, dst, src *Tensor, nb int) error {
	if nb == 0 {
		return nil
	}
	if s.dev.kind != KindCUDA {
		return s.run(func() {
			d, sr := dst.HostBytes(), src.HostBytes()
			par.For(nb, 1<<20, func(lo, hi int) { copy(d[lo:hi], sr[lo:hi]) })
		}, nil)
	}
	dp, sp := dst.dptr(), src.dptr()
	n16 := 0
	if dp%16 == 0 && sp%16 == 0 {
		n16 = nb / 16
	}
	if n16 > 0 {
		k, err := s.dev.Kernel(elementwise, "dl_copy16")
		if err != nil {
			return err
		}
		grid := (n16 + threads*4 - 1) / (threads * 4)
		if err := k.Launch(s, D1(grid), D1(threads), 0, dst, src, uint64(n16)); err != nil {
			return err
		}
	}
	if rest := nb - 16*n16; rest > 0 {
		k, err := s.dev.Kernel(elementwise, "dl_copy1")
		if err != nil {
			return err
		}
		d, _ := dst.View(0, dst.n)
		sr, _ := src.View(0, src.n)
		d.off += 16 * n16
		sr.off += 16 * n16
		grid := min(max(rest/threads, 1), s.dev.sms*32)
		return k.Launch(s, D1(grid), D1(threads), 0, d, sr, uint64(rest))
	}
	return nil
}

// Cast converts src into dst, element by element, on s: the same dtype copies bits;
// I32 and I64 convert directly (I64 to I32 saturates); all else goes through float32
// with the rounding and saturation of the destination's conversion (see EncodeFloat32).
// GPU results are bit-identical to the CPU's. dst may be src itself when their dtypes
// are the same (see Copy); otherwise they must not overlap: that is an error.
func Cast(s *Stream, dst, src *Tensor) error {
	if err := dst.usable(s, "Cast destination"); err != nil {
		return err
	}
	if err := src.usable(s, "Cast source"); err != nil {
		return err
	}
	if err := checkSameLen("Cast", dst, src); err != nil {
		return err
	}
	if err := checkAlias("Cast", dst, src); err != nil {
		return err
	}
	if dst.dtype == src.dtype {
		return copyBytes(s, dst, src, dst.Bytes())
	}
	n := dst.n
	if n == 0 {
		return nil
	}
	if s.dev.kind != KindCUDA {
		return s.run(func() {
			d, sr := dst.HostBytes(), src.HostBytes()
			ds, ss := dst.dtype.Size(), src.dtype.Size()
			par.For(n, 1<<16, func(lo, hi int) {
				ConvertBytes(dst.dtype, d[lo*ds:hi*ds], src.dtype, sr[lo*ss:hi*ss], hi-lo)
			})
		}, nil)
	}
	k, err := s.dev.Kernel(elementwise, "dl_cast_"+src.dtype.String()+"_"+dst.dtype.String())
	if err != nil {
		return err
	}
	grid := min(max(n/threads, 1), s.dev.sms*16)
	return k.Launch(s, D1(grid), D1(threads), 0, dst, src, uint64(n))
}
