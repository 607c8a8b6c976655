package offload_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/offload"
)

func second[T any](_ T, err error) error { return err }

// mustNew returns an offloader of the CPU with a pool of pool bytes, closed at the end
// of t.
func mustNew(t *testing.T, pool int, policy string) *offload.Offloader {
	t.Helper()
	o := dt.Must(offload.New(device.CPU(), offload.Config{PoolBytes: pool, Policy: offload.MustParsePolicy(policy)}))
	t.Cleanup(func() { dt.NoErr(t, o.Close()) })
	return o
}

// TestBadArgs feeds the package's exported functions and methods nil, freed, closed,
// foreign and out-of-range arguments on the CPU; each must return an error naming the
// argument, without a panic.
func TestBadArgs(t *testing.T) {
	c := device.CPU()
	s := c.Stream()
	var (
		nilO *offload.Offloader
		nilS *device.Stream
		nilT *device.Tensor
	)
	closedS := dt.Must(c.NewStream())
	dt.NoErr(t, closedS.Close())
	alloc := func() *device.Tensor { return dt.Must(s.Alloc(device.F32, 4)) }

	o := mustNew(t, 1<<12, "k=device,r=remat,*=offload")
	other := mustNew(t, 1<<12, "*=offload")
	kept := alloc()
	hk := dt.Must(o.Save(s, "k", kept))
	freed := alloc()
	dt.NoErr(t, freed.Free())
	loaded := dt.Must(o.Save(s, "l", alloc()))
	dt.NoErr(t, dt.Must(o.Load(s, loaded)).FreeOn(s))
	foreign := dt.Must(other.Save(s, "f", alloc()))
	live := dt.Must(o.Save(s, "x", alloc()))

	closedO := dt.Must(offload.New(c, offload.Config{PoolBytes: 1 << 12}))
	hc := dt.Must(closedO.Save(s, "c", alloc()))
	dt.NoErr(t, closedO.Close())

	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"New nil device", func() error { return second(offload.New(nil, offload.Config{})) }, "New: nil device"},
		{"New negative pool", func() error { return second(offload.New(c, offload.Config{PoolBytes: -1})) }, "Config.PoolBytes = -1"},
		{"New 2^50-byte pool", func() error { return second(offload.New(c, offload.Config{PoolBytes: 1 << 50})) }, "pinning 1125899906842624 bytes"},

		{"nil Save", func() error { return second(nilO.Save(s, "x", alloc())) }, "Save: nil Offloader"},
		{"nil Prefetch", func() error { return nilO.Prefetch(live) }, "Prefetch: nil Offloader"},
		{"nil Load", func() error { return second(nilO.Load(s, live)) }, "Load: nil Offloader"},
		{"nil Drop", func() error { return nilO.Drop(s, live) }, "Drop: nil Offloader"},
		{"nil Synchronize", nilO.Synchronize, "Synchronize: nil Offloader"},
		{"nil Close", nilO.Close, "Close: nil Offloader"},

		{"Save nil stream", func() error { return second(o.Save(nilS, "x", alloc())) }, "Save: nil stream"},
		{"Save closed stream", func() error { return second(o.Save(closedS, "x", alloc())) }, "Save: stream was closed"},
		{"Save nil tensor", func() error { return second(o.Save(s, "x", nilT)) }, `Save "x": device: tensor is nil`},
		{"Save nil tensor kept", func() error { return second(o.Save(s, "k", nilT)) }, `Save "k": device: tensor is nil`},
		{"Save freed tensor", func() error { return second(o.Save(s, "x", freed)) }, "tensor f32[4]@cpu was freed"},
		{"Save twice on the device", func() error { return second(o.Save(s, "k", kept)) }, `Save "k": tensor f32[4]@cpu is held by the handle of Save "k"`},
		{"Save to offload a kept tensor", func() error { return second(o.Save(s, "x", kept)) }, `Save "x": tensor f32[4]@cpu is held by the handle of Save "k"`},
		{"Save to drop a kept tensor", func() error { return second(o.Save(s, "r", kept)) }, `Save "r": tensor f32[4]@cpu is held by the handle of Save "k"`},
		{"Save after Close", func() error { return second(closedO.Save(s, "x", alloc())) }, "Save: offloader is closed"},

		{"Prefetch zero handle", func() error { return o.Prefetch(offload.Handle{}) }, "Prefetch: zero Handle"},
		{"Prefetch loaded", func() error { return o.Prefetch(loaded) }, "Prefetch: handle was already loaded or dropped"},
		{"Prefetch foreign", func() error { return o.Prefetch(foreign) }, "Prefetch: handle of another Offloader"},
		{"Prefetch after Close", func() error { return closedO.Prefetch(hc) }, "Prefetch: offloader is closed"},

		{"Load nil stream", func() error { return second(o.Load(nilS, live)) }, "Load: nil stream"},
		{"Load closed stream", func() error { return second(o.Load(closedS, hk)) }, "Load: stream was closed"},
		{"Load zero handle", func() error { return second(o.Load(s, offload.Handle{})) }, "Load: zero Handle"},
		{"Load loaded", func() error { return second(o.Load(s, loaded)) }, "Load: handle was already loaded or dropped"},
		{"Load foreign", func() error { return second(o.Load(s, foreign)) }, "Load: handle of another Offloader"},
		{"Load after Close", func() error { return second(closedO.Load(s, hc)) }, "Load: offloader is closed"},

		{"Drop nil stream", func() error { return o.Drop(nilS, live) }, "Drop: nil stream"},
		{"Drop closed stream", func() error { return o.Drop(closedS, live) }, "Drop: stream was closed"},
		{"Drop zero handle", func() error { return o.Drop(s, offload.Handle{}) }, "Drop: zero Handle"},
		{"Drop loaded", func() error { return o.Drop(s, loaded) }, "Drop: handle was already loaded or dropped"},
		{"Drop foreign", func() error { return o.Drop(s, foreign) }, "Drop: handle of another Offloader"},
		{"Drop after Close", func() error { return closedO.Drop(s, hc) }, "Drop: offloader is closed"},

		{"Synchronize after Close", closedO.Synchronize, "Synchronize: offloader is closed"},

		{"ParseAction unknown", func() error { return second(offload.ParseAction("keep")) }, `unknown action "keep"`},
		{"ParsePolicy no action", func() error { return second(offload.ParsePolicy("a")) }, `entry 1 "a": want name=action`},
		{"ParsePolicy empty name", func() error { return second(offload.ParsePolicy("=remat")) }, "empty name"},
		{"ParsePolicy twice", func() error { return second(offload.ParsePolicy("a=remat,a=device")) }, `"a" is listed twice`},
		{"UnmarshalText bad", func() error { var p offload.Policy; return p.UnmarshalText([]byte("a=gpu")) }, `unknown action "gpu"`},
		{"With empty name", func() error { return second(offload.Policy{}.With("", offload.Remat)) }, "Policy.With: empty name"},
		{"With bad name", func() error { return second(offload.Policy{}.With("a,b", offload.Remat)) }, `Policy.With: name "a,b" holds ','`},
		{"With bad action", func() error { return second(offload.Policy{}.With("a", offload.Action(7))) }, `Policy.With("a"): invalid Action(7)`},
	} {
		t.Run(tc.name, func(t *testing.T) { dt.WantError(t, tc.call, tc.want) })
	}
	// The refused Saves left the kept tensor and its handle alone.
	x := dt.Must(o.Load(s, hk))
	if x != kept || x.Freed() {
		t.Errorf("Load of the kept handle after refused Saves: %v (freed %v), want the kept tensor", x, x.Freed())
	}
	dt.NoErr(t, x.Free())
}

// TestNilAccessors checks that the accessors of a nil Offloader return zero values.
func TestNilAccessors(t *testing.T) {
	var o *offload.Offloader
	var got struct {
		Device   bool
		D2H, H2D bool
		Policy   string
		Stats    offload.Stats
	}
	p, _ := dt.Recover(func() error {
		got.Device, got.D2H, got.H2D = o.Device() == nil, o.D2H() == nil, o.H2D() == nil
		got.Policy, got.Stats = o.Policy().String(), o.Stats()
		return nil
	})
	if p != nil {
		t.Fatalf("accessors of a nil Offloader: panic %v", p)
	}
	want := got
	want.Device, want.D2H, want.H2D, want.Policy, want.Stats = true, true, true, "", offload.Stats{}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("accessors of a nil Offloader (-want +got):\n%s", diff)
	}
}

// TestCloseFreesAfterStreams checks that Close frees the tensors kept on the device
// even when the streams that allocated them were closed first.
func TestCloseFreesAfterStreams(t *testing.T) {
	c := device.CPU()
	s := dt.Must(c.NewStream())
	o := dt.Must(offload.New(c, offload.Config{PoolBytes: 1 << 12}))
	x := dt.Must(s.Alloc(device.BF16, 8))
	dt.Must(o.Save(s, "x", x))
	dt.NoErr(t, s.Close())
	dt.NoErr(t, o.Close())
	if !x.Freed() {
		t.Error("Close left a kept tensor unfreed")
	}
}
