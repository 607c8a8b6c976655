package hopper

import (
	"bytes"
	"math"
	"math/rand/v2"
	"regexp"
	"strconv"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestFP8KernelsCompile(t *testing.T) { dt.CheckCompiles(t, fp8) }

// TestFP8KernelsCompileBodies compiles the sm_90a bodies of the FP8 kernels where NVRTC
// cannot target sm_90a (before 12.0): with __CUDA_ARCH_FEAT_SM90_ALL defined by hand, to
// PTX for compute_90, so that every line of C++ goes through the compiler. (The inline PTX
// is checked only by ptxas, on a machine with NVRTC 12 or later, by TestFP8KernelsCompile.)
func TestFP8KernelsCompileBodies(t *testing.T) {
	dt.RequireNVRTC(t)
	target, err := device.Target(90)
	if err != nil {
		t.Skip(err)
	}
	if target == "sm_90a" {
		t.Skip("NVRTC targets sm_90a: TestFP8KernelsCompile compiles the bodies")
	}
	p := *fp8
	p.Options = append(append([]string(nil), p.Options...), "-D__CUDA_ARCH_FEAT_SM90_ALL")
	img, _, log, err := p.Compile("compute_90")
	if err != nil {
		t.Fatal(err)
	}
	// The bodies are there: the PTX holds the kernels' wgmma instructions.
	for _, want := range []string{"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2", "wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e4m3",
		"setmaxnreg.inc.sync.aligned.u32 232", "setmaxnreg.inc.sync.aligned.u32 160", "setmaxnreg.dec.sync.aligned.u32 24", ".entry dl_hopper_fp8_m192_e4m3_e4m3", ".entry dl_hopper_fp8_wgrad_m192_e5m2_e4m3"} {
		if !regexp.MustCompile(regexp.QuoteMeta(want)).Match(img) {
			t.Errorf("the PTX has no %q", want)
		}
	}
	if log != "" {
		t.Logf("NVRTC log:\n%s", log)
	}
}

// TestFP8StagesMirrorC checks that fp8Stages, fp8Stages3 and fp8MXT (and so fp8Smem and
// fp8Smem3) are HF_STAGES, HF_STAGES3 and HF_MXT of the source.
func TestFP8StagesMirrorC(t *testing.T) {
	for _, c := range []struct {
		name string
		want int
	}{{"HF_STAGES", fp8Stages}, {"HF_STAGES3", fp8Stages3}, {"HF_MXT", fp8MXT},
		{"HF_OUT_BF16", fp8OutBF16}, {"HF_OUT_F32", fp8OutF32}, {"HF_OUT_STAGED", fp8OutStaged}} {
		m := regexp.MustCompile(`#define ` + c.name + ` (\d+)`).FindStringSubmatch(fp8Src)
		if m == nil {
			t.Fatalf("kernels/fp8.cu has no %s", c.name)
		}
		if n, _ := strconv.Atoi(m[1]); n != c.want {
			t.Errorf("%s is %d, the Go mirror %d", c.name, n, c.want)
		}
	}
}

// skipUnlessFP8 skips t unless d is a GPU that runs the FP8 kernels.
func skipUnlessFP8(t *testing.T, d *device.Device) {
	t.Helper()
	if !d.IsCUDA() {
		t.Skip("CPU")
	}
	if err := BlockwiseSupported(d); err != nil {
		t.Skip(err)
	}
}

// TestFP8ClusterGrid: on a GPU that runs the FP8 kernels, the two-CTA kernels' persistent
// grid holds whole clusters and covers most of the multiprocessors (else the one-CTA
// kernels would serve better); it logs the grid.
func TestFP8ClusterGrid(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		skipUnlessFP8(t, d)
		for _, c := range []struct {
			name          string
			threads, smem int
		}{
			{"dl_hopper_fp8_x2_e4m3_e4m3", 384, fp8Smem}, {"dl_hopper_fp8_wgrad_x2_e4m3_e4m3", 384, fp8Smem},
			{"dl_hopper_mx_x2_e4m3_e4m3", 384, fp8Smem}, {"dl_hopper_fp8_x2_m192_e4m3_e4m3", 512, fp8Smem3},
			{"dl_hopper_fp8_wgrad_x2_m192_e4m3_e4m3", 512, fp8Smem3},
		} {
			name := c.name
			k, err := d.Kernel(fp8, name)
			if err != nil {
				t.Fatal(err)
			}
			n, err := k.MaxActiveClusters(2, c.threads, c.smem)
			if err != nil {
				t.Fatal(err)
			}
			g := fp8Grid(d, k, name, c.threads, c.smem)
			t.Logf("%s: %d clusters fit at once on %d multiprocessors: grid %d", name, n, d.Multiprocessors(), g)
			if g%2 != 0 || g > d.Multiprocessors() || 4*g < 3*d.Multiprocessors() {
				t.Errorf("%s: grid %d for %d multiprocessors", name, g, d.Multiprocessors())
			}
		}
	})
}

// TestFP8BadArgs: on a GPU that runs the FP8 kernels, each of their functions refuses
// operands of the wrong shape or dtype with an error naming the operand, before it
// launches anything; a cluster size below 1 is an error of MaxActiveClusters.
func TestFP8BadArgs(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		skipUnlessFP8(t, d)
		s := d.Stream()
		al := func(typ device.DType, shape ...int) *device.Tensor { return dt.Must(s.Alloc(typ, shape...)) }
		// G=2 groups, M=64 rows, K=128, N=256; the weight gradient's R=128, C=256, Mp=256.
		sizes := dt.Must(device.FromSlice(s, device.I32, []int32{32, 32}, 2))
		y := al(device.BF16, 64, 256)
		aQ, wQ := al(device.E4M3, 64, 128), al(device.E4M3, 2, 256, 128)
		bw := FP8{Q: wQ, Scale: al(device.F32, 2, 1, 2)}
		ba := FP8{Q: aQ, Scale: al(device.F32, 1, 64)}
		mw := MXOperand{Q: wQ, Scale: al(device.E8M0, 2, 1, 256, 4)}
		ma := MXOperand{Q: aQ, Scale: al(device.E8M0, 64, 4)}
		dw := al(device.F32, 2, 128, 256)
		xt, dyt := al(device.E4M3, 128, 256), al(device.E4M3, 256, 256)
		bx, bdy := FP8{Q: xt, Scale: al(device.F32, 2, 128)}, FP8{Q: dyt, Scale: al(device.F32, 2, 256)}
		mx, mdy := MXOperand{Q: xt, Scale: al(device.E8M0, 8, 128)}, MXOperand{Q: dyt, Scale: al(device.E8M0, 8, 256)}
		bgemm := func(y *device.Tensor, a, b FP8) func() error {
			return func() error { return BlockwiseGEMM(s, y, a, b, sizes, nil, 1, false) }
		}
		mgemm := func(y *device.Tensor, a, b MXOperand) func() error {
			return func() error { return MXFP8GEMM(s, y, a, b, sizes, nil, 1, false) }
		}
		bwg := func(dw *device.Tensor, a, b FP8, sz *device.Tensor) func() error {
			return func() error { return BlockwiseWeightGrad(s, dw, a, b, 64, sz, nil, 1, false) }
		}
		mwg := func(dw *device.Tensor, a, b MXOperand, sz *device.Tensor) func() error {
			return func() error { return MXFP8WeightGrad(s, dw, a, b, 64, sz, nil, 1, false) }
		}
		one := dt.Must(device.FromSlice(s, device.I32, []int32{64}, 1))
		k := dt.Must(d.Kernel(fp8, "dl_hopper_fp8_e4m3_e4m3"))
		for _, c := range []struct {
			name string
			fn   func() error
			want string
		}{
			{"blockwise y i32", bgemm(al(device.I32, 64, 256), ba, bw), "y is"},
			{"blockwise y shape", bgemm(al(device.BF16, 32, 256), ba, bw), "y is"},
			{"blockwise K not a multiple of 16", bgemm(y, FP8{Q: al(device.E4M3, 64, 120), Scale: ba.Scale}, bw), "multiples of 16"},
			{"blockwise B shape", bgemm(y, ba, FP8{Q: al(device.E4M3, 2, 128, 128), Scale: bw.Scale}), "B is"},
			{"blockwise A scales", bgemm(y, FP8{Q: aQ, Scale: al(device.F32, 1, 62)}, bw), "A's scales"},
			{"blockwise B scales", bgemm(y, ba, FP8{Q: wQ, Scale: al(device.E8M0, 2, 1, 2)}), "B's scales"},
			{"mxfp8 y shape", mgemm(al(device.F32, 32, 256), ma, mw), "y is"},
			{"mxfp8 B shape", mgemm(y, ma, MXOperand{Q: al(device.E4M3, 3, 256, 128), Scale: mw.Scale}), "B is"},
			{"mxfp8 A scales", mgemm(y, MXOperand{Q: aQ, Scale: al(device.F32, 64, 4)}, mw), "A's scales"},
			{"mxfp8 B scales", mgemm(y, ma, MXOperand{Q: wQ, Scale: al(device.E8M0, 2, 1, 256, 2)}), "B's scales"},
			{"blockwise dw rank", bwg(al(device.F32, 128, 256), bx, bdy, sizes), "dw is"},
			{"blockwise dw i32", bwg(al(device.I32, 2, 128, 256), bx, bdy, sizes), "dw is"},
			{"blockwise sizes", bwg(dw, bx, bdy, one), "sizes is"},
			{"blockwise A shape", bwg(dw, FP8{Q: al(device.E4M3, 64, 256), Scale: bx.Scale}, bdy, sizes), "A is"},
			{"blockwise B tokens", bwg(dw, bx, FP8{Q: al(device.E4M3, 256, 128), Scale: bdy.Scale}, sizes), "B is"},
			{"blockwise A scales", bwg(dw, FP8{Q: xt, Scale: al(device.F32, 1, 128)}, bdy, sizes), "A's scales"},
			{"mxfp8 dw rank", mwg(al(device.F32, 128, 256), mx, mdy, sizes), "dw is"},
			{"mxfp8 Mp", mwg(dw, MXOperand{Q: al(device.E4M3, 128, 200), Scale: mx.Scale}, mdy, sizes), "multiple of 128"},
			{"mxfp8 B scales", mwg(dw, mx, MXOperand{Q: dyt, Scale: al(device.E8M0, 8, 128)}, sizes), "B's scales"},
			{"cluster size 0", func() error { return dt.ErrOf(k.MaxActiveClusters(0, 384, fp8Smem)) }, "cluster size 0"},
		} {
			t.Run(c.name, func(t *testing.T) { dt.WantError(t, c.fn, c.want) })
		}
	})
}

// fp8Codes returns n random E4M3 or E5M2 codes, none NaN or infinite (the exponent field
// all ones is replaced by the next lower one).
func fp8Codes(r *rand.Rand, n int, e5m2 bool) []byte {
	b := dt.Bytes(r, n)
	for i, v := range b {
		if e5m2 && v&0x7C == 0x7C {
			b[i] = v &^ 0x04
		} else if !e5m2 && v&0x7F == 0x7F {
			b[i] = v &^ 0x01
		}
	}
	return b
}

// fp8Scales returns n random scales in [2^−4, 2^4).
func fp8Scales(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(math.Exp2(8*r.Float64() - 4))
	}
	return v
}

// TestFP8TallTiles: the blockwise kernels of 192-row tiles (_m192) give the bytes of the
// 128-row kernels in every form (each output's sum runs over the same MMAs and promotions
// in the same order), over ragged groups that split across 192-row tiles and not 128-row
// ones and back, empty and one-row groups, N and R not multiples of 128 or 192, f32 and
// bf16 output (through the staged epilogue and from the accumulator layout), and many tiles;
// and the forward's bands of row tiles (2 row tiles, none) give the bytes of the default.
func TestFP8TallTiles(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		skipUnlessFP8(t, d)
		s := d.Stream()
		defer func(v int, single bool, e string, b int) {
			fp8Rows, fp8Single, epilogue, bandRows = v, single, e, b
		}(fp8Rows, fp8Single, epilogue, bandRows)
		for _, tc := range []struct {
			name     string
			M, Kc, N int
			sizes    []int32
			nk, e5m2 bool
			out      device.DType
		}{
			{"ragged", 1000, 384, 272, []int32{0, 193, 1, 385, 191, 200}, false, false, device.F32},
			{"ragged_nk_bf16", 1000, 384, 272, []int32{0, 193, 1, 385, 191, 200}, true, true, device.BF16},
			{"one_group", 700, 256, 400, []int32{700}, false, false, device.BF16},
			{"many_tiles", 20000, 512, 640, manySizes(40, 480), false, false, device.F32},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r := dt.Rand(91)
				G, skc, sn := len(tc.sizes), ceilDiv(tc.Kc, fp8Block), ceilDiv(tc.N, fp8Block)
				Mr := 4 * ceilDiv(tc.M, 4)
				upload := func(typ device.DType, v []byte, shape ...int) *device.Tensor {
					return dt.Must(device.FromSlice(s, typ, v, shape...))
				}
				aT := device.E4M3
				if tc.e5m2 {
					aT = device.E5M2
				}
				a := FP8{Q: upload(aT, fp8Codes(r, tc.M*tc.Kc, tc.e5m2), tc.M, tc.Kc),
					Scale: dt.Must(device.FromSlice(s, device.F32, fp8Scales(r, skc*Mr), skc, Mr))}
				bs := []int{G, skc, sn}
				if tc.nk {
					bs = []int{G, sn, skc}
				}
				b := FP8{Q: upload(device.E4M3, fp8Codes(r, G*tc.N*tc.Kc, false), G, tc.N, tc.Kc),
					Scale: dt.Must(device.FromSlice(s, device.F32, fp8Scales(r, G*skc*sn), bs...))}
				sizes := dt.Must(device.FromSlice(s, device.I32, tc.sizes, G))
				// The weight gradient over the same groups: A [R, Mp] with R = Kc + 16 (not a
				// multiple of 128 or 192), B [C, Mp] with C = N.
				Mp := 0
				for _, sz := range tc.sizes {
					Mp += fp8Block * ceilDiv(int(sz), fp8Block)
				}
				Mp = max(Mp, fp8Block)
				R, C := tc.Kc+16, tc.N
				wa := FP8{Q: upload(aT, fp8Codes(r, R*Mp, tc.e5m2), R, Mp),
					Scale: dt.Must(device.FromSlice(s, device.F32, fp8Scales(r, Mp/fp8Block*R), Mp/fp8Block, R))}
				wb := FP8{Q: upload(device.E4M3, fp8Codes(r, C*Mp, false), C, Mp),
					Scale: dt.Must(device.FromSlice(s, device.F32, fp8Scales(r, Mp/fp8Block*C), Mp/fp8Block, C))}
				run := func(rows int, single bool) ([]byte, []byte) {
					fp8Rows, fp8Single = rows, single
					y := dt.Must(s.Alloc(tc.out, tc.M, tc.N))
					dw := dt.Must(s.Alloc(tc.out, G, R, C))
					defer y.Free()
					defer dw.Free()
					dt.Poison(t, s, y, dw)
					dt.NoErr(t, BlockwiseGEMM(s, y, a, b, sizes, nil, 1, tc.nk))
					dt.NoErr(t, BlockwiseWeightGrad(s, dw, wa, wb, tc.M, sizes, nil, 1, false))
					yb := make([]byte, y.Bytes())
					wb := make([]byte, dw.Bytes())
					dt.NoErr(t, y.CopyToHost(s, yb))
					dt.NoErr(t, dw.CopyToHost(s, wb))
					return yb, wb
				}
				y3, w3 := run(fp8Rows3, true)
				y2, w2 := run(fp8Block, true)
				yc, wc := run(fp8Rows3, false)
				epilogue = "direct"
				yd, wd := run(fp8Rows3, true)
				epilogue = ""
				bandRows = 256
				yb3, _ := run(fp8Rows3, true)
				yb2, _ := run(fp8Block, true)
				bandRows = 0
				yn3, _ := run(fp8Rows3, true)
				bandRows = 2048
				for _, c := range []struct {
					what      string
					got, want []byte
				}{{"y", y3, y2}, {"dw", w3, w2}, {"y of the two-CTA kernels", yc, y2}, {"dw of the two-CTA kernels", wc, w2},
					{"y from the accumulator layout", yd, y2}, {"dw from the accumulator layout", wd, w2},
					{"y in bands of 2 row tiles", yb3, y2}, {"y in bands of 2 128-row tiles", yb2, y2}, {"y without bands", yn3, y2}} {
					if !bytes.Equal(c.got, c.want) {
						n := 0
						for i := range c.got {
							if c.got[i] != c.want[i] {
								n++
							}
						}
						t.Errorf("%s: %d of %d bytes differ from those of the 128-row kernels in the default bands", c.what, n, len(c.got))
					}
				}
				for _, x := range []*device.Tensor{a.Q, a.Scale, b.Q, b.Scale, wa.Q, wa.Scale, wb.Q, wb.Scale, sizes} {
					x.Free()
				}
			})
		}
	})
}

// TestFP8TallWins: 192-row tiles for long groups, 128-row tiles where the last 192-row
// tile of each group would waste more than the taller tiles gain.
func TestFP8TallWins(t *testing.T) {
	for _, c := range []struct {
		m    int
		want bool
	}{{0, false}, {16, false}, {166, true}, {192, true}, {256, false}, {500, false}, {700, true}, {2048, true}, {4096, true}, {7168, true}} {
		if got := fp8TallWins(c.m); got != c.want {
			t.Errorf("fp8TallWins(%d) = %v, want %v", c.m, got, c.want)
		}
	}
}

// TestFP8Out: the blockwise kernels' output mode, f32, bf16 through the staged epilogue
// only where it can store (one CTA a cluster, not accumulating, DROPLESS_GEMM_EPILOGUE not
// "direct"), else bf16 from the accumulator layout.
func TestFP8Out(t *testing.T) {
	// CPU tensors, whose address reads as 0: aligned. (Unaligned outputs take the direct
	// stores in TestGroupedGEMM's checkDirectEpilogue, on the GPU.)
	s := device.CPU().Stream()
	aligned := dt.Must(s.Alloc(device.BF16, 8, 8))
	f32 := dt.Must(s.Alloc(device.F32, 8, 8))
	defer func(e string) { epilogue = e }(epilogue)
	for _, c := range []struct {
		name string
		cl   int
		out  *device.Tensor
		acc  bool
		env  string
		want int32
	}{
		{"f32", 1, f32, false, "", fp8OutF32},
		{"bf16", 1, aligned, false, "", fp8OutStaged},
		{"bf16_accumulating", 1, aligned, true, "", fp8OutBF16},
		{"bf16_two_ctas", 2, aligned, false, "", fp8OutBF16},
		{"bf16_direct_asked", 1, aligned, false, "direct", fp8OutBF16},
	} {
		epilogue = c.env
		if got := fp8Out(fp8Launch{cl: c.cl}, c.out, c.acc); got != c.want {
			t.Errorf("%s: fp8Out = %d, want %d", c.name, got, c.want)
		}
	}
}
