package ep

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/quant"
)

// DispatchedBlockwise is what DispatchBlockwise returns on a rank: its experts' rows,
// quantized to blockwise FP8, grouped by local expert.
type DispatchedBlockwise struct {
	// X holds Capacity rows in quant's ungrouped rowwise layout (X.M = Capacity, X.K = H,
	// the format and scale kind of the dispatched rows): X.Row is [Capacity, H] and
	// X.RowScale F32 [ceil(H/128), roundup(Capacity, 4)], the scale of row i, block b at
	// (b, i). Rows are in Dispatched.X's order (local expert 0, then 1, ..., Counts[j]
	// rows each), ready for gemm.RaggedDotBlockwise with the group sizes Counts. Rows
	// past the kept ones (Layout.Rows) are not written; their scales, and the padding
	// scales past Capacity, are 0.
	X *quant.Blockwise
	// Weights is F32 [Capacity]: each row's routing weight (nil when DispatchBlockwise
	// got none).
	Weights *device.Tensor
	// Counts is the layout's ExpertCounts: I32, the rows of each local expert.
	Counts *device.Tensor
}

// Free releases X and Weights; Counts belongs to the layout. Freeing a nil
// DispatchedBlockwise does nothing.
func (d *DispatchedBlockwise) Free() error {
	if d == nil {
		return nil
	}
	return errors.Join(d.X.Free(), device.FreeAll(d.Weights))
}

// DispatchBlockwise is Dispatch for rows quantized to blockwise FP8 (1×128 blocks along
// H, DeepSeek-V3's recipe for Hopper): q is the rowwise form of this rank's tokens [T,
// H] as quant.QuantizeBlockwise makes it without groups (q.Row, E4M3 or E5M2 [T, H], and
// q.RowScale, F32 [ceil(H/128), roundup(T, 4)]; Dir Rowwise or Both, of which only the
// rowwise form moves; float32 or power-of-two scales). Each (token, rank) pair sends the
// token's H element bytes and its ceil(H/128) scales once, in the same exchange as its
// weights (F32 [T, K], or nil), and on arrival both are replicated into the rows of
// DispatchedBlockwise.X, in Dispatched.X's order. The scales travel as one row per
// token: they are transposed out of q.RowScale's layout (scale blocks outer) before the
// exchange and into X.RowScale's after it, two passes over T and Capacity rows of
// ceil(H/128) floats.
//
// A rowwise block lies within a row, so a row's elements and scales do not depend on the
// other rows: quantizing before the dispatch gives, bit for bit, the rows and scales
// that quantizing Dispatch's X (without groups, with the same format and scale kind)
// gives, while moving H + 4·ceil(H/128) bytes per row instead of 2H for bf16, about
// half. Every rank passes the same H, format and presence of weights. q and weights are
// on the group's device and only read; X and Weights are new, allocated on s, and alias
// no input. Work is enqueued on s and on the group's transfer stream, as by Dispatch.
//
// The gradient of the dispatched rows goes back with DispatchBackward, as for
// Dispatch.
//
// The during functions run while the transfers move (see the package doc's Overlap).
func (l *Layout) DispatchBlockwise(s *device.Stream, q *quant.Blockwise, weights *device.Tensor, during ...func() error) (*DispatchedBlockwise, error) {
	const op = "DispatchBlockwise"
	if err := l.usable(s, op); err != nil {
		return nil, err
	}
	if err := l.checkBlockwise(s, op, q); err != nil {
		return nil, err
	}
	W, err := l.dispatchWeights(s, op, weights)
	if err != nil {
		return nil, err
	}
	X, err := quant.AllocBlockwise(s, l.capacity, q.K, quant.BlockOptions{Format: q.Format, Scale: q.Scale, Dir: quant.Rowwise})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ep: %s: %w", op, err), device.FreeAll(W))
	}
	fail := func(err error) (*DispatchedBlockwise, error) {
		return nil, errors.Join(err, X.Free(), device.FreeAll(W))
	}
	nb, cp := X.RowScale.Dim(0), X.RowScale.Dim(1)
	tmp := device.NewTemps(s)
	defer tmp.Free()
	// One row of scales per token, and per expert row on arrival.
	sendScale, recvScale := tmp.Alloc(device.F32, l.t, nb), tmp.Alloc(device.F32, l.capacity, nb)
	if err := tmp.Err(); err != nil {
		return fail(err)
	}
	be := l.g.be
	if err := device.Memset(s, X.RowScale, 0); err != nil {
		return fail(err)
	}
	if err := be.transpose4(s, sendScale, q.RowScale, nb, l.t, nb, q.RowScale.Dim(1)); err != nil {
		return fail(err)
	}
	err = l.dispatchCodes(s, op, X.Row, recvScale, W, q.Row, sendScale, weights, during)
	if err == nil {
		err = be.transpose4(s, X.RowScale, recvScale, l.Rows(), nb, cp, nb)
	}
	if err != nil {
		return fail(err)
	}
	return &DispatchedBlockwise{X: X, Weights: W, Counts: l.counts}, nil
}

// checkBlockwise returns an error of op unless q is the ungrouped rowwise blockwise form
// of this rank's T tokens, live on s's device.
func (l *Layout) checkBlockwise(s *device.Stream, op string, q *quant.Blockwise) error {
	if q == nil {
		return fmt.Errorf("ep: %s: q is nil", op)
	}
	switch {
	case q.Format != quant.E4M3 && q.Format != quant.E5M2:
		return fmt.Errorf("ep: %s: q.Format is %v: want E4M3 or E5M2", op, q.Format)
	case q.Scale != quant.ScaleF32 && q.Scale != quant.ScalePow2:
		return fmt.Errorf("ep: %s: q.Scale is %v: want f32 or pow2", op, q.Scale)
	case q.Dir != quant.Rowwise && q.Dir != quant.Both:
		return fmt.Errorf("ep: %s: q.Dir is %v: want the rowwise form (Rowwise or Both)", op, q.Dir)
	case q.Row == nil || q.RowScale == nil:
		return fmt.Errorf("ep: %s: q has no rowwise form (q.Row or q.RowScale is nil): want q as quant.QuantizeBlockwise made it", op)
	case q.Groups != 0 || q.Status != nil:
		return fmt.Errorf("ep: %s: q has a grouped layout (%d groups): want q quantized without groups", op, q.Groups)
	case q.M != l.t:
		return fmt.Errorf("ep: %s: q.M is %d: want the layout's %d tokens", op, q.M, l.t)
	case q.K < 0:
		return fmt.Errorf("ep: %s: q.K is %d: want H ≥ 0", op, q.K)
	}
	if err := checkShape(s, q.Row, op+": q.Row", q.Format.DType(), l.t, q.K); err != nil {
		return err
	}
	return checkShape(s, q.RowScale, op+": q.RowScale", device.F32, (q.K+quant.BlockSize-1)/quant.BlockSize, 4*((l.t+3)/4))
}
