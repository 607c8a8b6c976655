package moe

import (
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// randomRouting returns T×K distinct experts per token and random weights.
func randomRouting(r *rand.Rand, T, K, E int) ([]int32, []float32) {
	idx := make([]int32, T*K)
	for t := range T {
		for k, e := range r.Perm(E)[:K] {
			idx[t*K+k] = int32(e)
		}
	}
	return idx, dt.Normal(r, T*K, 1)
}

var permuteCases = []struct {
	T, K, E, H, cap int
}{
	{50, 2, 8, 16, 0},  // vector path
	{50, 2, 8, 12, 0},  // f32 vector, bf16 scalar
	{37, 3, 5, 7, 0},   // scalar
	{64, 4, 8, 16, 20}, // capacity: dropped assignments, unused rows
	{20, 1, 4, 24, 3},  // capacity with many unused rows
}

func TestPermute(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for i, tc := range permuteCases {
			for _, typ := range dtypes() {
				t.Run(name(typ, "_", tc), func(t *testing.T) {
					r := dt.Rand(uint64(400 + i))
					T, K, E, H := tc.T, tc.K, tc.E, tc.H
					idx, w := randomRouting(r, T, K, E)
					it := upI32(t, s, idx, T, K)
					defer it.Free()
					p := dt.Must(Sort(s, it, E, tc.cap))
					defer p.Free()
					R := p.Rows
					row := downI32(t, s, p.Row)
					used := int(downI32(t, s, p.Offsets)[E])
					x := randn(r, typ, T*H, 1)
					xt := up(t, s, typ, x, T, H)
					defer xt.Free()
					wt := up(t, s, device.F32, w, T, K)
					defer wt.Free()

					// Permute: an exact copy; unused rows zero.
					xp := alloc(t, s, typ, R, H)
					defer xp.Free()
					dt.NoErr(t, Permute(s, xp, xt, p))
					wantXp := make([]float32, R*H)
					for a, r := range row {
						if r >= 0 {
							copy(wantXp[int(r)*H:], x[a/K*H:(a/K+1)*H])
						}
					}
					if diff := cmp.Diff(wantXp, down(t, s, xp)); diff != "" {
						t.Fatalf("Permute (-want +got):\n%s", diff)
					}

					// Unpermute with and without the added term.
					yp := randn(r, typ, R*H, 1)
					add := randn(r, typ, T*H, 1)
					ypt, addt := up(t, s, typ, yp, R, H), up(t, s, typ, add, T, H)
					defer ypt.Free()
					defer addt.Free()
					for _, withAdd := range []bool{false, true} {
						y := alloc(t, s, typ, T, H)
						var a *device.Tensor
						if withAdd {
							a = addt
						}
						dt.NoErr(t, unpermute(s, y, ypt, wt, p.Row, K, R, a))
						want := make([]float64, T*H)
						for tok := range T {
							for h := range H {
								var acc float64
								for k := range K {
									if r := row[tok*K+k]; r >= 0 {
										acc += float64(w[tok*K+k]) * float64(yp[int(r)*H+h])
									}
								}
								if withAdd {
									acc += float64(add[tok*H+h])
								}
								want[tok*H+h] = acc
							}
						}
						closeTo(t, name("Unpermute add=", withAdd), down(t, s, y), want, tol(typ))
						y.Free()
					}

					// UnpermuteGrad.
					dy := randn(r, typ, T*H, 1)
					dyt := up(t, s, typ, dy, T, H)
					defer dyt.Free()
					dyp, dw := alloc(t, s, typ, R, H), alloc(t, s, device.F32, T, K)
					defer dyp.Free()
					defer dw.Free()
					dt.NoErr(t, UnpermuteGrad(s, dyp, dw, dyt, ypt, wt, p))
					wantDyp, wantDw := make([]float64, R*H), make([]float64, T*K)
					for a, r := range row {
						if r < 0 {
							continue
						}
						tok := a / K
						for h := range H {
							wantDyp[int(r)*H+h] = float64(w[a]) * float64(dy[tok*H+h])
							wantDw[a] += float64(dy[tok*H+h]) * float64(yp[int(r)*H+h])
						}
					}
					closeTo(t, "UnpermuteGrad dyp", down(t, s, dyp), wantDyp, tol(typ))
					closeTo(t, "UnpermuteGrad dweight", down(t, s, dw), wantDw, 1e-5)

					// PermuteGrad, plain and with the added term and the router's input gradient.
					dxp := randn(r, typ, R*H, 1)
					for i := used * H; i < R*H; i++ {
						dxp[i] = 0
					}
					dxpt := up(t, s, typ, dxp, R, H)
					defer dxpt.Free()
					dl := dt.Normal(r, T*E, 1)
					dlt := up(t, s, device.F32, dl, T, E)
					defer dlt.Free()
					for _, wtyp := range []device.DType{0, device.F32, device.BF16} {
						wr := randn(r, wtyp, E*H, 1)
						dx := alloc(t, s, typ, T, H)
						var a, g, wrt *device.Tensor
						if wtyp != 0 {
							wrt = up(t, s, wtyp, wr, E, H)
							a, g = addt, dlt
						}
						dt.NoErr(t, permuteGrad(s, dx, dxpt, p.Row, K, R, a, g, wrt))
						want := make([]float64, T*H)
						for tok := range T {
							for h := range H {
								var acc float64
								for k := range K {
									if r := row[tok*K+k]; r >= 0 {
										acc += float64(dxp[int(r)*H+h])
									}
								}
								if wtyp != 0 {
									acc += float64(add[tok*H+h])
									for e := range E {
										acc += float64(dl[tok*E+e]) * float64(wr[e*H+h])
									}
								}
								want[tok*H+h] = acc
							}
						}
						closeTo(t, name("PermuteGrad router=", wtyp), down(t, s, dx), want, tol(typ))
						dx.Free()
						if wrt != nil {
							wrt.Free()
						}
					}
				})
			}
		}
	})
}

func TestSwiGLU(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, tc := range []struct{ M, F, used int }{{33, 16, 33}, {20, 12, 13}, {9, 5, 0}, {40, 64, 40}} {
			for _, typ := range dtypes() {
				t.Run(name(typ, "_", tc), func(t *testing.T) {
					r := dt.Rand(uint64(tc.M*100 + tc.F))
					M, F := tc.M, tc.F
					h, da := randn(r, typ, M*2*F, 2), randn(r, typ, M*F, 1)
					ht, dat := up(t, s, typ, h, M, 2*F), up(t, s, typ, da, M, F)
					defer ht.Free()
					defer dat.Free()
					used := upI32(t, s, []int32{int32(tc.used)}, 1)
					defer used.Free()
					a, dh := alloc(t, s, typ, M, F), alloc(t, s, typ, M, 2*F)
					defer a.Free()
					defer dh.Free()
					var u *device.Tensor
					if tc.used != M {
						u = used
					}
					dt.NoErr(t, swiglu(s, a, ht, u))
					dt.NoErr(t, swigluGrad(s, dh, ht, dat, u))
					wantA, wantDh := make([]float64, M*F), make([]float64, M*2*F)
					for r := range tc.used {
						for f := range F {
							g, v, dd := float64(h[r*2*F+f]), float64(h[r*2*F+F+f]), float64(da[r*F+f])
							sg := 1 / (1 + exp(-g))
							wantA[r*F+f] = g * sg * v
							wantDh[r*2*F+f] = dd * v * sg * (1 + g*(1-sg))
							wantDh[r*2*F+F+f] = dd * g * sg
						}
					}
					closeTo(t, "SwiGLU", down(t, s, a), wantA, tol(typ))
					closeTo(t, "SwiGLUGrad", down(t, s, dh), wantDh, tol(typ))
				})
			}
		}
	})
}

func TestRouterGEMMs(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, tc := range []struct{ T, H, E int }{{70, 100, 10}, {64, 4096, 32}, {300, 70, 33}, {5, 3, 1}} {
			for _, xt := range dtypes() {
				for _, wtyp := range dtypes() {
					t.Run(name(xt, "_", wtyp, "_", tc), func(t *testing.T) {
						r := dt.Rand(uint64(tc.T + tc.H + tc.E))
						T, H, E := tc.T, tc.H, tc.E
						x, wr, dl := randn(r, xt, T*H, 1), randn(r, wtyp, E*H, 1), dt.Normal(r, T*E, 1)
						xd, wd, dld := up(t, s, xt, x, T, H), up(t, s, wtyp, wr, E, H), up(t, s, device.F32, dl, T, E)
						defer xd.Free()
						defer wd.Free()
						defer dld.Free()
						lg := alloc(t, s, device.F32, T, E)
						defer lg.Free()
						dt.NoErr(t, RouterLogits(s, lg, xd, wd))
						want := make([]float64, T*E)
						for i := range T {
							for e := range E {
								for h := range H {
									want[i*E+e] += float64(x[i*H+h]) * float64(wr[e*H+h])
								}
							}
						}
						closeTo(t, "RouterLogits", down(t, s, lg), want, 1e-5)
						prev := randn(r, wtyp, E*H, 1)
						dw := up(t, s, wtyp, prev, E, H)
						defer dw.Free()
						for _, acc := range []bool{true, false} {
							dt.NoErr(t, RouterWeightGrad(s, dw, xd, dld, acc))
							want := make([]float64, E*H)
							for e := range E {
								for h := range H {
									for i := range T {
										want[e*H+h] += float64(dl[i*E+e]) * float64(x[i*H+h])
									}
									if acc {
										want[e*H+h] += float64(prev[e*H+h])
									}
								}
							}
							tl := 1e-5
							if wtyp == device.BF16 {
								tl = tol(wtyp)
							}
							closeTo(t, name("RouterWeightGrad acc=", acc), down(t, s, dw), want, tl)
						}
					})
				}
			}
		}
	})
}
