package gemm

import (
	"fmt"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/par"
)

// cpu runs the call on the CPU: f32 operands (bf16 converted exactly), one gonum
// Sgemm per group, groups in parallel. Sgemm splits its work over blocks of the output
// only, so results do not depend on the number of threads.
func (c *call) cpu(s *device.Stream) error {
	var (
		ferr     error
		enqueued bool
	)
	err := s.EnqueueCPU(func() {
		if err := c.cpuRun(); err != nil {
			if !enqueued {
				ferr = err
				return
			}
			// Replayed from a captured graph: nobody receives the error, record it.
			if se, ok := err.(*sizesError); ok {
				record(c.status, c.name(), se.code, se.g, se.value, int64(c.M))
			}
		}
	})
	enqueued = true
	if err != nil {
		return err
	}
	return ferr
}

// sizesError is an invalid sizes tensor met on the CPU.
type sizesError struct {
	op             form
	code, g, value int64
	m              int
}

func (e *sizesError) Error() string {
	return device.StatusError(sizesRecord(e.op, e.code, e.g, e.value, int64(e.m))).Error()
}

// offsets returns the group row offsets off[0..G] of sizes, or the error.
func (c *call) offsets() ([]int, error) {
	sz := device.Slice[int32](c.sizes)
	off := make([]int, len(sz)+1)
	for g, v := range sz {
		if v < 0 {
			return nil, &sizesError{op: c.name(), code: statusNegative, g: int64(g), value: int64(v), m: c.M}
		}
		off[g+1] = off[g] + int(v)
	}
	if off[len(sz)] > c.M {
		return nil, &sizesError{op: c.name(), code: statusOverflow, g: int64(len(sz)), value: int64(off[len(sz)]), m: c.M}
	}
	return off, nil
}

// f32s returns t's elements as float32: an alias of an F32 tensor, a converted copy
// of a BF16 one.
func f32s(t *device.Tensor) []float32 {
	if t.DType() == device.F32 {
		return device.Slice[float32](t)
	}
	src := t.HostBytes()
	dst := make([]float32, t.Len())
	par.For(len(dst), 1<<16, func(lo, hi int) {
		device.DecodeFloat32(t.DType(), dst[lo:hi], src[2*lo:2*hi])
	})
	return dst
}

// storeF32 writes v into the rows [lo, hi) of the row-major tensor t of row length n.
func storeF32(t *device.Tensor, v []float32, lo, hi, n int) {
	if t.DType() == device.F32 {
		copy(device.Slice[float32](t)[lo*n:hi*n], v)
		return
	}
	device.EncodeFloat32(t.DType(), t.HostBytes()[2*lo*n:2*hi*n], v)
}

func (c *call) cpuRun() error {
	off, err := c.offsets()
	if err != nil {
		return err
	}
	impl := blas32.Implementation()
	a, b := f32s(c.a), f32s(c.b)
	M, K, N, G := c.M, c.K, c.N, c.G
	switch c.f {
	case forward, inputGrad:
		// C[rows, outer] = A[rows, inner] · op(B_g), op(B_g) inner x outer.
		inner, outer := K, N
		tB := blas.NoTrans // forward KN: w_g is [K][N]
		if c.f == forward && c.layout == NK {
			tB = blas.Trans // w_g is [N][K]
		}
		if c.f == inputGrad {
			inner, outer = N, K
			tB = blas.Trans // dx = dy · w_gᵀ, w_g [K][N]
			if c.layout == NK {
				tB = blas.NoTrans // w_g [N][K] is already [inner][outer]
			}
		}
		ldb := outer
		if tB == blas.Trans {
			ldb = inner
		}
		par.Each(G, func(g int) {
			lo, hi := off[g], off[g+1]
			rows := hi - lo
			if rows == 0 || outer == 0 {
				return
			}
			out := make([]float32, rows*outer)
			if inner > 0 {
				impl.Sgemm(blas.NoTrans, tB, rows, outer, inner, 1,
					a[lo*inner:hi*inner], max(inner, 1),
					b[g*inner*outer:(g+1)*inner*outer], max(ldb, 1),
					0, out, outer)
			}
			storeF32(c.out, out, lo, hi, outer)
		})
		if sum := off[G]; sum < M && outer > 0 {
			storeF32(c.out, make([]float32, (M-sum)*outer), sum, M, outer)
		}
	case weightGrad:
		// KN: dw_g[K][N] = x_gᵀ · dy_g. NK: dw_g[N][K] = dy_gᵀ · x_g.
		x, dy := a, b
		rowsC, colsC := K, N
		left, right := x, dy
		if c.layout == NK {
			rowsC, colsC = N, K
			left, right = dy, x
		}
		per := rowsC * colsC
		par.Each(G, func(g int) {
			lo, hi := off[g], off[g+1]
			rows := hi - lo
			if per == 0 || (rows == 0 && c.accum) {
				return
			}
			out := make([]float32, per)
			beta := float32(0)
			if c.accum {
				copy(out, f32sRange(c.out, g*per, (g+1)*per))
				beta = 1
			}
			if rows > 0 {
				impl.Sgemm(blas.Trans, blas.NoTrans, rowsC, colsC, rows, 1,
					left[lo*rowsC:hi*rowsC], rowsC,
					right[lo*colsC:hi*colsC], colsC,
					beta, out, colsC)
			}
			storeF32(c.out, out, g*rowsC, (g+1)*rowsC, colsC)
		})
	default:
		return fmt.Errorf("gemm: unknown form %d", c.f)
	}
	return nil
}

// f32sRange returns elements [lo, hi) of t as float32.
func f32sRange(t *device.Tensor, lo, hi int) []float32 {
	if t.DType() == device.F32 {
		return device.Slice[float32](t)[lo:hi]
	}
	dst := make([]float32, hi-lo)
	device.DecodeFloat32(t.DType(), dst, t.HostBytes()[2*lo:2*hi])
	return dst
}
