package moe

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/offload"
)

// TestLayerEP runs the layer expert-parallel over an in-process world of 2 ranks and
// checks that each rank gets what the single-device layer gives on its tokens: the
// output, the input and router gradients, and (summed over the ranks) the gradients
// of its local experts.
func TestLayerEP(t *testing.T) {
	const R = 2
	tokens := []int{40, 24}
	cfg := Config{Hidden: 16, FFN: 8, SharedFFN: 4,
		Router: RouterConfig{Experts: 8, TopK: 2, Renormalize: true, AuxLoss: 0.01}}
	E, H, F, L := cfg.Router.Experts, cfg.Hidden, cfg.FFN, cfg.Router.Experts/R
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, typ := range dtypes() {
			t.Run(typ.String(), func(t *testing.T) {
				r := dt.Rand(700)
				// One set of weights; each rank its own tokens.
				base := newRef(r, cfg, tokens[0]+tokens[1], false, typ, device.F32)
				refs := make([]*refLayer, R)
				gys := make([][]float32, R)
				want := make([]layerRun, R)
				off := 0
				for rk := range R {
					l := *base
					l.T = tokens[rk]
					l.x = base.x[off*H : (off+tokens[rk])*H]
					off += tokens[rk]
					refs[rk] = &l
					gys[rk] = randn(r, typ, tokens[rk]*H, 1)
					want[rk] = runLayer(t, d, refs[rk], typ, device.F32, gys[rk])
				}
				w, err := ep.NewWorld(R, d)
				dt.NoErr(t, err)
				got := make([]layerRun, R)
				var mu sync.Mutex
				err = w.Run(func(tr ep.Transport) error {
					rk := tr.Rank()
					g, err := ep.NewGroup(tr, ep.Config{Experts: E, TopK: cfg.Router.TopK})
					if err != nil {
						return err
					}
					defer g.Close()
					c := cfg
					c.EP = g
					l := *refs[rk]
					l.cfg = c
					l.w1 = base.w1[rk*L*H*2*F : (rk+1)*L*H*2*F]
					l.w2 = base.w2[rk*L*F*H : (rk+1)*L*F*H]
					s, err := d.NewStream()
					if err != nil {
						return err
					}
					defer s.Close()
					res, err := runLayerErr(s, &l, typ, device.F32, gys[rk])
					mu.Lock()
					got[rk] = res
					mu.Unlock()
					return err
				})
				dt.NoErr(t, err)
				tl := tol(typ)
				for rk := range R {
					closeTo(t, fmt.Sprint("rank ", rk, " y"), got[rk].y, f64(want[rk].y), tl)
					closeTo(t, fmt.Sprint("rank ", rk, " dx"), got[rk].dx, f64(want[rk].dx), tl)
					closeTo(t, fmt.Sprint("rank ", rk, " drouter"), got[rk].dwr, f64(want[rk].dwr), tl)
					closeTo(t, fmt.Sprint("rank ", rk, " dshared_w1"), got[rk].dsw1, f64(want[rk].dsw1), tl)
					closeTo(t, fmt.Sprint("rank ", rk, " dshared_w2"), got[rk].dsw2, f64(want[rk].dsw2), tl)
					if diff := cmp.Diff(want[rk].stats.Load, got[rk].stats.Load); diff != "" {
						t.Errorf("rank %d: Stats.Load (-want +got):\n%s", rk, diff)
					}
					// Local experts see the tokens of every rank.
					n1, n2 := L*H*2*F, L*F*H
					sum1, sum2 := make([]float64, n1), make([]float64, n2)
					for q := range R {
						for i := range n1 {
							sum1[i] += float64(want[q].dw1[rk*n1+i])
						}
						for i := range n2 {
							sum2[i] += float64(want[q].dw2[rk*n2+i])
						}
					}
					closeTo(t, fmt.Sprint("rank ", rk, " dw1"), got[rk].dw1, sum1, tl)
					closeTo(t, fmt.Sprint("rank ", rk, " dw2"), got[rk].dw2, sum2, tl)
				}
			})
		}
	})
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
// recompute: results are bit-identical to the plain layer's.
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
		l := newRef(r, cfg, 96, false, device.BF16, device.F32)
		gy := randn(r, device.BF16, 96*cfg.Hidden, 1)
		plain := runLayer(t, d, l, device.BF16, device.F32, gy)
		for _, pol := range policies {
			for _, pool := range []int{1 << 20, 4096} { // room for all; room for few (kept on the device)
				t.Run(fmt.Sprint(pol, "/pool=", pool), func(t *testing.T) {
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
					if pol == "*=remat" && st.Remat != 6 {
						t.Errorf("%d activations dropped for recompute, want 6", st.Remat)
					}
					if pol == "*=offload" && st.Offloads+st.Kept != 6 {
						t.Errorf("%d offloaded + %d kept, want 6", st.Offloads, st.Kept)
					}
				})
			}
		}
	})
}
