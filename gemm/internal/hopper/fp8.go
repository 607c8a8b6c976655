package hopper

import (
	_ "embed"
	"fmt"
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
	// fp8Smem is HF_SMEM of kernels/fp8.cu: the stages (A and B tiles, 128 A and 128 B
	// scales each), their barriers, the three group tables and alignment slack.
	fp8Smem = fp8Stages*(2*fp8Block*fp8Block+2*fp8Block*4) + 2*fp8Stages*8 + 3*(maxG+1)*4 + 1024
)

var fp8Support sync.Map // *device.Device → error

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
	if d.MaxSharedMemory() < fp8Smem {
		return fmt.Errorf("hopper: the FP8 kernels need %d bytes of shared memory per block, %v allows %d", fp8Smem, d, d.MaxSharedMemory())
	}
	names := []string{"dl_hopper_zero_tail"}
	for _, a := range []string{"e4m3", "e5m2"} {
		for _, b := range []string{"e4m3", "e5m2"} {
			names = append(names, "dl_hopper_fp8_"+a+"_"+b, "dl_hopper_fp8_wgrad_"+a+"_"+b)
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

// fp8Kernel returns the kernel prefix+"_"+A's type+"_"+B's type.
func fp8Kernel(d *device.Device, prefix string, a, b *device.Tensor) (*device.Kernel, error) {
	an, err := fp8Name("A", a)
	if err != nil {
		return nil, err
	}
	bn, err := fp8Name("B", b)
	if err != nil {
		return nil, err
	}
	return d.Kernel(fp8, prefix+"_"+an+"_"+bn)
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
	M, Kc := a.Q.Dim(0), a.Q.Dim(1)
	G, N := sizes.Len(), y.Dim(1)
	if M < 1 || Kc < 16 || N < 16 || Kc%16 != 0 || N%16 != 0 || G < 1 || G > maxG {
		return fmt.Errorf("hopper: BlockwiseGEMM needs M ≥ 1, Kc and N positive multiples of 16 and 1 ≤ G ≤ %d (M=%d Kc=%d N=%d G=%d)", maxG, M, Kc, N, G)
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
	case !y.HasShape(device.Invalid, M, N) || (y.DType() != device.BF16 && y.DType() != device.F32):
		return fmt.Errorf("hopper: BlockwiseGEMM: y is %v, want bf16 or f32 [%d %d]", y, M, N)
	case !a.Scale.HasShape(device.F32, skc, -1) || Mr < M || Mr%4 != 0:
		return fmt.Errorf("hopper: BlockwiseGEMM: A's scales are %v, want f32[%d Mr], Mr ≥ %d a multiple of 4", a.Scale, skc, M)
	case !b.Q.HasShape(device.Invalid, G, N, Kc):
		return fmt.Errorf("hopper: BlockwiseGEMM: B is %v, want [%d %d %d]", b.Q, G, N, Kc)
	case !b.Scale.HasShape(device.F32, bs...):
		return fmt.Errorf("hopper: BlockwiseGEMM: B's scales are %v, want %s", b.Scale, device.ShapeString(device.F32, bs...))
	}
	k, err := fp8Kernel(d, "dl_hopper_fp8", a.Q, b.Q)
	if err != nil {
		return err
	}
	tmA, err := tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(a.Q.Ptr()),
		[]uint64{uint64(Kc), uint64(M)}, []uint64{uint64(Kc)}, []uint32{fp8Block, fp8Block}, cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	tmB, err := tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(b.Q.Ptr()),
		[]uint64{uint64(Kc), uint64(N), uint64(G)}, []uint64{uint64(Kc), uint64(N) * uint64(Kc)}, []uint32{fp8Block, fp8Block, 1},
		cuda.TensorMapSwizzle128B)
	if err != nil {
		return err
	}
	z, err := d.Kernel(fp8, "dl_hopper_zero_tail")
	if err != nil {
		return err
	}
	f32 := y.DType() == device.F32
	var noCounter *device.Tensor
	if err := z.Launch(s, device.D1(d.Multiprocessors()), device.D1(256), 0, y, sizes, int32(G), int32(M), int32(N), f32, noCounter); err != nil {
		return err
	}
	return k.Launch(s, device.D1(d.Multiprocessors()), device.D1(384), fp8Smem, tmA, tmB, a.Scale, int32(Mr), y, b.Scale, sizes,
		int32(G), int32(M), int32(N), int32(Kc), ks, ns, int64(skc)*int64(sn), st, int32(op), int32(lightRows), f32)
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
	G, R, C, Mp := dw.Dim(0), dw.Dim(1), dw.Dim(2), a.Q.Dim(1)
	if R < 16 || C < 16 || R%16 != 0 || C%16 != 0 || G < 1 || G > maxG || Mp < fp8Block || Mp%fp8Block != 0 {
		return fmt.Errorf("hopper: BlockwiseWeightGrad needs R and C positive multiples of 16, 1 ≤ G ≤ %d and Mp a positive multiple of 128 (R=%d C=%d G=%d Mp=%d)", maxG, R, C, G, Mp)
	}
	nt := Mp / fp8Block
	switch {
	case dw.Rank() != 3 || (dw.DType() != device.BF16 && dw.DType() != device.F32):
		return fmt.Errorf("hopper: BlockwiseWeightGrad: dw is %v, want bf16 or f32 [G R C]", dw)
	case sizes.Len() != G:
		return fmt.Errorf("hopper: BlockwiseWeightGrad: sizes is %v, want %d groups", sizes, G)
	case !a.Q.HasShape(device.Invalid, R, Mp) || !a.Scale.HasShape(device.F32, nt, R):
		return fmt.Errorf("hopper: BlockwiseWeightGrad: A is %v with scales %v, want [%d %d] and f32[%d %d]", a.Q, a.Scale, R, Mp, nt, R)
	case !b.Q.HasShape(device.Invalid, C, Mp) || !b.Scale.HasShape(device.F32, nt, C):
		return fmt.Errorf("hopper: BlockwiseWeightGrad: B is %v with scales %v, want [%d %d] and f32[%d %d]", b.Q, b.Scale, C, Mp, nt, C)
	}
	k, err := fp8Kernel(d, "dl_hopper_fp8_wgrad", a.Q, b.Q)
	if err != nil {
		return err
	}
	var maps [2][]byte
	for i, x := range []FP8{a, b} {
		rows := []int{R, C}[i]
		if maps[i], err = tensorMapOf(d, cuda.TensorMapUint8, cuda.DevicePtr(x.Q.Ptr()),
			[]uint64{uint64(Mp), uint64(rows)}, []uint64{uint64(Mp)}, []uint32{fp8Block, fp8Block}, cuda.TensorMapSwizzle128B); err != nil {
			return err
		}
	}
	return k.Launch(s, device.D1(d.Multiprocessors()), device.D1(384), fp8Smem, maps[0], maps[1], a.Scale, b.Scale, dw, sizes,
		int32(G), int32(M), int32(R), int32(C), st, int32(op), dw.DType() == device.F32, acc)
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
