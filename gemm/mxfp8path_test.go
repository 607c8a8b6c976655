package gemm_test

import (
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
)

// TestMXFP8ViaBF16 runs the MXFP8 suites with every call that the Hopper MXFP8 kernels
// take run instead on its operands dequantized into bf16 and the bf16 kernels (on other
// devices the path those calls take anyway).
func TestMXFP8ViaBF16(t *testing.T) {
	defer gemm.SetMXFP8Path("bf16")()
	for _, tc := range []struct {
		name string
		run  func(*testing.T, family)
	}{
		{"suite", testFP8Suite},
		{"accumulate", testFP8Accumulate},
		{"many_tiles", testFP8ManyTiles},
		{"scale_spread", testFP8ScaleSpread},
		{"nan", testFP8NaN},
		{"pow2", testFP8ScalePow2},
		{"matches_bf16", testFP8MatchesBF16},
		{"deterministic", testFP8Deterministic},
		{"invalid_sizes", testFP8InvalidSizes},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, mxFam) })
	}
}

// TestMXFP8VectorKernels: on a GPU the vector kernels that dequantize MXFP8 operands
// into bf16 give the bytes of the element kernels, for every form, E4M3 and E5M2 codes,
// rows quantized with and without groups, and sizes that leave rows to no group.
func TestMXFP8VectorKernels(t *testing.T) {
	d := dt.GPU(t)
	defer gemm.SetMXFP8Path("bf16")()
	s := d.Stream()
	for i, sh := range []shape{blockShapes[1], blockShapes[2], blockShapes[3], blockShapes[4]} {
		for j, bf := range blockForms {
			ra, rb := e4m3F32, e5m2Pow2
			if (i+j)%2 == 1 {
				ra, rb = e5m2Pow2, e4m3F32
			}
			if bf.f != wgrad {
				rb = e4m3F32
			}
			o := newBop(mxFam, uint64(1300+8*i+j), sh, bf.f, bf.layout, []device.DType{device.BF16, device.F32}[j%2], ra, rb, false)
			if bf.f != wgrad && i%2 == 0 && o.used() == o.M {
				o.groupRows()
			}
			vec := o.run(t, s, nil, false)
			restore := gemm.MXFP8Vector(false)
			elem := o.run(t, s, nil, false)
			restore()
			if string(vec.out) != string(elem.out) {
				t.Fatalf("%v: the vector dequantization gives other bytes than the element kernels", o)
			}
			ref, abs := o.reference()
			o.check(t, vec, ref, abs, o.tol(d))
		}
	}
}

// TestMXFP8DequantOutOfMemory: where the bf16 temporaries of the dequantized operands do
// not fit, a call that the estimate sends through bf16 runs on the MXFP8 kernels instead,
// with their bytes; forced onto the bf16 path it returns the out-of-memory error, naming
// the form, with its output untouched.
func TestMXFP8DequantOutOfMemory(t *testing.T) {
	d := dt.GPU(t)
	if !gemm.FP8HopperKernels(d) {
		t.Skip("needs the Hopper FP8 kernels")
	}
	s := d.Stream()
	_, oom := device.CPU().Stream().Alloc(device.F32, 1<<50)
	if !device.IsOutOfMemory(oom) {
		t.Fatalf("Alloc of 4 PiB on the CPU: %v, want an out-of-memory error", oom)
	}
	calls := 0
	defer gemm.FailDequantAlloc(func() error { calls++; return oom })()
	// A weight gradient of K = N = 1024, which the estimate runs through bf16.
	o := newBop(mxFam, 1400, shape{"wide", 3, 300, 1024, 1024, "skewed"}, wgrad, gemm.KN, device.F32, e4m3F32, e4m3Pow2, false)
	restore := gemm.SetMXFP8Path("wgmma")
	want := o.run(t, s, nil, false)
	restore()
	got := o.run(t, s, nil, false)
	if calls != 1 {
		t.Fatalf("the call allocated bf16 temporaries %d times, want 1 (the estimate's bf16 path)", calls)
	}
	if string(got.out) != string(want.out) {
		t.Fatalf("%v: without memory for the temporaries the call gives other bytes than the MXFP8 kernels", o)
	}
	defer gemm.SetMXFP8Path("bf16")()
	err := o.runErr(t, s, nil)
	if prefix := "gemm: " + mxFam.op(wgrad) + ": "; err == nil || !device.IsOutOfMemory(err) || !strings.HasPrefix(err.Error(), prefix) {
		t.Fatalf("forced through bf16 without memory: error %v, want an out-of-memory error starting %q", err, prefix)
	}
}
