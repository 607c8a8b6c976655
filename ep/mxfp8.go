package ep

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// DispatchedMXFP8 is what DispatchMXFP8 returns on a rank: its experts' rows, quantized
// to MXFP8, grouped by local expert.
type DispatchedMXFP8 struct {
	// X holds Capacity rows in quant's ungrouped rowwise layout (X.M = Capacity, X.K =
	// H, the format and scale mode of the dispatched rows, plain scales): X.Row is
	// [Capacity, H] and X.RowScale [32·X.Tiles(), roundup(ceil(H/32), 4)], with row i's
	// scales in scale row i. Rows are in Dispatched.X's order (local expert 0, then 1,
	// ..., Counts[j] rows each), ready for a ragged MXFP8 matrix product with the group
	// sizes Counts. Rows past the kept ones (Layout.Rows) and their scale rows are not
	// written; the padding scale rows past Capacity are 0.
	X *quant.MXFP8
	// Weights is F32 [Capacity]: each row's routing weight (nil when DispatchMXFP8 got
	// none).
	Weights *device.Tensor
	// Counts is the layout's ExpertCounts: I32, the rows of each local expert.
	Counts *device.Tensor
}

// Free releases X and Weights; Counts belongs to the layout. Freeing a nil
// DispatchedMXFP8 does nothing.
func (d *DispatchedMXFP8) Free() error {
	if d == nil {
		return nil
	}
	return errors.Join(d.X.Free(), device.FreeAll(d.Weights))
}

// DispatchMXFP8 is Dispatch for rows quantized to MXFP8: q is the rowwise form of this
// rank's tokens [T, H] as quant.Quantize makes it without groups and without swizzling
// (q.Row, E4M3 or E5M2 [T, H], and q.RowScale, E8M0 [32·q.Tiles(), cp] with cp =
// roundup(ceil(H/32), 4), row t's scales in scale row t; Dir Rowwise or Both, of which
// only the rowwise form moves). Each (token, rank) pair sends the token's H element
// bytes and its cp scale bytes once, in the same exchange as its weights (F32 [T, K], or
// nil), and on arrival both are replicated into the rows of DispatchedMXFP8.X, in
// Dispatched.X's order.
//
// A rowwise block lies within a row, so a row's elements and scales do not depend on
// the other rows: quantizing before the dispatch gives, bit for bit, the rows and scale
// rows that quantizing Dispatch's X (without groups, with the same format and mode)
// gives, while moving H + cp bytes per row instead of 2H for bf16, about half. Every
// rank passes the same H, format and presence of weights. q and weights are on the
// group's device and only read; X and Weights are new, allocated on s, and alias no
// input. Work is enqueued on s and on the group's transfer stream, as by Dispatch.
//
// The gradient of the dispatched rows goes back with DispatchBackward, as for
// Dispatch.
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) DispatchMXFP8(s *device.Stream, q *quant.MXFP8, weights *device.Tensor, during ...func() error) (*DispatchedMXFP8, error) {
	const op = "DispatchMXFP8"
	if err := l.usable(s, op); err != nil {
		return nil, err
	}
	if err := l.checkMXFP8(s, op, q); err != nil {
		return nil, err
	}
	W, err := l.dispatchWeights(s, op, weights)
	if err != nil {
		return nil, err
	}
	X, err := quant.Alloc(s, l.capacity, q.K, quant.Options{Format: q.Format, Mode: q.Mode, Dir: quant.Rowwise})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ep: %s: %w", op, err), device.FreeAll(W))
	}
	fail := func(err error) (*DispatchedMXFP8, error) {
		return nil, errors.Join(err, X.Free(), device.FreeAll(W))
	}
	// The scale rows past Capacity are padding, 0 as Quantize leaves them.
	if pad := rows(X.RowScale, l.capacity, X.RowScale.Dim(0)); pad.Len() > 0 {
		if err := device.Memset(s, pad, 0); err != nil {
			return fail(err)
		}
	}
	outScale := rows(X.RowScale, 0, l.capacity)
	err = l.dispatchCodes(s, op, X.Row, outScale, W, q.Row, rows(q.RowScale, 0, l.t), weights, during)
	if err != nil {
		return fail(err)
	}
	return &DispatchedMXFP8{X: X, Weights: W, Counts: l.counts}, nil
}

// dispatchCodes is the exchange of DispatchMXFP8 and DispatchBlockwise: it dispatches
// codes [T, H] with one row of scales per token, scales [T, n], and weights (F32 [T, K],
// or nil), in one exchange, and replicates them on arrival into the expert rows of
// outCodes [Capacity, H], outScales [Capacity, n] and W (F32 [Capacity], nil without
// weights), on s.
func (l *Layout) dispatchCodes(s *device.Stream, op string, outCodes, outScales, W, codes, scales, weights *device.Tensor, during []func() error) error {
	be := l.g.be
	return l.dispatch(s, op, []string{"q.Row", "q.RowScale"}, []*device.Tensor{codes, scales}, weights, during,
		func(src []*device.Tensor, srcW, rowMap, slot *device.Tensor) error {
			if err := be.replicate(s, outCodes, W, src[0], srcW, rowMap, slot); err != nil {
				return err
			}
			return be.replicate(s, outScales, nil, src[1], nil, rowMap, slot)
		})
}

// checkMXFP8 returns an error of op unless q is the ungrouped, unswizzled rowwise MXFP8
// form of this rank's T tokens, live on s's device.
func (l *Layout) checkMXFP8(s *device.Stream, op string, q *quant.MXFP8) error {
	if q == nil {
		return fmt.Errorf("ep: %s: q is nil", op)
	}
	switch {
	case q.Format != quant.E4M3 && q.Format != quant.E5M2:
		return fmt.Errorf("ep: %s: q.Format is %v: want E4M3 or E5M2", op, q.Format)
	case q.Mode != quant.RCEIL && q.Mode != quant.FLOOR:
		return fmt.Errorf("ep: %s: q.Mode is %v: want RCEIL or FLOOR", op, q.Mode)
	case q.Dir != quant.Rowwise && q.Dir != quant.Both:
		return fmt.Errorf("ep: %s: q.Dir is %v: want the rowwise form (Rowwise or Both)", op, q.Dir)
	case q.Row == nil || q.RowScale == nil:
		return fmt.Errorf("ep: %s: q has no rowwise form (q.Row or q.RowScale is nil): want q as quant.Quantize made it", op)
	case q.Groups != 0 || q.Status != nil:
		return fmt.Errorf("ep: %s: q has a grouped layout (%d groups): want q quantized without groups", op, q.Groups)
	case q.Swizzled:
		return fmt.Errorf("ep: %s: q has swizzled scales: want plain ones (quant.Options.Swizzle false)", op)
	case q.M != l.t:
		return fmt.Errorf("ep: %s: q.M is %d: want the layout's %d tokens", op, q.M, l.t)
	case q.K < 0:
		return fmt.Errorf("ep: %s: q.K is %d: want H ≥ 0", op, q.K)
	}
	if err := checkShape(s, q.Row, op+": q.Row", q.Format.DType(), l.t, q.K); err != nil {
		return err
	}
	cp := 4 * ((q.K + 127) / 128) // roundup(ceil(K/32), 4)
	if err := checkShape(s, q.RowScale, op+": q.RowScale", device.E8M0, 32*q.Tiles(), cp); err != nil {
		return err
	}
	if q.Tiles() != 4*((l.t+127)/128) {
		return fmt.Errorf("ep: %s: q has %d tiles of 32 rows: want %d, the ungrouped layout of %d rows", op, q.Tiles(), 4*((l.t+127)/128), l.t)
	}
	return nil
}
