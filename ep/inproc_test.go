package ep_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// peerDevs returns n devices for the ranks of a world on two GPUs, rank r on GPU r mod
// 2, or skips t when there are fewer than two GPUs.
func peerDevs(t testing.TB, n int) []*device.Device {
	t.Helper()
	if c, err := device.CUDACount(); err != nil || c < 2 {
		t.Skipf("needs 2 GPUs (found %d: %v)", c, err)
	}
	gpus := []*device.Device{dt.Must(device.Open("cuda:0")), dt.Must(device.Open("cuda:1"))}
	devs := make([]*device.Device, n)
	for r := range devs {
		devs[r] = gpus[r%2]
	}
	return devs
}

// upload returns a tensor of dtype d and shape on s's device holding the bytes b.
func upload(s *device.Stream, d device.DType, b []byte, shape ...int) (*device.Tensor, error) {
	x, err := s.Alloc(d, shape...)
	if err != nil {
		return nil, err
	}
	return x, x.CopyFromHost(s, b)
}

// hostCopy returns x's bytes.
func hostCopy(s *device.Stream, x *device.Tensor) ([]byte, error) {
	b := make([]byte, x.Bytes())
	return b, x.CopyToHost(s, b)
}

// poisoned returns n bytes of 0xFF.
func poisoned(n int) []byte { return bytes.Repeat([]byte{0xFF}, n) }

// TestWorldCollectives: a world's AllGather (of one dtype, in place, and into a tensor
// of another dtype) and AllToAllV (into rows of another dtype of the same bytes, with
// gaps between the segments, rows to the rank itself and empty pieces) put every byte
// where it belongs and nothing elsewhere, and count the bytes between ranks: on the CPU
// and on GPU 0 (every rank on it: device to device), with the device route's protocol
// on the CPU (without other dtypes, which only GPUs reinterpret), and on two GPUs with
// ranks on both.
func TestWorldCollectives(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) { checkCollectives(t, dt.Must(ep.NewWorld(3, d)), true) })
	t.Run("device route on the CPU", func(t *testing.T) {
		checkCollectives(t, dt.Must(ep.DeviceRoute(dt.Must(ep.NewWorld(3)))), false)
	})
	t.Run("two GPUs", func(t *testing.T) { checkCollectives(t, dt.Must(ep.NewWorld(3, peerDevs(t, 3)...)), true) })
}

// checkCollectives runs the collectives of TestWorldCollectives on w, of 3 ranks, into
// tensors of other dtypes when other.
func checkCollectives(t *testing.T, w *ep.World, other bool) {
	const R = 3
	w.SetTimeout(20 * time.Second)
	gdt, a2adt := device.BF16, device.BF16 // the dtypes of AllGather's send into f32, of AllToAllV's f32 rows of 2
	if !other {
		gdt, a2adt = device.F32, device.F32
	}
	cnt := func(src, dst int) int { return (2*src + dst) % 4 } // rows from src to dst
	sendOff := func(src, dst int) int {                        // a gap row before each segment
		o := dst
		for e := range dst {
			o += cnt(src, e)
		}
		return o
	}
	recvOff := func(dst, src int) int { // two gap rows before each segment and after the last
		o := 2*src + 2
		for q := range src {
			o += cnt(q, dst)
		}
		return o
	}
	rowB := []int{8, 12}                           // f32 rows of 2 (into a2adt rows); i32 rows of 3
	in := func(r int, what string, n int) []byte { // rank r's bytes of what
		seed := uint64(r)
		for _, c := range what {
			seed = 131*seed + uint64(c)
		}
		return dt.Bytes(dt.Rand(seed), n)
	}
	type outs struct{ gather, inPlace, other []byte }
	got := make([]outs, R)
	gotA := make([][2][]byte, R)
	err := w.Run(func(tr ep.Transport) error {
		r := tr.Rank()
		s, err := tr.Device().NewStream()
		if err != nil {
			return err
		}
		defer s.Close()
		tmp := device.NewTemps(s)
		defer tmp.Free()
		var first error
		keep := func(x *device.Tensor, err error) *device.Tensor {
			if x != nil {
				tmp.Add(x)
			}
			if first == nil {
				first = err
			}
			return x
		}
		// AllGather: one dtype, in place, another dtype.
		send := keep(upload(s, device.I32, in(r, "g", 24), 2, 3))
		recv := keep(upload(s, device.I32, poisoned(72), 3, 6))
		both := append(poisoned(12*r), in(r, "p", 12)...)
		both = append(both, poisoned(12*(R-1-r))...)
		whole := keep(upload(s, device.I32, both, 3*R))
		bsend := keep(upload(s, gdt, in(r, "o", 12), 12/gdt.Size()))
		frecv := keep(upload(s, device.F32, poisoned(36), 9))
		// AllToAllV.
		S, Rv := sendOff(r, R), recvOff(r, R)
		x := &ep.Exchange{SendOff: make([]int, R), SendCount: make([]int, R), RecvOff: make([]int, R), RecvCount: make([]int, R)}
		for p := range R {
			x.SendOff[p], x.SendCount[p] = sendOff(r, p), cnt(r, p)
			x.RecvOff[p], x.RecvCount[p] = recvOff(r, p), cnt(p, r)
		}
		x.Send = []*device.Tensor{keep(upload(s, device.F32, in(r, "a0", S*8), S, 2)), keep(upload(s, device.I32, in(r, "a1", S*12), S, 3))}
		x.Recv = []*device.Tensor{keep(upload(s, a2adt, poisoned(Rv*8), Rv, 8/a2adt.Size())), keep(upload(s, device.I32, poisoned(Rv*12), Rv, 3))}
		if first != nil {
			return first
		}
		if err := tr.AllGather(s, send, recv); err != nil {
			return err
		}
		if err := tr.AllGather(s, dt.Must(whole.View(3*r, 3)), whole); err != nil {
			return err
		}
		if err := tr.AllGather(s, bsend, frecv); err != nil {
			return err
		}
		if err := tr.AllToAllV(s, x); err != nil {
			return err
		}
		if err := tr.Sync(s); err != nil {
			return err
		}
		var errs [5]error
		got[r].gather, errs[0] = hostCopy(s, recv)
		got[r].inPlace, errs[1] = hostCopy(s, whole)
		got[r].other, errs[2] = hostCopy(s, frecv)
		gotA[r][0], errs[3] = hostCopy(s, x.Recv[0])
		gotA[r][1], errs[4] = hostCopy(s, x.Recv[1])
		return errors.Join(errs[:]...)
	})
	if err != nil {
		t.Fatal(err)
	}
	var gather, inPlace, into []byte
	for q := range R {
		gather = append(gather, in(q, "g", 24)...)
		inPlace = append(inPlace, in(q, "p", 12)...)
		into = append(into, in(q, "o", 12)...)
	}
	for r := range R {
		for _, c := range []struct {
			what      string
			got, want []byte
		}{{"AllGather", got[r].gather, gather}, {"AllGather in place", got[r].inPlace, inPlace}, {"AllGather into f32", got[r].other, into}} {
			if !bytes.Equal(c.got, c.want) {
				t.Errorf("rank %d: %s: %x, want %x", r, c.what, c.got, c.want)
			}
		}
		for i, rb := range rowB {
			want := poisoned(recvOff(r, R) * rb)
			for src := range R {
				seg := in(src, fmt.Sprintf("a%d", i), sendOff(src, R)*rb)[sendOff(src, r)*rb:]
				copy(want[recvOff(r, src)*rb:], seg[:cnt(src, r)*rb])
			}
			if !bytes.Equal(gotA[r][i], want) {
				t.Errorf("rank %d: AllToAllV tensor %d: %x, want %x", r, i, gotA[r][i], want)
			}
		}
	}
	for src, row := range w.Bytes() {
		for dst, b := range row {
			want := int64(0)
			if src != dst {
				want = int64(24 + 12 + 12 + cnt(src, dst)*(rowB[0]+rowB[1]))
			}
			if b != want {
				t.Errorf("bytes %d→%d = %d, want %d", src, dst, b, want)
			}
		}
	}
}

// TestWorldMismatchRoutes: ranks whose collectives do not match fail with the same
// error through host memory and with the device route's protocol, before any rank
// reads another's tensors.
func TestWorldMismatchRoutes(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(tr ep.Transport, s *device.Stream) error
		want []string // the rank that finds the mismatch first words it
	}{
		{"AllToAllV counts", func(tr ep.Transport, s *device.Stream) error {
			n := 1 + tr.Rank() // every rank sends 1 row to each, rank 1 expects 2
			return tr.AllToAllV(s, &ep.Exchange{Send: []*device.Tensor{dt.Must(s.Alloc(device.F32, 4, 2))}, Recv: []*device.Tensor{dt.Must(s.Alloc(device.F32, 4, 2))},
				SendOff: []int{0, 0}, SendCount: []int{1, 1}, RecvOff: []int{0, 0}, RecvCount: []int{n, n}})
		}, []string{"rank 0 sends 1 rows to rank 1, which expects 2"}},
		{"AllGather sizes", func(tr ep.Transport, s *device.Stream) error {
			n := 1 + tr.Rank()
			return tr.AllGather(s, dt.Must(s.Alloc(device.I32, n)), dt.Must(s.Alloc(device.I32, 2*n)))
		}, []string{"AllGather: rank", "sends", "bytes, rank"}},
		{"AllGather and AllToAllV", func(tr ep.Transport, s *device.Stream) error {
			x := dt.Must(s.Alloc(device.I32, 2))
			if tr.Rank() == 1 {
				return tr.AllToAllV(s, &ep.Exchange{Send: []*device.Tensor{x}, Recv: []*device.Tensor{dt.Must(s.Alloc(device.I32, 2))},
					SendOff: []int{0, 0}, SendCount: []int{0, 0}, RecvOff: []int{0, 0}, RecvCount: []int{0, 0}})
			}
			return tr.AllGather(s, x, dt.Must(s.Alloc(device.I32, 4)))
		}, []string{"rank 0 called AllGather", "rank 1 called AllToAllV"}},
	} {
		for _, route := range []string{"host", "device"} {
			t.Run(tc.name+"/"+route, func(t *testing.T) {
				w := dt.Must(ep.NewWorld(2))
				if route == "device" {
					w = dt.Must(ep.DeviceRoute(w))
				}
				w.SetTimeout(5 * time.Second)
				err := w.Run(func(tr ep.Transport) error { return tc.call(tr, device.CPU().Stream()) })
				if msg := wantErr(err, tc.want...); msg != "" {
					t.Error(msg)
				}
			})
		}
	}
}

// TestInvariantsDeviceRoute runs the shared suite on worlds of CPU ranks that follow
// the device route's protocol, under shuffled schedules, whose results must equal those
// through host memory bit for bit.
func TestInvariantsDeviceRoute(t *testing.T) {
	for _, sc := range scenarios() {
		t.Run(sc.name, func(t *testing.T) {
			ins := sc.inputs()
			w := dt.Must(ep.DeviceRoute(dt.Must(ep.NewWorld(sc.R))))
			checkWorld(t, w, sc, ins, runWorld(t, device.CPU(), sc, ins, nil), func(tr ep.Transport) ep.Transport {
				return &jitter{Transport: tr, r: dt.Rand(sc.seed + uint64(tr.Rank()))}
			})
		})
	}
}

// TestInvariantsPeers runs the shared suite on in-process worlds with rank r on GPU r
// mod 2 (ranks that share a GPU and ranks that do not: device to device when the GPUs
// address each other's memory), whose results must equal the CPU's bit for bit.
func TestInvariantsPeers(t *testing.T) {
	peerDevs(t, 1)
	for _, sc := range scenarios() {
		t.Run(sc.name, func(t *testing.T) {
			ins := sc.inputs()
			want := runWorld(t, device.CPU(), sc, ins, nil)
			checkWorld(t, dt.Must(ep.NewWorld(sc.R, peerDevs(t, sc.R)...)), sc, ins, want, nil)
		})
	}
}

// checkWorld runs sc on w's ranks (each wrapped by wrap, if not nil) and checks the
// invariants and that the outputs are want's.
func checkWorld(t *testing.T, w *ep.World, sc scen, ins []rankIn, want []*rankOut, wrap func(ep.Transport) ep.Transport) {
	t.Helper()
	w.SetTimeout(20 * time.Second)
	trs := make([]ep.Transport, sc.R)
	for r := range trs {
		if trs[r] = w.Transport(r); wrap != nil {
			trs[r] = wrap(trs[r])
		}
	}
	outs, errs := runAll(trs, sc, ins, w)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	check(t, sc, ins, outs)
	if diff := diffOuts(want, outs); diff != "" {
		t.Errorf("results differ (got, want through host memory on the CPU):\n%s", diff)
	}
}

// BenchmarkWorld times Dispatch followed by Combine (identity experts) between two
// in-process ranks on one device, with uniform and Zipf(1.1)-skewed routing under the
// Dropless capacity, and reports what BenchmarkDispatchCombine reports. On the CPU the
// ranks have that benchmark's CPU setting (T = 512 tokens each, H = 256 bf16, E = 16,
// K = 4); on a GPU both ranks are on GPU 0 with its GPU setting (T = 16384 tokens each,
// H = 7168 bf16, E = 64, K = 8), and rows move device to device within the GPU.
func BenchmarkWorld(b *testing.B) {
	for _, d := range dt.Devices(b) {
		for _, route := range []string{"uniform", "zipf"} {
			b.Run(fmt.Sprintf("%v/%s", d, route), func(b *testing.B) {
				sc := scen{R: 2, E: 16, K: 4, H: 256, T: []int{512, 512}, dt: device.BF16, route: route, seed: 41}
				if d.IsCUDA() {
					sc = scen{R: 2, E: 64, K: 8, H: 7168, T: []int{16384, 16384}, dt: device.BF16, route: route, seed: 42}
				}
				w := dt.Must(ep.NewWorld(sc.R, d))
				trs := make([]ep.Transport, sc.R)
				for r := range trs {
					trs[r] = w.Transport(r)
				}
				benchDC(b, trs, sc)
			})
		}
	}
}
