package offload

import (
	"bytes"
	_ "embed"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

//go:embed kernels/spin.cu
var spinSrc string

// spinProgram holds dl_spin, which busy-waits for a number of SM clock cycles; tests
// and benchmarks use it to hold a stream for a known time.
var spinProgram = device.NewProgram("spin.cu", spinSrc)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, spinProgram) }

// spinHz bounds the SM clock from above, so delay holds a stream at least as long as asked.
const spinHz = 2.1e9

// spin enqueues on s a kernel that holds blocks SMs for cycles clock cycles.
func spin(tb testing.TB, s *device.Stream, blocks int, cycles int64) {
	tb.Helper()
	k := dt.Must(s.Device().Kernel(spinProgram, "dl_spin"))
	dt.NoErr(tb, k.Launch(s, device.D1(blocks), device.D1(32), 0, cycles))
}

// delay holds s for at least d: a one-thread spin kernel on a GPU, a sleep enqueued as
// an op on the CPU.
func delay(tb testing.TB, s *device.Stream, d time.Duration) {
	tb.Helper()
	if !s.Device().IsCUDA() {
		dt.NoErr(tb, s.EnqueueCPU(func() { time.Sleep(d) }))
		return
	}
	spin(tb, s, 1, int64(d.Seconds()*spinHz))
}

// delayFor is the delay the use-before-ready tests hold a stream for: long enough on a
// GPU that the host enqueues everything after it before it ends.
func delayFor(d *device.Device) time.Duration {
	if d.IsCUDA() {
		return 50 * time.Millisecond
	}
	return time.Millisecond
}

// act is an activation of a test: its name, dtype, shape and bytes.
type act struct {
	name  string
	dtype device.DType
	shape []int
	data  []byte
}

var shapes = [][]int{{0}, {1}, {3}, {7, 5}, {1, 1, 13}, {0, 9}, {33, 17}, {1021}, {4, 255}, {2, 3, 5, 7}}

// randActs returns n activations of random dtypes and shapes from shapes plus random
// sizes up to maxElems, named name0, name1, ...
func randActs(r *rand.Rand, n, maxElems int, name string) []act {
	out := make([]act, n)
	for i := range out {
		typ := device.DTypes[r.IntN(len(device.DTypes))]
		shape := shapes[r.IntN(len(shapes))]
		if r.IntN(2) == 0 {
			shape = []int{1 + r.IntN(maxElems)}
		}
		a := act{name: fmt.Sprintf("%s%d", name, i), dtype: typ, shape: shape}
		nel := 1
		for _, d := range shape {
			nel *= d
		}
		a.data = dt.Bytes(r, nel*typ.Size())
		out[i] = a
	}
	return out
}

// upload returns a's data in a fresh tensor on s.
func (a act) upload(tb testing.TB, s *device.Stream) *device.Tensor {
	tb.Helper()
	x := dt.Must(s.Alloc(a.dtype, a.shape...))
	dt.NoErr(tb, x.CopyFromHost(s, a.data))
	return x
}

// check fails tb unless x, read on s, is a's activation: dtype, shape and bytes.
func (a act) check(tb testing.TB, s *device.Stream, x *device.Tensor, what string) {
	tb.Helper()
	if x.DType() != a.dtype || fmt.Sprint(x.Shape()) != fmt.Sprint(a.shape) {
		tb.Fatalf("%s: %s came back as %v, want %v%v", what, a.name, x, a.dtype, a.shape)
	}
	got := make([]byte, x.Bytes())
	dt.NoErr(tb, x.CopyToHost(s, got))
	if i := firstDiff(got, a.data); i >= 0 {
		tb.Fatalf("%s: %s (%v%v, %d bytes): byte %d is %#02x, want %#02x", what, a.name, a.dtype, a.shape, len(got), i, got[i], a.data[i])
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// fillPool sets every byte of o's pool to b, so a copy that reads a slot too early
// reads b. Nothing may be in flight.
func fillPool(tb testing.TB, o *Offloader, b byte) {
	tb.Helper()
	dt.NoErr(tb, o.Synchronize())
	p := o.pool.Bytes()
	for i := range p {
		p[i] = b
	}
}

// newOffloader returns an offloader of d, closed at the end of tb.
func newOffloader(tb testing.TB, d *device.Device, pool int, policy string) *Offloader {
	tb.Helper()
	o := dt.Must(New(d, Config{PoolBytes: pool, Policy: MustParsePolicy(policy)}))
	tb.Cleanup(func() { dt.NoErr(tb, o.Close()) })
	return o
}

// sumSlots returns the pool bytes acts take.
func sumSlots(acts []act) int {
	n := 0
	for _, a := range acts {
		n += alignUp(len(a.data))
	}
	return n
}

// checkBooks fails tb unless o's bookkeeping is consistent: pending records are
// draining and sorted by reload order, the free list holds exactly the free records,
// live and draining slots are disjoint and account for the pool's used bytes.
func checkBooks(tb testing.TB, o *Offloader) {
	tb.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	draining := 0
	for k, id := range o.pending {
		r := &o.recs[id]
		if r.state != stDraining || r.n == 0 || (k > 0 && o.recs[o.pending[k-1]].seq >= r.seq) {
			tb.Fatalf("pending %d: record %d in state %d, slot %d, seq %d: not draining in reload order", k, id, r.state, r.n, r.seq)
		}
		draining += r.n
	}
	if draining != o.draining {
		tb.Fatalf("draining %d, pending slots hold %d", o.draining, draining)
	}
	free := map[int32]bool{}
	for _, id := range o.free {
		if free[id] || o.recs[id].state != stFree {
			tb.Fatalf("free list: record %d twice or not free", id)
		}
		free[id] = true
	}
	var slots []span
	for i := range o.recs {
		r := &o.recs[i]
		if (r.state == stFree) != free[int32(i)] {
			tb.Fatalf("record %d in state %d, on the free list: %v", i, r.state, free[int32(i)])
		}
		if r.state != stFree && r.act == Offload && r.n > 0 {
			slots = append(slots, span{r.off, r.n})
		}
	}
	used := 0
	for i, a := range slots {
		used += a.n
		for _, b := range slots[:i] {
			if a.off < b.off+b.n && b.off < a.off+a.n {
				tb.Fatalf("slots %v and %v overlap", a, b)
			}
		}
	}
	if used != o.arena.used {
		tb.Fatalf("records hold %d pool bytes, the pool says %d", used, o.arena.used)
	}
}
