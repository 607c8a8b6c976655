package ep

import (
	_ "embed"
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

//go:embed kernels/ep.cu
var kernelSrc string

// kernels is the program of the package's CUDA kernels (kernels/ep.cu).
var kernels = device.NewProgram("ep.cu", kernelSrc)

// gpuBackend runs the operations with the kernels of ep.cu.
type gpuBackend struct {
	dev *device.Device
	g   *Group // for its transfer stream and whether it transfers directly
}

const (
	block      = 256 // threads per block
	maxEntries = 1024
)

func (b *gpuBackend) launch(s *device.Stream, name string, grid, smem int, args ...any) error {
	k, err := b.dev.Kernel(kernels, name)
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(grid), device.D1(block), smem, args...)
}

// The grid of the row kernels: blocks of rowThreads threads (a warp per row), at most
// rowPerSM blocks per multiprocessor, looping over the rows. One block of 1024 threads
// on three quarters of the multiprocessors leaves the rest to the kernels of NCCL's
// transfers, which run beside the row kernels and cannot share a multiprocessor with a
// full block (measured on two H200s: docs/perf.md).
//
// With direct transfers the kernels that pack rows into the peers' memory run on the
// transfer stream, beside those of the op's stream: each side gets half of the
// multiprocessors (directPerSM, packPerSM), which measured best on two H200s.
var (
	rowThreads  = 1024
	rowPerSM    = 0.75
	directPerSM = 0.5
	packPerSM   = 0.5
)

// rowGrid is the grid of a row kernel over n rows, on the transfer stream when pack.
func (b *gpuBackend) rowGrid(n int, pack bool) int {
	w, f := rowThreads/32, rowPerSM
	switch {
	case pack:
		f = packPerSM
	case b.g.win != nil:
		f = directPerSM
	}
	return max(1, min((n+w-1)/w, int(f*float64(b.dev.Multiprocessors()))))
}

// rowLaunch launches row kernel name over n rows.
func (b *gpuBackend) rowLaunch(s *device.Stream, name string, n int, args ...any) error {
	k, err := b.dev.Kernel(kernels, name)
	if err != nil {
		return err
	}
	return k.Launch(s, device.D1(b.rowGrid(n, s == b.g.cs)), device.D1(rowThreads), 0, args...)
}

func blocks(n int) int { return max(1, (n+block-1)/block) }

// vecName picks the widest unit, 16, 4 or 1 bytes, that divides the rows and the bases.
func vecName(rb int, ts ...*device.Tensor) string {
	switch {
	case rb%16 == 0 && device.Aligned(16, ts...):
		return "v16"
	case rb%4 == 0 && device.Aligned(4, ts...):
		return "v4"
	}
	return "v1"
}

// vec8 reports whether the arithmetic kernels may move 8 elements as 16-byte words.
func vec8(h int, ts ...*device.Tensor) bool { return h%8 == 0 && device.Aligned(16, ts...) }

// checkArith returns an error unless the arithmetic kernels (ep_wsum_*, ep_final_sum_*,
// ep_rscale_*, named by dtype) exist for dt: f32, bf16 and f16.
func checkArith(dt device.DType) error {
	switch dt {
	case device.F32, device.BF16, device.F16:
		return nil
	}
	return fmt.Errorf("ep: no GPU arithmetic for %v", dt)
}

func i32(n int) int32 { return int32(n) }

// chunkRows returns the rows per block of the counting sort for entries of width w.
func chunkRows(w int) int { return max(1, min(64, maxEntries/w)) }

// sort runs the counting sort of keys (n rows of w keys, row stride stride) over nkeys
// keys: total gets each key's count; pos (if not nil) the positions, capped at capacity;
// kept (if not nil) each key's entries below capacity.
func (b *gpuBackend) sort(s *device.Stream, keys *device.Tensor, n, w, stride, nkeys, capacity int, pos, total, kept *device.Tensor) error {
	if n == 0 {
		for _, t := range []*device.Tensor{total, kept} {
			if t != nil {
				if err := device.Fill(s, t, 0); err != nil {
					return err
				}
			}
		}
		return nil
	}
	cr := chunkRows(w)
	nb := (n + cr - 1) / cr
	cnt, err := s.Alloc(device.I32, nb, nkeys)
	if err != nil {
		return err
	}
	defer cnt.Free()
	if err := b.launch(s, "ep_sort_count", nb, 4*nkeys, keys, i32(n), i32(w), i32(stride), i32(nkeys), i32(cr), cnt); err != nil {
		return err
	}
	if err := b.launch(s, "ep_sort_scan", nkeys, 0, cnt, i32(nb), i32(nkeys), total); err != nil {
		return err
	}
	if pos == nil && kept == nil {
		return nil
	}
	off, err := s.Alloc(device.I32, nkeys)
	if err != nil {
		return err
	}
	defer off.Free()
	k, err := b.dev.Kernel(kernels, "ep_sort_offsets")
	if err != nil {
		return err
	}
	if err := k.Launch(s, device.D1(1), device.D1(1), 0, total, i32(nkeys), i32(capacity), off, kept); err != nil {
		return err
	}
	if pos == nil {
		return nil
	}
	return b.launch(s, "ep_sort_assign", nb, 0, keys, i32(n), i32(w), i32(stride), i32(nkeys), i32(cr), cnt, off, i32(capacity), pos)
}

func (b *gpuBackend) localCounts(s *device.Stream, idx, sendRow, vec *device.Tensor, E, L int) error {
	T, K, R := idx.Dim(0), idx.Dim(1), sendRow.Dim(1)
	tmp := device.NewTemps(s)
	defer tmp.Free()
	bad, keys, tok, exp := tmp.Alloc(device.I32, 2), tmp.Alloc(device.I32, T, R), tmp.Alloc(device.I32, R), tmp.Alloc(device.I32, E)
	if err := tmp.Err(); err != nil {
		return err
	}
	if err := device.Fill(s, bad, math.MaxInt32); err != nil {
		return err
	}
	if T > 0 {
		if err := b.launch(s, "ep_dest_keys", blocks(T), 0, idx, i32(T), i32(K), i32(E), i32(L), i32(R), keys, bad); err != nil {
			return err
		}
	}
	if err := b.sort(s, keys, T, R, R, R, math.MaxInt32, sendRow, tok, nil); err != nil {
		return err
	}
	if err := b.sort(s, idx, T, K, K, E, math.MaxInt32, nil, exp, nil); err != nil {
		return err
	}
	return b.launch(s, "ep_count_vec", blocks(R*(4+L)), 0, tok, exp, bad, i32(T), i32(R), i32(L), vec)
}

func (b *gpuBackend) packMeta(s *device.Stream, idx, sendRow, sendTok, meta *device.Tensor, L int) error {
	T, K, R := idx.Dim(0), idx.Dim(1), sendRow.Dim(1)
	if T == 0 {
		return nil
	}
	return b.launch(s, "ep_pack_meta", blocks(T*R), 0, idx, sendRow, i32(T), i32(K), i32(R), i32(L), sendTok, meta)
}

func (b *gpuBackend) assignSlots(s *device.Stream, meta, slot, counts *device.Tensor, L, capacity int) error {
	n, K := slot.Dim(0), slot.Dim(1)
	total, err := s.Alloc(device.I32, L)
	if err != nil {
		return err
	}
	defer total.Free()
	return b.sort(s, meta, n, K, K+1, L, capacity, slot, total, counts)
}

func (b *gpuBackend) origins(s *device.Stream, out, slot, meta, recvOff *device.Tensor) error {
	n, K := slot.Dim(0), slot.Dim(1)
	if n == 0 {
		return nil
	}
	return b.launch(s, "ep_origins", blocks(n*K), 0, out, slot, meta, recvOff, i32(recvOff.Len()-1), int64(n), i32(K))
}

func (b *gpuBackend) gather(s *device.Stream, dst, src, rowMap *device.Tensor) error {
	n, rb := dst.Dim(0), rowBytes(dst)
	if n == 0 || rb == 0 {
		return nil
	}
	return b.rowLaunch(s, "ep_gather_"+vecName(rb, dst, src), n, dst, src, rowMap, int64(n), int64(rb))
}

func (b *gpuBackend) replicate(s *device.Stream, X, W, src, srcW, rowMap, slot *device.Tensor) error {
	n, K, rb := slot.Dim(0), slot.Dim(1), rowBytes(X)
	if n == 0 {
		return nil
	}
	if W == nil {
		srcW = nil
	}
	return b.rowLaunch(s, "ep_replicate_"+vecName(rb, X, src), n, X, W, src, srcW, rowMap, slot, int64(n), i32(K), int64(rb))
}

func (b *gpuBackend) wsum(s *device.Stream, dst, y, w, slot *device.Tensor) error {
	n, K, H := slot.Dim(0), slot.Dim(1), y.Dim(1)
	if n == 0 {
		return nil
	}
	if err := checkArith(y.DType()); err != nil {
		return err
	}
	return b.rowLaunch(s, "ep_wsum_"+y.DType().String(), n, dst, y, w, slot, int64(n), i32(K), int64(H), vec8(H, dst, y))
}

func (b *gpuBackend) finalSum(s *device.Stream, out, back, sendRow *device.Tensor, part *finalPart) error {
	T, R, H := out.Dim(0), sendRow.Dim(1), out.Dim(1)
	if T == 0 {
		return nil
	}
	if err := checkArith(out.DType()); err != nil {
		return err
	}
	var offs *device.Tensor // null: every token
	rank, c, C := int32(0), int32(0), int32(1)
	if part != nil {
		offs, rank, c, C = part.dev, i32(part.rank), i32(part.c), i32(part.C)
	}
	return b.rowLaunch(s, "ep_final_sum_"+out.DType().String(), T, out, back, sendRow, int64(T), i32(R), int64(H), vec8(H, out, back),
		offs, rank, C, c)
}

func (b *gpuBackend) replicateScaled(s *device.Stream, dy, dw, src, rowMap, slot, w, y *device.Tensor) error {
	n, K, H := slot.Dim(0), slot.Dim(1), dy.Dim(1)
	if n == 0 {
		return nil
	}
	if err := checkArith(dy.DType()); err != nil {
		return err
	}
	return b.rowLaunch(s, "ep_rscale_"+dy.DType().String(), n, dy, dw, src, rowMap, slot, w, y,
		int64(n), i32(K), int64(H), vec8(H, dy, src, y))
}

func (b *gpuBackend) transpose4(s *device.Stream, dst, src *device.Tensor, rows, cols, ldd, lds int) error {
	if rows == 0 || cols == 0 {
		return nil
	}
	k, err := b.dev.Kernel(kernels, "ep_transpose4")
	if err != nil {
		return err
	}
	grid := device.Dim3{X: (cols + 31) / 32, Y: min((rows+31)/32, 65535), Z: 1}
	return k.Launch(s, grid, device.Dim3{X: 32, Y: 8, Z: 1}, 0, dst, src, int64(rows), int64(cols), int64(ldd), int64(lds))
}

func (b *gpuBackend) dwPack(s *device.Stream, dst, slot, dW *device.Tensor) error {
	nk := slot.Len()
	if nk == 0 {
		return nil
	}
	return b.launch(s, "ep_dw_pack", blocks(nk), 0, dst, slot, dW, int64(nk))
}

func (b *gpuBackend) dwUnpack(s *device.Stream, dweights, idx, sendRow, back *device.Tensor, L int) error {
	T, K, R := idx.Dim(0), idx.Dim(1), sendRow.Dim(1)
	if T == 0 {
		return nil
	}
	return b.launch(s, "ep_dw_unpack", blocks(T*K), 0, dweights, idx, sendRow, back, i32(T), i32(K), i32(R), i32(L))
}

// signal sets the flag at byte off of every other rank's window to v, after the work
// before it on s.
func (b *gpuBackend) signal(s *device.Stream, w *window, off int, v uint32) error {
	return b.launch(s, "ep_signal", blocks(w.r), 0, w.bases, i32(w.r), i32(w.me), int64(off), v)
}
