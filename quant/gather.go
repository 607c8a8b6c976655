package quant

import (
	_ "embed"
	"errors"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// Gathering quantized rows: moving each token's rowwise-quantized row, codes and
// scales, to the rows that need it (the expert rows of a MoE layer, where a token's row
// appears once per expert it is routed to), instead of quantizing the moved bf16 rows.
// A rowwise block lies within a row and is quantized from that row alone, so the
// gathered rows are bit for bit what quantizing the gathered source rows gives.

//go:embed kernels/gather.cu
var gatherSrc string

// gatherKernels is the program of the gather kernels (kernels/gather.cu).
var gatherKernels = device.NewProgram("gather.cu", gatherSrc)

// The ops of the gathers' records of index entries out of range in a device.Status
// (domain statusDomain, code statusIndex, values: the destination row, the entry and
// the bound). kernels/gather.cu records them with the op it is given.
const (
	opGatherBlockwise = 4
	opGatherMXFP8     = 5
	statusIndex       = 3
)

// gatherStatusError returns the error of a gather's record, nil for other ops.
func gatherStatusError(op, code int, v [3]int64) error {
	var fn string
	switch op {
	case opGatherBlockwise:
		fn = "GatherBlockwise"
	case opGatherMXFP8:
		fn = "GatherMXFP8"
	default:
		return nil
	}
	if code == statusIndex {
		return fmt.Errorf("quant: %s: index[%d] = %d: want -1 or a copy in [0, %d); that row was gathered as a zero row", fn, v[0], v[1], v[2])
	}
	return fmt.Errorf("quant: %s: invalid index (code %d)", fn, code)
}

// GatherBlockwise returns, for an index I32[R] on s's device, the R rows of q's
// rowwise form chosen by it: row r of the result is q's row index[r]/per, codes and
// scales, or where index[r] is -1 an all-zero row as quantizing one gives it (codes 0,
// scale 1). per (≥ 1) is the number of copies of each source row that index numbers,
// copy j of row i being i·per + j: 1 when index holds row numbers, K for the
// assignments of a MoE layer's tokens to their top-K experts. The result is rowwise,
// without groups, with q's format and scale kind, allocated on s; it is what
// QuantizeBlockwise gives for the gathered source rows, bit for bit.
//
// q must hold its rowwise form (Dir Rowwise or Both, grouped or not). Entries of
// index outside [-1, q.M·per) give zero rows and are recorded in st (the first one,
// as an error of st.Check), which must not be nil. Nothing waits for the device.
func GatherBlockwise(s *device.Stream, q *Blockwise, index *device.Tensor, per int, st *device.Status) (*Blockwise, error) {
	const fn = "GatherBlockwise"
	R, err := checkGather(fn, s, q, index, per, st)
	if err != nil {
		return nil, err
	}
	opt := BlockOptions{Format: q.Format, Scale: q.Scale, Dir: Rowwise}
	dst, err := allocBlockwise(fn, s, R, q.K, opt, fmt.Sprintf("%d gathered rows of %d", R, q.K))
	if err != nil {
		return nil, err
	}
	sg, dg := q.alloc.g, dst.alloc.g
	j := gatherJob{dq: dst.Row, sq: q.Row, index: index, per: per, m: q.M, k: q.K, st: st, op: opGatherBlockwise}
	if s.Device().IsCUDA() {
		err = j.gpu(s, "dl_gather_bw", dg.mr, dst.RowScale, q.RowScale, int64(dg.mr), int64(sg.mr), int64(sg.nb))
	} else {
		ds, ss := device.Slice[float32](dst.RowScale), device.Slice[float32](q.RowScale)
		err = j.cpu(s, func(r, i int) {
			for b := range sg.nb {
				ds[b*dg.mr+r] = 1 // a zero block's scale
				if i >= 0 {
					ds[b*dg.mr+r] = ss[b*sg.mr+i]
				}
			}
		}, func() {
			for b := range sg.nb {
				clear(ds[b*dg.mr+R : (b+1)*dg.mr])
			}
		})
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("quant: %s: %w", fn, err), dst.Free())
	}
	return dst, nil
}

// GatherMXFP8 is GatherBlockwise for MXFP8: row r of the result is q's rowwise row
// index[r]/per, codes and E8M0 scales, or an all-zero row (codes 0, scale code 0) where
// index[r] is -1. The result is rowwise, unswizzled, without groups, with q's format
// and mode, allocated on s: what Quantize gives for the gathered source rows, bit for
// bit. q must hold its rowwise form, unswizzled and without groups (whose scale rows
// follow the groups' tiles).
func GatherMXFP8(s *device.Stream, q *MXFP8, index *device.Tensor, per int, st *device.Status) (*MXFP8, error) {
	const fn = "GatherMXFP8"
	R, err := checkGather(fn, s, q, index, per, st)
	if err != nil {
		return nil, err
	}
	switch {
	case q.Swizzled:
		return nil, fmt.Errorf("quant: %s: q's rowwise scales are swizzled: want plain ones (Options.Swizzle false)", fn)
	case q.grouped:
		return nil, fmt.Errorf("quant: %s: q has a grouped layout (its scale rows follow the groups' tiles): want q quantized without groups", fn)
	}
	opt := Options{Format: q.Format, Mode: q.Mode, Dir: Rowwise}
	dst, err := alloc(fn, s, R, q.K, opt, fmt.Sprintf("%d gathered rows of %d", R, q.K))
	if err != nil {
		return nil, err
	}
	cp := q.g.cp
	j := gatherJob{dq: dst.Row, sq: q.Row, index: index, per: per, m: q.M, k: q.K, st: st, op: opGatherMXFP8}
	if s.Device().IsCUDA() {
		rows := 32 * dst.g.ntiles
		err = j.gpu(s, "dl_gather_mx", rows, dst.RowScale, q.RowScale, int64(rows), int64(cp), 0)
	} else {
		ds, ss := bytesOf(dst.RowScale), bytesOf(q.RowScale)
		err = j.cpu(s, func(r, i int) {
			if i < 0 {
				clear(ds[r*cp : (r+1)*cp]) // a zero block's scale code, 0
				return
			}
			copy(ds[r*cp:(r+1)*cp], ss[i*cp:(i+1)*cp])
		}, func() { clear(ds[R*cp:]) })
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("quant: %s: %w", fn, err), dst.Free())
	}
	return dst, nil
}

// checkGather returns the rows R of index, an I32[R] on s's device, after checking s,
// src's rowwise form, index, per ≥ 1 and st, a Status usable on s.
func checkGather(fn string, s *device.Stream, src interface {
	check(string, *device.Stream, Direction) error
}, index *device.Tensor, per int, st *device.Status) (int, error) {
	if s == nil {
		return 0, fmt.Errorf("quant: %s: nil stream", fn)
	}
	if err := src.check(fn, s, Rowwise); err != nil {
		return 0, err
	}
	if err := index.Check(s, "index"); err != nil {
		return 0, fmt.Errorf("quant: %s: %w", fn, err)
	}
	if index.DType() != device.I32 || index.Rank() != 1 {
		return 0, fmt.Errorf("quant: %s: index is %v: want i32[R]", fn, index)
	}
	if per < 1 || per > math.MaxInt32 {
		return 0, fmt.Errorf("quant: %s: per = %d: want 1 ≤ per ≤ 2^31 − 1", fn, per)
	}
	if st == nil {
		return 0, fmt.Errorf("quant: %s: st is nil: want the Status that records index entries out of range", fn)
	}
	if err := st.Usable(s, "st"); err != nil {
		return 0, fmt.Errorf("quant: %s: %w", fn, err)
	}
	return index.Len(), nil
}

// gatherJob is a gather's codes, dq [R, k] from sq [m, k] bytes by index and per,
// recording bad entries in st as op.
type gatherJob struct {
	dq, sq, index *device.Tensor
	per, m, k     int
	st            *device.Status
	op            int
}

// cpu enqueues the CPU gather on s: for each destination row r with source row i (-1 for
// a zero row: index -1 or out of range) its k codes, and scales(r, i) its scales, in
// parallel; then pad, the padding scales past R; then the first entry out of range is
// recorded in j.st.
func (j gatherJob) cpu(s *device.Stream, scales func(r, i int), pad func()) error {
	return s.EnqueueCPU(func() {
		dq, sq, k := bytesOf(j.dq), bytesOf(j.sq), j.k
		index := device.Slice[int32](j.index)
		lim := int64(j.m) * int64(j.per)
		par.For(len(index), 256, func(lo, hi int) {
			for r := lo; r < hi; r++ {
				i := -1
				if e := int64(index[r]); e >= 0 && e < lim {
					i = int(e / int64(j.per))
				}
				if i < 0 {
					clear(dq[r*k : (r+1)*k])
				} else {
					copy(dq[r*k:(r+1)*k], sq[i*k:(i+1)*k])
				}
				scales(r, i)
			}
		})
		pad()
		for r, e := range index {
			if e < -1 || int64(e) >= lim {
				// j.st was checked to be usable on the CPU stream: Record cannot fail.
				_ = j.st.Record(device.StatusCode(statusDomain, j.op, statusIndex), int64(r), int64(e), lim)
				break
			}
		}
	})
}

// gpu launches kernel name (dl_gather_bw or dl_gather_mx; _w16 when the codes' rows are
// whole 16-byte units, else _w1) on s with one block per destination scale row (rows:
// the blockwise scales' padded columns, or the MXFP8 scale rows), each copying its row's
// k codes and scales ds ← ss. For blockwise, a and b are the destination's and source's
// scale strides and c the blocks per row; for MXFP8, b is the scale bytes per row (a and
// c are unused).
func (j gatherJob) gpu(s *device.Stream, name string, rows int, ds, ss *device.Tensor, a, b, c int64) error {
	if rows == 0 {
		return nil
	}
	vec := "_w1"
	if j.k%16 == 0 && device.Aligned(16, j.dq, j.sq) {
		vec = "_w16"
	}
	kern, err := s.Device().Kernel(gatherKernels, name+vec)
	if err != nil {
		return err
	}
	return kern.Launch(s, device.D1(rows), device.D1(gatherThreads), 0, j.dq, j.sq, ds, ss, j.index, int32(j.index.Len()), int32(j.per),
		int32(j.m), int64(j.k), a, b, c, j.st, int32(j.op))
}

// gatherThreads is the block of the gather kernels.
const gatherThreads = 128
