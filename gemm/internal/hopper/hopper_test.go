package hopper

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, grouped) }

// sizesRecord is a status record of the kernels as the tests' decoder of package gemm's
// domain returns it (gemm, whose decoder words it, is not linked into these tests).
type sizesRecord struct {
	Op, Code int
	V        [3]int64
}

func (r *sizesRecord) Error() string {
	return fmt.Sprintf("op %d, code %d, values %v", r.Op, r.Code, r.V)
}

func init() {
	device.RegisterStatus(1, func(op, code int, v [3]int64) error { return &sizesRecord{op, code, v} })
}

// reference computes y = a·B_g in float64 from bf16 inputs.
func reference(a, b []float32, sizes []int32, M, Kc, N int, bMN bool) []float64 {
	y := make([]float64, M*N)
	row := 0
	for g, sz := range sizes {
		for r := row; r < row+int(sz); r++ {
			for n := 0; n < N; n++ {
				var acc float64
				for k := 0; k < Kc; k++ {
					var bv float32
					if bMN {
						bv = b[(g*Kc+k)*N+n]
					} else {
						bv = b[(g*N+n)*Kc+k]
					}
					acc += float64(a[r*Kc+k]) * float64(bv)
				}
				y[r*N+n] = acc
			}
		}
		row += int(sz)
	}
	return y
}

// hopperGPU returns the GPU of the tests if it runs the Hopper kernels, and skips the
// test (fails it when GPUs are required) if not.
func hopperGPU(tb testing.TB) *device.Device {
	tb.Helper()
	d := dt.GPU(tb)
	if err := Supported(d); err != nil {
		if dt.RequireGPU() {
			tb.Fatal(err)
		}
		tb.Skip(err)
	}
	return d
}

func TestGroupedGEMM(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	for _, tc := range []struct {
		name    string
		M, K, N int
		sizes   []int32
		bMN     bool
		out     device.DType
	}{
		{"kmaj_one", 128, 64, 256, []int32{128}, false, device.F32},
		{"mnmaj_one", 128, 64, 256, []int32{128}, true, device.F32},
		{"kmaj_ragged", 700, 200, 320, []int32{0, 129, 1, 300, 0, 200}, false, device.BF16},
		{"mnmaj_ragged", 700, 200, 320, []int32{0, 129, 1, 300, 0, 200}, true, device.BF16},
		{"mnmaj_big", 1024, 1024, 512, []int32{256, 0, 512, 200}, true, device.F32},
		{"kmaj_big", 1024, 1024, 512, []int32{256, 0, 512, 200}, false, device.F32},
		{"mnmaj_70_groups", 3000, 128, 256, manySizes(70, 80), true, device.BF16},
		// More than 4·132 tiles: dealt rounds, then claimed ones, light groups among them.
		{"mnmaj_dealt_and_claimed", 8000, 64, 2304, manySizes(56, 300), true, device.BF16},
		// N not a multiple of the 64 columns a pass of the staged epilogue stores.
		{"kmaj_ragged_n200", 700, 192, 200, []int32{0, 129, 1, 300, 0, 200}, false, device.BF16},
		{"mnmaj_ragged_n328", 700, 256, 328, []int32{65, 63, 1, 300, 200}, true, device.BF16},
		// Groups of more than one band of row tiles (bandRows), the last band short.
		{"kmaj_bands", 6000, 64, 768, []int32{2900, 0, 2600, 1, 300}, false, device.BF16},
		// Fewer tiles than CTAs, a contraction of 32 k-blocks: every tile split in 6 units,
		// a tile of 50 rows (one warpgroup idle), a light group.
		{"kmaj_split", 1000, 2048, 512, []int32{300, 50, 0, 129, 400}, false, device.BF16},
		{"mnmaj_split", 1000, 2048, 512, []int32{300, 50, 0, 129, 400}, true, device.BF16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dt.Rand(7)
			G := len(tc.sizes)
			av := dt.Normal(r, tc.M*tc.K, 1)
			bv := dt.Normal(r, G*tc.K*tc.N, 1)
			round := func(v []float32) {
				for i := range v {
					v[i] = device.BF16ToFloat32(device.BF16FromFloat32(v[i]))
				}
			}
			round(av)
			round(bv)
			a := dt.Must(device.FromFloat32(s, device.BF16, av, tc.M, tc.K))
			shape := []int{G, tc.N, tc.K}
			if tc.bMN {
				shape = []int{G, tc.K, tc.N}
			}
			b := dt.Must(device.FromFloat32(s, device.BF16, bv, shape...))
			sz := dt.Must(device.FromSlice(s, device.I32, tc.sizes, G))
			st := dt.Must(device.NewStatus(s))
			defer st.Free()
			y := dt.Must(s.Alloc(tc.out, tc.M, tc.N))
			// A caller's counter, poisoned: the call must reset it before the GEMM reads it.
			ctr := dt.Must(s.Alloc(device.I32, 1))
			defer ctr.Free()
			dt.Poison(t, s, y, ctr)
			dt.NoErr(t, GroupedGEMM(s, y, a, b, sz, st, 1, ctr, tc.bMN))
			got := dt.Must(y.Float32s(s))
			want := reference(av, bv, tc.sizes, tc.M, tc.K, tc.N, tc.bMN)
			var num, den float64
			bad := 0
			for i := range want {
				e := float64(got[i]) - want[i]
				num += e * e
				den += want[i] * want[i]
				if math.IsNaN(float64(got[i])) || math.Abs(e) > 0.02*math.Sqrt(float64(tc.K))+0.02*math.Abs(want[i]) {
					if bad < 5 {
						t.Errorf("y[%d,%d] = %v, want %v", i/tc.N, i%tc.N, got[i], want[i])
					}
					bad++
				}
			}
			t.Logf("relative error %.3g, %d bad of %d", math.Sqrt(num/den), bad, len(want))
			if tc.out == device.BF16 {
				checkDirectEpilogue(t, s, y, a, b, sz, tc.bMN)
			}
			checkStatusFree(t, s, st, a, b, sz, y)
		})
	}
}

// TestBands: the forward's bands of row tiles change which CTA computes which tile, not
// the bytes: bands of 2 row tiles, of the default height and none give the same y, over
// groups of several bands with a short last one.
func TestBands(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	defer func(v int) { bandRows = v }(bandRows)
	const M, K, N = 6000, 64, 768
	sizes := []int32{2900, 0, 2600, 1, 300}
	G := len(sizes)
	for _, bMN := range []bool{false, true} {
		shape := []int{G, N, K}
		if bMN {
			shape = []int{G, K, N}
		}
		a := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(21), M*K, 1), M, K))
		b := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(22), G*K*N, 1), shape...))
		sz := dt.Must(device.FromSlice(s, device.I32, sizes, G))
		run := func(rows int) []uint16 {
			bandRows = rows
			y := dt.Must(s.Alloc(device.BF16, M, N))
			defer y.Free()
			dt.Poison(t, s, y)
			dt.NoErr(t, GroupedGEMM(s, y, a, b, sz, nil, 1, nil, bMN))
			got := make([]uint16, M*N)
			dt.NoErr(t, device.Download(s, y, got))
			return got
		}
		want := run(2048)
		for _, rows := range []int{256, 0} {
			if diff := cmp.Diff(want, run(rows)); diff != "" {
				t.Errorf("MN-major %v, bands of %d rows against 2048 (-2048 +%d):\n%.2000s", bMN, rows, rows, diff)
			}
		}
		for _, x := range []*device.Tensor{a, b, sz} {
			x.Free()
		}
	}
}

// TestSplitTiles: a last round of fewer tiles than CTAs is split along the contraction
// into units whose partial sums the last of them adds up. Against the unsplit kernels
// the sums differ only in their order (f32 rounding); the split result is the same bytes
// on every run, whichever rounds the CTAs claim (a uniform routing dealt, a skewed one
// claimed) and whichever L2 hints their loads carry.
func TestSplitTiles(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	defer func(c int, on bool, h int) { claimRounds, splitTiles, l2Hint = c, on, h }(claimRounds, splitTiles, l2Hint)
	const M, K, N = 4480, 4096, 1024
	for _, tc := range []struct {
		name  string
		sizes []int32
		bMN   bool
	}{
		{"uniform", []int32{M}, false},                   // 140 tiles: 8 split in 16 units each
		{"skewed", []int32{3000, 100, 0, 1, 1379}, true}, // 148 tiles: 16 split in 8
	} {
		t.Run(tc.name, func(t *testing.T) {
			G := len(tc.sizes)
			shape := []int{G, N, K}
			if tc.bMN {
				shape = []int{G, K, N}
			}
			a := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(31), M*K, 1), M, K))
			b := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(32), G*K*N, 1), shape...))
			sz := dt.Must(device.FromSlice(s, device.I32, tc.sizes, G))
			defer func() {
				for _, x := range []*device.Tensor{a, b, sz} {
					x.Free()
				}
			}()
			run := func(split bool, claim int) []float32 {
				splitTiles, claimRounds = split, claim
				y := dt.Must(s.Alloc(device.F32, M, N))
				defer y.Free()
				dt.Poison(t, s, y)
				dt.NoErr(t, GroupedGEMM(s, y, a, b, sz, nil, 1, nil, tc.bMN))
				return dt.Must(y.Float32s(s))
			}
			whole, split := run(false, -1), run(true, -1)
			differ := 0
			for i := range whole {
				e := math.Abs(float64(split[i] - whole[i]))
				if math.IsNaN(float64(split[i])) || e > 1e-5*math.Abs(float64(whole[i]))+1e-3 {
					t.Fatalf("y[%d,%d] = %v split, %v whole", i/N, i%N, split[i], whole[i])
				}
				if e != 0 {
					differ++
				}
			}
			if differ == 0 {
				t.Errorf("split and whole tiles gave the same bits everywhere: no tile was split")
			}
			for _, claim := range []int{-1, 0, 1 << 20} {
				if diff := cmp.Diff(split, run(true, claim)); diff != "" {
					t.Errorf("split tiles, %d claimed rounds, against the first run:\n%.1000s", claim, diff)
				}
			}
			for _, hint := range []int{0, 6, 9} {
				l2Hint = hint
				if diff := cmp.Diff(split, run(true, -1)); diff != "" {
					t.Errorf("split tiles, L2 hint %d, against the first run:\n%.1000s", hint, diff)
				}
			}
			l2Hint = -1
		})
	}
}

// checkDirectEpilogue runs the bf16 forward of TestGroupedGEMM again into a y that starts 4
// bytes past a 16-byte boundary, which the staged epilogue cannot store into, so that the
// kernels store from the accumulator layout: the bytes must be those of want (the staged
// epilogue's, y aligned), rows past the groups zeroed as well.
func checkDirectEpilogue(t *testing.T, s *device.Stream, want, a, b, sizes *device.Tensor, bMN bool) {
	t.Helper()
	M, N := want.Dim(0), want.Dim(1)
	buf := dt.Must(s.Alloc(device.BF16, M*N+8))
	defer buf.Free()
	y := dt.Must(buf.View(2, M, N))
	if want.Ptr()%16 != 0 || y.Ptr()%16 == 0 {
		t.Fatalf("y at %#x and %#x: want one 16-byte aligned and one not", want.Ptr(), y.Ptr())
	}
	dt.Poison(t, s, buf)
	dt.NoErr(t, GroupedGEMM(s, y, a, b, sizes, nil, 1, nil, bMN))
	staged := make([]uint16, M*N)
	direct := make([]uint16, M*N)
	dt.NoErr(t, device.Download(s, want, staged))
	dt.NoErr(t, device.Download(s, y, direct))
	if diff := cmp.Diff(staged, direct); diff != "" {
		t.Errorf("stores from the accumulator layout against the staged epilogue (-staged +direct):\n%.2000s", diff)
	}
}

// checkStatusFree reports an error recorded in st on s, then frees ts.
func checkStatusFree(t *testing.T, s *device.Stream, st *device.Status, ts ...*device.Tensor) {
	t.Helper()
	if err := st.Check(s); err != nil {
		t.Errorf("status: %v", err)
	}
	for _, x := range ts {
		x.Free()
	}
}

// TestStreams runs each kernel on two streams at once, several times: every result must
// be the bytes of a call alone (the forward's tile counter belongs to its call).
func TestStreams(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	const M, K, N = 8000, 128, 2048
	sizes := manySizes(56, 300) // forward: 648 tiles, dealt rounds then claimed ones
	G := len(sizes)
	a := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(11), M*K, 1), M, K))
	b := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(12), G*K*N, 1), G, K, N))
	dy := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(13), M*N, 1), M, N))
	sz := dt.Must(device.FromSlice(s, device.I32, sizes, G))
	defer func() {
		for _, x := range []*device.Tensor{a, b, dy, sz} {
			x.Free()
		}
	}()
	s2 := dt.Must(d.NewStream())
	defer s2.Close()
	for _, tc := range []struct {
		name  string
		shape []int
		call  func(s *device.Stream, out *device.Tensor) error
	}{
		{"forward", []int{M, N}, func(s *device.Stream, y *device.Tensor) error { return GroupedGEMM(s, y, a, b, sz, nil, 1, nil, true) }},
		{"weight_grad", []int{G, K, N}, func(s *device.Stream, dw *device.Tensor) error { return WeightGrad(s, dw, a, dy, sz, nil, 3, false) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ref := dt.Must(s.Alloc(device.BF16, tc.shape...))
			dt.Poison(t, s, ref)
			dt.NoErr(t, tc.call(s, ref))
			want := make([]uint16, ref.Len())
			dt.NoErr(t, device.Download(s, ref, want))
			ys := []*device.Tensor{dt.Must(s.Alloc(device.BF16, tc.shape...)), dt.Must(s.Alloc(device.BF16, tc.shape...))}
			dt.NoErr(t, s.Synchronize())
			for rep := range 4 {
				for i, st := range []*device.Stream{s, s2} {
					dt.Poison(t, st, ys[i])
				}
				for range 3 {
					for i, st := range []*device.Stream{s, s2} {
						dt.NoErr(t, tc.call(st, ys[i]))
					}
				}
				for i, st := range []*device.Stream{s, s2} {
					got := make([]uint16, len(want))
					dt.NoErr(t, device.Download(st, ys[i], got))
					for j := range got {
						if got[j] != want[j] {
							t.Fatalf("round %d, stream %d: element %d = %#04x, want %#04x (a call alone)", rep, i, j, got[j], want[j])
						}
					}
				}
			}
			for _, x := range append(ys, ref) {
				x.Free()
			}
		})
	}
}

// manySizes returns g group sizes from 0 to most, some of them 0, in a fixed order.
func manySizes(g, most int) []int32 {
	r := dt.Rand(uint64(g))
	out := make([]int32, g)
	for i := range out {
		if r.IntN(5) > 0 {
			out[i] = int32(r.IntN(most + 1))
		}
	}
	return out
}

// TestInvalidSizes: a negative size or sizes summing past M, past the first 32 groups
// (the kernels scan the sizes 32 at a time), record the first bad group in the status,
// with the call's op, and leave the output as it was.
func TestInvalidSizes(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	const M, K, N = 512, 64, 64
	for _, tc := range []struct {
		name string
		edit func(sz []int32)
		code int
		v    [3]int64
	}{
		{"negative", func(sz []int32) { sz[40] = -3; sz[50] = 1000 }, 1, [3]int64{40, -3, M}},
		{"past_m", func(sz []int32) { sz[45] = 500; sz[60] = -1 }, 2, [3]int64{45, 2*45 + 500, M}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sizes := make([]int32, 64)
			for i := range sizes {
				sizes[i] = 2
			}
			tc.edit(sizes)
			sz := dt.Must(device.FromSlice(s, device.I32, sizes, len(sizes)))
			a := dt.Must(s.Alloc(device.BF16, M, K))
			dt.NoErr(t, device.Fill(s, a, 1))
			for _, wg := range []bool{false, true} {
				st := dt.Must(device.NewStatus(s))
				op := 1
				var out *device.Tensor
				if wg {
					dy := dt.Must(s.Alloc(device.BF16, M, N))
					dt.NoErr(t, device.Fill(s, dy, 1))
					out = dt.Must(s.Alloc(device.F32, len(sizes), K, N))
					dt.NoErr(t, device.Fill(s, out, 7))
					op = 3
					dt.NoErr(t, WeightGrad(s, out, a, dy, sz, st, op, false))
					dy.Free()
				} else {
					b := dt.Must(s.Alloc(device.BF16, len(sizes), K, N))
					dt.NoErr(t, device.Fill(s, b, 1))
					out = dt.Must(s.Alloc(device.F32, M, N))
					dt.NoErr(t, device.Fill(s, out, 7))
					dt.NoErr(t, GroupedGEMM(s, out, a, b, sz, st, op, nil, true))
					b.Free()
				}
				var got *sizesRecord
				if err := st.Check(s); !errors.As(err, &got) {
					t.Errorf("weight gradient %v: status %v, want a record", wg, err)
				} else if d := cmp.Diff(&sizesRecord{op, tc.code, tc.v}, got); d != "" {
					t.Errorf("weight gradient %v: status record (-want +got):\n%s", wg, d)
				}
				vals := dt.Must(out.Float32s(s))
				for i, v := range vals {
					if v != 7 {
						t.Errorf("weight gradient %v: output[%d] = %v, want it untouched (7)", wg, i, v)
						break
					}
				}
				out.Free()
				st.Free()
			}
			a.Free()
			sz.Free()
		})
	}
}

// randomize fills t (BF16) with N(0,1) values: a random block uploaded once and copied
// over t, so large benchmark inputs cost little to make but keep tensor cores busy
// with realistic bit patterns.
func randomize(tb testing.TB, s *device.Stream, t *device.Tensor) {
	const blk = 1 << 22
	n := t.Len()
	src := dt.Must(device.FromFloat32(s, device.BF16, dt.Normal(dt.Rand(uint64(n)), min(n, blk), 1), min(n, blk)))
	defer src.Free()
	for off := 0; off < n; off += blk {
		m := min(blk, n-off)
		dst := dt.Must(t.View(off, m))
		sv := dt.Must(src.View(0, m))
		dt.NoErr(tb, device.Copy(s, dst, sv))
	}
}

// benchCases are the uniform baseline shapes.
var benchCases = []struct {
	name       string
	G, M, K, N int
}{
	{"dsv3_wi", 32, 65536, 7168, 4096},
	{"dsv3_wo", 32, 65536, 2048, 7168},
	{"mixtral_wi", 8, 32768, 4096, 28672},
	{"qwen3_wi", 128, 32768, 2048, 1536},
	{"qwen3_small", 128, 2048, 2048, 1536},
}

// benchGEMM times call, whose operands are a[M,K] and b[M or G·K, ·] (random bf16),
// out (bf16) and uniform sizes, and reports 2·M·K·N flops per call as TFLOP/s.
func benchGEMM(b *testing.B, G, M, K, N int, aShape, bShape, outShape []int,
	call func(s *device.Stream, out, a, bt, sizes *device.Tensor, st *device.Status) error) {
	d := hopperGPU(b)
	s := d.Stream()
	a := dt.Must(s.Alloc(device.BF16, aShape...))
	bt := dt.Must(s.Alloc(device.BF16, bShape...))
	out := dt.Must(s.Alloc(device.BF16, outShape...))
	randomize(b, s, a)
	randomize(b, s, bt)
	sizes := make([]int32, G)
	for i := range sizes {
		sizes[i] = int32(M / G)
	}
	sz := dt.Must(device.FromSlice(s, device.I32, sizes, G))
	st := dt.Must(device.NewStatus(s))
	defer st.Free()
	dt.NoErr(b, call(s, out, a, bt, sz, st))
	dt.NoErr(b, s.Synchronize())
	b.ResetTimer()
	for range b.N {
		dt.NoErr(b, call(s, out, a, bt, sz, st))
	}
	dt.NoErr(b, s.Synchronize())
	b.ReportMetric(2*float64(M)*float64(K)*float64(N)*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
	for _, x := range []*device.Tensor{a, bt, out, sz} {
		x.Free()
	}
}

func BenchmarkGrouped(b *testing.B) {
	for _, c := range benchCases {
		for _, mn := range []bool{true, false} {
			name := c.name + "/kmaj"
			if mn {
				name = c.name + "/mnmaj"
			}
			b.Run(name, func(b *testing.B) {
				benchGEMM(b, c.G, c.M, c.K, c.N, []int{c.M, c.K}, []int{c.G, c.K, c.N}, []int{c.M, c.N},
					func(s *device.Stream, y, x, w, sz *device.Tensor, st *device.Status) error {
						return GroupedGEMM(s, y, x, w, sz, st, 1, nil, mn)
					})
			})
		}
	}
}

func TestWeightGrad(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	for _, tc := range []struct {
		name    string
		M, K, N int
		sizes   []int32
		acc     bool
		out     device.DType
	}{
		{"one", 64, 128, 256, []int32{64}, false, device.F32},
		{"ragged", 700, 200, 320, []int32{0, 129, 1, 300, 0, 200}, false, device.F32},
		{"ragged_bf16", 700, 200, 320, []int32{0, 129, 1, 300, 0, 200}, false, device.BF16},
		{"acc", 1000, 256, 512, []int32{500, 0, 63, 65, 300}, true, device.F32},
		{"70_groups_bf16", 3000, 128, 256, manySizes(70, 80), false, device.BF16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dt.Rand(9)
			G := len(tc.sizes)
			xv := dt.Normal(r, tc.M*tc.K, 1)
			yv := dt.Normal(r, tc.M*tc.N, 1)
			base := dt.Normal(r, G*tc.K*tc.N, 1)
			for _, v := range [][]float32{xv, yv, base} {
				for i := range v {
					v[i] = device.BF16ToFloat32(device.BF16FromFloat32(v[i]))
				}
			}
			// Rows past the groups belong to none: NaN there must not reach dw.
			used := 0
			for _, n := range tc.sizes {
				used += int(n)
			}
			for i := used * tc.K; i < len(xv); i++ {
				xv[i] = float32(math.NaN())
			}
			for i := used * tc.N; i < len(yv); i++ {
				yv[i] = float32(math.NaN())
			}
			x := dt.Must(device.FromFloat32(s, device.BF16, xv, tc.M, tc.K))
			dy := dt.Must(device.FromFloat32(s, device.BF16, yv, tc.M, tc.N))
			sz := dt.Must(device.FromSlice(s, device.I32, tc.sizes, G))
			st := dt.Must(device.NewStatus(s))
			defer st.Free()
			dw := dt.Must(s.Alloc(tc.out, G, tc.K, tc.N))
			if tc.acc {
				dt.NoErr(t, dw.SetFloat32(s, base))
			} else {
				dt.Poison(t, s, dw)
			}
			dt.NoErr(t, WeightGrad(s, dw, x, dy, sz, st, 3, tc.acc))
			got := dt.Must(dw.Float32s(s))
			var num, den float64
			bad := 0
			row := 0
			for g, n := range tc.sizes {
				for k := 0; k < tc.K; k++ {
					for j := 0; j < tc.N; j++ {
						var want float64
						if tc.acc {
							want = float64(base[(g*tc.K+k)*tc.N+j])
						}
						for m := row; m < row+int(n); m++ {
							want += float64(xv[m*tc.K+k]) * float64(yv[m*tc.N+j])
						}
						v := float64(got[(g*tc.K+k)*tc.N+j])
						e := v - want
						num += e * e
						den += want * want
						if math.IsNaN(v) || math.Abs(e) > 0.05*math.Sqrt(float64(n)+1)+0.01*math.Abs(want) || (n == 0 && !tc.acc && v != 0) {
							if bad < 5 {
								t.Errorf("dw[%d,%d,%d] = %v, want %v", g, k, j, v, want)
							}
							bad++
						}
					}
				}
				row += int(n)
			}
			t.Logf("relative error %.3g, %d bad", math.Sqrt(num/den), bad)
			checkStatusFree(t, s, st, x, dy, sz, dw)
		})
	}
}

// TestWeightGradManyTiles: a weight gradient of 1,056 tiles (eight rounds of the grid),
// groups of 300 rows (a partial last k-block each) and rows past the groups. No poisoned
// element may remain, and sampled elements match a float64 reference.
func TestWeightGradManyTiles(t *testing.T) {
	d := hopperGPU(t)
	s := d.Stream()
	const G, rows, K, N = 66, 300, 1024, 512
	const M = G*rows + 100
	r := dt.Rand(21)
	xv := dt.Normal(r, M*K, 1)
	yv := dt.Normal(r, M*N, 1)
	for _, v := range [][]float32{xv, yv} {
		for i := range v {
			v[i] = device.BF16ToFloat32(device.BF16FromFloat32(v[i]))
		}
	}
	sizes := make([]int32, G)
	for g := range sizes {
		sizes[g] = rows
	}
	x := dt.Must(device.FromFloat32(s, device.BF16, xv, M, K))
	dy := dt.Must(device.FromFloat32(s, device.BF16, yv, M, N))
	sz := dt.Must(device.FromSlice(s, device.I32, sizes, G))
	dw := dt.Must(s.Alloc(device.BF16, G, K, N))
	defer func() {
		for _, v := range []*device.Tensor{x, dy, sz, dw} {
			v.Free()
		}
	}()
	dt.Poison(t, s, dw)
	dt.NoErr(t, WeightGrad(s, dw, x, dy, sz, nil, 3, false))
	got := dt.Must(dw.Float32s(s))
	for i, v := range got {
		if math.IsNaN(float64(v)) {
			t.Fatalf("dw[%d,%d,%d] was not written", i/(K*N), i/N%K, i%N)
		}
	}
	for range 4096 {
		g, k, j := r.IntN(G), r.IntN(K), r.IntN(N)
		var want float64
		for m := g * rows; m < (g+1)*rows; m++ {
			want += float64(xv[m*K+k]) * float64(yv[m*N+j])
		}
		if v := float64(got[(g*K+k)*N+j]); math.Abs(v-want) > 0.05*math.Sqrt(rows)+0.01*math.Abs(want) {
			t.Fatalf("dw[%d,%d,%d] = %v, want %v", g, k, j, v, want)
		}
	}
}

func BenchmarkWeightGrad(b *testing.B) {
	for _, c := range benchCases {
		b.Run(c.name, func(b *testing.B) {
			benchGEMM(b, c.G, c.M, c.K, c.N, []int{c.M, c.K}, []int{c.M, c.N}, []int{c.G, c.K, c.N},
				func(s *device.Stream, dw, x, dy, sz *device.Tensor, st *device.Status) error {
					return WeightGrad(s, dw, x, dy, sz, st, 3, false)
				})
		})
	}
}

// TestL2Policy: the forward's L2 hints are on (A evict last, B evict first) from 32 column
// tiles of 256, off below, and the setting overrides the choice.
func TestL2Policy(t *testing.T) {
	defer func(h int) { l2Hint = h }(l2Hint)
	for _, tc := range []struct{ hint, n, want int }{
		{-1, 28672, 6}, {-1, 8192, 6}, {-1, 7937, 6}, {-1, 7936, 0}, {-1, 7168, 0}, {-1, 1, 0},
		{0, 28672, 0}, {9, 1024, 9},
	} {
		l2Hint = tc.hint
		if got := l2Policy(tc.n); got != int32(tc.want) {
			t.Errorf("l2Policy(%d) with DROPLESS_GEMM_L2 %d = %d, want %d", tc.n, tc.hint, got, tc.want)
		}
	}
}
