package moe

import (
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/quant"
)

func TestKernelsCompileGradFP8(t *testing.T) {
	dt.CheckCompiles(t, gradMXBF16Prog, gradMXF32Prog, gradBwBF16Prog, gradBwF32Prog, fp8RowsMXProg, fp8RowsBwProg)
}

// TestFP8FusedGrad checks that quantizing dyp, dh and the permuted x as they are
// computed changes no result: the output and every gradient are bit for bit those of
// the layer that writes them in the activations' dtype and quantizes them
// (Layer.fusedGrad empty), on the cases of TestLayerFP8 (unused rows of a capacity
// layer, short blocks, a skewed expert, no tokens, bf16 and f32), with the default
// parts, all three or one fused, and with all three fused, with each incoming
// gradient quantized by two passes (gradTwoPass: the sources read twice) and with h
// offloaded or rebuilt, which the fused SwiGLU gradient reads after W1's input
// gradient.
func TestFP8FusedGrad(t *testing.T) {
	same := func(t *testing.T, want, got layerRun) {
		t.Helper()
		sameRun(t, "operands quantized as computed against written then quantized (-unfused +fused)", want, got)
	}
	policies := []string{"moe_mlpwi=offload", "moe_mlpwi=remat", "*=remat"}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for i, tc := range fp8Cases {
			l, gy := tc.inputs(uint64(1300 + i))
			for _, prec := range fp8Precisions {
				t.Run(name(tc.name, "/", prec), func(t *testing.T) {
					old := withPrecision(l, prec)
					old.fusedGrad = 0
					want := runLayer(t, d, old, tc.typ, tc.rtyp, gy)
					if tc.T > 0 && (cmp.Equal(want.dw1, make([]float32, len(want.dw1))) || cmp.Equal(want.dx, make([]float32, len(want.dx)))) {
						t.Fatal("dw1 or dx is all zeros")
					}
					same(t, want, runLayer(t, d, withPrecision(l, prec), tc.typ, tc.rtyp, gy))
					all := withPrecision(l, prec)
					all.fusedGrad = allGradParts
					for _, f := range []gradParts{allGradParts, gradDyp, gradDh, gradXp} {
						one := *all
						one.fusedGrad = f
						same(t, want, runLayer(t, d, &one, tc.typ, tc.rtyp, gy))
					}
					two := *all
					two.gradTwoPass = true
					same(t, want, runLayer(t, d, &two, tc.typ, tc.rtyp, gy))
					sameOffloaded(t, d, all, tc, gy, want, policies, same)
				})
			}
		}
	})
}

// TestFP8RowsSource checks the source of the dispatched FP8 rows that W1's weight
// gradient quantizes columnwise with Config.EP: bit for bit the columnwise quantization
// of the rows dequantized by quant into an f32 tensor, over all rows and over fewer
// (the kept rows), with block magnitudes spread over 2^±20, short blocks, widths with
// and without 8-column loads, and an empty group.
func TestFP8RowsSource(t *testing.T) {
	cases := []struct {
		name   string
		M, K   int
		rows   int
		groups []int32
	}{
		{"wide", 300, 272, 300, []int32{130, 0, 41, 129}},
		{"kept_rows", 260, 160, 190, []int32{5, 128, 57}},
		{"narrow", 70, 20, 70, []int32{70}},
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, tc := range cases {
			func() {
				r := dt.Rand(1410)
				v := randn(r, device.F32, tc.M*tc.K, 1)
				for i := range v {
					v[i] *= float32(math.Ldexp(1, int(r.IntN(41))-20))
				}
				x := up(t, s, device.F32, v, tc.M, tc.K)
				sizes := upI32(t, s, tc.groups, len(tc.groups))
				deq := alloc(t, s, device.F32, tc.M, tc.K)
				defer device.FreeAll(x, sizes, deq)
				for _, prec := range fp8Precisions {
					t.Run(name(tc.name, "/", prec), func(t *testing.T) {
						ex := &experts{s: s, cfg: Config{Precision: prec}}
						q := dt.Must(quantizeFP8(s, prec, x, blockRows, mxRows))
						defer q.free()
						bo, mo := blockCols(sizes, quant.Columnwise), mxCols(sizes, quant.Columnwise)
						if prec == PrecisionBlockwise {
							dt.NoErr(t, quant.DequantizeBlockwise(s, deq, q.b, quant.Rowwise))
						} else {
							dt.NoErr(t, quant.Dequantize(s, deq, q.m, quant.Rowwise))
						}
						want := dt.Must(ex.quantize(operand{t: deq}, tc.rows, bo, mo))
						defer want.free()
						got := dt.Must(ex.quantize(operand{src: ex.fp8RowsSource(q)}, tc.rows, bo, mo))
						defer got.free()
						wc, ws := want.detachCols()
						gc, gs := got.detachCols()
						defer device.FreeAll(wc, ws, gc, gs)
						if diff := cmp.Diff(bytesOf(t, s, wc, ws), bytesOf(t, s, gc, gs)); diff != "" {
							t.Errorf("columnwise codes and scales (-dequantized tensor +source):\n%s", diff)
						}
					})
				}
			}()
		}
	})
}

// TestGradKernelsNamed checks that the program gradKernels picks for each recipe, loader
// and dtype holds that loader's kernels in that dtype, and no other program's.
func TestGradKernelsNamed(t *testing.T) {
	dt.RequireNVRTC(t)
	cc := 0 // as Program.CheckCompile picks the target
	if n, err := device.CUDACount(); err == nil && n > 0 {
		cc = dt.Must(device.Open("cuda:0")).ComputeCapability()
	}
	target := dt.Must(device.Target(cc))
	for _, prec := range fp8Precisions {
		for _, c := range []struct {
			loader string
			dt     device.DType
		}{{"dh", device.BF16}, {"dh", device.F32}, {"rows", device.BF16}, {"rows", device.F32}, {"fp8rows", device.F32}} {
			ex := &experts{cfg: Config{Precision: prec}}
			prog, prefix := ex.gradKernels(c.loader, c.dt)
			// The image of TestKernelsCompileGradFP8's target (cached): its kernels' names
			// are in it, in the PTX or the cubin's symbols.
			img, _, _, err := prog.Compile(target)
			if err != nil {
				t.Fatalf("%v %s %v: %v", prec, c.loader, c.dt, err)
			}
			if !strings.Contains(string(img), prefix+"_e4m3_") {
				t.Errorf("%v %s %v: the program of gradKernels has no kernel %s_e4m3*", prec, c.loader, c.dt, prefix)
			}
		}
	}
}
