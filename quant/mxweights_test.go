package quant

import (
	"fmt"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/google/go-cmp/cmp"
)

type mxwCase struct {
	g, k, n  int
	nk       bool
	specials bool
	offset   int // the source's element offset in its storage (1: not 16-byte aligned)
}

var mxwCases = []mxwCase{
	{g: 1, k: 16, n: 16}, {g: 2, k: 128, n: 128, specials: true}, {g: 3, k: 144, n: 48, nk: true},
	{g: 1, k: 272, n: 400, specials: true}, {g: 2, k: 48, n: 272, nk: true, specials: true},
	{g: 1, k: 528, n: 80}, {g: 1, k: 80, n: 528, nk: true, specials: true},
	{g: 0, k: 32, n: 32}, {g: 2, k: 0, n: 64}, {g: 1, k: 160, n: 144, offset: 1}, {g: 2, k: 128, n: 16, nk: true, offset: 3},
}

// mxwOptions lists every Format and ScaleMode.
func mxwOptions() []Options {
	var os []Options
	for _, f := range []Format{E4M3, E5M2} {
		for _, m := range []ScaleMode{RCEIL, FLOOR} {
			os = append(os, Options{Format: f, Mode: m})
		}
	}
	return os
}

// mxwNames names the outputs of mxwBytes.
var mxwNames = [4]string{"KMajor", "KScale", "NMajor", "NScale"}

// mxwBytes returns q's KMajor, KScale, NMajor and NScale.
func mxwBytes(t testing.TB, s *device.Stream, q *MXFP8Weights) [4][]byte {
	t.Helper()
	return [4][]byte{download(t, s, q.KMajor), download(t, s, q.KScale), download(t, s, q.NMajor), download(t, s, q.NScale)}
}

// mxwQuant quantizes vals, c's weights in their layout (at c.offset in their storage),
// with opt on s into poisoned outputs, and returns the outputs' bytes and q.
func mxwQuant(t testing.TB, s *device.Stream, in device.DType, vals []float32, c mxwCase, opt Options) ([4][]byte, *MXFP8Weights) {
	t.Helper()
	r, cc := c.k, c.n
	if c.nk {
		r, cc = c.n, c.k
	}
	base := dt.Must(device.FromFloat32(s, in, append(make([]float32, c.offset), vals...), c.offset+len(vals)))
	defer base.Free()
	w := dt.Must(base.View(c.offset, c.g, r, cc))
	opt.NK = c.nk
	q := dt.Must(QuantizeMXFP8Weights(s, w, opt))
	dt.Poison(t, s, q.KMajor, q.KScale, q.NMajor, q.NScale)
	dt.NoErr(t, quantizeMXFP8WeightsInto(s, q, w))
	return mxwBytes(t, s, q), q
}

// mxwDequant dequantizes q's orientation kMajor into a poisoned [G, K, N] tensor of
// dtype out and returns its bytes.
func mxwDequant(t testing.TB, s *device.Stream, q *MXFP8Weights, kMajor bool, out device.DType) []byte {
	t.Helper()
	y := dt.Must(s.Alloc(out, q.G, q.K, q.N))
	defer y.Free()
	dt.Poison(t, s, y)
	dt.NoErr(t, DequantizeMXFP8Weights(s, y, q, kMajor))
	return download(t, s, y)
}

// TestQuantizeMXFP8Weights checks the CPU against the independent reference and every GPU
// kernel variant against the CPU, bit for bit with outputs poisoned, for every format
// and rule, KN and NK weights, aligned and not; and DequantizeMXFP8Weights of both
// orientations (the CPU against decode·scale of the reference's codes, the GPU against
// the CPU).
func TestQuantizeMXFP8Weights(t *testing.T) {
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range mxwCases {
			for oi, opt := range mxwOptions() {
				in := []device.DType{device.BF16, device.F32}[(oi+ci)%2]
				name := fmt.Sprintf("%d×%d×%d nk %v offset %d %v %v %v", c.g, c.k, c.n, c.nk, c.offset, in, opt.Format, opt.Mode)
				vals := testValues(dt.Rand(uint64(100*ci+oi)), c.g*c.k*c.n, c.specials)
				want, qc := mxwQuant(t, cpu, in, vals, c, opt)
				if !d.IsCUDA() {
					exact := dt.Must(dt.Must(device.FromFloat32(cpu, in, vals, len(vals))).Float32s(cpu))
					km, ks, nm, ns := refMXWeights(exact, c.g, c.k, c.n, c.nk, opt.Format, opt.Mode)
					for i, ref := range [4][]byte{km, ks, nm, ns} {
						if diff := firstDiff(want[i], ref, 1); diff != "" {
							t.Errorf("%s: %s against the reference: %s", name, mxwNames[i], diff)
						}
					}
					checkMXWDequant(t, name, qc, want)
				}
				for _, v := range variants(d) {
					restore := v.use()
					got, q := mxwQuant(t, s, in, vals, c, opt)
					for i := range got {
						if diff := firstDiff(got[i], want[i], 1); diff != "" {
							t.Errorf("%s %s: %s: %s", v.name, name, mxwNames[i], diff)
						}
					}
					for _, kMajor := range []bool{true, false} {
						for _, out := range []device.DType{device.F32, device.BF16} {
							g, w := mxwDequant(t, s, q, kMajor, out), mxwDequant(t, cpu, qc, kMajor, out)
							if diff := firstDiff(g, w, out.Size()); diff != "" {
								t.Errorf("%s %s: DequantizeMXFP8Weights kMajor %v → %v: %s", v.name, name, kMajor, out, diff)
							}
						}
					}
					restore()
					q.Free()
				}
				qc.Free()
			}
		}
	})
}

// checkMXWDequant checks DequantizeMXFP8Weights of a CPU q, whose outputs are out, in
// both orientations against decode·2^(scale−127) of the codes in float64.
func checkMXWDequant(t *testing.T, name string, q *MXFP8Weights, out [4][]byte) {
	t.Helper()
	s := device.CPU().Stream()
	k, n := q.K, q.N
	kb, nb := (k+127)/128, (n+127)/128
	dec := func(e, c uint8) float32 {
		v := refValue(q.Format, e) * math.Pow(2, float64(int(c)-127))
		if math.IsNaN(v) {
			return nanF32
		}
		return float32(v)
	}
	for _, kMajor := range []bool{true, false} {
		got := f32sOf(mxwDequant(t, s, q, kMajor, device.F32))
		for i, v := range got {
			g, kk, nn := i/(k*n), i/n%k, i%n
			var w float32
			if kMajor {
				w = dec(out[0][(g*n+nn)*k+kk], out[1][((g*kb+kk/128)*n+nn)*4+kk/32%4])
			} else {
				w = dec(out[2][i], out[3][((g*nb+nn/128)*k+kk)*4+nn/32%4])
			}
			if math.Float32bits(v) != math.Float32bits(w) {
				t.Errorf("%s: DequantizeMXFP8Weights kMajor %v: element (%d, %d, %d) = %v, want %v", name, kMajor, g, kk, nn, v, w)
				return
			}
		}
	}
}

// TestMXFP8WeightsMatchQuantize checks on the CPU that the weights' blocks are those of
// Quantize: KMajor and KScale of w_g are Row and RowScale of Quantize(w_gᵀ) rearranged,
// NMajor and NScale those of Quantize(w_g).
func TestMXFP8WeightsMatchQuantize(t *testing.T) {
	s := device.CPU().Stream()
	for ci, c := range mxwCases {
		for oi, opt := range mxwOptions() {
			vals := testValues(dt.Rand(uint64(10*ci+oi)), c.g*c.k*c.n, c.specials)
			got, q := mxwQuant(t, s, device.F32, vals, c, opt)
			q.Free()
			name := fmt.Sprintf("%d×%d×%d nk %v %v %v", c.g, c.k, c.n, c.nk, opt.Format, opt.Mode)
			for g := range c.g {
				kn := make([]float32, c.k*c.n) // w_g [K, N]
				for i := range c.k {
					for j := range c.n {
						if c.nk {
							kn[i*c.n+j] = vals[(g*c.n+j)*c.k+i]
						} else {
							kn[i*c.n+j] = vals[(g*c.k+i)*c.n+j]
						}
					}
				}
				for _, o := range []struct {
					data, scale []byte
					name        string
					rows, cols  int
					src         []float32
				}{
					{got[0], got[1], "KMajor", c.n, c.k, transpose(kn, c.k, c.n)},
					{got[2], got[3], "NMajor", c.k, c.n, kn},
				} {
					x := dt.Must(device.FromFloat32(s, device.F32, o.src, o.rows, o.cols))
					mq := dt.Must(Quantize(s, x, Options{Format: opt.Format, Mode: opt.Mode}))
					row, rs := download(t, s, mq.Row), download(t, s, mq.RowScale)
					cp := mq.RowScale.Dim(1)
					if diff := cmp.Diff(row, o.data[g*o.rows*o.cols:(g+1)*o.rows*o.cols]); diff != "" {
						t.Errorf("%s: %s of expert %d against Quantize's Row (-Quantize +weights):\n%s", name, o.name, g, diff)
					}
					blocks := (o.cols + 127) / 128
					for r := range o.rows {
						for b := range cp {
							if a, w := o.scale[((g*blocks+b/4)*o.rows+r)*4+b%4], rs[r*cp+b]; a != w {
								t.Fatalf("%s: %s scale of expert %d line %d block %d is %d, Quantize's RowScale %d", name, o.name, g, r, b, a, w)
							}
						}
					}
					mq.Free()
					x.Free()
				}
			}
		}
	}
}

// TestMXFP8WeightsOrientations checks that [G, N, K] weights with opt.NK give the outputs
// of the same weights stored [G, K, N].
func TestMXFP8WeightsOrientations(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const g, k, n = 2, 272, 144
		kn := testValues(dt.Rand(11), g*k*n, true)
		nk := nkOf(kn, g, k, n)
		for _, mode := range []ScaleMode{RCEIL, FLOOR} {
			a, qa := mxwQuant(t, s, device.BF16, kn, mxwCase{g: g, k: k, n: n}, Options{Mode: mode})
			b, qb := mxwQuant(t, s, device.BF16, nk, mxwCase{g: g, k: k, n: n, nk: true}, Options{Mode: mode})
			for i := range a {
				if diff := firstDiff(b[i], a[i], 1); diff != "" {
					t.Errorf("%v: %s of NK weights against KN: %s", mode, mxwNames[i], diff)
				}
			}
			qa.Free()
			qb.Free()
		}
	})
}

// TestMXFP8WeightsRoundTrip checks that weights dequantized from either orientation,
// quantized again, dequantize to the same bits, and under FLOOR give the same codes and
// scales; and that under RCEIL every value is within half an element step of the
// source (relative 2^-4 for E4M3, 2^-3 for E5M2, or half the smallest subnormal times
// the scale).
func TestMXFP8WeightsRoundTrip(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const g, k, n = 2, 160, 272
		vals := testValues(dt.Rand(21), g*k*n, false)
		for _, f := range []Format{E4M3, E5M2} {
			rel, sub := 0x1p-4, 0x1p-10
			if f == E5M2 {
				rel, sub = 0x1p-3, 0x1p-17
			}
			for _, mode := range []ScaleMode{RCEIL, FLOOR} {
				first, q := mxwQuant(t, s, device.F32, vals, mxwCase{g: g, k: k, n: n}, Options{Format: f, Mode: mode})
				for _, kMajor := range []bool{true, false} {
					y := f32sOf(mxwDequant(t, s, q, kMajor, device.F32))
					again, q2 := mxwQuant(t, s, device.F32, y, mxwCase{g: g, k: k, n: n}, Options{Format: f, Mode: mode})
					if diff := firstDiff(mxwDequant(t, s, q2, kMajor, device.F32), f32Bytes(y), 4); diff != "" {
						t.Errorf("%v %v kMajor %v: dq(q(dq(q))) against dq(q): %s", f, mode, kMajor, diff)
					}
					if mode == FLOOR {
						for _, i := range map[bool][]int{true: {0, 1}, false: {2, 3}}[kMajor] {
							if diff := firstDiff(again[i], first[i], 1); diff != "" {
								t.Errorf("%v FLOOR: %s of q(dq(q)) against q: %s", f, mxwNames[i], diff)
							}
						}
					}
					q2.Free()
					if mode != RCEIL {
						continue
					}
					kb, nb := (k+127)/128, (n+127)/128
					for i, v := range vals {
						e, kk, nn := i/(k*n), i/n%k, i%n
						c := first[3][((e*nb+nn/128)*k+kk)*4+nn/32%4]
						if kMajor {
							c = first[1][((e*kb+kk/128)*n+nn)*4+kk/32%4]
						}
						bound := math.Max(math.Abs(float64(v))*rel, math.Ldexp(sub, int(c)-127)) * (1 + 0x1p-18)
						if err := math.Abs(float64(y[i]) - float64(v)); !(err <= bound) {
							t.Fatalf("%v kMajor %v: w[%d][%d][%d] = %v dequantized to %v: error %g > %g", f, kMajor, e, kk, nn, v, y[i], err, bound)
						}
					}
				}
				q.Free()
			}
		}
	})
}

// TestQuantizeMXFP8WeightsLargeGPU compares the GPU with the CPU, bit for bit, on bf16
// 2×2048×7168 weights in both layouts, every kernel variant.
func TestQuantizeMXFP8WeightsLargeGPU(t *testing.T) {
	g := dt.GPU(t)
	s, cpu := g.Stream(), device.CPU().Stream()
	c := mxwCase{g: 2, k: 2048, n: 7168}
	vals := testValues(dt.Rand(6), c.g*c.k*c.n, true)
	for _, nk := range []bool{false, true} {
		c.nk = nk
		want, qc := mxwQuant(t, cpu, device.BF16, vals, c, Options{})
		qc.Free()
		for _, v := range variants(g) {
			restore := v.use()
			got, q := mxwQuant(t, s, device.BF16, vals, c, Options{})
			restore()
			for i := range got {
				if diff := firstDiff(got[i], want[i], 1); diff != "" {
					t.Errorf("%s nk %v: %s: %s", v.name, nk, mxwNames[i], diff)
				}
			}
			q.Free()
		}
	}
}
