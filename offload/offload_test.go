package offload

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// TestRoundTrip checks that bytes come back exactly for every dtype and for odd,
// zero-length and empty shapes, with and without Prefetch.
func TestRoundTrip(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(1)
		var acts []act
		for _, typ := range device.DTypes {
			for _, shape := range slices.Concat(shapes, [][]int{{}, {100003}}) {
				nel := 1
				for _, n := range shape {
					nel *= n
				}
				acts = append(acts, act{name: fmt.Sprintf("%v%v", typ, shape), dtype: typ, shape: shape, data: dt.Bytes(r, nel*typ.Size())})
			}
		}
		o := newOffloader(t, d, sumSlots(acts), "*=offload")
		fillPool(t, o, 0xA5)
		hs := make([]Handle, len(acts))
		for i, a := range acts {
			x := a.upload(t, s)
			hs[i] = dt.Must(o.Save(s, a.name, x))
			if hs[i].Action() != Offload {
				t.Fatalf("%s: Save did %v, want offload", a.name, hs[i].Action())
			}
			if !x.Freed() {
				t.Fatalf("%s: Save left the device copy", a.name)
			}
		}
		for i, a := range acts {
			if i%2 == 0 {
				dt.NoErr(t, o.Prefetch(hs[i]))
			}
			x := dt.Must(o.Load(s, hs[i]))
			a.check(t, s, x, "round trip")
			dt.NoErr(t, x.FreeOn(s))
		}
		dt.NoErr(t, o.Synchronize())
		st := o.Stats()
		total := 0
		for _, a := range acts {
			total += len(a.data)
		}
		want := Stats{PoolBytes: int64(sumSlots(acts)), Peak: int64(sumSlots(acts)), Offloaded: int64(total), Reloaded: int64(total),
			Offloads: len(acts), Unprefetched: len(acts) / 2}
		if diff := cmp.Diff(want, st); diff != "" {
			t.Errorf("stats (-want +got):\n%s", diff)
		}
	})
}

// op is one call of a step's schedule.
type op struct {
	kind byte // 's'ave, 'p'refetch, 'l'oad
	i    int
}

// schedule returns the saves and loads of n activations in an order: fifo, lifo,
// random (all saves, then loads in a random order) or interleaved (saves and loads
// mixed at random, as pipeline schedules do).
func schedule(r *rand.Rand, n int, order string) []op {
	var ops []op
	perm := make([]int, n)
	for i := range perm {
		perm[i] = i
	}
	switch order {
	case "lifo":
		for i := range perm {
			perm[i] = n - 1 - i
		}
	case "random":
		r.Shuffle(n, func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	case "interleaved":
		var live []int
		next := 0
		for next < n || len(live) > 0 {
			if next < n && (len(live) == 0 || r.IntN(3) > 0) {
				ops = append(ops, op{'s', next})
				live = append(live, next)
				next++
				continue
			}
			k := r.IntN(len(live))
			ops = append(ops, op{'l', live[k]})
			live = append(live[:k], live[k+1:]...)
		}
		return ops
	}
	for i := range n {
		ops = append(ops, op{'s', i})
	}
	for _, i := range perm {
		ops = append(ops, op{'l', i})
	}
	return ops
}

// withPrefetch adds Prefetch calls to a schedule: none; all (right after each save);
// ahead (before each load, the next two loads already saved); random (a random live
// activation before some ops, so some twice).
func withPrefetch(r *rand.Rand, ops []op, mode string) []op {
	var out []op
	saved := map[int]bool{}
	for k, o := range ops {
		switch {
		case mode == "ahead" && o.kind == 'l':
			got := 0
			for _, n := range ops[k:] {
				if n.kind == 'l' && saved[n.i] && got < 2 {
					out = append(out, op{'p', n.i})
					got++
				}
			}
		case mode == "random" && r.IntN(2) == 0:
			var live []int
			for i, ok := range saved {
				if ok {
					live = append(live, i)
				}
			}
			if len(live) > 0 {
				out = append(out, op{'p', live[r.IntN(len(live))]})
			}
		}
		out = append(out, o)
		if o.kind == 's' {
			saved[o.i] = true
			if mode == "all" {
				out = append(out, op{'p', o.i})
			}
		} else {
			saved[o.i] = false
		}
	}
	return out
}

// runSchedule saves, prefetches and loads acts as ops say, checking every activation
// that comes back, and returns the handles' actions.
func runSchedule(t *testing.T, o *Offloader, s *device.Stream, acts []act, ops []op) []Action {
	t.Helper()
	hs := make([]Handle, len(acts))
	done := make([]Action, len(acts))
	for _, p := range ops {
		a := acts[p.i]
		switch p.kind {
		case 's':
			hs[p.i] = dt.Must(o.Save(s, a.name, a.upload(t, s)))
			done[p.i] = hs[p.i].Action()
		case 'p':
			dt.NoErr(t, o.Prefetch(hs[p.i]))
		case 'l':
			x := dt.Must(o.Load(s, hs[p.i]))
			a.check(t, s, x, "load")
			dt.NoErr(t, x.FreeOn(s))
		}
		checkBooks(t, o)
	}
	return done
}

// TestLoadOrders checks that every load order, with every way of prefetching, gets
// the same bytes back, in ample and tight pools (tight: slots reused within the step,
// offloads kept on the device).
func TestLoadOrders(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, order := range []string{"fifo", "lifo", "random", "interleaved"} {
			for _, pf := range []string{"none", "all", "ahead", "random"} {
				for _, pool := range []string{"ample", "tight"} {
					r := dt.Rand(uint64(len(order)*100 + len(pf)*10 + len(pool)))
					acts := randActs(r, 16, 3000, "act")
					size := sumSlots(acts)
					if pool == "tight" {
						size = size * 2 / 5
					}
					o := newOffloader(t, d, size, "*=offload")
					fillPool(t, o, 0x5A)
					ops := withPrefetch(r, schedule(r, len(acts), order), pf)
					name := order + "/" + pf + "/" + pool
					done := runSchedule(t, o, s, acts, ops)
					dt.NoErr(t, o.Synchronize())
					st := o.Stats()
					kept, keptBytes, moved := 0, 0, 0
					for i, a := range done {
						if a == Device {
							kept++
							keptBytes += len(acts[i].data)
						} else {
							moved += len(acts[i].data)
						}
					}
					if st.InUse != 0 || st.Draining != 0 || st.Peak > st.PoolBytes {
						t.Errorf("%s: pool after the step: %+v", name, st)
					}
					if st.Kept != kept || st.KeptBytes != int64(keptBytes) || st.Offloaded != int64(moved) || st.Reloaded != int64(moved) {
						t.Errorf("%s: stats %+v: want %d kept (%d bytes), %d bytes moved each way", name, st, kept, keptBytes, moved)
					}
					if pool == "tight" && order != "interleaved" && kept == 0 {
						t.Errorf("%s: a pool of 40%% of the step kept nothing on the device", name)
					}
				}
			}
		}
	})
}

// TestLaggingReloads reruns the load orders with reloads reported unfinished at random
// (always, in the "never" case), so Save must take slots whose reloads are running:
// the D2H stream waits for them (Stats.Stalls) and bytes still come back exactly.
func TestLaggingReloads(t *testing.T) {
	saved := eventDone
	defer func() { eventDone = saved }()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, lag := range []string{"never", "random"} {
			r := dt.Rand(uint64(len(lag)))
			eventDone = func(e *device.Event) (bool, error) {
				done, err := saved(e)
				return done && lag == "random" && r.IntN(2) == 0, err
			}
			for _, order := range []string{"fifo", "lifo", "random", "interleaved"} {
				for _, pool := range []string{"ample", "tight"} {
					name := lag + "/" + order + "/" + pool
					acts := randActs(r, 16, 3000, "act")
					size := sumSlots(acts)
					if pool == "tight" {
						size = size / 3
					}
					o := newOffloader(t, d, size, "*=offload")
					var st Stats
					for step := range 3 {
						ops := withPrefetch(r, schedule(r, len(acts), order), "ahead")
						runSchedule(t, o, s, acts, ops)
						st = o.Stats()
						if st.InUse != 0 || st.Peak > st.PoolBytes || st.InUse+st.Draining > st.PoolBytes {
							t.Fatalf("%s: step %d: %+v", name, step, st)
						}
						if step == 0 && pool == "ample" && st.Stalls != 0 {
							t.Errorf("%s: %d stalls in the first step with room for all", name, st.Stalls)
						}
					}
					if lag == "never" && st.Stalls == 0 {
						t.Errorf("%s: no stall with no reload ever reported finished", name)
					}
					dt.NoErr(t, o.Synchronize())
					if st := o.Stats(); st.Draining != 0 || st.InUse != 0 || len(o.pending) != 0 {
						t.Errorf("%s: after Synchronize: %+v", name, st)
					}
				}
			}
		}
	})
}

// TestUseBeforeReady delays each copy's input with a spin kernel (a sleep op on the
// CPU) and checks that no copy reads before its input is ready and no slot or device
// memory is reused early.
func TestUseBeforeReady(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		wait := delayFor(d)
		r := dt.Rand(7)
		a := act{name: "x", dtype: device.BF16, shape: []int{333, 129}}
		a.data = dt.Bytes(r, 333*129*2)
		b := act{name: "y", dtype: device.BF16, shape: []int{333, 129}, data: dt.Bytes(r, 333*129*2)}
		slot := alignUp(len(a.data))

		t.Run("producer", func(t *testing.T) {
			// The producer writes x after a delay on compute; Save and Load follow at
			// once. A D2H copy that did not wait for compute would read the poison.
			for _, prefetch := range []bool{false, true} {
				o := newOffloader(t, d, slot, "*=offload")
				src := a.upload(t, s)
				x := dt.Must(s.Alloc(a.dtype, a.shape...))
				dt.Poison(t, s, x)
				delay(t, s, wait)
				dt.NoErr(t, device.Copy(s, x, src))
				h := dt.Must(o.Save(s, a.name, x))
				if prefetch {
					dt.NoErr(t, o.Prefetch(h))
				}
				y := dt.Must(o.Load(s, h))
				a.check(t, s, y, "producer delayed")
				dt.NoErr(t, y.FreeOn(s))
				src.Free()
			}
		})

		t.Run("offload", func(t *testing.T) {
			// The D2H copy is held behind a delay; the reload is asked for at once. An
			// H2D copy that did not wait for the D2H event would read the pool's fill.
			for _, prefetch := range []bool{false, true} {
				o := newOffloader(t, d, slot, "*=offload")
				fillPool(t, o, 0xEE)
				x := a.upload(t, s)
				delay(t, o.D2H(), wait)
				h := dt.Must(o.Save(s, a.name, x))
				if prefetch {
					dt.NoErr(t, o.Prefetch(h))
				}
				y := dt.Must(o.Load(s, h))
				a.check(t, s, y, "offload delayed")
				dt.NoErr(t, y.FreeOn(s))
			}
		})

		t.Run("source", func(t *testing.T) {
			// Right after Save, compute allocates tensors of the source's size and
			// overwrites them. Were the source freed on compute before its delayed copy,
			// one of them would take its memory and the copy would read the overwrite.
			o := newOffloader(t, d, slot, "*=offload")
			x := a.upload(t, s)
			delay(t, o.D2H(), wait)
			h := dt.Must(o.Save(s, a.name, x))
			var junk []*device.Tensor
			for range 8 {
				j := dt.Must(s.Alloc(a.dtype, a.shape...))
				dt.NoErr(t, device.Memset(s, j, 0xFF))
				junk = append(junk, j)
			}
			y := dt.Must(o.Load(s, h))
			a.check(t, s, y, "source overwritten")
			dt.NoErr(t, y.FreeOn(s))
			for _, j := range junk {
				j.Free()
			}
		})

		t.Run("slot", func(t *testing.T) {
			// A pool of one slot: x's reload is held behind a delay on H2D when y, saved
			// next, needs the slot. y's D2H copy must wait for x's reload, else x comes
			// back as y's bytes. Repeated over steps, with and without Prefetch.
			o := newOffloader(t, d, slot, "*=offload")
			for step := range 4 {
				x, y := a, b
				if step%2 == 1 {
					x, y = b, a
				}
				// Nothing between the delay and Save(y) may block the host.
				tx, ty := x.upload(t, s), y.upload(t, s)
				hx := dt.Must(o.Save(s, x.name, tx))
				delay(t, o.H2D(), wait)
				if step < 2 {
					dt.NoErr(t, o.Prefetch(hx))
				}
				gx := dt.Must(o.Load(s, hx))
				hy := dt.Must(o.Save(s, y.name, ty))
				if hy.Action() != Offload {
					t.Fatalf("step %d: y was not offloaded: %v", step, hy.Action())
				}
				gy := dt.Must(o.Load(s, hy))
				x.check(t, s, gx, fmt.Sprintf("step %d: reload of the slot's previous tensor", step))
				y.check(t, s, gy, fmt.Sprintf("step %d: the slot's next tensor", step))
				dt.NoErr(t, gx.FreeOn(s))
				dt.NoErr(t, gy.FreeOn(s))
			}
			st := o.Stats()
			if d.IsCUDA() && st.Stalls != 4 {
				t.Errorf("stalls = %d, want 4 (y waited for x's reload each step)", st.Stalls)
			}
			if st.Kept != 0 || st.Peak != int64(slot) {
				t.Errorf("stats %+v: want nothing kept and a peak of one slot", st)
			}
		})
	})
}

// TestPoolFull checks that an offload finding no room stays on the device, counted,
// and comes back intact; and that tensors larger than the pool never wait.
func TestPoolFull(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(3)
		acts := []act{
			{name: "a", dtype: device.F32, shape: []int{100}, data: dt.Bytes(r, 400)},
			{name: "b", dtype: device.F32, shape: []int{100}, data: dt.Bytes(r, 400)},
			{name: "c", dtype: device.F32, shape: []int{1000}, data: dt.Bytes(r, 4000)},
		}
		o := newOffloader(t, d, 512, "*=offload")
		var hs []Handle
		var xs []*device.Tensor
		for _, a := range acts {
			x := a.upload(t, s)
			hs = append(hs, dt.Must(o.Save(s, a.name, x)))
			xs = append(xs, x)
		}
		got := []Action{hs[0].Action(), hs[1].Action(), hs[2].Action()}
		if diff := cmp.Diff([]Action{Offload, Device, Device}, got); diff != "" {
			t.Errorf("actions (-want +got):\n%s", diff)
		}
		for i, h := range hs {
			y := dt.Must(o.Load(s, h))
			if i > 0 && y != xs[i] {
				t.Errorf("%s: a kept tensor came back as another tensor", acts[i].name)
			}
			acts[i].check(t, s, y, "pool full")
			dt.NoErr(t, y.FreeOn(s))
		}
		st := o.Stats()
		if st.Kept != 2 || st.KeptBytes != 4400 || st.Stalls != 0 || st.Offloaded != 400 {
			t.Errorf("stats %+v: want 2 kept (4400 bytes), no stall, 400 bytes offloaded", st)
		}
	})
}

// TestDeviceAndRematSkipPool checks that Device and Remat activations never touch the
// pool: no slot, no copy, no byte of the pool changed.
func TestDeviceAndRematSkipPool(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(4)
		acts := randActs(r, 12, 5000, "a")
		policy := ""
		for i := range acts {
			acts[i].name = []string{"query_proj", "moe_mlpwi_0", "decoder_layer_input"}[i%3] + fmt.Sprint(i)
			policy += fmt.Sprintf("%s=%v,", acts[i].name, []Action{Remat, Offload, Device}[i%3])
		}
		policy += "*=offload"
		o := newOffloader(t, d, 1<<20, policy)
		fillPool(t, o, 0xC3)
		var hs []Handle
		var xs []*device.Tensor
		slots, moved := 0, 0
		for i, a := range acts {
			x := a.upload(t, s)
			h := dt.Must(o.Save(s, a.name, x))
			if want := []Action{Remat, Offload, Device}[i%3]; h.Action() != want {
				t.Fatalf("%s: Save did %v, want %v", a.name, h.Action(), want)
			}
			if h.Action() == Offload {
				slots += alignUp(len(a.data))
				moved += len(a.data)
			}
			if got, want := x.Freed(), h.Action() != Device; got != want {
				t.Errorf("%s (%v): device copy freed = %v, want %v", a.name, h.Action(), got, want)
			}
			hs = append(hs, h)
			xs = append(xs, x)
		}
		dt.NoErr(t, s.Synchronize())
		dt.NoErr(t, o.D2H().Synchronize())
		st := o.Stats()
		if st.InUse != int64(slots) || st.Offloaded != int64(moved) || st.Device != 4 || st.Remat != 4 || st.Offloads != 4 {
			t.Errorf("stats after saves %+v: want %d bytes in use, %d offloaded, 4 of each action", st, slots, moved)
		}
		for i, c := range o.pool.Bytes()[slots:] {
			if c != 0xC3 {
				t.Fatalf("pool byte %d beyond the offloads' %d changed", slots+i, slots)
			}
		}
		for i, h := range hs {
			y, err := o.Load(s, h)
			switch h.Action() {
			case Remat:
				if !errors.Is(err, ErrRecompute) || y != nil || !strings.Contains(err.Error(), acts[i].name) {
					t.Errorf("%s: Load of a remat activation = %v, %v; want ErrRecompute naming it", acts[i].name, y, err)
				}
				continue
			case Device:
				if y != xs[i] {
					t.Errorf("%s: Load of a device activation returned another tensor", acts[i].name)
				}
			}
			dt.NoErr(t, err)
			acts[i].check(t, s, y, "load")
			dt.NoErr(t, y.FreeOn(s))
		}
		if st := o.Stats(); st.Reloaded != int64(moved) {
			t.Errorf("reloaded %d bytes, want %d", st.Reloaded, moved)
		}
		h := dt.Must(o.Save(s, "query_proj0", nil))
		if _, err := o.Load(s, h); !errors.Is(err, ErrRecompute) {
			t.Errorf("Remat with a nil tensor: %v", err)
		}
	})
}

// TestManySteps runs 1,000 steps of random activations, orders and prefetches through
// a pool smaller than a step's offloads: bytes always come back, the pool stays within
// its size and empties after each step, the pinned pool is allocated once, and the
// offloader's records stop growing.
func TestManySteps(t *testing.T) {
	pinned := 0
	saved := allocPinned
	allocPinned = func(d *device.Device, n int) (*device.HostBuffer, error) { pinned++; return saved(d, n) }
	defer func() { allocPinned = saved }()
	dt.Run(t, func(t *testing.T, d *device.Device) {
		pinned = 0
		s := d.Stream()
		r := dt.Rand(5)
		const steps, perStep = 1000, 8
		o := newOffloader(t, d, 16<<10, "*=offload")
		pool := o.pool
		var recs int
		orders := []string{"fifo", "lifo", "random", "interleaved"}
		pfs := []string{"none", "all", "ahead", "random"}
		for step := range steps {
			acts := randActs(r, perStep, 1200, "a")
			ops := withPrefetch(r, schedule(r, perStep, orders[step%4]), pfs[(step/4)%4])
			runSchedule(t, o, s, acts, ops)
			st := o.Stats()
			if st.InUse != 0 || st.Peak > st.PoolBytes || st.Draining > st.PoolBytes {
				t.Fatalf("step %d: %+v", step, st)
			}
			if step == 10 {
				recs = len(o.recs)
			}
			if step > 10 && len(o.recs) > recs+perStep {
				t.Fatalf("step %d: %d records, %d at step 10", step, len(o.recs), recs)
			}
		}
		dt.NoErr(t, o.Synchronize())
		st := o.Stats()
		if st.InUse != 0 || st.Draining != 0 || o.arena.used != 0 || len(o.pending) != 0 {
			t.Errorf("after %d steps: %+v, %d bytes used", steps, st, o.arena.used)
		}
		if pinned != 1 || o.pool != pool {
			t.Errorf("%d pinned allocations, want the one of New", pinned)
		}
		if len(o.recs) > 2*perStep {
			t.Errorf("%d records for %d live at a time", len(o.recs), perStep)
		}
		t.Logf("%d steps: %d records, stats %+v", steps, len(o.recs), st)
	})
}

// TestNoHostAllocation checks that Save (and, on a GPU, Prefetch and Load) allocate no
// host memory in proportion to the data: nothing is pinned or buffered per call.
func TestNoHostAllocation(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		const n, size = 16, 1 << 20
		o := newOffloader(t, d, n*size, "*=offload")
		step := func(measure bool) uint64 {
			xs := make([]*device.Tensor, n)
			for i := range xs {
				xs[i] = dt.Must(s.Alloc(device.E4M3, size))
			}
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			hs := make([]Handle, 0, n)
			for _, x := range xs {
				hs = append(hs, dt.Must(o.Save(s, "x", x)))
			}
			if d.IsCUDA() {
				for _, h := range hs {
					dt.NoErr(t, o.Prefetch(h))
				}
				for i, h := range hs {
					xs[i] = dt.Must(o.Load(s, h))
				}
			}
			runtime.ReadMemStats(&m1)
			for i, h := range hs {
				if !d.IsCUDA() {
					xs[i] = dt.Must(o.Load(s, h))
				}
				dt.NoErr(t, xs[i].FreeOn(s))
			}
			dt.NoErr(t, s.Synchronize())
			return m1.TotalAlloc - m0.TotalAlloc
		}
		step(false)
		got := step(true)
		t.Logf("%d bytes of host memory allocated moving %d tensors of %d MiB", got, n, size>>20)
		if got > n*8<<10 {
			t.Errorf("%d bytes of host memory allocated moving %d tensors of %d MiB, want < 8 KiB a tensor", got, n, size>>20)
		}
	})
}

// TestDrop checks Drop at each stage of a handle's life.
func TestDrop(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(6)
		acts := randActs(r, 4, 1000, "a")
		o := newOffloader(t, d, 1<<16, "a0=offload,a1=offload,a2=device,a3=remat")
		var hs []Handle
		for _, a := range acts {
			hs = append(hs, dt.Must(o.Save(s, a.name, a.upload(t, s))))
		}
		dt.NoErr(t, o.Prefetch(hs[1]))
		for _, h := range hs {
			dt.NoErr(t, o.Drop(s, h))
			if _, err := o.Load(s, h); err == nil || !strings.Contains(err.Error(), "already loaded or dropped") {
				t.Errorf("Load after Drop: %v", err)
			}
		}
		dt.NoErr(t, o.Synchronize())
		if st := o.Stats(); st.InUse != 0 || st.Draining != 0 {
			t.Errorf("after Drop: %+v", st)
		}
		// The slots are usable again.
		h := dt.Must(o.Save(s, "a0", acts[0].upload(t, s)))
		y := dt.Must(o.Load(s, h))
		acts[0].check(t, s, y, "after Drop")
		dt.NoErr(t, y.FreeOn(s))
	})
}

// TestErrors checks that bad calls return errors naming what is wrong.
func TestErrors(t *testing.T) {
	if _, err := New(device.CPU(), Config{PoolBytes: -1}); err == nil || !strings.Contains(err.Error(), "PoolBytes = -1") {
		t.Errorf("New with a negative pool: %v", err)
	}
	if _, err := New(nil, Config{}); err == nil || !strings.Contains(err.Error(), "nil device") {
		t.Errorf("New(nil): %v", err)
	}
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		o := newOffloader(t, d, 1<<12, "*=offload")
		other := newOffloader(t, d, 1<<12, "*=offload")
		x := dt.Must(s.Alloc(device.F32, 4))
		freed := dt.Must(s.Alloc(device.F32, 4))
		freed.Free()
		loaded := dt.Must(o.Save(s, "l", dt.Must(s.Alloc(device.F32, 4))))
		y := dt.Must(o.Load(s, loaded))
		y.FreeOn(s)
		foreign := dt.Must(other.Save(s, "f", dt.Must(s.Alloc(device.F32, 4))))
		for _, tc := range []struct {
			name string
			call func() error
			want string
		}{
			{"nil stream", func() error { _, err := o.Save(nil, "x", x); return err }, "Save: nil stream"},
			{"nil tensor", func() error { _, err := o.Save(s, "x", nil); return err }, `Save "x"`},
			{"freed tensor", func() error { _, err := o.Save(s, "w", freed); return err }, "was freed"},
			{"zero handle", func() error { _, err := o.Load(s, Handle{}); return err }, "zero Handle"},
			{"loaded twice", func() error { _, err := o.Load(s, loaded); return err }, "already loaded"},
			{"prefetch loaded", func() error { return o.Prefetch(loaded) }, "Prefetch: handle was already loaded"},
			{"foreign handle", func() error { _, err := o.Load(s, foreign); return err }, "another Offloader"},
			{"load nil stream", func() error { _, err := o.Load(nil, foreign); return err }, "Load: nil stream"},
			{"drop nil stream", func() error { return o.Drop(nil, foreign) }, "Drop: nil stream"},
		} {
			err := tc.call()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
			}
		}
		if d.IsCUDA() {
			c := device.CPU().Stream()
			cx := dt.Must(c.Alloc(device.F32, 4))
			if _, err := o.Save(c, "x", cx); err == nil || !strings.Contains(err.Error(), "stream of cpu") {
				t.Errorf("Save on a CPU stream: %v", err)
			}
			if _, err := o.Save(s, "x", cx); err == nil || !strings.Contains(err.Error(), "cpu") {
				t.Errorf("Save of a CPU tensor: %v", err)
			}
		}
		c := dt.Must(New(d, Config{PoolBytes: 1 << 12, Policy: MustParsePolicy("*=offload")}))
		h := dt.Must(c.Save(s, "x", x))
		dt.NoErr(t, c.Close())
		dt.NoErr(t, c.Close())
		if _, err := c.Save(s, "x", x); err == nil || !strings.Contains(err.Error(), "closed") {
			t.Errorf("Save after Close: %v", err)
		}
		if _, err := c.Load(s, h); err == nil || !strings.Contains(err.Error(), "closed") {
			t.Errorf("Load after Close: %v", err)
		}
	})
}

// TestConcurrent runs steps from several goroutines, each with its own compute stream,
// through one offloader (run it with -race).
func TestConcurrent(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		acts := randActs(dt.Rand(8), 4*6, 2000, "a")
		o := newOffloader(t, d, sumSlots(acts)/2, "*=offload")
		t.Run("steps", func(t *testing.T) {
			for g := range 4 {
				t.Run(fmt.Sprint(g), func(t *testing.T) {
					t.Parallel()
					s := dt.Must(d.NewStream())
					defer s.Close()
					r := dt.Rand(uint64(g))
					mine := acts[g*6 : g*6+6]
					for step := range 20 {
						ops := withPrefetch(r, schedule(r, len(mine), []string{"fifo", "lifo", "random", "interleaved"}[step%4]), "random")
						runSchedule(t, o, s, mine, ops)
						_ = o.Stats()
					}
				})
			}
		})
		dt.NoErr(t, o.Synchronize())
		if st := o.Stats(); st.InUse != 0 || st.Draining != 0 {
			t.Errorf("after the steps: %+v", st)
		}
	})
}
