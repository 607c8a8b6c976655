package ep

import (
	"errors"
	"fmt"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// fakeDev is a device for chooseRoute: a GPU or not, with a name.
type fakeDev struct {
	name string
	gpu  bool
}

func (d *fakeDev) IsCUDA() bool { return d.gpu }

// TestChooseRoute: a world moves rows device to device exactly when every rank is on a
// GPU and every two of its GPUs let each other read their memory; it asks for each
// ordered pair of distinct GPUs once.
func TestChooseRoute(t *testing.T) {
	cpu, g0, g1, g2 := &fakeDev{"cpu", false}, &fakeDev{"g0", true}, &fakeDev{"g1", true}, &fakeDev{"g2", true}
	for _, tc := range []struct {
		name  string
		devs  []*fakeDev
		deny  string // "a>b": a cannot read b's memory
		want  route
		asked []string
	}{
		{"CPU", []*fakeDev{cpu, cpu}, "", viaHost, nil},
		{"one GPU", []*fakeDev{g0, g0, g0}, "", viaDevice, nil},
		{"one rank", []*fakeDev{g1}, "", viaDevice, nil},
		{"CPU and GPU", []*fakeDev{g0, cpu}, "", viaHost, nil},
		{"peers", []*fakeDev{g0, g1, g0, g1}, "", viaDevice, []string{"g0>g1", "g1>g0"}},
		{"three peers", []*fakeDev{g2, g0, g1}, "", viaDevice, []string{"g2>g0", "g2>g1", "g0>g2", "g0>g1", "g1>g2", "g1>g0"}},
		{"no peer access", []*fakeDev{g0, g1}, "g0>g1", viaHost, []string{"g0>g1"}},
		{"one way only", []*fakeDev{g0, g1, g2}, "g2>g1", viaHost, []string{"g0>g1", "g0>g2", "g1>g0", "g1>g2", "g2>g0", "g2>g1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var asked []string
			got := chooseRoute(tc.devs, func(a, b *fakeDev) error {
				pair := a.name + ">" + b.name
				asked = append(asked, pair)
				if pair == tc.deny {
					return errors.New("no peer-to-peer path")
				}
				return nil
			})
			if got != tc.want || fmt.Sprint(asked) != fmt.Sprint(tc.asked) {
				t.Errorf("route %v after asking %v, want %v after %v", got, asked, tc.want, tc.asked)
			}
		})
	}
}

// TestWorldRouteCPU: ranks on the CPU move rows through host memory.
func TestWorldRouteCPU(t *testing.T) {
	for _, devs := range [][]*device.Device{nil, {device.CPU()}, {device.CPU(), device.CPU()}} {
		w := dt.Must(NewWorld(2, devs...))
		if w.route != viaHost || w.dr != nil {
			t.Errorf("NewWorld(2, %v): route %v with state %v, want through host memory", devs, w.route, w.dr)
		}
	}
}

// TestWorldRouteGPU: ranks all on one GPU move rows device to device, as do ranks on
// two GPUs that address each other's memory; a world with a rank on the CPU goes
// through host memory. Every rank of a world of the device route has its events.
func TestWorldRouteGPU(t *testing.T) {
	g := dt.GPU(t)
	check := func(devs []*device.Device, want route) {
		t.Helper()
		w := dt.Must(NewWorld(len(devs), devs...))
		if w.route != want {
			t.Errorf("NewWorld(%d, %v): route %v, want %v", len(devs), devs, w.route, want)
		}
		if want == viaDevice && (w.dr == nil || len(w.dr.ranks) != len(devs)) {
			t.Errorf("NewWorld(%d, %v): state %v, want one per rank", len(devs), devs, w.dr)
		}
	}
	check([]*device.Device{g}, viaDevice)
	check([]*device.Device{g, g, g}, viaDevice)
	check([]*device.Device{g, device.CPU()}, viaHost)
	if n, err := device.CUDACount(); err != nil || n < 2 {
		return
	}
	h := dt.Must(device.Open("cuda:1"))
	want := viaHost
	if a, _ := g.CanAccessPeer(h); a {
		if b, _ := h.CanAccessPeer(g); b {
			want = viaDevice
		}
	}
	check([]*device.Device{g, h, g}, want)
}

func (r route) String() string {
	if r == viaDevice {
		return "device to device"
	}
	return "through host memory"
}
