package gemm

import (
	"math"

	"github.com/dropless/dropless/device"
)

// padAllocFault, when not nil, is called before each allocation of a padded copy with
// its index (0, 1, ... in the order padded allocates them); an error it returns stands
// for that allocation's. Tests set it to reach the fallbacks.
var padAllocFault func(i int) error

// round8 returns n rounded up to a multiple of 8.
func round8(n int) int { return (n + 7) &^ 7 }

// padOK reports whether the call can run on the Hopper kernels through padded copies
// (see padded), where hopperOK fails: it passes hopperShapeOK, and K and N rounded up to
// multiples of 8 are still 32-bit integers, as the kernels take them.
func (c *call) padOK(d *device.Device) bool {
	return round8(c.K) <= math.MaxInt32 && round8(c.N) <= math.MaxInt32 && c.hopperShapeOK(d)
}

// padOperand is one operand of a padded call: t holds batch row-major matrices of
// rows×cols elements; its padded copy holds them as rows8×cols8 matrices.
type padOperand struct {
	t                 *device.Tensor
	batch, rows, cols int
	rows8, cols8      int
	zero              bool           // the copy's padding is contracted: it must be zeros
	p                 *device.Tensor // the padded copy, or t where the kernels can read t
}

// needsCopy reports whether the operand must be copied for the Hopper kernels: its
// shape is padded, or its first element is not 16-byte aligned.
func (o *padOperand) needsCopy() bool {
	return o.rows8 != o.rows || o.cols8 != o.cols || !device.Aligned(16, o.t)
}

// strides returns the layouts of the operand and of its padded copy.
func (o *padOperand) strides() (t, p device.Strides) {
	return device.Strides{Row: o.cols, Batch: o.rows * o.cols}, device.Strides{Row: o.cols8, Batch: o.rows8 * o.cols8}
}

// padded enqueues the call on the Hopper kernels through zero-padded copies of the
// operands that they cannot read as they are: K and N are rounded up to multiples of 8
// (K8, N8), and each operand whose rows are then longer, or that is not 16-byte
// aligned, is copied into a new tensor of the padded shape (x [M,K8], dy [M,N8], w and
// dw [G,K8,N8] or [G,N8,K8]) with device.CopyRect. The padding of the contracted
// dimension (K in the forward, N in the input gradient) is zeroed, so it adds nothing;
// that of the others only makes output elements that are not copied back. The output's
// copy starts as a copy of the output, so that it holds dw with Options.Accumulate, and
// the output as it was where the kernels write nothing (invalid sizes); after the
// kernels its real rows×cols are copied back into the output (rows past the groups are
// zeros there, as the kernels write them). The plan kernel has checked the sizes into
// the call's Status already; counter is the forward's scratch element, as for hopper.
//
// Every copy is allocated before anything is enqueued. When an allocation runs out of
// memory, padded frees the others and returns false with nothing enqueued: the caller
// then runs the portable kernels. Any other error is returned. The copies are freed in
// stream order on s after the kernels.
func (c *call) padded(s *device.Stream, counter *device.Tensor) (ran bool, err error) {
	M, G := c.M, c.G
	K8, N8 := round8(c.K), round8(c.N)
	// weights is w or dw ([G,K,N] or [G,N,K]); rows is a matrix of M rows.
	weights := func(t *device.Tensor, zero bool) padOperand {
		if c.layout == NK {
			return padOperand{t: t, batch: G, rows: c.N, cols: c.K, rows8: N8, cols8: K8, zero: zero}
		}
		return padOperand{t: t, batch: G, rows: c.K, cols: c.N, rows8: K8, cols8: N8, zero: zero}
	}
	rows := func(t *device.Tensor, cols, cols8 int, zero bool) padOperand {
		return padOperand{t: t, batch: 1, rows: M, cols: cols, rows8: M, cols8: cols8, zero: zero}
	}
	// The operands in the order of the call: out, a, b.
	var ops [3]padOperand
	switch c.f {
	case forward: // y[M,N] = x[M,K]·w_g, contracting K
		ops = [3]padOperand{rows(c.out, c.N, N8, false), rows(c.a, c.K, K8, K8 > c.K), weights(c.b, K8 > c.K)}
	case inputGrad: // dx[M,K] = dy[M,N]·w_gᵀ, contracting N
		ops = [3]padOperand{rows(c.out, c.K, K8, false), rows(c.a, c.N, N8, N8 > c.N), weights(c.b, N8 > c.N)}
	default: // dw_g = x_gᵀ·dy_g, contracting the group's rows: no padding is contracted
		ops = [3]padOperand{weights(c.out, false), rows(c.a, c.K, K8, false), rows(c.b, c.N, N8, false)}
	}

	ts := device.NewTemps(s)
	defer func() {
		if ferr := ts.Free(); err == nil {
			err = ferr
		}
	}()
	n := 0
	for i := range ops {
		o := &ops[i]
		o.p = o.t
		if !o.needsCopy() {
			continue
		}
		if padAllocFault != nil {
			if err := padAllocFault(n); err != nil {
				return false, oomOrErr(err)
			}
		}
		n++
		shape := []int{o.rows8, o.cols8}
		if o.t.Rank() == 3 {
			shape = []int{o.batch, o.rows8, o.cols8}
		}
		if o.p = ts.Alloc(o.t.DType(), shape...); o.p == nil {
			return false, oomOrErr(ts.Err())
		}
	}

	// Every copy, the output's too, starts as its operand.
	for _, o := range ops {
		if o.p == o.t {
			continue
		}
		if o.zero {
			if err := device.Memset(s, o.p, 0); err != nil {
				return false, err
			}
		}
		tl, pl := o.strides()
		if err := device.CopyRects(s, o.p, pl, o.t, tl, o.batch, o.rows, o.cols); err != nil {
			return false, err
		}
	}
	p := *c
	p.K, p.N = K8, N8
	p.out, p.a, p.b = ops[0].p, ops[1].p, ops[2].p
	if err := p.hopper(s, counter); err != nil {
		return false, err
	}
	if o := ops[0]; o.p != o.t {
		tl, pl := o.strides()
		if err := device.CopyRects(s, o.t, tl, o.p, pl, o.batch, o.rows, o.cols); err != nil {
			return false, err
		}
	}
	return true, nil
}

// oomOrErr returns nil for an out-of-memory error, which makes padded fall back to the
// portable kernels, and err otherwise.
func oomOrErr(err error) error {
	if device.IsOutOfMemory(err) {
		return nil
	}
	return err
}
