package gemm_test

import (
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// The MXFP8 forms run the tests of the blockwise ones (fp8_test.go), on operands quantized
// in 32-element blocks with E8M0 scales: RCEIL where the blockwise test takes f32 scales,
// FLOOR where it takes power-of-two ones.

// TestRaggedDotMXFP8 is the shared suite on the MXFP8 forms, every other forward and input
// gradient with its rowwise operand quantized in the groups of the sizes.
func TestRaggedDotMXFP8(t *testing.T) { testFP8Suite(t, mxFam) }

// TestRaggedDotMXFP8Accumulate checks dw += x_gᵀ·dy_g in both layouts and dtypes, with
// empty groups left as they were.
func TestRaggedDotMXFP8Accumulate(t *testing.T) { testFP8Accumulate(t, mxFam) }

// TestMXFP8Portable runs the forms with the Hopper kernels turned off.
func TestMXFP8Portable(t *testing.T) { testFP8Portable(t, mxFam) }

// TestMXFP8ManyTiles runs each form on a GPU with many tiles against the CPU path.
func TestMXFP8ManyTiles(t *testing.T) { testFP8ManyTiles(t, mxFam) }

// TestMXFP8ScaleSpread gives every 32-element scale block of each operand its own
// magnitude, 2^e with e in [-20, 20], and one block of each operand all zeros (code 0):
// a scale read from the wrong block, row, column or tile shows.
func TestMXFP8ScaleSpread(t *testing.T) { testFP8ScaleSpread(t, mxFam) }

// TestMXFP8NaN: NaN elements and an infinite value make NaN or ±Inf only in the outputs
// they reach; every other output is finite and correct.
func TestMXFP8NaN(t *testing.T) { testFP8NaN(t, mxFam) }

// TestMXFP8ScalePow2: 2^k times an operand quantizes to the same elements with scale
// codes k larger, and the output is exactly 2^k times larger.
func TestMXFP8ScalePow2(t *testing.T) { testFP8ScalePow2(t, mxFam) }

// TestMXFP8MatchesBF16 compares each form with the bf16 form on the dequantized operands:
// the same bytes on the CPU, within 1e-2 on a GPU.
func TestMXFP8MatchesBF16(t *testing.T) { testFP8MatchesBF16(t, mxFam) }

// TestMXFP8ReadsOneOrientation: the forward needs no more of w than KMajor and KScale,
// the input gradient no more than NMajor and NScale: with the other orientation freed
// they give the same bytes.
func TestMXFP8ReadsOneOrientation(t *testing.T) {
	checkReadsOnly(t, mxFam, fwd, func(w quantized) {
		mw := w.(*quant.MXFP8Weights)
		dt.NoErr(t, device.FreeAll(mw.NMajor, mw.NScale))
	})
	checkReadsOnly(t, mxFam, dgrad, func(w quantized) {
		mw := w.(*quant.MXFP8Weights)
		dt.NoErr(t, device.FreeAll(mw.KMajor, mw.KScale))
	})
}

// TestMXFP8DeterministicAndCapture: two runs give the same bytes, and so does the call
// captured in a graph and replayed.
func TestMXFP8DeterministicAndCapture(t *testing.T) { testFP8Deterministic(t, mxFam) }

// TestMXFP8InvalidSizes: invalid sizes are an error at once on the CPU, recorded in the
// Status from a graph or on a GPU with nothing written; the record names the MXFP8 form.
func TestMXFP8InvalidSizes(t *testing.T) { testFP8InvalidSizes(t, mxFam) }

// TestMXFP8GroupedRows: a forward or input gradient whose rowwise operand is quantized in
// the groups of the sizes (its scale rows in the groups' tile layout) gives the bytes of
// the same call on the operand quantized without groups (rowwise blocks do not depend on
// the groups), on groups of 1 to 127 rows, empty groups and skewed sizes, and matches the
// reference.
func TestMXFP8GroupedRows(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, sh := range []shape{blockShapes[0], blockShapes[1], blockShapes[3]} {
			for j, f := range []form{fwd, dgrad} {
				out := []device.DType{device.F32, device.BF16}[(i+j)%2]
				o := newBop(mxFam, uint64(1100+2*i+j), sh, f, gemm.KN, out, e4m3F32, e4m3Pow2, false)
				plain := o.run(t, s, nil, false)
				grouped := o.groupRows().runCheck(t, d)
				if string(plain.out) != string(grouped.out) {
					t.Fatalf("%v: the call on the operand quantized in groups gives other bytes than without groups", o)
				}
			}
		}
	})
}
