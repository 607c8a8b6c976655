package gemm_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// unalignedDims are the K×N of the unaligned suite: K, N or both not multiples of 8
// (odd and even), beside aligned neighbours, and long rows of 4100 and 4099 elements.
var unalignedDims = [][2]int{
	{17, 23}, {23, 17}, {16, 23}, {23, 16}, {100, 17}, {17, 100}, {100, 100},
	{4100, 24}, {24, 4100}, {4099, 23}, {3, 5},
}

// unalignedSizes are the suite's group sizes for M = 300: skewed, an empty group, and 3
// rows past the groups.
var unalignedSizes = []int32{211, 0, 86}

// setSizes replaces o's sizes, with NaN in the rows of its inputs past the groups (which
// must reach no result), as newOperands makes them.
func (o *operands) setSizes(sizes []int32) {
	o.sizes = sizes
	used := 0
	for _, s := range sizes {
		used += int(s)
	}
	nanRows(o.a[used*o.aShape[1]:])
	if o.f == wgrad {
		nanRows(o.b[used*o.sh.N:])
	}
}

// unalignedOperands returns the suite's operands of K×N for form f.
func unalignedOperands(seed uint64, K, N int, f form, layout gemm.WeightLayout, out device.DType, acc bool) *operands {
	sh := shape{name: fmt.Sprintf("k%d-n%d", K, N), G: len(unalignedSizes), M: 300, K: K, N: N}
	o := newOperands(seed, sh, f, layout, device.BF16, out, acc)
	o.setSizes(unalignedSizes)
	return o
}

// TestUnalignedShapes runs bf16 calls whose K or N is not a multiple of 8, every form
// and layout, bf16 and f32 outputs (bf16 only where the forward and input gradient
// contract over thousands), the weight gradient also accumulating, against the
// float64 reference and, on a GPU, against the CPU: on the H100 and H200 they run the
// Hopper kernels on padded copies. Outputs are poisoned first; rows past the groups must
// be zeros, the guard past the output untouched. Some run on views one element into
// their allocations, and the first shape also twice and captured in a graph.
func TestUnalignedShapes(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		seed := uint64(5000)
		for i, kn := range unalignedDims {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
					for _, out := range []device.DType{device.BF16, device.F32} {
						for _, acc := range []bool{false, true} {
							if acc && f != wgrad || out == device.F32 && f != wgrad && max(kn[0], kn[1]) > 1000 {
								// checkClose's f32 tolerance (1e-5) is one for short sums:
								// f32 results of 4100-term sums in another order may not meet it.
								continue
							}
							seed++
							o := unalignedOperands(seed, kn[0], kn[1], f, layout, out, acc)
							o.offset = i % 2 // odd pairs on unaligned views
							res := o.run(t, s, nil, false)
							o.checkAgainstRef(t, res, o.reference())
							if d.IsCUDA() {
								o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
							}
							if i == 0 && out == device.BF16 && !acc {
								checkDeterministic(t, s, o)
							}
						}
					}
				}
			}
		}
	})
}

// TestPortableUnaligned runs unaligned shapes with the Hopper kernels turned off: the
// portable kernels' element loads, which other GPUs run and to which padded calls fall
// back when their copies do not fit.
func TestPortableUnaligned(t *testing.T) {
	defer gemm.ForceMMA(true)()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, kn := range [][2]int{{17, 23}, {16, 23}, {4099, 24}} {
			for _, f := range []form{fwd, dgrad, wgrad} {
				for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
					o := unalignedOperands(uint64(6000+i), kn[0], kn[1], f, layout, device.BF16, false)
					res := o.run(t, s, nil, false)
					o.checkAgainstRef(t, res, o.reference())
					if d.IsCUDA() {
						o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
					}
				}
			}
		}
	})
}

// TestPadAllocFails checks the padded path's allocation failures on a GPU whose calls
// take it: out of memory for a copy (after the first copy was allocated) runs the
// portable kernels instead, with the same results; any other error is the call's, with
// the output left as it was. Elsewhere the calls take no padded path and only their
// results are checked.
func TestPadAllocFails(t *testing.T) {
	_, oom := device.CPU().Stream().Alloc(device.F32, 1<<50)
	if !device.IsOutOfMemory(oom) {
		t.Fatalf("Alloc of 4 PiB on the CPU: %v, want an out-of-memory error", oom)
	}
	injected := errors.New("injected failure")
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, f := range []form{fwd, dgrad, wgrad} {
			for _, layout := range []gemm.WeightLayout{gemm.KN, gemm.NK} {
				o := unalignedOperands(7000, 17, 23, f, layout, device.BF16, f == wgrad)
				calls := 0
				restore := gemm.FailPadAlloc(func(i int) error {
					calls++
					if i == 1 {
						return fmt.Errorf("device: Alloc: %w", oom)
					}
					return nil
				})
				res := o.run(t, s, nil, false)
				restore()
				o.checkAgainstRef(t, res, o.reference())
				if d.IsCUDA() {
					o.checkClose(t, res, o.run(t, device.CPU().Stream(), nil, false))
				}
				if want := gemm.HopperKernels(d); (calls > 0) != want {
					t.Fatalf("%v: %d padded allocations, want them %v", o, calls, map[bool]string{true: "tried", false: "not tried"}[want])
				}

				restore = gemm.FailPadAlloc(func(int) error { return injected })
				err := o.runErr(t, s, &gemm.Options{Layout: o.layout, Accumulate: o.accumulate})
				restore()
				if gemm.HopperKernels(d) {
					if err == nil || !errors.Is(err, injected) || !strings.Contains(err.Error(), "injected failure") {
						t.Fatalf("%v: error %v, want the injected one", o, err)
					}
				} else if err != nil {
					t.Fatalf("%v: %v", o, err)
				}
			}
		}
	})
}
