package offload

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// overlap runs training-like steps on one device: a forward pass of n chunks of compute
// on the compute stream, each producing an activation of size bytes that is saved, then
// a backward pass loading them in reverse, two ahead, each followed by a chunk of
// compute. Compute is the spin kernel on every SM (a busy loop on the CPU), so its
// duration is known and it does not compete with the copies.
type overlap struct {
	tb      testing.TB
	d       *device.Device
	s       *device.Stream
	o       *Offloader
	n, size int
	hz      float64 // spin kernel cycles per second, measured
	a, b    *device.Event
}

// overlapTimes are a step's times three ways and the compute chunk that balanced them.
type overlapTimes struct {
	step, compute, copy, chunk time.Duration
}

// ratio is step / max(compute, copy): 1 when the copies hide entirely behind compute.
func (r overlapTimes) ratio() float64 { return r.step.Seconds() / max(r.compute, r.copy).Seconds() }

func (r overlapTimes) String() string {
	return fmt.Sprintf("step %v, compute alone %v, copy alone %v (chunk %v): ratio %.3f", r.step, r.compute, r.copy, r.chunk, r.ratio())
}

func newOverlap(tb testing.TB, d *device.Device, n, size int) *overlap {
	v := &overlap{tb: tb, d: d, s: d.Stream(), n: n, size: size}
	v.o = newOffloader(tb, d, n*alignUp(size), "act=offload,keep=device")
	v.a, v.b = dt.Must(d.NewEvent()), dt.Must(d.NewEvent())
	tb.Cleanup(func() { v.a.Close(); v.b.Close() })
	if d.IsCUDA() {
		// Calibrate the spin kernel's clock on all SMs.
		const cycles = 20_000_000
		spin(tb, v.s, d.Multiprocessors(), cycles)
		el := v.timed(func() { spin(tb, v.s, d.Multiprocessors(), cycles) })
		v.hz = cycles / el.Seconds()
	}
	return v
}

// work enqueues a chunk of compute of duration c on the compute stream.
func (v *overlap) work(c time.Duration) {
	if c <= 0 {
		return
	}
	if !v.d.IsCUDA() {
		dt.NoErr(v.tb, v.s.EnqueueCPU(func() {
			for t0 := time.Now(); time.Since(t0) < c; {
			}
		}))
		return
	}
	spin(v.tb, v.s, v.d.Multiprocessors(), int64(c.Seconds()*v.hz))
}

// timed returns the compute stream's time for the work fn enqueues. On a GPU a gate
// holds the stream first, so the host has enqueued the work before it starts.
func (v *overlap) timed(fn func()) time.Duration {
	if v.d.IsCUDA() {
		delay(v.tb, v.s, 20*time.Millisecond)
	}
	dt.NoErr(v.tb, v.a.Record(v.s))
	fn()
	dt.NoErr(v.tb, v.b.Record(v.s))
	dt.NoErr(v.tb, v.b.Synchronize())
	return dt.Must(v.b.Since(v.a))
}

// step runs one step saving the activations as name, with compute chunks of c, and
// returns its time. Everything it moves ends before the compute stream's last event.
func (v *overlap) step(name string, c time.Duration) time.Duration {
	const ahead = 2
	hs := make([]Handle, v.n)
	el := v.timed(func() {
		for i := range hs {
			x := dt.Must(v.s.Alloc(device.E4M3, v.size))
			v.work(c) // produces x
			hs[i] = dt.Must(v.o.Save(v.s, name, x))
		}
		for i := v.n - 1; i >= 0; i-- {
			for j := i; j >= max(i-ahead, 0); j-- {
				dt.NoErr(v.tb, v.o.Prefetch(hs[j]))
			}
			x := dt.Must(v.o.Load(v.s, hs[i]))
			v.work(c) // consumes x
			dt.NoErr(v.tb, x.FreeOn(v.s))
		}
	})
	dt.NoErr(v.tb, v.o.Synchronize())
	if st := v.o.Stats(); st.Kept != 0 || st.InUse != 0 {
		v.tb.Fatalf("overlap step: %+v", st)
	}
	return el
}

// median returns the median of reps runs of fn.
func median(reps int, fn func() time.Duration) time.Duration {
	ts := make([]time.Duration, reps)
	for i := range ts {
		ts[i] = fn()
	}
	slices.Sort(ts)
	return ts[reps/2]
}

// measure times the copies alone, calibrates the compute chunk so the compute alone
// takes as long, and times the step with both; medians of reps runs.
func (v *overlap) measure(reps int) overlapTimes {
	v.step("act", 0) // warm the device's memory pool
	var r overlapTimes
	r.copy = median(reps, func() time.Duration { return v.step("act", 0) })
	r.chunk = r.copy / time.Duration(2*v.n)
	c := median(reps, func() time.Duration { return v.step("keep", r.chunk) })
	r.chunk = time.Duration(float64(r.chunk) * r.copy.Seconds() / c.Seconds())
	r.compute = median(reps, func() time.Duration { return v.step("keep", r.chunk) })
	r.step = median(reps, func() time.Duration { return v.step("act", r.chunk) })
	return r
}

// TestOverlapGPU checks on the GPU that a step offloading and reloading 1 GiB beside
// compute of the same duration takes at most 1.05 × max(compute, copy).
func TestOverlapGPU(t *testing.T) {
	g := dt.GPU(t)
	r := newOverlap(t, g, 64, 16<<20).measure(3)
	t.Logf("1 GiB in 16 MiB activations, out and back: %v", r)
	if r.ratio() > 1.05 {
		t.Errorf("step takes %.3f × max(compute, copy), want ≤ 1.05: %v", r.ratio(), r)
	}
}

// TestOverlap runs the overlap measurement small, on every device, so the helper is
// exercised without a GPU. On the CPU nothing overlaps: the ratio is about 2.
func TestOverlap(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		r := newOverlap(t, d, 4, 64<<10).measure(1)
		t.Logf("%v", r)
		if r.step <= 0 || r.compute <= 0 || r.copy <= 0 {
			t.Errorf("times: %v", r)
		}
	})
}

// BenchmarkOffload offloads 1 GiB in 16 MiB activations and reloads it (64 MiB in
// 1 MiB on the CPU), reporting each direction's GB/s from the copy streams' events.
func BenchmarkOffload(b *testing.B) {
	for _, d := range dt.Devices(b) {
		n, size := 64, 16<<20
		if !d.IsCUDA() {
			n, size = 64, 1<<20
		}
		for _, dir := range []string{"d2h", "h2d"} {
			b.Run(d.String()+"/"+dir, func(b *testing.B) { benchOffload(b, d, n, size, dir) })
		}
	}
}

func benchOffload(b *testing.B, d *device.Device, n, size int, dir string) {
	s := d.Stream()
	o := newOffloader(b, d, n*size, "*=offload")
	ev := make([]*device.Event, 4)
	for i := range ev {
		ev[i] = dt.Must(d.NewEvent())
		defer ev[i].Close()
	}
	hs := make([]Handle, n)
	xs := make([]*device.Tensor, n)
	var d2h, h2d time.Duration
	round := func() {
		for i := range xs {
			xs[i] = dt.Must(s.Alloc(device.E4M3, size))
		}
		dt.NoErr(b, s.Synchronize())
		dt.NoErr(b, ev[0].Record(o.D2H()))
		for i, x := range xs {
			hs[i] = dt.Must(o.Save(s, "x", x))
		}
		dt.NoErr(b, ev[1].Record(o.D2H()))
		dt.NoErr(b, o.D2H().Synchronize())
		dt.NoErr(b, ev[2].Record(o.H2D()))
		for _, h := range hs {
			dt.NoErr(b, o.Prefetch(h))
		}
		dt.NoErr(b, ev[3].Record(o.H2D()))
		for _, h := range hs {
			x := dt.Must(o.Load(s, h))
			dt.NoErr(b, x.FreeOn(s))
		}
		dt.NoErr(b, o.Synchronize())
		dt.NoErr(b, s.Synchronize())
		d2h += dt.Must(ev[1].Since(ev[0]))
		h2d += dt.Must(ev[3].Since(ev[2]))
	}
	round()
	d2h, h2d = 0, 0
	b.SetBytes(int64(n * size))
	b.ResetTimer()
	for range b.N {
		round()
	}
	b.StopTimer()
	el := d2h
	if dir == "h2d" {
		el = h2d
	}
	b.ReportMetric(float64(n*size)*float64(b.N)/el.Seconds()/1e9, "GB/s")
}

// BenchmarkOverlap times a step offloading and reloading 1 GiB in 16 MiB activations
// beside compute calibrated to the copies' duration (4 MiB in 64 KiB on the CPU), and
// reports step / max(compute, copy) as "ratio" with the three times in ms.
func BenchmarkOverlap(b *testing.B) {
	for _, d := range dt.Devices(b) {
		n, size := 64, 16<<20
		if !d.IsCUDA() {
			n, size = 64, 64<<10
		}
		b.Run(d.String(), func(b *testing.B) {
			v := newOverlap(b, d, n, size)
			r := v.measure(3)
			b.ResetTimer()
			ts := make([]time.Duration, b.N)
			for i := range ts {
				ts[i] = v.step("act", r.chunk)
			}
			b.StopTimer()
			slices.Sort(ts)
			r.step = ts[len(ts)/2]
			b.ReportMetric(r.ratio(), "ratio")
			b.ReportMetric(r.step.Seconds()*1e3, "step-ms")
			b.ReportMetric(r.compute.Seconds()*1e3, "compute-ms")
			b.ReportMetric(r.copy.Seconds()*1e3, "copy-ms")
			b.ReportMetric(2*float64(n*size)/r.copy.Seconds()/1e9, "copy-GB/s")
		})
	}
}
