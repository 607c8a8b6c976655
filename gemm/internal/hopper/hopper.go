// Package hopper holds the Hopper (sm_90a) tensor-core kernels of package gemm: a grouped
// GEMM on wgmma and the tensor memory accelerator, used by gemm when the GPU and NVRTC
// support it.
package hopper

import (
	_ "embed"
	"fmt"
	"os"
	"strconv"
	"sync"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/cuda"
)

//go:embed kernels/grouped.cu
var groupedSrc string

// grouped is the program of the grouped GEMM kernels.
var grouped = device.NewProgram("hopper_grouped.cu", groupedSrc)

const (
	bm, bn, bk = 128, 256, 64
	// The larger of the 4-stage kernels and the 3-stage weight gradient with its 64 KB
	// staging area, plus barriers, group tables and alignment slack.
	smemBytes = 3*(bm*bk*2+bn*bk*2) + 65536 + 2*4*8 + 2*(maxG+1)*4 + 1024
	maxG      = 1024
	// lightRows is the forward kernels' schedule threshold: the tiles of groups of fewer
	// rows (one row tile) are spread evenly among those of longer groups, see the kernels'
	// source. The forward's three group tables stay within smemBytes.
	lightRows = bm + 1
)

// epilogue picks how the forward kernels (bf16 and blockwise FP8) and the blockwise FP8
// weight gradient store bf16 output: "" (the default) through shared memory where they
// can (hb_store_staged in the kernels), "direct" from the accumulator layout
// (DROPLESS_GEMM_EPILOGUE), for comparisons.
var epilogue = os.Getenv("DROPLESS_GEMM_EPILOGUE")

// bandRows is the height in rows of the forward kernels' bands of row tiles (hb_place in
// the kernels' source), within which each group's row tiles are walked innermost: 2,048
// by default, DROPLESS_GEMM_BAND=n for n rows, 0 for none (each group one band), for
// comparisons.
var bandRows = envInt("DROPLESS_GEMM_BAND", 2048)

// claimRounds is how many of the bf16 forward kernels' last rounds of tiles the CTAs
// claim from the call's counter instead of taking them dealt round-robin (see the
// kernels' tile schedule): by default (-1) every round on a skewed routing and the last
// three otherwise, chosen on the device; DROPLESS_GEMM_CLAIM=n claims n rounds, for
// comparisons.
var claimRounds = envInt("DROPLESS_GEMM_CLAIM", -1)

// splitTiles lets the bf16 forward kernels split the tiles of a last, part-filled round
// along the contraction (see the kernels' source); DROPLESS_GEMM_SPLIT=0 turns it off,
// for comparisons.
var splitTiles = envInt("DROPLESS_GEMM_SPLIT", 1) != 0

// l2Hint is the bf16 forward kernels' L2 cache hint for their TMA loads (bits 0-1 for
// A, 2-3 for B: 1 evict first, 2 evict last, 0 neither): by default (-1) chosen by
// l2Policy; DROPLESS_GEMM_L2=n sets n, for comparisons (0: no hints).
var l2Hint = envInt("DROPLESS_GEMM_L2", -1)

// l2Policy returns the L2 hint of a forward call of N output columns. Where a group has
// many column tiles (N ≥ 8192: 32 or more of 256), each band of its A rows is read again
// for every round of its column tiles, while a k-block of a weight tile serves only the
// CTAs of one round: A's loads are marked evict last and B's evict first (6), which
// measured +3–4% on mixtral's forward (N = 28,672) and within the runs' spread on the
// others (docs/perf.md). Elsewhere no hint: with short groups (qwen3 skewed) the same
// hints cost 1–4%.
func l2Policy(N int) int32 {
	switch {
	case l2Hint >= 0:
		return int32(l2Hint)
	case (N+255)/256 >= 32:
		return 2 | 1<<2
	}
	return 0
}

// envInt returns the integer value of the environment variable name, or def when it is
// unset or not an integer.
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// bandTiles returns the kernels' band argument for tiles of rows rows: bandRows in row
// tiles, at least one, or 0 for none.
func bandTiles(rows int) int32 {
	if bandRows <= 0 {
		return 0
	}
	return int32(ceilDiv(bandRows, rows))
}

// stagedOK reports whether the staged epilogue may store bf16 output into out: out is
// 16-byte aligned (it stores 16-byte chunks of rows) and epilogue does not ask for the
// direct stores.
func stagedOK(out *device.Tensor) bool { return out.Ptr()%16 == 0 && epilogue != "direct" }

var support sync.Map // *device.Device → error

// Supported returns nil when d can run the Hopper kernels: an sm_90 GPU with the shared
// memory they need, NVRTC able to target sm_90a and a driver with tensor maps.
func Supported(d *device.Device) error {
	if v, ok := support.Load(d); ok {
		if v == nil {
			return nil
		}
		return v.(error)
	}
	err := supported(d)
	if err == nil {
		support.Store(d, nil)
	} else {
		support.Store(d, err)
	}
	return err
}

// target returns nil when d is an sm_90 GPU with the shared memory the kernels need
// and NVRTC targets sm_90a: what Supported checks before compiling the kernels.
func target(d *device.Device) error {
	if !d.IsCUDA() || d.ComputeCapability() != 90 {
		return fmt.Errorf("hopper: %v is not an sm_90 GPU", d)
	}
	t, err := device.Target(90)
	if err != nil {
		return err
	}
	if t != "sm_90a" {
		return fmt.Errorf("hopper: NVRTC targets %s, not sm_90a", t)
	}
	if d.MaxSharedMemory() < smemBytes {
		return fmt.Errorf("hopper: the kernels need %d bytes of shared memory per block, %v allows %d", smemBytes, d, d.MaxSharedMemory())
	}
	return nil
}

func supported(d *device.Device) error {
	if err := target(d); err != nil {
		return err
	}
	for _, name := range []string{"dl_hopper_kmaj_bf16", "dl_hopper_kmaj_bf16_direct", "dl_hopper_kmaj_f32",
		"dl_hopper_mnmaj_bf16", "dl_hopper_mnmaj_bf16_direct", "dl_hopper_mnmaj_f32", "dl_hopper_wgrad_bf16", "dl_hopper_wgrad_f32", "dl_hopper_wgrad_bf16_acc", "dl_hopper_wgrad_f32_acc"} {
		if _, err := d.Kernel(grouped, name); err != nil {
			return err
		}
	}
	return nil
}

// GroupedGEMM computes y[M,N] = a[M,Kc]·B_g for the rows of each group g, where sizes
// (I32[G] on the device) gives the groups' row counts in order. a and b are BF16; y is
// BF16 or F32. b holds G matrices: when bMN is false, b is [G,N,Kc] (each B_gᵀ stored
// row-major, contraction contiguous); when true, b is [G,Kc,N]. Rows past sum(sizes)
// are zeroed. Kc and N must be multiples of 8 (16-byte rows for the tensor maps) and
// G at most 1024. Invalid sizes write nothing and record the first bad group g in st
// as a record of package gemm (its domain, op its call's form): code 1 with (g,
// sizes[g], M) for a negative size, code 2 with (g, sizes[0]+…+sizes[g], M) for sizes
// summing past M. st may be nil: then invalid sizes only write nothing. counter (I32, at
// least one element) is scratch for the tile schedule, overwritten; nil allocates one in
// stream order for the call. Calls that may run at once need distinct counters. Two
// launches on s; nothing is copied to the host.
func GroupedGEMM(s *device.Stream, y, a, b, sizes *device.Tensor, st *device.Status, op int, counter *device.Tensor, bMN bool) error {
	d := s.Device()
	if err := Supported(d); err != nil {
		return err
	}
	M, Kc := a.Dim(0), a.Dim(1)
	G, N := sizes.Len(), y.Dim(1)
	if Kc%8 != 0 || N%8 != 0 || G > maxG || G < 1 {
		return fmt.Errorf("hopper: GroupedGEMM needs Kc, N multiples of 8 and 1 ≤ G ≤ %d (Kc=%d N=%d G=%d)", maxG, Kc, N, G)
	}
	if counter != nil && (counter.DType() != device.I32 || counter.Len() < 1 || counter.Device() != d) {
		return fmt.Errorf("hopper: GroupedGEMM: counter is %v, want I32 with at least one element on %v", counter, d)
	}
	tmA, err := tensorMap(d, cuda.DevicePtr(a.Ptr()),
		[]uint64{uint64(Kc), uint64(M)}, []uint64{uint64(Kc) * 2}, []uint32{bk, bm}, cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	var tmB []byte
	if bMN {
		tmB, err = tensorMap(d, cuda.DevicePtr(b.Ptr()),
			[]uint64{uint64(N), uint64(Kc), uint64(G)}, []uint64{uint64(N) * 2, uint64(N) * uint64(Kc) * 2},
			[]uint32{64, bk, 1}, cuda.TensorMapSwizzle128B)
	} else {
		tmB, err = tensorMap(d, cuda.DevicePtr(b.Ptr()),
			[]uint64{uint64(Kc), uint64(N), uint64(G)}, []uint64{uint64(Kc) * 2, uint64(N) * uint64(Kc) * 2},
			[]uint32{bk, bn, 1}, cuda.TensorMapSwizzle128B)
	}
	if err != nil {
		return err
	}
	name := "dl_hopper_kmaj_"
	if bMN {
		name = "dl_hopper_mnmaj_"
	}
	f32 := y.DType() == device.F32
	switch {
	case f32:
		name += "f32"
	case stagedOK(y):
		name += "bf16"
	default:
		name += "bf16_direct"
	}
	k, err := d.Kernel(grouped, name)
	if err != nil {
		return err
	}
	z, err := d.Kernel(grouped, "dl_hopper_zero_tail")
	if err != nil {
		return err
	}
	// The tile counter of the schedule's last rounds, zeroed by the tail kernel that runs
	// first.
	if counter == nil {
		if counter, err = s.Alloc(device.I32, 1); err != nil {
			return err
		}
		defer counter.Free()
	}
	P := s.Multiprocessors()
	part, cnt := splitWorkspace(s, P, Kc)
	if part != nil {
		defer part.Free()
		defer cnt.Free()
	}
	if err := z.Launch(s, device.D1(d.Multiprocessors()), device.D1(256), 0, y, sizes, int32(G), int32(M), int32(N), f32, counter,
		cnt, int32(P)); err != nil {
		return err
	}
	return k.Launch(s, device.D1(P), device.D1(384), smemBytes, tmA, tmB, y, sizes,
		int32(G), int32(M), int32(N), int32(Kc), st, int32(op), int32(lightRows), bandTiles(bm), int32(claimRounds), counter, part, cnt, l2Policy(N))
}

// splitWorkspace returns, allocated in s's order, the workspace of the bf16 forward
// kernels' split tiles on P CTAs (see the kernels' source): the partial sums part
// (P·128·256 F32, 16.5 MiB on 132 SMs) and the counters cnt (P I32, zeroed by the tail
// kernel). It returns two nils, and the call runs unsplit, where splitting is off, the
// contraction of Kc has fewer than 8 k-blocks or the memory is not there.
func splitWorkspace(s *device.Stream, P, Kc int) (part, cnt *device.Tensor) {
	if !splitTiles || ceilDiv(Kc, bk) < 8 {
		return nil, nil
	}
	part, err := s.Alloc(device.F32, P*bm*bn)
	if err != nil {
		return nil, nil
	}
	if cnt, err = s.Alloc(device.I32, P); err != nil {
		part.Free()
		return nil, nil
	}
	return part, cnt
}

// WeightGrad computes dw[g] = x_gᵀ·dy_g (dw [G,K,N]) for the row groups of x [M,K] and
// dy [M,N] given by sizes (I32[G] on the device), adding to dw when acc is set. x and dy
// are BF16; dw is BF16 or F32. An empty group's dw is exactly zero (left as is with acc).
// K and N must be multiples of 8 and G at most 1024. Invalid sizes write nothing and are
// recorded in st (if not nil) as for GroupedGEMM. One launch on s, a persistent grid of
// s.Multiprocessors() blocks; nothing is copied to the host.
func WeightGrad(s *device.Stream, dw, x, dy, sizes *device.Tensor, st *device.Status, op int, acc bool) error {
	d := s.Device()
	if err := Supported(d); err != nil {
		return err
	}
	M, K, N, G := x.Dim(0), x.Dim(1), dy.Dim(1), sizes.Len()
	if K%8 != 0 || N%8 != 0 || G > maxG || G < 1 {
		return fmt.Errorf("hopper: WeightGrad needs K, N multiples of 8 and 1 ≤ G ≤ %d (K=%d N=%d G=%d)", maxG, K, N, G)
	}
	tmX, err := tensorMap(d, cuda.DevicePtr(x.Ptr()),
		[]uint64{uint64(K), uint64(M)}, []uint64{uint64(K) * 2}, []uint32{64, bk}, cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	tmDY, err := tensorMap(d, cuda.DevicePtr(dy.Ptr()),
		[]uint64{uint64(N), uint64(M)}, []uint64{uint64(N) * 2}, []uint32{64, bk}, cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	tmDW, err := tensorMap(d, cuda.DevicePtr(dw.Ptr()),
		[]uint64{uint64(N), uint64(K), uint64(G)}, []uint64{uint64(N) * 2, uint64(N) * uint64(K) * 2}, []uint32{64, 64, 1},
		cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	name := "dl_hopper_wgrad_bf16"
	if dw.DType() == device.F32 {
		name = "dl_hopper_wgrad_f32"
	}
	if acc {
		name += "_acc"
	}
	k, err := d.Kernel(grouped, name)
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(s.Multiprocessors()), device.D1(384), smemBytes, tmX, tmDY, tmDW, dw, sizes,
		int32(G), int32(M), int32(K), int32(N), st, int32(op))
}

// tensorMap encodes a tiled bf16 tensor map with d's context current on the calling
// thread, which the driver requires.
func tensorMap(d *device.Device, addr cuda.DevicePtr, dims, strides []uint64, box []uint32, swizzle int) ([]byte, error) {
	return tensorMapOf(d, cuda.TensorMapBFloat16, addr, dims, strides, box, swizzle)
}
