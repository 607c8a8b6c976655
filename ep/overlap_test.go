package ep_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestOverlapErrors checks the ops' during functions when an op fails: an op that fails
// on a bad argument calls none of them; the error of one fails the op with that error
// and the functions after it are not called; the next op of the layout runs as usual,
// skipping a nil function.
// (The shared suite checks that each op calls them once, in order.)
func TestOverlapErrors(t *testing.T) {
	sc := scenarios()[1] // R2
	ins := sc.inputs()
	stop := errors.New("stop")
	dt.Run(t, func(t *testing.T, d *device.Device) {
		_, trs := newWorld(t, d, sc.R)
		_, errs := eachRank(trs, func(r int, _ *phaser) (struct{}, error) {
			rk, err := newRank(trs[r], sc, ins[r].idx)
			if err != nil {
				return struct{}{}, err
			}
			defer rk.close()
			s := rk.s
			x, err := device.FromFloat32(s, sc.dt, ins[r].x, sc.T[r], sc.H)
			if err != nil {
				return struct{}{}, err
			}
			defer x.Free()
			l, err := rk.g.Layout(s, rk.idx)
			if err != nil {
				return struct{}{}, err
			}
			defer l.Free()
			var calls []string
			log := func(name string, err error) func() error {
				return func() error { calls = append(calls, name); return err }
			}
			// A bad argument: no transfer starts, no function runs.
			if _, err := l.Dispatch(s, nil, nil, log("bad", nil)); err == nil {
				return struct{}{}, errors.New("Dispatch of a nil x: no error")
			}
			// The second of three fails the op.
			_, err = l.Dispatch(s, x, nil, log("first", nil), log("second", stop), log("third", nil))
			if !errors.Is(err, stop) {
				return struct{}{}, fmt.Errorf("Dispatch with a failing during function: error %v, want %v", err, stop)
			}
			// The layout still moves rows.
			D, err := l.Dispatch(s, x, nil, nil, log("after", nil))
			if err != nil {
				return struct{}{}, err
			}
			if err := errors.Join(trs[r].Sync(s), D.Free()); err != nil {
				return struct{}{}, err
			}
			if got, want := strings.Join(calls, " "), "first second after"; got != want {
				return struct{}{}, fmt.Errorf("rank %d: during functions ran as %q, want %q", r, got, want)
			}
			return struct{}{}, nil
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
	})
}
