package quant

import (
	"fmt"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/google/go-cmp/cmp"
)

// colTCases are the groupings of the transposed-data tests: Zipf sizes with empty groups
// and groups of 1–127 rows, hand-picked sizes around 32 and 128, and M not a multiple of
// 128 without groups.
var colTCases = []struct {
	m, k  int
	sizes []int32 // nil: no groups
}{
	{1000, 96, baseline.ZipfSizes(16, 1000, 3)},
	{500, 256, baseline.ZipfSizes(32, 500, 5)},
	{649, 200, []int32{0, 1, 127, 128, 129, 0, 31, 33, 200, 0}},
	{300, 64, []int32{0, 300, 0}},
	{300, 288, nil}, {5, 40, nil}, {130, 256, nil}, {1, 32, nil},
}

// colTColumns returns, for m rows in groups of sizes (nil: one group), the ColT column of
// each row: group g's row r is column 128·P_g + r, P_g = Σ_{h<g} ceil(M_h/128).
func colTColumns(m int, sizes []int32) []int {
	if sizes == nil {
		sizes = []int32{int32(m)}
	}
	cols := make([]int, 0, m)
	p := 0
	for _, n := range sizes {
		for r := range int(n) {
			cols = append(cols, 128*p+r)
		}
		p += (int(n) + 127) / 128
	}
	return cols
}

// TestColTIsColTransposed checks, on every device and kernel variant, that the transposed
// columnwise data is Col transposed into the groups' token columns (ColT[k][p] =
// Col[row(p)][k], padding columns 0), that the scales and the rowwise data are those of
// the untransposed quantization, and that Dequantize gives the same bits from ColT as
// from Col.
func TestColTIsColTransposed(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range colTCases {
			for oi, opt := range []Options{
				{Dir: Both},
				{Dir: Columnwise, Format: E5M2, Mode: FLOOR},
				{Dir: Both, Swizzle: true, Mode: FLOOR},
			} {
				in := []device.DType{device.BF16, device.F32}[(ci+oi)%2]
				name := fmt.Sprintf("%d×%d %v groups %v %+v", c.m, c.k, in, c.sizes, opt)
				x, _ := upload(t, s, in, testValues(dt.Rand(uint64(100*ci+oi)), c.m*c.k, true), c.m, c.k)
				opt.GroupSizes = groupTensor(t, s, c.sizes)
				for _, v := range variants(d) {
					restore := v.use()
					plain, qp := quantBytes(t, s, x, opt)
					topt := opt
					topt.Transpose = true
					got, q := quantBytes(t, s, x, topt)
					restore()
					if q.Col != nil || q.ColT == nil || !q.Transposed {
						t.Fatalf("%s %s: Col %v, ColT %v, Transposed %v: want only ColT", v.name, name, q.Col, q.ColT, q.Transposed)
					}
					ld := 32 * q.Tiles()
					if diff := cmp.Diff([]int{c.k, ld}, q.ColT.Shape()); diff != "" {
						t.Errorf("%s %s: ColT shape (-want +got):\n%s", v.name, name, diff)
					}
					want := make([]byte, c.k*ld)
					for r, p := range colTColumns(c.m, c.sizes) {
						for j := range c.k {
							want[j*ld+p] = plain.col[r*c.k+j]
						}
					}
					if diff := firstDiff(got.col, want, 1); diff != "" {
						t.Errorf("%s %s: ColT against Col transposed: %s", v.name, name, diff)
					}
					for _, p := range []struct {
						name      string
						got, want []byte
					}{{"Row", got.row, plain.row}, {"RowScale", got.rowScale, plain.rowScale}, {"ColScale", got.colScale, plain.colScale}} {
						if diff := firstDiff(p.got, p.want, 1); diff != "" {
							t.Errorf("%s %s: %s of the transposed quantization: %s", v.name, name, p.name, diff)
						}
					}
					for _, out := range []device.DType{device.F32, device.BF16} {
						a, b := dequantBytes(t, s, q, Columnwise, out), dequantBytes(t, s, qp, Columnwise, out)
						if diff := firstDiff(a, b, out.Size()); diff != "" {
							t.Errorf("%s %s: Dequantize from ColT → %v against from Col: %s", v.name, name, out, diff)
						}
					}
					if q.Status != nil {
						dt.NoErr(t, q.Status.Check(s))
					}
					q.Free()
					qp.Free()
				}
				device.FreeAll(x, opt.GroupSizes)
			}
		}
	})
}

// dequantBytes dequantizes q's direction dir into a poisoned tensor of dtype out and
// returns its bytes.
func dequantBytes(t testing.TB, s *device.Stream, q *MXFP8, dir Direction, out device.DType) []byte {
	t.Helper()
	y := dt.Must(s.Alloc(out, q.M, q.K))
	defer y.Free()
	dt.Poison(t, s, y)
	dt.NoErr(t, Dequantize(s, y, q, dir))
	return download(t, s, y)
}

// TestColTRoundTrip checks that values dequantized from ColT, quantized again with
// Transpose, dequantize to the same bits, and under FLOOR give the same codes and
// scales, grouped and not.
func TestColTRoundTrip(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, c := range colTCases[2:5] {
			for _, mode := range []ScaleMode{RCEIL, FLOOR} {
				for _, f := range []Format{E4M3, E5M2} {
					opt := Options{Format: f, Mode: mode, Dir: Columnwise, Transpose: true, GroupSizes: groupTensor(t, s, c.sizes)}
					x, _ := upload(t, s, device.F32, testValues(dt.Rand(uint64(c.m)), c.m*c.k, false), c.m, c.k)
					first, q := quantBytes(t, s, x, opt)
					y := dt.Must(s.Alloc(device.F32, c.m, c.k))
					dt.NoErr(t, Dequantize(s, y, q, Columnwise))
					again, q2 := quantBytes(t, s, y, opt)
					a, b := dequantBytes(t, s, q, Columnwise, device.F32), dequantBytes(t, s, q2, Columnwise, device.F32)
					if diff := firstDiff(b, a, 4); diff != "" {
						t.Errorf("%d×%d groups %v %v %v: dq(q(dq(ColT))) against dq(ColT): %s", c.m, c.k, c.sizes, f, mode, diff)
					}
					if mode == FLOOR {
						if diff := diffOut(again, first); diff != "" {
							t.Errorf("%d×%d groups %v %v FLOOR: q(dq(ColT)) against ColT: %s", c.m, c.k, c.sizes, f, diff)
						}
					}
					for i, v := range f32sOf(a) {
						if math.IsNaN(float64(v)) {
							t.Fatalf("%d×%d groups %v %v %v: element %d dequantized to NaN from finite input", c.m, c.k, c.sizes, f, mode, i)
						}
					}
					q.Free()
					q2.Free()
					device.FreeAll(x, y, opt.GroupSizes)
				}
			}
		}
	})
}
