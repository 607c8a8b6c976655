package quant

import (
	"fmt"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// testSourceSrc is the program of the Source tests: the loader of 3·x[r][c0 + c], the
// columns [c0, c0 + K) of a wider row-major x [M, ld] of E times 3 (values the kernels
// must round to E), with 16-byte loads when asked, instantiated for both recipes.
const testSourceSrc = `
#include "quant_mxfp8.cuh"
#include "quant_blockwise.cuh"

__device__ __forceinline__ float tld(const u16 *p) { return dl_bf16_to_f32(*p); }
__device__ __forceinline__ float tld(const float *p) { return *p; }

template <typename E>
struct TestSrc {
    typedef E T;
    const E *x;
    i64 ld, c0;
    template <bool VEC>
    __device__ __forceinline__ void load8(u64 r, u64 c, int n, float f[8]) const {
        const E *p = x + (i64)r * ld + c0 + (i64)c;
        if (VEC && n >= 8) {
            const uint4 *q = (const uint4 *)p;
            const int per = 16 / (int)sizeof(E);
            for (int k = 0; k < 8 / per; k++) {
                const uint4 w = q[k];
                const u32 v[4] = {w.x, w.y, w.z, w.w};
                for (int e = 0; e < per; e++) {
                    f[k * per + e] = 3.f * (sizeof(E) == 2 ? __uint_as_float(e & 1 ? v[e / 2] & 0xffff0000u : v[e / 2] << 16)
                                                           : __uint_as_float(v[e]));
                }
            }
            return;
        }
        for (int e = 0; e < 8; e++) f[e] = e < n ? 3.f * tld(p + e) : 0.f;
    }
    __device__ __forceinline__ float at(u64 r, u64 c) const { return 3.f * tld(x + (i64)r * ld + c0 + (i64)c); }
};

DL_MX_SOURCE_KERNELS(test_mxq_bf16, TestSrc<u16>, 6)
DL_MX_SOURCE_KERNELS(test_mxq_f32, TestSrc<float>, 4)
DL_BW_SOURCE_KERNELS(test_bwq_bf16, TestSrc<u16>, 3)
DL_BW_SOURCE_KERNELS(test_bwq_f32, TestSrc<float>, 2)
`

// testSourceProgs are the program of the Source tests with the hardware and the software
// element conversion.
var testSourceProgs = [2]*device.Program{
	device.NewProgram("source_test.cu", testSourceSrc).WithHeaders(Headers()...),
	device.NewProgram("source_test.cu", testSourceSrc, "-DDL_MX_HW_CVT=0", "-DDL_BW_HW_CVT=0").WithHeaders(Headers()...),
}

func TestKernelsCompileSource(t *testing.T) { dt.CheckCompiles(t, testSourceProgs[0]) }

// testLoader mirrors TestSrc of testSourceSrc.
type testLoader struct {
	X      *device.Tensor
	Ld, C0 int64
}

// testSource returns the Source 3·x[:, c0:c0+k] of x [M, ld], its kernels those of
// recipe ("mxq" or "bwq") in the soft or hardware program.
func testSource(x *device.Tensor, c0, k int, recipe string, soft bool) Source {
	m, ld, typ := x.Dim(0), x.Dim(1), x.DType()
	prog := testSourceProgs[0]
	if soft {
		prog = testSourceProgs[1]
	}
	return Source{M: m, K: k, DType: typ, Inputs: []*device.Tensor{x},
		Fill: func(v []float32) {
			in := source(x)
			for r := range m {
				for c := range k {
					v[r*k+c] = 3 * in(r*ld+c0+c)
				}
			}
		},
		Program: prog, Kernels: "test_" + recipe + "_" + typ.String(),
		Loader: testLoader{X: x, Ld: int64(ld), C0: int64(c0)},
		Vec:    (ld*typ.Size())%16 == 0 && (c0*typ.Size())%16 == 0 && device.Aligned(16, x),
	}
}

// testSourceValues returns, on the CPU, the tensor of dtype typ holding a source's
// values: 3·vals[r][c0 + c] of vals [m, ld], rounded to typ.
func testSourceValues(t testing.TB, typ device.DType, vals []float32, m, ld, c0, k int) *device.Tensor {
	t.Helper()
	v := make([]float32, m*k)
	for r := range m {
		for c := range k {
			v[r*k+c] = 3 * vals[r*ld+c0+c]
		}
	}
	return dt.Must(device.FromFloat32(device.CPU().Stream(), typ, v, m, k))
}

// sourceGeometry returns the columns of the case ci's wider source: its first column c0
// and row length ld, and the element offset of its storage (1: not 16-byte aligned).
func sourceGeometry(ci, k int) (c0, ld, offset int) {
	c0 = 8 * (ci % 2)
	ld = k + c0
	if ci%3 == 0 {
		ld += 16
	}
	if ci%4 == 3 {
		offset = 1
	}
	return c0, ld, offset
}

// TestQuantizeSource checks QuantizeSource on every device and kernel variant against
// QuantizeInto on the CPU of the tensor holding the source's values, bit for bit, with
// outputs poisoned first: every option combination over the case table (a rotating
// third each), sources 16-byte loadable or not, bf16 (values rounded by the kernels)
// and f32.
func TestQuantizeSource(t *testing.T) {
	combos := optionCombos()
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range quantCases {
			c0, ld, offset := sourceGeometry(ci, c.k)
			for oi, opt := range combos {
				if (oi+ci)%3 != 0 {
					continue
				}
				in := []device.DType{device.BF16, device.F32}[(oi/3+ci)%2]
				name := fmt.Sprintf("%d×%d of %d from %d (offset %d) %v groups %v %+v", c.m, c.k, ld, c0, offset, in, c.sizes, opt)
				vals := testValues(dt.Rand(uint64(3000+1000*ci+oi)), c.m*ld, c.specials)
				xc, exact := bwSource(t, cpu, in, vals, c.m, ld, offset)
				y := testSourceValues(t, in, exact, c.m, ld, c0, c.k)
				copt := opt
				copt.GroupSizes = groupTensor(t, cpu, c.sizes)
				want, qc := quantBytes(t, cpu, y, copt)
				x, _ := bwSource(t, s, in, vals, c.m, ld, offset)
				opt.GroupSizes = groupTensor(t, s, c.sizes)
				for _, v := range variants(d) {
					restore := v.use()
					q := dt.Must(Alloc(s, c.m, c.k, opt))
					poison(t, s, q)
					dt.NoErr(t, QuantizeSource(s, q, testSource(x, c0, c.k, "mxq", v.prog == softKernels), opt))
					got := outBytes(t, s, q)
					restore()
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%s: %s: %s", v.name, name, diff)
					}
					if q.Status != nil {
						dt.NoErr(t, q.Status.Check(s))
					}
					q.Free()
				}
				device.FreeAll(x, opt.GroupSizes, xc, y, copt.GroupSizes)
				qc.Free()
			}
		}
	})
}

// TestQuantizeBlockwiseSource is TestQuantizeSource for QuantizeBlockwiseSource, over
// the blockwise cases (short blocks, row counts past multiples of 128, empty, tiny and
// skewed groups, layouts with room for more groups) against QuantizeBlockwiseInto.
func TestQuantizeBlockwiseSource(t *testing.T) {
	opts := bwOptions()
	cpu := device.CPU().Stream()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for ci, c := range bwCases {
			c0, ld, offset := sourceGeometry(ci, c.k)
			offset = max(offset, c.offset)
			for oi, opt := range opts {
				if (oi+ci)%3 != 0 {
					continue
				}
				in := []device.DType{device.BF16, device.F32}[(oi/3+ci)%2]
				name := fmt.Sprintf("%d×%d of %d from %d (offset %d) %v groups %v %v %v %v", c.m, c.k, ld, c0, offset, in, c.sizes,
					opt.Format, opt.Scale, opt.Dir)
				vals := bwValues(dt.Rand(uint64(5000+1000*ci+oi)), c.m*ld, ld, c.specials)
				groups := max(c.groups, len(c.sizes))
				xc, exact := bwSource(t, cpu, in, vals, c.m, ld, offset)
				y := testSourceValues(t, in, exact, c.m, ld, c0, c.k)
				copt := opt
				copt.GroupSizes = groupTensor(t, cpu, c.sizes)
				want, qc := bwQuantBytes(t, cpu, y, copt, groups)
				x, _ := bwSource(t, s, in, vals, c.m, ld, offset)
				opt.GroupSizes = groupTensor(t, s, c.sizes)
				aopt := opt
				if opt.GroupSizes != nil && groups > len(c.sizes) {
					aopt.GroupSizes = dt.Must(s.Alloc(device.I32, groups))
				}
				for _, v := range bwVariants(d) {
					restore := v.use()
					q := dt.Must(AllocBlockwise(s, c.m, c.k, aopt))
					for _, o := range []*device.Tensor{q.Row, q.RowScale, q.ColT, q.ColTScale} {
						if o != nil {
							dt.Poison(t, s, o)
						}
					}
					dt.NoErr(t, QuantizeBlockwiseSource(s, q, testSource(x, c0, c.k, "bwq", v.prog == softBlockwiseKernels), opt))
					got := refOut{download(t, s, q.Row), download(t, s, q.RowScale), download(t, s, q.ColT), download(t, s, q.ColTScale)}
					restore()
					if diff := diffOut(got, want); diff != "" {
						t.Errorf("%s: %s: %s (Col: ColT)", v.name, name, diff)
					}
					if q.Status != nil {
						dt.NoErr(t, q.Status.Check(s))
					}
					q.Free()
				}
				if aopt.GroupSizes != opt.GroupSizes {
					aopt.GroupSizes.Free()
				}
				device.FreeAll(x, opt.GroupSizes, xc, y, copt.GroupSizes)
				qc.Free()
			}
		}
	})
}

// TestQuantizeSourceInvalidSizes checks that a source quantized with invalid group
// sizes gives what the tensor does (NaN codes for MXFP8, the ungrouped blocks for the
// blockwise recipe) and records it in the Status, with the blockwise error naming
// QuantizeBlockwiseSource.
func TestQuantizeSourceInvalidSizes(t *testing.T) {
	cpu := device.CPU().Stream()
	const m, k = 70, 64
	vals := testValues(dt.Rand(77), m*k, false)
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		xc, exact := bwSource(t, cpu, device.BF16, vals, m, k, 0)
		y := testSourceValues(t, device.BF16, exact, m, k, 0, k)
		x, _ := bwSource(t, s, device.BF16, vals, m, k, 0)
		defer device.FreeAll(xc, y, x)
		bad := []int32{30, 50}
		opt := Options{Dir: Both, Transpose: true, GroupSizes: groupTensor(t, cpu, bad)}
		want, qc := quantBytes(t, cpu, y, opt)
		qc.Free()
		opt.GroupSizes = groupTensor(t, s, bad)
		q := dt.Must(Alloc(s, m, k, opt))
		poison(t, s, q)
		dt.NoErr(t, QuantizeSource(s, q, testSource(x, 0, k, "mxq", false), opt))
		if diff := diffOut(outBytes(t, s, q), want); diff != "" {
			t.Errorf("MXFP8: %s", diff)
		}
		if err := q.Status.Check(s); err == nil {
			t.Error("MXFP8: no error recorded for sizes summing to 80 > 70")
		}
		q.Free()

		bopt := BlockOptions{Dir: Both, GroupSizes: groupTensor(t, cpu, bad)}
		bwant, bqc := bwQuantBytes(t, cpu, y, bopt, 2)
		bqc.Free()
		bopt.GroupSizes = groupTensor(t, s, bad)
		bq := dt.Must(AllocBlockwise(s, m, k, bopt))
		dt.NoErr(t, QuantizeBlockwiseSource(s, bq, testSource(x, 0, k, "bwq", false), bopt))
		got := refOut{download(t, s, bq.Row), download(t, s, bq.RowScale), download(t, s, bq.ColT), download(t, s, bq.ColTScale)}
		if diff := diffOut(got, bwant); diff != "" {
			t.Errorf("blockwise: %s", diff)
		}
		dt.WantError(t, func() error { return bq.Status.Check(s) }, "QuantizeBlockwiseSource", "sizes sum to 80 > M=70")
		bq.Free()
		device.FreeAll(opt.GroupSizes, bopt.GroupSizes)
	})
}
