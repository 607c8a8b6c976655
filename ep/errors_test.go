package ep_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// noPanic calls f and returns its error, or a panic of f as an error.
func noPanic(f func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return f()
}

// wantErr reports how err falls short of an error that contains every string of want.
func wantErr(err error, want ...string) string {
	if err == nil {
		return fmt.Sprintf("no error, want one containing %q", want)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			return fmt.Sprintf("error %q, want one containing %q", err, want)
		}
	}
	return ""
}

// TestWorldTransportOutOfRange: the endpoint of a rank outside the world fails every
// call with an error that names the rank and the world's size.
func TestWorldTransportOutOfRange(t *testing.T) {
	w := dt.Must(ep.NewWorld(2))
	s := device.CPU().Stream()
	a, b := dt.Must(s.Alloc(device.I32, 2)), dt.Must(s.Alloc(device.I32, 4))
	for _, r := range []int{5, 2, -1} {
		tr := w.Transport(r)
		for name, call := range map[string]func() error{
			"NewGroup":  func() error { return errOf(ep.NewGroup(tr, ep.Config{Experts: 2, TopK: 1})) },
			"AllGather": func() error { return tr.AllGather(s, a, b) },
			"AllToAllV": func() error {
				return tr.AllToAllV(s, &ep.Exchange{Send: []*device.Tensor{a}, Recv: []*device.Tensor{b},
					SendOff: []int{0, 0}, SendCount: []int{0, 0}, RecvOff: []int{0, 0}, RecvCount: []int{0, 0}})
			},
			"Sync":  func() error { return tr.Sync(s) },
			"Close": tr.Close,
		} {
			if msg := wantErr(noPanic(call), fmt.Sprintf("rank %d", r), "2 ranks"); msg != "" {
				t.Errorf("Transport(%d): %s: %s", r, name, msg)
			}
		}
	}
	// The world is not harmed: its ranks still work.
	if err := w.Run(func(tr ep.Transport) error {
		return tr.AllGather(s, dt.Must(s.Alloc(device.I32, 2)), dt.Must(s.Alloc(device.I32, 4)))
	}); err != nil {
		t.Errorf("the world after calls of ranks outside it: %v", err)
	}
}

// TestWorldRunPanic: a rank that panics in Run fails every rank, with an error that
// carries the panic value and the rank, instead of killing the process.
func TestWorldRunPanic(t *testing.T) {
	w := dt.Must(ep.NewWorld(3))
	w.SetTimeout(10 * time.Second)
	err := noPanic(func() error {
		return w.Run(func(tr ep.Transport) error {
			if tr.Rank() == 1 {
				panic("boom")
			}
			s := device.CPU().Stream()
			return tr.AllGather(s, dt.Must(s.Alloc(device.I32, 1)), dt.Must(s.Alloc(device.I32, 3)))
		})
	})
	for _, r := range []int{0, 1, 2} {
		if msg := wantErr(err, fmt.Sprintf("rank %d: ep: rank 1 panicked: boom", r)); msg != "" {
			t.Error(msg)
		}
	}
	var pe *ep.PanicError
	if !errors.As(err, &pe) || pe.Rank != 1 || pe.Value != "boom" || len(pe.Stack) == 0 {
		t.Errorf("errors.As(%v) = %+v, want the *PanicError of rank 1 with its value and stack", err, pe)
	}
	if msg := wantErr(w.Err(), "rank 1 panicked: boom"); msg != "" {
		t.Errorf("the world's error: %s", msg)
	}
}

// TestWorldTimeout: a rank that never arrives makes the others fail within the timeout,
// with an error that names the missing rank, not the waiting ones.
func TestWorldTimeout(t *testing.T) {
	w, _ := ep.NewWorld(3)
	w.SetTimeout(200 * time.Millisecond)
	s := device.CPU().Stream()
	start := time.Now()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := dt.Must(s.Alloc(device.I32, 4))
			errs[r] = w.Transport(r).AllGather(s, x, dt.Must(s.Alloc(device.I32, 12)))
		}()
	}
	wg.Wait()
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("ranks returned after %v", el)
	}
	for r, err := range errs {
		if msg := wantErr(err, "rank(s) [2] of 3", "AllGather", "200ms"); msg != "" {
			t.Errorf("rank %d: %s", r, msg)
		}
	}
	// The world stays aborted.
	if err := w.Transport(2).AllGather(s, dt.Must(s.Alloc(device.I32, 4)), dt.Must(s.Alloc(device.I32, 12))); err == nil {
		t.Error("the late rank's call succeeded in an aborted world")
	}
}

// TestTimeoutEnv: $DROPLESS_EP_TIMEOUT must be a positive Go duration with its unit;
// anything else fails the transport's creation instead of meaning the default.
func TestTimeoutEnv(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want string // "": no error
	}{
		{"90s", ""},
		{"1m30s", ""},
		{"5", `DROPLESS_EP_TIMEOUT="5"`},
		{"bogus", `DROPLESS_EP_TIMEOUT="bogus"`},
		{"0s", `DROPLESS_EP_TIMEOUT="0s"`},
		{"-3s", `DROPLESS_EP_TIMEOUT="-3s"`},
	} {
		t.Setenv("DROPLESS_EP_TIMEOUT", tc.env)
		_, err := ep.NewWorld(2)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%q: %v", tc.env, err)
		case tc.want != "":
			if msg := wantErr(err, tc.want, "unit"); msg != "" {
				t.Errorf("%q: %s", tc.env, msg)
			}
		}
	}
}

// TestRanksDisagree: ranks whose groups or ops disagree on a setting fail with an error
// that names the setting and the ranks, instead of a mismatch of byte counts (or, for
// rows of the same bytes, a silent wrong answer).
func TestRanksDisagree(t *testing.T) {
	base := ep.Config{Experts: 4, TopK: 2}
	for _, tc := range []struct {
		name string
		cfg  func(r int) ep.Config
		x    func(r int) (device.DType, int) // Dispatch's x: dtype, width
		want []string
	}{
		{name: "TopK", cfg: func(r int) ep.Config { c := base; c.TopK = 1 + r; return c },
			want: []string{"Config.TopK", "1 on rank 0", "2 on rank 1"}},
		{name: "Experts", cfg: func(r int) ep.Config { c := base; c.Experts = 4 + 4*r; return c },
			want: []string{"Config.Experts", "4 on rank 0", "8 on rank 1"}},
		{name: "Capacity", cfg: func(r int) ep.Config { c := base; c.Capacity = ep.Rows(8 + r); return c },
			want: []string{"Config.Capacity", "Rows(8) on rank 0", "Rows(9) on rank 1"}},
		{name: "row width", x: func(r int) (device.DType, int) { return device.F32, 4 + 4*r },
			want: []string{"Dispatch", "x", "f32 rows of 4 on rank 0", "f32 rows of 8 on rank 1"}},
		{name: "dtype of rows of the same bytes", x: func(r int) (device.DType, int) {
			if r == 0 {
				return device.F32, 4
			}
			return device.BF16, 8
		}, want: []string{"Dispatch", "x", "f32 rows of 4 on rank 0", "bf16 rows of 8 on rank 1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := dt.Must(ep.NewWorld(2))
			w.SetTimeout(10 * time.Second)
			err := noPanic(func() error {
				return w.Run(func(tr ep.Transport) error {
					cfg, xdt, H := base, device.F32, 4
					if tc.cfg != nil {
						cfg = tc.cfg(tr.Rank())
					}
					if tc.x != nil {
						xdt, H = tc.x(tr.Rank())
					}
					g, err := ep.NewGroup(tr, cfg)
					if err != nil {
						return err
					}
					defer g.Close()
					s := device.CPU().Stream()
					idx := make([]int32, 3*cfg.TopK) // token t: experts t, t+1, ... mod E
					for i := range idx {
						idx[i] = int32((i/cfg.TopK + i%cfg.TopK) % cfg.Experts)
					}
					l, err := g.Layout(s, dt.Must(device.FromSlice(s, device.I32, idx, 3, cfg.TopK)))
					if err != nil {
						return err
					}
					defer l.Free()
					_, err = l.Dispatch(s, dt.Must(s.Alloc(xdt, 3, H)), nil)
					return err
				})
			})
			if msg := wantErr(err, tc.want...); msg != "" {
				t.Error(msg)
			}
			t.Log(err)
		})
	}
}
