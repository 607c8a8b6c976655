package main

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// adamHyper are AdamW's hyperparameters.
type adamHyper struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
}

// adamArgs mirrors struct tr_adam_hyper of kernels/train.cu.
type adamArgs struct {
	LR, Beta1, Beta2, Eps, Decay, C1, C2 float32
}

// adamChunk is TR_ADAM_CHUNK: the elements of a parameter each block takes at a time.
const adamChunk = 2048

// adamParam is one parameter of a multi-tensor AdamW step: the parameter p, F32, its
// gradient g, F32 or BF16 (the table's gradient dtype), and its moments m and v, F32 or
// BF16 (the table's moment dtype), all of one length; c, when not nil, a BF16 copy of p
// of the same length that the step refreshes (the weights the compute reads).
type adamParam struct {
	name          string // for messages
	p, g, m, v, c *device.Tensor
	decay         bool // weight decay applies
}

// adamTable steps a set of parameters with one kernel launch: on a GPU it holds a device
// table of their addresses and sizes (tr_adam_param of kernels/train.cu, 8 words each),
// so the tensors must outlive it.
type adamTable struct {
	ps      []adamParam
	moments device.DType   // of every parameter's m and v: F32 (tr_adamw) or BF16 (tr_adamw_bf16)
	grads   device.DType   // of every parameter's g: F32, or BF16 (the kernels named _gbf16)
	tab     *device.Tensor // I64[len(ps), 8] on a GPU, nil on the CPU
	chunks  int64
	grid    int // blocks of the launch, once known
}

// adamShift returns the position of q's element 0 in its group of 4 elements that the
// kernel loads and stores at once (16 bytes of f32, 8 of the bf16 copy), 0 to 3, when
// every tensor of q has its element 0 at the same position; else -1, and the kernel
// takes q's elements one at a time.
func adamShift(q adamParam) int {
	ms := uintptr(q.m.DType().Size())
	addrs := []elemAddr{{q.p.Ptr(), 4}, {q.g.Ptr(), uintptr(q.g.DType().Size())}, {q.m.Ptr(), ms}, {q.v.Ptr(), ms}}
	if q.c != nil {
		addrs = append(addrs, elemAddr{q.c.Ptr(), 2})
	}
	return groupShift(addrs)
}

// elemAddr is the address of a tensor's element 0 and the size of its elements.
type elemAddr struct{ at, size uintptr }

// groupShift returns the position of each address's element in its group of 4
// elements (of 4·size bytes, aligned) when the position is the same for all and every
// address is aligned to its element size; else -1.
func groupShift(addrs []elemAddr) int {
	shift := -1
	for _, a := range addrs {
		if a.at%a.size != 0 {
			return -1
		}
		sh := int(a.at % (4 * a.size) / a.size)
		if shift >= 0 && sh != shift {
			return -1
		}
		shift = sh
	}
	return shift
}

// adamChunks returns the chunks of the kernel over a parameter of n elements whose
// groups of 4 start at element −shift (adamShift).
func adamChunks(n, shift int) int64 {
	if n == 0 {
		return 0
	}
	return int64((n + max(shift, 0) + adamChunk - 1) / adamChunk)
}

// newAdamTable returns the table of ps, uploaded on s. Their moments are all F32 or all
// BF16, and so are their gradients.
func newAdamTable(s *device.Stream, ps []adamParam) (*adamTable, error) {
	if len(ps) == 0 {
		return nil, fmt.Errorf("adamw: no parameters")
	}
	t := &adamTable{ps: ps, moments: device.F32, grads: device.F32} // parameter 0's tensors say which
	if m := ps[0].m; m != nil && m.DType() == device.BF16 {
		t.moments = device.BF16
	}
	if g := ps[0].g; g != nil && g.DType() == device.BF16 {
		t.grads = device.BF16
	}
	words := make([]int64, 0, 8*len(ps))
	for i, q := range ps {
		n := q.p.Len()
		for _, c := range []struct {
			what string
			t    *device.Tensor
			dt   device.DType
		}{
			{"parameter", q.p, device.F32}, {"gradient", q.g, t.grads},
			{"first moment", q.m, t.moments}, {"second moment", q.v, t.moments}, {"compute copy", q.c, device.BF16},
		} {
			if c.t == nil && c.what == "compute copy" {
				continue // optional
			}
			what := fmt.Sprintf("adamw parameter %d's %s", i, c.what)
			if err := c.t.Check(s, what); err != nil {
				return nil, err
			}
			if c.t.DType() != c.dt || c.t.Len() != n {
				return nil, fmt.Errorf("%s is %v, want %v of %d elements", what, c.t, c.dt, n)
			}
		}
		var cp uintptr
		if q.c != nil {
			cp = q.c.Ptr()
		}
		decay := int64(0)
		if q.decay {
			decay = 1
		}
		shift := adamShift(q)
		// The last word holds two C ints, decay then shift.
		words = append(words, int64(q.p.Ptr()), int64(q.g.Ptr()), int64(q.m.Ptr()), int64(q.v.Ptr()), int64(cp),
			int64(n), t.chunks, decay|int64(uint32(int32(shift)))<<32)
		t.chunks += adamChunks(n, shift)
	}
	if s.Device().IsCUDA() {
		var err error
		if t.tab, err = device.FromSlice(s, device.I64, words, len(ps), 8); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// spread makes each step of t one block per chunk instead of as many blocks as fit on
// the device at once: blocks that come and go, so that when t steps on a stream beside
// another one the GPU's scheduler can interleave the other stream's kernels, rather than
// wait for blocks that loop over the whole table.
func (t *adamTable) spread() { t.grid = int(max(t.chunks, 1)) }

// bytes returns the bytes a step of t reads and writes: p, g, m and v read, p, m, v and
// the compute copy written.
func (t *adamTable) bytes() float64 {
	ms, gs, b := float64(t.moments.Size()), float64(t.grads.Size()), 0.0
	for _, q := range t.ps {
		b += float64(q.p.Len()) * (8 + gs + 4*ms)
		if q.c != nil {
			b += float64(q.c.Len()) * 2
		}
	}
	return b
}

// Free releases the device table.
func (t *adamTable) Free() error {
	if t == nil || t.tab == nil {
		return nil
	}
	return t.tab.Free()
}

// adamStep returns one element's parameter p, first and second moments m and v after a
// step with gradient g, decay (1, or 1 − lr·wd for a parameter with weight decay) and
// the step's hyperparameters a. Every product, sum, square root and quotient is rounded
// to float32 on its own, the explicit conversions keeping the compiler from fusing a
// multiply and an add: tr_adam1 of kernels/train.cu makes the same operations in the
// same order, so that the GPU's results are these bit for bit.
func adamStep(p, g, m, v, decay float32, a adamArgs) (p2, m2, v2 float32) {
	ob1, ob2 := 1-a.Beta1, 1-a.Beta2
	m2 = float32(a.Beta1*m) + float32(ob1*g)
	v2 = float32(a.Beta2*v) + float32(float32(ob2*g)*g)
	den := float32(math.Sqrt(float64(float32(v2*a.C2)))) + a.Eps // rounded to float32, the float64 root is the correctly rounded float32 one
	p2 = float32(p*decay) - float32(a.LR*float32(m2*a.C1))/den
	return p2, m2, v2
}

// step applies AdamW step n (1, 2, ...) to every parameter of the table, on s:
// decoupled weight decay p·(1 − lr·wd) for the parameters that take it, then the
// bias-corrected Adam update, and the compute copies refreshed. BF16 moments are widened,
// stepped in float32 as F32 ones are, and rounded back to nearest even; BF16 gradients are
// widened. On a GPU it is one launch of tr_adamw (tr_adamw_bf16 for BF16 moments, with
// _gbf16 for BF16 gradients), as many blocks as fit on the device at once (one a chunk
// after spread).
func (t *adamTable) step(s *device.Stream, h adamHyper, n int) error {
	if n < 1 {
		return fmt.Errorf("adamw: step %d, want ≥ 1", n)
	}
	a := adamArgs{
		LR: float32(h.LR), Beta1: float32(h.Beta1), Beta2: float32(h.Beta2), Eps: float32(h.Eps),
		Decay: float32(1 - h.LR*h.WeightDecay),
		C1:    float32(1 / (1 - math.Pow(h.Beta1, float64(n)))),
		C2:    float32(1 / (1 - math.Pow(h.Beta2, float64(n)))),
	}
	if s.Device().IsCUDA() {
		name := "tr_adamw"
		if t.moments == device.BF16 {
			name = "tr_adamw_bf16"
		}
		if t.grads == device.BF16 {
			name += "_gbf16"
		}
		if t.grid == 0 {
			k, err := s.Device().Kernel(program, name)
			if err != nil {
				return err
			}
			per, err := k.MaxActiveBlocksPerSM(threads, 0)
			if err != nil {
				return err
			}
			t.grid = int(max(min(t.chunks, int64(max(per, 1)*s.Device().Multiprocessors())), 1))
		}
		return launch(s, name, device.D1(t.grid), 0, t.tab, int32(len(t.ps)), t.chunks, a)
	}
	return s.EnqueueCPU(func() {
		for _, q := range t.ps {
			decay := float32(1)
			if q.decay {
				decay = a.Decay
			}
			pv := device.Slice[float32](q.p)
			var gv []float32
			var gh []uint16
			if t.grads == device.BF16 {
				gh = device.Slice[uint16](q.g)
			} else {
				gv = device.Slice[float32](q.g)
			}
			grad := func(i int) float32 { // a BF16 gradient widened exactly
				if gh != nil {
					return device.BF16ToFloat32(gh[i])
				}
				return gv[i]
			}
			var cv []uint16
			if q.c != nil {
				cv = device.Slice[uint16](q.c)
			}
			if t.moments == device.BF16 {
				mh, vh := device.Slice[uint16](q.m), device.Slice[uint16](q.v)
				par.For(len(pv), 1<<14, func(lo, hi int) {
					for i := lo; i < hi; i++ {
						var m, v float32
						pv[i], m, v = adamStep(pv[i], grad(i), device.BF16ToFloat32(mh[i]), device.BF16ToFloat32(vh[i]), decay, a)
						mh[i], vh[i] = device.BF16FromFloat32(m), device.BF16FromFloat32(v)
						if cv != nil {
							cv[i] = device.BF16FromFloat32(pv[i])
						}
					}
				})
				continue
			}
			mv, vv := device.Slice[float32](q.m), device.Slice[float32](q.v)
			par.For(len(pv), 1<<14, func(lo, hi int) {
				for i := lo; i < hi; i++ {
					pv[i], mv[i], vv[i] = adamStep(pv[i], grad(i), mv[i], vv[i], decay, a)
					if cv != nil {
						cv[i] = device.BF16FromFloat32(pv[i])
					}
				}
			})
		}
	})
}
