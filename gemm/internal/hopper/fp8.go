package hopper

import (
	_ "embed"
	"fmt"
	"os"
	"sync"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/cuda"
)

//go:embed kernels/fp8.cu
var fp8Src string

// fp8 is the program of the blockwise FP8 kernels. It includes the bf16 kernels' source
// for their helpers (barriers, TMA, descriptors, the group scan and tile schedule, the
// tail kernel).
var fp8 = device.NewProgram("hopper_fp8.cu", fp8Src).WithHeaders(device.Header{Name: "hopper_grouped.cuh", Source: groupedSrc})

const (
	fp8Block  = 128 // tile rows, columns and stage depth: one scale block
	fp8Stages = 6   // HF_STAGES
	fp8MXT    = 640 // HF_MXT: floats of one table of decoded MXFP8 column scales
	// fp8Smem is HF_SMEM of kernels/fp8.cu: the stages (A and B tiles, 128 A and 128 B
	// scales each), the MXFP8 consumers' four tables of decoded scales, the stages'
	// barriers, the four group tables and alignment slack.
	fp8Smem = fp8Stages*(2*fp8Block*fp8Block+2*fp8Block*4) + 4*fp8MXT*4 + 2*fp8Stages*8 + 4*(maxG+1)*4 + 1024

	fp8Rows3   = 192 // tile rows of the _m192 kernels: three consumer warpgroups
	fp8Stages3 = 5   // HF_STAGES3
	// fp8Smem3 is HF_SMEM3, the _m192 kernels' shared memory: their stages (192-row A
	// tiles, 128-row B tiles and their scales), barriers, group tables and slack.
	fp8Smem3 = fp8Stages3*((fp8Rows3+fp8Block)*fp8Block+(fp8Rows3+fp8Block)*4) + 2*fp8Stages3*8 + 4*(maxG+1)*4 + 1024
)

var fp8Support sync.Map // *device.Device → error

// fp8Single keeps the FP8 kernels to one CTA per cluster (no multicast): the default, as the
// two-CTA kernels measured no faster on the H200 (docs/perf.md); DROPLESS_FP8_CLUSTER=2 selects
// them, for comparisons.
var fp8Single = os.Getenv("DROPLESS_FP8_CLUSTER") != "2"

// fp8Rows picks the tile rows of the blockwise forward, input gradient and weight
// gradient: 0 (the default) chooses by shape (fp8TallWins), 128 or 192
// (DROPLESS_FP8_ROWS) forces the 128-row kernels or the _m192 kernels (three consumer
// warpgroups: docs/perf.md, the sixth round), for comparisons. The MXFP8 kernels and the
// two-CTA kernels have 128-row tiles.
var fp8Rows = envInt("DROPLESS_FP8_ROWS", 0)

// fp8TallWins reports whether tiles of 192 rows serve groups of about m rows better than
// tiles of 128: their higher rate on long groups (about 8% on the forward at 2,048 rows a
// group and more, docs/perf.md) against the rows they waste in each group's last tile.
func fp8TallWins(m int) bool {
	return m > 0 && float64(fp8Rows3*ceilDiv(m, fp8Rows3)) < 1.08*float64(fp8Block*ceilDiv(m, fp8Block))
}

// fp8Tall reports whether a blockwise call of groups of about m rows runs the _m192
// kernels (see fp8Rows).
func fp8Tall(m int) bool {
	switch fp8Rows {
	case fp8Block:
		return false
	case fp8Rows3:
		return true
	}
	return fp8TallWins(m)
}

// fp8Grids caches, per device and kernel, the persistent grid of the two-CTA kernels: twice
// the clusters that fit on the device at once (0: the kernel cannot run in clusters).
var fp8Grids sync.Map // fp8GridKey → int

type fp8GridKey struct {
	d    *device.Device
	name string
}

// BlockwiseSupported returns nil when d can run the blockwise FP8 kernels: when Supported
// says d runs the Hopper kernels, the FP8 kernels fit its shared memory and compile.
func BlockwiseSupported(d *device.Device) error {
	if v, ok := fp8Support.Load(d); ok {
		if v == nil {
			return nil
		}
		return v.(error)
	}
	err := blockwiseSupported(d)
	if err == nil {
		fp8Support.Store(d, nil)
	} else {
		fp8Support.Store(d, err)
	}
	return err
}

func blockwiseSupported(d *device.Device) error {
	if err := Supported(d); err != nil {
		return err
	}
	if need := max(fp8Smem, fp8Smem3); d.MaxSharedMemory() < need {
		return fmt.Errorf("hopper: the FP8 kernels need %d bytes of shared memory per block, %v allows %d", need, d, d.MaxSharedMemory())
	}
	names := []string{"dl_hopper_zero_tail"}
	for _, a := range []string{"e4m3", "e5m2"} {
		for _, b := range []string{"e4m3", "e5m2"} {
			for _, p := range []string{"dl_hopper_fp8_", "dl_hopper_fp8_x2_", "dl_hopper_fp8_m192_", "dl_hopper_fp8_x2_m192_",
				"dl_hopper_fp8_wgrad_", "dl_hopper_fp8_wgrad_x2_", "dl_hopper_fp8_wgrad_m192_", "dl_hopper_fp8_wgrad_x2_m192_", "dl_hopper_mx_", "dl_hopper_mx_x2_", "dl_hopper_mx_wgrad_",
				"dl_hopper_mx_wgrad_x2_"} {
				names = append(names, p+a+"_"+b)
			}
		}
	}
	for _, name := range names {
		if _, err := d.Kernel(fp8, name); err != nil {
			return err
		}
	}
	return nil
}

// FP8 is an operand of the blockwise kernels: Q holds its E4M3 or E5M2 elements, Scale the
// F32 scales of their 128-element blocks along the contraction (shapes per function).
type FP8 struct {
	Q, Scale *device.Tensor
}

// fp8Name returns "e4m3" or "e5m2" for t's dtype.
func fp8Name(what string, t *device.Tensor) (string, error) {
	switch t.DType() {
	case device.E4M3:
		return "e4m3", nil
	case device.E5M2:
		return "e5m2", nil
	}
	return "", fmt.Errorf("hopper: %s is %v, want e4m3 or e5m2", what, t)
}

// fp8Launch is a kernel of the FP8 family chosen for a call: the two-CTA (multicast) form
// when it runs on the device, else the one-CTA form (of 192-row tiles where it has one),
// with its persistent grid, threads and shared memory per CTA, the CTAs of a cluster and
// the rows of the A box each CTA loads.
type fp8Launch struct {
	k             *device.Kernel
	grid, cl      int
	threads, smem int
	aRows         uint32
}

// gridOn returns the persistent grid of k on s: k.grid, at most s.Multiprocessors()
// blocks, an even count of at least 2 for the two-CTA kernels.
func (k fp8Launch) gridOn(s *device.Stream) int {
	n := min(k.grid, s.Multiprocessors())
	if k.cl == 2 {
		n = max(n&^1, 2)
	}
	return n
}

// rows returns the tile rows of k: its CTAs' A rows times the cluster's CTAs.
func (k fp8Launch) rows() int { return int(k.aRows) * k.cl }

// fp8Kernel returns the kernel prefix+"_"+A's type+"_"+B's type for d, or its _x2 form, or
// with tall (the families that have them) its _m192 form.
func fp8Kernel(d *device.Device, prefix string, tall bool, a, b *device.Tensor) (fp8Launch, error) {
	an, err := fp8Name("A", a)
	if err != nil {
		return fp8Launch{}, err
	}
	bn, err := fp8Name("B", b)
	if err != nil {
		return fp8Launch{}, err
	}
	form, threads, smem, rows := "_", 384, fp8Smem, fp8Block
	if tall {
		form, threads, smem, rows = "_m192_", 512, fp8Smem3, fp8Rows3
	}
	if !fp8Single {
		name := prefix + "_x2" + form + an + "_" + bn
		if k, err := d.Kernel(fp8, name); err == nil {
			if g := fp8Grid(d, k, name, threads, smem); g > 0 {
				return fp8Launch{k: k, grid: g, cl: 2, threads: threads, smem: smem, aRows: uint32(rows / 2)}, nil
			}
		}
	}
	k, err := d.Kernel(fp8, prefix+form+an+"_"+bn)
	return fp8Launch{k: k, grid: d.Multiprocessors(), cl: 1, threads: threads, smem: smem, aRows: uint32(rows)}, err
}

// fp8Grid returns the persistent grid of the two-CTA kernel k: twice the clusters that fit
// on d at once, at most d's multiprocessors; 0 when none fit or the driver cannot say.
func fp8Grid(d *device.Device, k *device.Kernel, name string, threads, smem int) int {
	key := fp8GridKey{d, name}
	if v, ok := fp8Grids.Load(key); ok {
		return v.(int)
	}
	n, err := k.MaxActiveClusters(2, threads, smem)
	g := 0
	if err == nil {
		g = 2 * min(n, d.Multiprocessors()/2)
	}
	fp8Grids.Store(key, g)
	return g
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// BlockwiseGEMM computes y[M,N] = Σ_b (A_b·B_g,bᵀ)·sA·sB for the rows of each group g
// (sizes, I32[G] on the device, gives the groups' row counts in order), the sum running
// over the 128-element blocks b of the contraction Kc, in f32:
//   - a.Q is E4M3 or E5M2 [M, Kc]; a.Scale is F32 [ceil(Kc/128), Mr], Mr ≥ M a multiple
//     of 4, the scale of row m's block b at (b, m);
//   - b.Q is E4M3 or E5M2 [G, N, Kc] (contraction contiguous); b.Scale is F32
//     [G, ceil(Kc/128), ceil(N/128)] with the scale of the 128×128 block (b, n/128) at
//     (g, b, n/128), or, when bNK is set, F32 [G, ceil(N/128), ceil(Kc/128)] with it at
//     (g, n/128, b).
//
// y is BF16 or F32; rows past sum(sizes) are zeroed. M ≥ 1, Kc and N positive multiples of
// 16, 1 ≤ G ≤ 1024, tensors 16-byte aligned. Invalid sizes write nothing and are recorded
// in st (if not nil) as for GroupedGEMM. Two launches on s; nothing is copied to the host.
func BlockwiseGEMM(s *device.Stream, y *device.Tensor, a, b FP8, sizes *device.Tensor, st *device.Status, op int, bNK bool) error {
	d := s.Device()
	if err := BlockwiseSupported(d); err != nil {
		return err
	}
	M, Kc, G, N, err := fp8FwdShape("BlockwiseGEMM", y, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	skc, sn := ceilDiv(Kc, fp8Block), ceilDiv(N, fp8Block)
	Mr := a.Scale.Dim(1)
	bs := []int{G, skc, sn}
	ks, ns := int64(sn), int64(1)
	if bNK {
		bs = []int{G, sn, skc}
		ks, ns = 1, int64(skc)
	}
	switch {
	case !a.Scale.HasShape(device.F32, skc, -1) || Mr < M || Mr%4 != 0:
		return fmt.Errorf("hopper: BlockwiseGEMM: A's scales are %v, want f32[%d Mr], Mr ≥ %d a multiple of 4", a.Scale, skc, M)
	case !b.Scale.HasShape(device.F32, bs...):
		return fmt.Errorf("hopper: BlockwiseGEMM: B's scales are %v, want %s", b.Scale, device.ShapeString(device.F32, bs...))
	}
	k, tmA, tmB, err := fp8Forward(s, "dl_hopper_fp8", fp8Tall(M/G), y, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	return k.k.Launch(s, device.D1(k.gridOn(s)), device.D1(k.threads), k.smem, tmA, tmB, a.Scale, int32(Mr), y, b.Scale, sizes,
		int32(G), int32(M), int32(N), int32(Kc), ks, ns, int64(skc)*int64(sn), st, int32(op), int32(lightRows), bandTiles(k.rows()), fp8Out(k, y, false))
}

// BlockwiseWeightGrad computes dw[g] = Σ_t (A_g,t·B_g,tᵀ)·sA·sB (dw [G,R,C]) for each group
// g, contracting over its tokens, which are the 128-token blocks t in [P_g, P_g +
// ceil(M_g/128)), P_g = Σ_{h<g} ceil(M_h/128), of the operands' columns (sizes, I32[G] on
// the device, gives the M_g; their sum is at most M):
//   - a.Q is E4M3 or E5M2 [R, Mp], Mp a positive multiple of 128; a.Scale is F32
//     [Mp/128, R], the scale of row i's block t at (t, i);
//   - b.Q is E4M3 or E5M2 [C, Mp]; b.Scale is F32 [Mp/128, C].
//
// Padding tokens (past M_g in the group's last block) must be zeros. dw is BF16 or F32; an
// empty group's dw is exactly zero (left as it is with acc, which adds to dw). R and C
// positive multiples of 16, 1 ≤ G ≤ 1024, tensors 16-byte aligned. Invalid sizes write
// nothing and are recorded in st (if not nil) as for GroupedGEMM. One launch on s; nothing
// is copied to the host.
func BlockwiseWeightGrad(s *device.Stream, dw *device.Tensor, a, b FP8, M int, sizes *device.Tensor, st *device.Status, op int, acc bool) error {
	d := s.Device()
	if err := BlockwiseSupported(d); err != nil {
		return err
	}
	G, R, C, Mp, err := fp8WGradShape("BlockwiseWeightGrad", dw, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	nt := Mp / fp8Block
	switch {
	case !a.Scale.HasShape(device.F32, nt, R):
		return fmt.Errorf("hopper: BlockwiseWeightGrad: A's scales are %v, want f32[%d %d]", a.Scale, nt, R)
	case !b.Scale.HasShape(device.F32, nt, C):
		return fmt.Errorf("hopper: BlockwiseWeightGrad: B's scales are %v, want f32[%d %d]", b.Scale, nt, C)
	}
	k, err := fp8Kernel(d, "dl_hopper_fp8_wgrad", fp8Tall(R), a.Q, b.Q)
	if err != nil {
		return err
	}
	maps, err := fp8TokenMaps(d, k, a.Q, b.Q)
	if err != nil {
		return err
	}
	return k.k.Launch(s, device.D1(k.gridOn(s)), device.D1(k.threads), k.smem, maps[0], maps[1], a.Scale, b.Scale, dw, sizes,
		int32(G), int32(M), int32(R), int32(C), st, int32(op), fp8Out(k, dw, acc), acc)
}

// The blockwise kernels' output modes (HF_OUT_ in their source).
const (
	fp8OutBF16   = 0 // bf16 stored from the accumulator layout
	fp8OutF32    = 1
	fp8OutStaged = 2 // bf16 through the staged epilogue
)

// fp8Out is the blockwise kernels' output mode for out: f32, or bf16 through the staged
// epilogue where it can run (the one-CTA kernels, not accumulating, stagedOK), else bf16
// from the accumulator layout.
func fp8Out(k fp8Launch, out *device.Tensor, acc bool) int32 {
	switch {
	case out.DType() == device.F32:
		return fp8OutF32
	case k.cl == 1 && !acc && stagedOK(out):
		return fp8OutStaged
	}
	return fp8OutBF16
}

// fp8FwdShape checks what the forward kernels of both recipes need of y, A's elements a
// [M, Kc] and B's b [G, N, Kc] for sizes of G groups (fn names the call): M ≥ 1, Kc and N
// positive multiples of 16, 1 ≤ G ≤ maxG, y BF16 or F32 [M, N]. It returns the dimensions.
func fp8FwdShape(fn string, y, a, b, sizes *device.Tensor) (M, Kc, G, N int, err error) {
	M, Kc, G, N = a.Dim(0), a.Dim(1), sizes.Len(), y.Dim(1)
	switch {
	case M < 1 || Kc < 16 || N < 16 || Kc%16 != 0 || N%16 != 0 || G < 1 || G > maxG:
		err = fmt.Errorf("hopper: %s needs M ≥ 1, Kc and N positive multiples of 16 and 1 ≤ G ≤ %d (M=%d Kc=%d N=%d G=%d)", fn, maxG, M, Kc, N, G)
	case !y.HasShape(device.Invalid, M, N) || (y.DType() != device.BF16 && y.DType() != device.F32):
		err = fmt.Errorf("hopper: %s: y is %v, want bf16 or f32 [%d %d]", fn, y, M, N)
	case !b.HasShape(device.Invalid, G, N, Kc):
		err = fmt.Errorf("hopper: %s: B is %v, want [%d %d %d]", fn, b, G, N, Kc)
	}
	return
}

// fp8WGradShape checks what the weight-gradient kernels of both recipes need of dw
// [G, R, C], A's elements a [R, Mp] and B's b [C, Mp] for sizes of G groups (fn names the
// call): R and C positive multiples of 16, 1 ≤ G ≤ maxG, Mp a positive multiple of 128, dw
// BF16 or F32. It returns the dimensions.
func fp8WGradShape(fn string, dw, a, b, sizes *device.Tensor) (G, R, C, Mp int, err error) {
	if dw.Rank() != 3 || (dw.DType() != device.BF16 && dw.DType() != device.F32) {
		return 0, 0, 0, 0, fmt.Errorf("hopper: %s: dw is %v, want bf16 or f32 [G R C]", fn, dw)
	}
	G, R, C, Mp = dw.Dim(0), dw.Dim(1), dw.Dim(2), a.Dim(1)
	switch {
	case R < 16 || C < 16 || R%16 != 0 || C%16 != 0 || G < 1 || G > maxG || Mp < fp8Block || Mp%fp8Block != 0:
		err = fmt.Errorf("hopper: %s needs R and C positive multiples of 16, 1 ≤ G ≤ %d and Mp a positive multiple of 128 (R=%d C=%d G=%d Mp=%d)", fn, maxG, R, C, G, Mp)
	case sizes.Len() != G:
		err = fmt.Errorf("hopper: %s: sizes is %v, want %d groups", fn, sizes, G)
	case !a.HasShape(device.Invalid, R, Mp):
		err = fmt.Errorf("hopper: %s: A is %v, want [%d %d]", fn, a, R, Mp)
	case !b.HasShape(device.Invalid, C, Mp):
		err = fmt.Errorf("hopper: %s: B is %v, want [%d %d]", fn, b, C, Mp)
	}
	return
}

// fp8Forward prepares a forward-form launch of the family prefix: it picks the kernel for
// A's and B's element types (tall as for fp8Kernel), encodes the tensor maps of A [M, Kc] (box {128, k.aRows}) and
// B [G, N, Kc] (box {128, 128, 1}), and enqueues the tail kernel that zeroes y's rows
// past sum(sizes) on s.
func fp8Forward(s *device.Stream, prefix string, tall bool, y, a, b, sizes *device.Tensor) (k fp8Launch, tmA, tmB []byte, err error) {
	d := s.Device()
	M, Kc, G, N := a.Dim(0), a.Dim(1), sizes.Len(), y.Dim(1)
	if k, err = fp8Kernel(d, prefix, tall, a, b); err != nil {
		return
	}
	if tmA, err = tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(a.Ptr()),
		[]uint64{uint64(Kc), uint64(M)}, []uint64{uint64(Kc)}, []uint32{fp8Block, k.aRows}, cuda.TensorMapSwizzle128B); err != nil {
		return
	}
	if tmB, err = tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(b.Ptr()),
		[]uint64{uint64(Kc), uint64(N), uint64(G)}, []uint64{uint64(Kc), uint64(N) * uint64(Kc)}, []uint32{fp8Block, fp8Block, 1},
		cuda.TensorMapSwizzle128B); err != nil {
		return
	}
	z, err := d.Kernel(fp8, "dl_hopper_zero_tail")
	if err != nil {
		return
	}
	var noCounter *device.Tensor
	err = z.Launch(s, device.D1(d.Multiprocessors()), device.D1(256), 0, y, sizes, int32(G), int32(M), int32(N), y.DType() == device.F32, noCounter,
		noCounter, int32(0))
	return
}

// fp8TokenMaps encodes the tensor maps of the weight-gradient operands a [R, Mp] (box
// {128, k.aRows}) and b [C, Mp] (box {128, 128}), contraction over the tokens Mp.
func fp8TokenMaps(d *device.Device, k fp8Launch, a, b *device.Tensor) ([2][]byte, error) {
	var maps [2][]byte
	for i, x := range []*device.Tensor{a, b} {
		box := []uint32{k.aRows, fp8Block}[i]
		var err error
		if maps[i], err = tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(x.Ptr()),
			[]uint64{uint64(x.Dim(1)), uint64(x.Dim(0))}, []uint64{uint64(x.Dim(1))}, []uint32{fp8Block, box}, cuda.TensorMapSwizzle128B); err != nil {
			return maps, err
		}
	}
	return maps, nil
}

// tensorMapOf encodes a tiled tensor map of element type dtype (cuda.TensorMap*) with d's
// context current on the calling thread, which the driver requires.
func tensorMapOf(d *device.Device, dtype int, addr cuda.DevicePtr, dims, strides []uint64, box []uint32, swizzle int) ([]byte, error) {
	var m []byte
	err := d.Do(func() error {
		var err error
		m, err = cuda.TensorMapEncodeTiled(dtype, addr, dims, strides, box, swizzle)
		return err
	})
	return m, err
}

// MXOperand is an operand of the MXFP8 kernels: Q holds its E4M3 or E5M2 elements, Scale
// the E8M0 codes of their 32-element blocks along the contraction (layouts per function).
type MXOperand struct {
	Q, Scale *device.Tensor
}

// MXFP8GEMM computes y[M,N] = Σ_b (A_b·B_g,bᵀ)·sA·sB for the rows of each group g (sizes,
// I32[G] on the device), the sum running over the 32-element blocks b of the contraction
// Kc, in f32:
//   - a.Q is E4M3 or E5M2 [M, Kc]; a.Scale is E8M0 [Sr, cp], cp = roundup(ceil(Kc/32), 4):
//     row r's codes in scale row r, or, when grouped, in scale row 128·P_g + (r − start_g)
//     for row r of group g, P_g = Σ_{h<g} ceil(M_h/128) (package quant's layouts);
//   - b.Q is E4M3 or E5M2 [G, N, Kc]; b.Scale is E8M0 [G, ceil(Kc/128), N, 4], the code of
//     column n's block b at (g, b/4, n, b%4).
//
// y is BF16 or F32; rows past sum(sizes) are zeroed. M ≥ 1, Kc and N positive multiples of
// 16, 1 ≤ G ≤ 1024, tensors 16-byte aligned. Invalid sizes write nothing and are recorded
// in st (if not nil) as for GroupedGEMM. Two launches on s; nothing is copied to the host.
func MXFP8GEMM(s *device.Stream, y *device.Tensor, a, b MXOperand, sizes *device.Tensor, st *device.Status, op int, grouped bool) error {
	d := s.Device()
	if err := BlockwiseSupported(d); err != nil {
		return err
	}
	M, Kc, G, N, err := fp8FwdShape("MXFP8GEMM", y, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	cp := 4 * ceilDiv(ceilDiv(Kc, 32), 4)
	bs := []int{G, ceilDiv(Kc, fp8Block), N, 4}
	switch {
	case !a.Scale.HasShape(device.E8M0, -1, cp) || (!grouped && a.Scale.Dim(0) < M):
		return fmt.Errorf("hopper: MXFP8GEMM: A's scales are %v, want e8m0[Sr %d] with Sr ≥ %d", a.Scale, cp, M)
	case !b.Scale.HasShape(device.E8M0, bs...):
		return fmt.Errorf("hopper: MXFP8GEMM: B's scales are %v, want %s", b.Scale, device.ShapeString(device.E8M0, bs...))
	}
	k, tmA, tmB, err := fp8Forward(s, "dl_hopper_mx", false, y, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	f32 := y.DType() == device.F32
	return k.k.Launch(s, device.D1(k.gridOn(s)), device.D1(k.threads), k.smem, tmA, tmB, a.Scale, int32(cp), grouped, y, b.Scale, sizes,
		int32(G), int32(M), int32(N), int32(Kc), st, int32(op), int32(lightRows), bandTiles(k.rows()), f32)
}

// MXFP8WeightGrad computes dw[g] = Σ_t (A_g,t·B_g,tᵀ)·sA·sB (dw [G,R,C]) for each group g,
// contracting over its tokens, the columns [128·P_g, 128·P_g + M_g) of the operands
// (P_g = Σ_{h<g} ceil(M_h/128)), in 32-token scale blocks t:
//   - a.Q is E4M3 or E5M2 [R, Mp], Mp a positive multiple of 128; a.Scale is E8M0
//     [Mp/32, roundup(R, 128)], the code of row i's block t at (t, i);
//   - b.Q is E4M3 or E5M2 [C, Mp]; b.Scale is E8M0 [Mp/32, roundup(C, 128)].
//
// Padding tokens must be zeros. dw is BF16 or F32; an empty group's dw is exactly zero
// (left as it is with acc, which adds to dw). R and C positive multiples of 16,
// 1 ≤ G ≤ 1024, tensors 16-byte aligned. Invalid sizes write nothing and are recorded in st
// (if not nil). One launch on s; nothing is copied to the host.
func MXFP8WeightGrad(s *device.Stream, dw *device.Tensor, a, b MXOperand, M int, sizes *device.Tensor, st *device.Status, op int, acc bool) error {
	d := s.Device()
	if err := BlockwiseSupported(d); err != nil {
		return err
	}
	G, R, C, Mp, err := fp8WGradShape("MXFP8WeightGrad", dw, a.Q, b.Q, sizes)
	if err != nil {
		return err
	}
	ka, kb := fp8Block*ceilDiv(R, fp8Block), fp8Block*ceilDiv(C, fp8Block)
	switch {
	case !a.Scale.HasShape(device.E8M0, Mp/32, ka):
		return fmt.Errorf("hopper: MXFP8WeightGrad: A's scales are %v, want e8m0[%d %d]", a.Scale, Mp/32, ka)
	case !b.Scale.HasShape(device.E8M0, Mp/32, kb):
		return fmt.Errorf("hopper: MXFP8WeightGrad: B's scales are %v, want e8m0[%d %d]", b.Scale, Mp/32, kb)
	}
	k, err := fp8Kernel(d, "dl_hopper_mx_wgrad", false, a.Q, b.Q)
	if err != nil {
		return err
	}
	maps, err := fp8TokenMaps(d, k, a.Q, b.Q)
	if err != nil {
		return err
	}
	return k.k.Launch(s, device.D1(k.gridOn(s)), device.D1(k.threads), k.smem, maps[0], maps[1], a.Scale, int32(ka), b.Scale, int32(kb), dw, sizes,
		int32(G), int32(M), int32(R), int32(C), st, int32(op), dw.DType() == device.F32, acc)
}
