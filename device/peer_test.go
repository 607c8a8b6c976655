package device_test

import (
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestPeerMemoryCPU(t *testing.T) {
	cpu := device.CPU()
	if _, err := cpu.AllocPeerMemory(16); err == nil {
		t.Error("AllocPeerMemory on the CPU: want an error")
	}
	if _, err := cpu.WrapPeer(0, device.F32, 4); err == nil {
		t.Error("WrapPeer on the CPU: want an error")
	}
	if err := cpu.Stream().WaitAtLeast(0, 1); err == nil {
		t.Error("WaitAtLeast on the CPU: want an error")
	}
}

// done polls e for up to d: a test that waits on a flag must not hang its binary when
// the flag never comes.
func done(t *testing.T, e *device.Event, d time.Duration) bool {
	t.Helper()
	for end := time.Now().Add(d); ; {
		ok, err := e.Done()
		if err != nil {
			t.Fatal(err)
		}
		if ok || time.Now().After(end) {
			return ok
		}
		time.Sleep(time.Millisecond)
	}
}

// TestPeerMemory: peer memory starts zeroed and has a handle for other processes; a
// stream passes a wait on a word that holds enough. With two GPUs, one writes into the
// other's peer memory, and a stream of the other that waits on the word runs on only
// once it is written. Streams stuck on a wait are left as they are (and their memory
// allocated): freeing would wait for them.
func TestPeerMemory(t *testing.T) {
	d := dt.GPU(t)
	if _, err := d.AllocPeerMemory(0); err == nil {
		t.Error("AllocPeerMemory(0): want an error")
	}
	const n = 1 << 16
	m := dt.Must(d.AllocPeerMemory(4 * n))
	x := dt.Must(d.WrapPeer(m.Ptr(), device.I32, n))
	s := dt.Must(d.NewStream())
	got := make([]int32, n)
	dt.NoErr(t, device.Download(s, x, got))
	for i, v := range got {
		if v != 0 {
			t.Fatalf("new peer memory [%d] = %d, want 0", i, v)
		}
	}
	if _, err := m.Handle(); err != nil {
		t.Fatal(err)
	}
	dt.NoErr(t, device.Fill(s, dt.Must(x.View(0, 1)), 9))
	dt.NoErr(t, s.WaitAtLeast(m.Ptr(), 7))
	dt.NoErr(t, device.Fill(s, dt.Must(x.View(1, 1)), 5))
	if !done(t, dt.Must(s.Record()), 5*time.Second) {
		t.Fatal("a stream waits on a word that holds more than it waits for")
	}
	dt.NoErr(t, device.Download(s, x, got))
	if got[0] != 9 || got[1] != 5 {
		t.Errorf("after the wait: words %d, %d; want 9, 5", got[0], got[1])
	}
	defer m.Free()
	defer s.Close()

	if c, err := device.CUDACount(); err != nil || c < 2 {
		return
	}
	e := dt.Must(device.Open("cuda:1"))
	if ok, _ := d.CanAccessPeer(e); !ok {
		if dt.RequireGPU() {
			t.Fatalf("%v cannot address %v", d, e)
		}
		return
	}
	dt.NoErr(t, d.EnablePeerAccess(e))
	pm := dt.Must(e.AllocPeerMemory(4 * n))
	es := dt.Must(e.NewStream())
	mine := dt.Must(e.WrapPeer(pm.Ptr(), device.I32, n))
	// Load e's fill kernel first: loading a module waits for the device's streams.
	dt.NoErr(t, device.Fill(es, dt.Must(mine.View(3, 1)), 0))
	dt.NoErr(t, es.Synchronize())
	dt.NoErr(t, es.WaitAtLeast(pm.Ptr(), 3))
	dt.NoErr(t, device.Fill(es, dt.Must(mine.View(2, 1)), 4))
	if done(t, dt.Must(es.Record()), 20*time.Millisecond) {
		t.Fatalf("%v ran past a wait on an unset word", e)
	}
	y := dt.Must(d.WrapPeer(pm.Ptr(), device.I32, n))                         // e's memory, written by d
	dt.NoErr(t, device.Copy(s, dt.Must(y.View(0, 2)), dt.Must(x.View(0, 2)))) // 9, 5
	if !done(t, dt.Must(s.Record()), 5*time.Second) {
		t.Fatalf("%v's writes into %v's memory did not finish", d, e)
	}
	if !done(t, dt.Must(es.Record()), 5*time.Second) {
		t.Fatalf("%v's stream still waits after %v set the word", e, d)
	}
	defer pm.Free()
	defer es.Close()
	back := make([]int32, n)
	dt.NoErr(t, device.Download(es, mine, back))
	if back[0] != 9 || back[1] != 5 || back[2] != 4 || back[3] != 0 {
		t.Errorf("%v's memory after %v wrote it: %v; want 9, 5, 4, 0", e, d, back[:4])
	}
}
