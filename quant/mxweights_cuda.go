package quant

import (
	"fmt"

	"github.com/dropless/dropless/device"
)

// mxwArgs mirrors DlMxWArgs of kernels/mxfp8.cu.
type mxwArgs struct {
	W, Direct, DS, Trans, TS *device.Tensor
	R, C, Nrt, Nct, Rb, Cb   int32
	Rcp                      float32
	Emax                     int32
	Floor                    bool
}

// mxwDequantArgs mirrors DlMxWDqArgs.
type mxwDequantArgs struct {
	Y, Q, Sc       *device.Tensor
	K, N, Nkt, Nnt int32
	KMajor         bool
}

// quantizeMXFP8WeightsGPU enqueues one kernel for both orientations: a block of 128
// threads per 32×256 tile of w_g, 16-byte loads where w is 16-byte aligned (rows are, C
// being a multiple of 16), element loads otherwise (and under forceGeneral).
func quantizeMXFP8WeightsGPU(s *device.Stream, q *MXFP8Weights, w *device.Tensor) error {
	g := q.wg
	grid := g.g * g.nrt * g.nct
	if grid == 0 {
		return nil
	}
	suffix := ""
	if forceGeneral || !device.Aligned(16, w) {
		suffix = "_scalar"
	}
	k, err := s.Device().Kernel(program, fmt.Sprintf("dl_mxw_%s_%s%s", w.DType(), q.Format, suffix))
	if err != nil {
		return err
	}
	d, ds, t, ts := g.orient(q)
	return k.Launch(s, device.D1(grid), device.D1(fastThreads), 0, mxwArgs{
		W: w, Direct: d, DS: ds, Trans: t, TS: ts,
		R: int32(g.r), C: int32(g.c), Nrt: int32(g.nrt), Nct: int32(g.nct), Rb: int32(g.rb), Cb: int32(g.cb),
		Rcp: q.Format.rcp(), Emax: int32(q.Format.emax()), Floor: q.Mode == FLOOR,
	})
}

// dequantizeMXFP8WeightsGPU enqueues the dequantization of one orientation: a block of
// 256 threads per 32×32 tile of dst.
func dequantizeMXFP8WeightsGPU(s *device.Stream, dst *device.Tensor, q *MXFP8Weights, kMajor bool) error {
	g := q.wg
	nkt, nnt := ceilDiv(g.k, 32), ceilDiv(g.n, 32)
	grid := g.g * nkt * nnt
	if grid == 0 {
		return nil
	}
	k, err := s.Device().Kernel(program, fmt.Sprintf("dl_mxdqw_%s_%s", dst.DType(), q.Format))
	if err != nil {
		return err
	}
	a := mxwDequantArgs{Y: dst, Q: q.NMajor, Sc: q.NScale, K: int32(g.k), N: int32(g.n), Nkt: int32(nkt), Nnt: int32(nnt)}
	if kMajor {
		a.Q, a.Sc, a.KMajor = q.KMajor, q.KScale, true
	}
	return k.Launch(s, device.D1(grid), device.D1(256), 0, a)
}
