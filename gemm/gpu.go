package gemm

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/gemm.cu
var gemmSrc string

// program holds the package's CUDA kernels: the plan kernel that reads the group sizes
// on the device, the bf16 tensor-core GEMMs (mma.sync) and the exact f32 GEMMs.
var program = device.NewProgram("gemm.cu", gemmSrc)

// Kernel constants shared with kernels/gemm.cu.
const (
	planOff  = 4    // DL_PLAN_OFF
	schedMax = 4096 // DL_SCHED_MAX
	mmaBK    = 64
	fmaTile  = 64 // FMA_BM, FMA_BN
	f32Out   = 1  // DL_F32_OUT
	accumOut = 2  // DL_ACCUMULATE
)

// tileConfig is one compiled tile shape of the bf16 kernels.
type tileConfig struct {
	name    string // "big" or "small"
	bm, bn  int
	threads int
	stages  int
}

var (
	bigTiles   = tileConfig{name: "big", bm: 128, bn: 256, threads: 256, stages: 4}
	smallTiles = tileConfig{name: "small", bm: 32, bn: 128, threads: 128, stages: 4}
)

func (t tileConfig) ring() int { return t.stages * (t.bm + t.bn) * mmaBK * 2 }

// kernelInfo caches per-kernel launch facts.
type kernelInfo struct {
	once sync.Once
	occ  int
	err  error
}

var kinfo sync.Map // *device.Kernel → *kernelInfo

// occupancy returns how many blocks of the given size and maxSmem bytes of dynamic
// shared memory fit on one SM, asking the driver once per kernel.
func occupancy(k *device.Kernel, threads, maxSmem int) (int, error) {
	v, _ := kinfo.LoadOrStore(k, &kernelInfo{})
	ki := v.(*kernelInfo)
	ki.once.Do(func() {
		ki.occ, ki.err = k.MaxActiveBlocksPerSM(threads, maxSmem)
		if ki.err == nil && ki.occ < 1 {
			ki.err = fmt.Errorf("gemm: kernel does not fit on an SM with %d threads and %d bytes of shared memory", threads, maxSmem)
		}
	})
	return ki.occ, ki.err
}

// gemmArgs mirrors struct GemmArgs of kernels/gemm.cu field for field (16 fields of 8
// bytes): the by-value argument of the GEMM kernels, passed to Kernel.Launch as is.
type gemmArgs struct {
	A, B, C, Plan    *device.Tensor // const void *a, *b; void *c; const int *plan
	M, N, K          int64
	Lda, Ldb, Ldc    int64
	StrideB, StrideC int64
	G, Flags         int64
	TilesM, TilesN   int64
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// plan enqueues the plan kernel on s, which checks the sizes into the call's status and
// writes the plan (see kernels/gemm.cu; tile prefixes of bm-row tiles, nt column tiles
// each, when bm > 0) into the returned workspace: the plan's words, then one element of
// scratch for the Hopper kernels. The caller frees it.
func (c *call) plan(s *device.Stream, bm, nt int) (*device.Tensor, error) {
	plan, err := s.Device().Kernel(program, "dl_gemm_plan")
	if err != nil {
		return nil, err
	}
	ws, err := s.Alloc(device.I32, planOff+2+2*(c.G+1)+1)
	if err != nil {
		return nil, fmt.Errorf("gemm: %v: workspace: %w", c.name(), err)
	}
	planThreads := 256
	if c.G > 256 {
		planThreads = 1024
	}
	if err := plan.Launch(s, device.D1(1), device.D1(planThreads), 0,
		c.sizes, int32(c.G), int64(c.M), int32(bm), int32(nt), ws, c.status, int32(c.name())); err != nil {
		ws.Free()
		return nil, fmt.Errorf("gemm: %v: %w", c.name(), err)
	}
	return ws, nil
}

// needSM80 returns the error of op unless d has compute capability 8.0 or newer, which
// the kernels need.
func needSM80(d *device.Device, op form) error {
	if cc := d.ComputeCapability(); cc < 80 {
		return fmt.Errorf("gemm: %v: %v has compute capability %d.%d: the kernels need 8.0 or newer", op, d, cc/10, cc%10)
	}
	return nil
}

// gpu enqueues the call on s: the plan kernel, then the GEMM kernel.
func (c *call) gpu(s *device.Stream) error {
	d := s.Device()
	if err := needSM80(d, c.f); err != nil {
		return err
	}
	M, K, N, G := c.M, c.K, c.N, c.G
	p := gemmArgs{A: c.a, B: c.b, C: c.out, G: int64(G)}
	if c.out.DType() == device.F32 {
		p.Flags |= f32Out
	}
	if c.accum {
		p.Flags |= accumOut
	}
	bt := false // B stored [contraction][n] (else [n][contraction])
	switch c.f {
	case forward: // y = x · w_g
		p.M, p.N, p.K = int64(M), int64(N), int64(K)
		bt = c.layout == KN
		p.Lda, p.Ldc, p.StrideB = int64(K), int64(N), int64(K)*int64(N)
	case inputGrad: // dx = dy · w_gᵀ
		p.M, p.N, p.K = int64(M), int64(K), int64(N)
		bt = c.layout == NK
		p.Lda, p.Ldc, p.StrideB = int64(N), int64(K), int64(K)*int64(N)
	case weightGrad: // dw_g = x_gᵀ · dy_g (KN) or dy_gᵀ · x_g (NK)
		bt = true
		p.M, p.N, p.K = int64(K), int64(N), int64(M)
		if c.layout == NK {
			p.M, p.N = int64(N), int64(K)
			p.A, p.B = c.b, c.a
		}
		p.Lda, p.Ldb, p.Ldc, p.StrideC = p.M, p.N, p.N, int64(K)*int64(N)
	}
	if c.f != weightGrad {
		p.Ldb = p.K // [n][k]
		if bt {
			p.Ldb = p.N // [k][n]
		}
	}
	raggedK := c.f == weightGrad
	bf16 := c.a.DType() == device.BF16
	vec := bf16 && K%8 == 0 && N%8 == 0 && device.Aligned(16, p.A, p.B, p.C)

	// Pick the kernel and its tile shape.
	var (
		name          string
		bm, bn, thr   int
		ring, maxSmem int
	)
	switch {
	case !bf16:
		bm, bn, thr = fmaTile, fmaTile, 256
		switch {
		case raggedK:
			name = "dl_fma_k"
		case bt:
			name = "dl_fma_m_kn"
		default:
			name = "dl_fma_m_nk"
		}
	case raggedK:
		tc := bigTiles
		if d.MaxSharedMemory() < tc.ring() {
			return fmt.Errorf("gemm: %v: the weight-gradient kernel needs %d bytes of shared memory per block, %v allows %d", c.f, tc.ring(), d, d.MaxSharedMemory())
		}
		bm, bn, thr, ring = tc.bm, tc.bn, tc.threads, tc.ring()
		maxSmem = ring
		name = "dl_mma_k_big_any"
		if vec {
			name = "dl_mma_k_big_vec"
		}
	default:
		tc := smallTiles
		if vec && M >= 96*max(G, 1) && d.MaxSharedMemory() >= bigTiles.ring()+4*schedMax {
			tc = bigTiles
		}
		if need := tc.ring() + 4*schedMax; d.MaxSharedMemory() < need {
			return fmt.Errorf("gemm: %v: the kernel needs %d bytes of shared memory per block, %v allows %d", c.f, need, d, d.MaxSharedMemory())
		}
		bm, bn, thr, ring = tc.bm, tc.bn, tc.threads, tc.ring()
		maxSmem = ring + 4*schedMax
		lay := "nk"
		if bt {
			lay = "kn"
		}
		v := "any"
		if vec {
			v = "vec"
		}
		name = "dl_mma_m_" + tc.name + "_" + lay + "_" + v
	}
	p.TilesN = int64(ceilDiv(int(p.N), bn))
	var bound int64 // upper bound on the tiles of the call
	if raggedK {
		p.TilesM = int64(ceilDiv(int(p.M), bm))
		bound = int64(G) * p.TilesM * p.TilesN
	} else {
		bound = (2*int64(ceilDiv(M, bm)) + int64(G)) * p.TilesN
	}
	if bound >= 1<<30 {
		return fmt.Errorf("gemm: %v: M=%d, K=%d, N=%d, G=%d make %d tiles: at most 2^30", c.f, M, K, N, G, bound)
	}

	planBM, planNT := 0, 0
	if !raggedK {
		planBM, planNT = bm, int(p.TilesN)
	}
	ws, err := c.plan(s, planBM, planNT)
	if err != nil {
		return err
	}
	defer ws.Free()
	p.Plan = ws
	wsPlan := planOff + 2 + 2*(G+1)
	if bound == 0 || c.out.Len() == 0 {
		return nil // nothing to write; the plan still checked the sizes
	}
	if hop := c.hopperOK(d); hop || c.padOK(d) {
		counter, err := ws.View(wsPlan, 1)
		if err != nil {
			return err
		}
		ran := true
		if hop {
			err = c.hopper(s, counter)
		} else {
			ran, err = c.padded(s, counter) // false: out of memory for the copies
		}
		if err != nil {
			return fmt.Errorf("gemm: %v: %w", c.f, err)
		}
		if ran {
			return nil
		}
	}

	k, err := d.Kernel(program, name)
	if err != nil {
		return err
	}
	occ, err := occupancy(k, thr, maxSmem)
	if err != nil {
		return fmt.Errorf("gemm: %v: %s: %w", c.f, name, err)
	}
	smem := ring
	if !raggedK && bf16 && G+1 <= schedMax {
		smem += 4 * (G + 1)
	}
	grid := int64(s.Multiprocessors() * occ)
	if grid > bound {
		grid = bound
	}
	if err := k.Launch(s, device.D1(int(grid)), device.D1(thr), smem, p); err != nil {
		return fmt.Errorf("gemm: %v: %w", c.f, err)
	}
	return nil
}
