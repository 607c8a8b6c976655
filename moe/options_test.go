package moe

import (
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/offload"
)

// TestLayerEP runs the layer expert-parallel over in-process worlds of 2 and 4 ranks,
// each with its own tokens (one rank with none), and checks that together they compute
// what the one-device layer computes on all their tokens at once: each rank's rows of the
// output and of the input gradient, the gradients of its experts, and, summed over the
// ranks, the router's and the shared expert's gradients, the loads and the
// load-balancing loss, which is over the global batch.
func TestLayerEP(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    Config
		tokens []int
	}{
		{"softmax_2ranks", Config{Hidden: 16, FFN: 8, SharedFFN: 4,
			Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}, []int{40, 24}},
		{"sigmoid_groups_4ranks", Config{Hidden: 16, FFN: 8,
			Router: RouterConfig{Experts: 8, TopK: 2, Score: Sigmoid, Groups: 4, TopKGroups: 2, Renormalize: true, Scale: 2.5, AuxLoss: 0.5}},
			[]int{20, 0, 30, 14}},
		// FP8: x's rows dispatched quantized. Each expert's rows fit one block of
		// tokens, so that W2's weight gradient's scales match the one-device layer's,
		// whose rows come in another order; W1's is quantized from the dispatched FP8
		// rows, not from x (see fp8W1Bound).
		{"blockwise_2ranks", Config{Hidden: 32, FFN: 16, SharedFFN: 16, Precision: PrecisionBlockwise,
			Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}, []int{40, 24}},
		{"mxfp8_4ranks", Config{Hidden: 32, FFN: 16, Precision: PrecisionMXFP8,
			Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}, []int{6, 0, 10, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testLayerEP(t, tc.cfg, tc.tokens)
		})
	}
}

func testLayerEP(t *testing.T, cfg Config, tokens []int) {
	R := len(tokens)
	E, H, F, Fs, L := cfg.Router.Experts, cfg.Hidden, cfg.FFN, cfg.SharedFFN, cfg.Router.Experts/R
	T := 0
	for _, n := range tokens {
		T += n
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, typ := range dtypes() {
			t.Run(typ.String(), func(t *testing.T) {
				r := dt.Rand(700)
				// One set of weights and one batch: the one-device layer takes it all,
				// each rank its own tokens.
				base := newRef(r, cfg, T, false, typ, device.F32)
				gy := randn(r, typ, T*H, 1)
				want := runLayer(t, d, base, typ, device.F32, gy)
				if !(want.stats.AuxLoss > 0) {
					t.Fatalf("one-device AuxLoss = %v, want > 0", want.stats.AuxLoss)
				}
				off := rankOffsets(tokens)
				got := runRanks(t, d, base, tokens, typ, gy)
				tl := tol(typ)
				sum := func(f func(layerRun) []float32) []float64 {
					var out []float64
					for _, g := range got {
						v := f(g)
						if out == nil {
							out = make([]float64, len(v))
						}
						for i, x := range v {
							out[i] += float64(x)
						}
					}
					return out
				}
				closeTo(t, "drouter summed over the ranks", f32s(sum(func(g layerRun) []float32 { return g.dwr })), f64(want.dwr), tl)
				if Fs > 0 {
					closeTo(t, "dshared_w1 summed over the ranks", f32s(sum(func(g layerRun) []float32 { return g.dsw1 })), f64(want.dsw1), tl)
					closeTo(t, "dshared_w2 summed over the ranks", f32s(sum(func(g layerRun) []float32 { return g.dsw2 })), f64(want.dsw2), tl)
				}
				aux, load := 0.0, make([]int, E)
				for rk, g := range got {
					a, b := off[rk], off[rk+1]
					closeTo(t, fmt.Sprint("rank ", rk, " y"), g.y, f64(want.y[a*H:b*H]), tl)
					closeTo(t, fmt.Sprint("rank ", rk, " dx"), g.dx, f64(want.dx[a*H:b*H]), tl)
					n1, n2 := L*H*2*F, L*F*H
					if w1 := want.dw1[rk*n1 : (rk+1)*n1]; cfg.Precision.fp8() {
						e := relErr(g.dw1, w1)
						t.Logf("rank %d dw1: relative error %.3g against the one-device layer", rk, e)
						if !(e <= fp8W1Bound) {
							t.Errorf("rank %d dw1: relative error %.4g against the one-device layer, want ≤ %g", rk, e, fp8W1Bound)
						}
					} else {
						closeTo(t, fmt.Sprint("rank ", rk, " dw1"), g.dw1, f64(w1), tl)
					}
					closeTo(t, fmt.Sprint("rank ", rk, " dw2"), g.dw2, f64(want.dw2[rk*n2:(rk+1)*n2]), tl)
					aux += float64(g.stats.AuxLoss)
					for e, n := range g.stats.Load {
						load[e] += n
					}
				}
				if diff := cmp.Diff(want.stats.Load, load); diff != "" {
					t.Errorf("Stats.Load summed over the ranks (-one device +ranks):\n%s", diff)
				}
				if wa := float64(want.stats.AuxLoss); math.Abs(aux-wa) > 1e-5*wa {
					t.Errorf("Stats.AuxLoss summed over the ranks = %v, want %v (one device)", aux, wa)
				}
			})
		}
	})
}

// fp8W1Bound bounds the relative error of an expert-parallel FP8 layer's W1 weight
// gradient against the one-device layer's: its columnwise operand is quantized from
// the dispatched FP8 rows, dequantized, where the one-device layer quantizes x, so each
// element carries a second rounding to E4M3 (up to 2^-4 of it, relative).
const fp8W1Bound = 0.05

// TestLayerEPOffload runs the expert-parallel layer in each precision, with a shared
// expert, with its activations offloaded or dropped and rebuilt (an FP8 layer's
// dispatched rows, kept in FP8, are dispatched again), and with its work overlapping
// ep's transfers (the default: the shared expert and FP8 weights while x's rows are
// dispatched, the shared expert's backward while dy's rows move, W1's weight gradient
// while DispatchBackward moves dxp's rows) or run in the order of its data flow: every
// rank's results are bit for bit those of the plain layer run in that order.
func TestLayerEPOffload(t *testing.T) {
	cfg := Config{Hidden: 32, FFN: 16, SharedFFN: 8, Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.5}}
	tokens := []int{30, 0, 50, 14}
	T := 0
	for _, n := range tokens {
		T += n
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		r := dt.Rand(820)
		base := newRef(r, cfg, T, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, T*cfg.Hidden, 1)
		for _, prec := range []Precision{PrecisionBF16, PrecisionBlockwise, PrecisionMXFP8} {
			l := withPrecision(base, prec)
			serial := *l
			serial.serialEP = true
			want := runRanks(t, d, &serial, tokens, device.BF16, gy)
			for _, v := range []struct {
				pol    string
				serial bool
			}{{"", false}, {"*=remat", false}, {"*=offload", false}, {"moe_permuted=remat,moe_mlp_swiglu=offload", false}, {"*=offload", true}} {
				sub := v.pol
				if sub == "" {
					sub = "kept"
				}
				if !v.serial {
					sub += "/overlapped"
				}
				t.Run(name(prec, "/", sub), func(t *testing.T) {
					lo := *l
					lo.rankPolicy, lo.serialEP = v.pol, v.serial
					got := runRanks(t, d, &lo, tokens, device.BF16, gy)
					for rk := range tokens {
						got[rk].stats, want[rk].stats = Stats{}, Stats{}
						sameRun(t, fmt.Sprint("rank ", rk, " (-plain, in order +", sub, ")"), want[rk], got[rk])
					}
				})
			}
		}
	})
}

// rankOffsets returns the offsets of the ranks' tokens in the batch.
func rankOffsets(tokens []int) []int {
	off := make([]int, len(tokens)+1)
	for rk, n := range tokens {
		off[rk+1] = off[rk] + n
	}
	return off
}

// runRanks runs base expert-parallel over an in-process world of len(tokens) ranks on
// d, rank rk with the next tokens[rk] tokens of base's batch and of gy and its experts'
// share of base's weights, and returns each rank's results.
func runRanks(t *testing.T, d *device.Device, base *refLayer, tokens []int, typ device.DType, gy []float32) []layerRun {
	t.Helper()
	cfg := base.cfg
	R := len(tokens)
	E, H, F, L := cfg.Router.Experts, cfg.Hidden, cfg.FFN, cfg.Router.Experts/R
	off := rankOffsets(tokens)
	w, err := ep.NewWorld(R, d)
	dt.NoErr(t, err)
	got := make([]layerRun, R)
	var mu sync.Mutex
	err = w.Run(func(tr ep.Transport) (err error) {
		rk := tr.Rank()
		g, err := ep.NewGroup(tr, ep.Config{Experts: E, TopK: cfg.Router.TopK})
		if err != nil {
			return err
		}
		defer g.Close()
		l := *base
		l.cfg.EP = g
		l.T = tokens[rk]
		l.x = base.x[off[rk]*H : off[rk+1]*H]
		l.w1 = base.w1[rk*L*H*2*F : (rk+1)*L*H*2*F]
		l.w2 = base.w2[rk*L*F*H : (rk+1)*L*F*H]
		if base.rankPolicy != "" {
			pol, err := offload.ParsePolicy(base.rankPolicy)
			if err != nil {
				return err
			}
			o, err := offload.New(d, offload.Config{PoolBytes: 1 << 20, Policy: pol})
			if err != nil {
				return err
			}
			defer o.Close()
			l.cfg.Offload = o
			defer func() {
				if err == nil {
					err = o.Synchronize()
				}
				st := o.Stats()
				if err == nil && st.InUse != 0 {
					err = fmt.Errorf("rank %d: the offloader holds %d bytes after the step", rk, st.InUse)
				}
				// ActPermuted, ActWi, ActSwiGLU and ActWo (FP8: ActPermuted and ActSwiGLU as
				// codes and scales), and the shared expert's two.
				saved := 4
				if cfg.SharedFFN > 0 {
					saved += 2
				}
				if cfg.Precision.fp8() {
					saved += 2
				}
				if err == nil && base.rankPolicy == "*=remat" && st.Remat != saved {
					err = fmt.Errorf("rank %d: %d activations dropped for recompute, want %d", rk, st.Remat, saved)
				}
			}()
		}
		s, err := d.NewStream()
		if err != nil {
			return err
		}
		defer s.Close()
		res, err := runLayerErr(s, &l, typ, device.F32, gy[off[rk]*H:off[rk+1]*H])
		mu.Lock()
		got[rk] = res
		mu.Unlock()
		return err
	})
	dt.NoErr(t, err)
	return got
}

// runLayerErr is runLayer for a goroutine: it returns errors instead of failing.
func runLayerErr(s *device.Stream, l *refLayer, typ, rtyp device.DType, gy []float32) (res layerRun, err error) {
	ft := &fakeT{}
	defer func() {
		if v := recover(); v != nil {
			if v != errFakeFatal {
				err = fmt.Errorf("%v\n%s", v, debug.Stack())
			} else {
				err = errors.New(ft.msg)
			}
		}
	}()
	res = runLayerOn(ft, s, l, typ, rtyp, gy)
	return res, nil
}

var errFakeFatal = errors.New("fatal")

// fakeT is a testing.TB whose failures panic, for helpers run off the test goroutine.
type fakeT struct {
	testing.TB
	msg string
}

func (f *fakeT) Helper() {}
func (f *fakeT) Fatal(args ...any) {
	f.msg = fmt.Sprint(args...)
	panic(errFakeFatal)
}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(errFakeFatal)
}
func (f *fakeT) Errorf(format string, args ...any) { f.Fatalf(format, args...) }

// TestLayerOffload runs the layer with activations offloaded, kept or dropped for
// recompute, in each precision: results are bit-identical to the plain layer's (an
// FP8 layer recomputes with the same quantizations).
func TestLayerOffload(t *testing.T) {
	cfg := Config{Hidden: 32, FFN: 16, SharedFFN: 8,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.01}}
	policies := []string{
		"moe_permuted=remat,moe_mlpwi=offload,moe_mlp_swiglu=remat,moe_mlpwo=offload,mlpwi=remat,mlp_swiglu=offload",
		"*=remat",
		"*=offload",
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		r := dt.Rand(800)
		l0 := newRef(r, cfg, 96, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, 96*cfg.Hidden, 1)
		for _, prec := range []Precision{PrecisionBF16, PrecisionBlockwise, PrecisionMXFP8} {
			l := withPrecision(l0, prec)
			plain := runLayer(t, d, l, device.BF16, device.F32, gy)
			for _, pol := range policies {
				for _, pool := range []int{1 << 20, 4096} { // room for all; room for few (kept on the device)
					t.Run(fmt.Sprint(prec, "/", pol, "/pool=", pool), func(t *testing.T) {
						o := dt.Must(offload.New(d, offload.Config{PoolBytes: pool, Policy: offload.MustParsePolicy(pol)}))
						defer o.Close()
						lc := *l
						lc.cfg.Offload = o
						got := runLayer(t, d, &lc, device.BF16, device.F32, gy)
						dt.NoErr(t, o.Synchronize())
						got.stats, plain.stats = Stats{}, Stats{}
						if diff := cmp.Diff(plain, got, cmp.AllowUnexported(layerRun{})); diff != "" {
							t.Errorf("results differ from the plain layer's (-plain +offload):\n%s", diff)
						}
						st := o.Stats()
						if st.InUse != 0 {
							t.Errorf("offloader holds %d bytes after the step", st.InUse)
						}
						// An FP8 layer keeps no permuted input (Backward permutes x again) and
						// its SwiGLU output as two tensors, its FP8 codes and their scales.
						saved := 6
						if pol == "*=remat" && st.Remat != saved {
							t.Errorf("%d activations dropped for recompute, want %d", st.Remat, saved)
						}
						if pol == "*=offload" && st.Offloads+st.Kept != saved {
							t.Errorf("%d offloaded + %d kept, want %d", st.Offloads, st.Kept, saved)
						}
					})
				}
			}
		}
	})
}
