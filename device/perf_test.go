package device_test

import (
	"sort"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// timeOn returns the median GPU time of reps runs of fn on s, measured with events.
func timeOn(t testing.TB, s *device.Stream, reps int, fn func()) time.Duration {
	t.Helper()
	d := s.Device()
	var ts []time.Duration
	for range reps {
		a := dt.Must(d.NewEvent())
		b := dt.Must(d.NewEvent())
		dt.NoErr(t, a.Record(s))
		fn()
		dt.NoErr(t, b.Record(s))
		dt.NoErr(t, b.Synchronize())
		ts = append(ts, dt.Must(b.Since(a)))
		a.Close()
		b.Close()
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
	return ts[len(ts)/2]
}

// TestPinnedBandwidth checks that 1 GiB copies between pinned host memory and the GPU
// run at ≥ 50 GB/s each way.
func TestPinnedBandwidth(t *testing.T) {
	g := dt.GPU(t)
	const n = 1 << 30
	s := g.Stream()
	h := dt.Must(g.AllocPinned(n))
	defer h.Free()
	copy(h.Bytes(), dt.Bytes(dt.Rand(4), n))
	x := dt.Must(s.Alloc(device.E4M3, n))
	defer x.Free()
	h2d := timeOn(t, s, 5, func() { dt.NoErr(t, x.CopyFromPinned(s, h, 0)) })
	d2h := timeOn(t, s, 5, func() { dt.NoErr(t, x.CopyToPinned(s, h, 0)) })
	up, down := float64(n)/h2d.Seconds()/1e9, float64(n)/d2h.Seconds()/1e9
	t.Logf("pinned 1 GiB: host→device %.1f GB/s, device→host %.1f GB/s", up, down)
	if up < 50 || down < 50 {
		t.Errorf("pinned copies below 50 GB/s: %.1f / %.1f", up, down)
	}
}

// TestCopyBandwidth checks that the device-to-device copy kernel moves ≥ 3.8 TB/s
// counted as bytes read + bytes written, on 2 GiB, far beyond L2.
func TestCopyBandwidth(t *testing.T) {
	g := dt.GPU(t)
	const n = 2 << 30
	s := g.Stream()
	a := dt.Must(s.Alloc(device.E4M3, n))
	b := dt.Must(s.Alloc(device.E4M3, n))
	defer a.Free()
	defer b.Free()
	dt.NoErr(t, device.Fill(s, a, 1))
	el := timeOn(t, s, 10, func() { dt.NoErr(t, device.Copy(s, b, a)) })
	tbs := 2 * float64(n) / el.Seconds() / 1e12
	t.Logf("copy kernel 2 GiB: %v, %.2f TB/s read+write", el, tbs)
	if tbs < 3.8 {
		t.Errorf("copy kernel at %.2f TB/s, want ≥ 3.8", tbs)
	}
}

func benchCopy(b *testing.B, d *device.Device, n int) {
	s := d.Stream()
	x := dt.Must(s.Alloc(device.E4M3, n))
	y := dt.Must(s.Alloc(device.E4M3, n))
	defer x.Free()
	defer y.Free()
	dt.NoErr(b, device.Fill(s, x, 1))
	dt.NoErr(b, s.Synchronize())
	b.SetBytes(int64(2 * n))
	b.ResetTimer()
	for range b.N {
		dt.NoErr(b, device.Copy(s, y, x))
	}
	dt.NoErr(b, s.Synchronize())
	b.ReportMetric(2*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
}

func BenchmarkCopy(b *testing.B) {
	for _, d := range dt.Devices(b) {
		n := 2 << 30
		if !d.IsCUDA() {
			n = 64 << 20
		}
		b.Run(d.String(), func(b *testing.B) { benchCopy(b, d, n) })
	}
}

func BenchmarkCastF32ToBF16(b *testing.B) {
	for _, d := range dt.Devices(b) {
		n := 256 << 20
		if !d.IsCUDA() {
			n = 8 << 20
		}
		b.Run(d.String(), func(b *testing.B) {
			s := d.Stream()
			x := dt.Must(s.Alloc(device.F32, n))
			y := dt.Must(s.Alloc(device.BF16, n))
			defer x.Free()
			defer y.Free()
			dt.NoErr(b, device.Fill(s, x, 1.5))
			dt.NoErr(b, s.Synchronize())
			b.ResetTimer()
			for range b.N {
				dt.NoErr(b, device.Cast(s, y, x))
			}
			dt.NoErr(b, s.Synchronize())
			b.ReportMetric(6*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

func BenchmarkPinned(b *testing.B) {
	g := dt.GPU(b)
	const n = 1 << 30
	s := g.Stream()
	h := dt.Must(g.AllocPinned(n))
	defer h.Free()
	x := dt.Must(s.Alloc(device.E4M3, n))
	defer x.Free()
	for _, dir := range []string{"HtoD", "DtoH"} {
		b.Run(dir, func(b *testing.B) {
			b.SetBytes(n)
			for range b.N {
				if dir == "HtoD" {
					dt.NoErr(b, x.CopyFromPinned(s, h, 0))
				} else {
					dt.NoErr(b, x.CopyToPinned(s, h, 0))
				}
			}
			dt.NoErr(b, s.Synchronize())
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkLaunch measures the host cost of one small op: the binding's overhead.
func BenchmarkLaunch(b *testing.B) {
	for _, d := range dt.Devices(b) {
		b.Run(d.String(), func(b *testing.B) {
			s := d.Stream()
			x := dt.Must(s.Alloc(device.F32, 256))
			defer x.Free()
			for i := range b.N {
				dt.NoErr(b, device.Fill(s, x, float64(i)))
			}
			dt.NoErr(b, s.Synchronize())
		})
	}
}
