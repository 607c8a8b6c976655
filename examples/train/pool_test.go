package main

import (
	"errors"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/offload"
	"github.com/dropless/dropless/quant"
)

// TestFP8SwiGLUBytes checks fp8SwiGLUBytes against the tensors package quant allocates
// for the columnwise form of an FP8 layer's SwiGLU output, in both recipes.
func TestFP8SwiGLUBytes(t *testing.T) {
	s := device.CPU().Stream()
	for _, c := range []struct{ rows, F, G int }{{256, 16, 4}, {1000, 48, 7}, {3, 128, 8}, {8192, 1024, 16}} {
		sizes := dt.Must(device.CPU().Alloc(device.I32, c.G))
		bw := dt.Must(quant.AllocBlockwise(s, c.rows, c.F, quant.BlockOptions{Format: quant.E4M3, Dir: quant.Columnwise, GroupSizes: sizes}))
		mx := dt.Must(quant.Alloc(s, c.rows, c.F, quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: quant.Columnwise, Transpose: true, GroupSizes: sizes}))
		for _, p := range []struct {
			prec moe.Precision
			want []int
		}{
			{moe.PrecisionBlockwise, []int{bw.ColT.Bytes(), bw.ColTScale.Bytes()}},
			{moe.PrecisionMXFP8, []int{mx.ColT.Bytes(), mx.ColScale.Bytes()}},
		} {
			if got := fp8SwiGLUBytes(p.prec, c.rows, c.F, c.G); got[0] != p.want[0] || got[1] != p.want[1] {
				t.Errorf("%v, %d rows, F = %d, %d groups: %v bytes, quant allocates %v", p.prec, c.rows, c.F, c.G, got, p.want)
			}
		}
		dt.NoErr(t, errors.Join(bw.Free(), mx.Free(), sizes.Free()))
	}
}

// TestFP8RowsBytes checks fp8RowsBytes against the tensors package quant allocates for
// the rowwise form of rows, as ep dispatches them, in both recipes.
func TestFP8RowsBytes(t *testing.T) {
	s := device.CPU().Stream()
	for _, c := range []struct{ rows, H int }{{256, 16}, {1000, 48}, {3, 200}, {131072, 7168}} {
		bw := dt.Must(quant.AllocBlockwise(s, c.rows, c.H, quant.BlockOptions{Format: quant.E4M3, Dir: quant.Rowwise}))
		mx := dt.Must(quant.Alloc(s, c.rows, c.H, quant.Options{Format: quant.E4M3, Mode: quant.RCEIL, Dir: quant.Rowwise}))
		for _, p := range []struct {
			prec moe.Precision
			want []int
		}{
			{moe.PrecisionBlockwise, []int{bw.Row.Bytes(), bw.RowScale.Bytes()}},
			{moe.PrecisionMXFP8, []int{mx.Row.Bytes(), mx.RowScale.Bytes()}},
		} {
			if got := fp8RowsBytes(p.prec, c.rows, c.H); got[0] != p.want[0] || got[1] != p.want[1] {
				t.Errorf("%v, %d rows, H = %d: %v bytes, quant allocates %v", p.prec, c.rows, c.H, got, p.want)
			}
		}
		dt.NoErr(t, errors.Join(bw.Free(), mx.Free()))
	}
}

// TestOffloadPoolFP8 checks that the pool of an FP8 model holds ActSwiGLU's FP8 bytes,
// not its bf16 ones, no ActPermuted without expert parallelism and ActPermuted's FP8
// bytes with it.
func TestOffloadPoolFP8(t *testing.T) {
	c := defaultOptions().modelConfig(0)
	c.Hidden, c.FFN, c.Experts, c.TopK = 1024, 1024, 16, 2
	const B = 8192
	rows, F := B*c.TopK, c.FFN
	pol := offload.MustParsePolicy("*=offload")
	bf := offloadPool(c, pol, moe.PrecisionBF16, B, 1, device.BF16)
	for _, prec := range []moe.Precision{moe.PrecisionBlockwise, moe.PrecisionMXFP8} {
		sw := fp8SwiGLUBytes(prec, rows, F, c.Experts)
		// ActPermuted and the bf16 ActSwiGLU out, the FP8 one in.
		want := bf - c.Layers*(aligned(2*rows*c.Hidden)+aligned(2*rows*F)-aligned(sw[0])-aligned(sw[1]))
		if got := offloadPool(c, pol, prec, B, 1, device.BF16); got != want {
			t.Errorf("%v: pool of %d bytes, want %d (bf16: %d)", prec, got, want, bf)
		}
		// Over 2 ranks ActPermuted is the dispatched rows in FP8: B·2·min(K, E/2) of them.
		er := B * 2 * min(c.TopK, c.Experts/2)
		bf2 := offloadPool(c, pol, moe.PrecisionBF16, B, 2, device.BF16)
		sw, xp := fp8SwiGLUBytes(prec, er, F, c.Experts/2), fp8RowsBytes(prec, er, c.Hidden)
		want = bf2 - c.Layers*(aligned(2*er*c.Hidden)+aligned(2*er*F)-aligned(sw[0])-aligned(sw[1])-aligned(xp[0])-aligned(xp[1]))
		if got := offloadPool(c, pol, prec, B, 2, device.BF16); got != want {
			t.Errorf("%v over 2 ranks: pool of %d bytes, want %d (bf16: %d)", prec, got, want, bf2)
		}
	}
}

// aligned returns n rounded up to offload.Align.
func aligned(n int) int { return (n + offload.Align - 1) / offload.Align * offload.Align }
