package device_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// badCase is a call with a bad argument and a piece of the error it must return.
type badCase struct {
	name string
	call func() error
	want string
}

// runBad runs each case in a subtest and fails it unless the call returns an error
// holding want, without a panic.
func runBad(t *testing.T, cases []badCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { dt.WantError(t, tc.call, tc.want) })
	}
}

func second[T any](_ T, err error) error { return err }

// TestBadArgs feeds the package's exported functions and methods nil, freed, closed,
// wrong-shape, wrong-dtype and out-of-range arguments on the CPU.
func TestBadArgs(t *testing.T) {
	c := device.CPU()
	s := c.Stream()
	var (
		nilD *device.Device
		nilS *device.Stream
		nilT *device.Tensor
		nilE *device.Event
		nilG *device.Graph
		nilH *device.HostBuffer
		nilP *device.PeerMemory
	)
	closed := dt.Must(c.NewStream())
	orphan := dt.Must(closed.Alloc(device.F32, 4)) // its allocating stream gets closed
	dt.NoErr(t, closed.Close())

	x := dt.Must(s.Alloc(device.F32, 2, 3))
	b := dt.Must(s.Alloc(device.BF16, 6))
	z := dt.Must(s.Alloc(device.F32, 7))
	w := dt.Must(s.Alloc(device.F32, 16))
	lo, hi := dt.Must(x.View(0, 4)), dt.Must(x.View(2, 4))
	freed := dt.Must(s.Alloc(device.F32, 6))
	dt.NoErr(t, freed.Free())

	e := dt.Must(s.Record())
	unrecorded := dt.Must(c.NewEvent())
	closedE := dt.Must(c.NewEvent())
	dt.NoErr(t, closedE.Close())

	gs := dt.Must(c.NewStream())
	dt.NoErr(t, gs.BeginCapture())
	dt.NoErr(t, device.Fill(gs, x, 1))
	g := dt.Must(gs.EndCapture())
	dt.NoErr(t, gs.BeginCapture())
	dt.NoErr(t, device.Fill(gs, x, 2))
	closedG := dt.Must(gs.EndCapture())
	dt.NoErr(t, closedG.Close())
	capturing := dt.Must(c.NewStream())
	dt.NoErr(t, capturing.BeginCapture())

	h := dt.Must(c.AllocPinned(64))
	freedH := dt.Must(c.AllocPinned(64))
	dt.NoErr(t, freedH.Free())

	nop := func() {}
	nopErr := func() error { return nil }
	bytes6 := make([]byte, x.Bytes())

	cases := []badCase{
		// Devices.
		{"Open tpu", func() error { return second(device.Open("tpu")) }, `"tpu"`},
		{"nil Device.Do", func() error { return nilD.Do(nopErr) }, "Do: nil device"},
		{"Do nil function", func() error { return c.Do(nil) }, "Do: nil function"},
		{"nil Device.Synchronize", nilD.Synchronize, "Device.Synchronize: nil device"},
		{"nil Device.PoolStats", func() error { _, _, err := nilD.PoolStats(); return err }, "PoolStats: nil device"},
		{"nil Device.TrimPool", func() error { return nilD.TrimPool(0) }, "TrimPool: nil device"},
		{"Kernel on cpu", func() error { return second(c.Kernel(device.NewProgram("k.cu", ""), "k")) }, "runs no CUDA kernels"},
		{"nil Device.Load", func() error { return nilD.Load() }, "Load: nil device"},
		{"Load nil program", func() error { return c.Load(device.NewProgram("k.cu", ""), nil) }, "Load: progs[1] is nil"},

		// Streams.
		{"nil NewStream", func() error { return second(nilD.NewStream()) }, "NewStream: nil device"},
		{"nil NewPriorityStream", func() error { return second(nilD.NewPriorityStream()) }, "NewPriorityStream: nil device"},
		{"nil WrapStream", func() error { return second(nilD.WrapStream(1)) }, "WrapStream: nil device"},
		{"WrapStream on cpu", func() error { return second(c.WrapStream(1)) }, "WrapStream on cpu"},
		{"nil Stream.Close", nilS.Close, "Stream.Close: nil stream"},
		{"nil Stream.Synchronize", nilS.Synchronize, "Stream.Synchronize: nil stream"},
		{"closed Stream.Synchronize", closed.Synchronize, "Stream.Synchronize: stream was closed"},
		{"nil EnqueueCPU", func() error { return nilS.EnqueueCPU(nop) }, "EnqueueCPU: nil stream"},
		{"closed EnqueueCPU", func() error { return closed.EnqueueCPU(nop) }, "EnqueueCPU: stream was closed"},
		{"EnqueueCPU nil function", func() error { return s.EnqueueCPU(nil) }, "EnqueueCPU: nil function"},
		{"nil Stream.Record", func() error { return second(nilS.Record()) }, "Stream.Record: nil stream"},
		{"closed Stream.Record", func() error { return second(closed.Record()) }, "Stream.Record: stream was closed"},
		{"nil Stream.Wait", func() error { return nilS.Wait(e) }, "Stream.Wait: nil stream"},
		{"closed Stream.Wait", func() error { return closed.Wait(e) }, "Stream.Wait: stream was closed"},
		{"Wait nil event", func() error { return s.Wait(nilE) }, "Stream.Wait: event is nil"},
		{"Wait closed event", func() error { return s.Wait(closedE) }, "Stream.Wait: event was closed"},
		{"nil BeginCapture", nilS.BeginCapture, "BeginCapture: nil stream"},
		{"closed BeginCapture", closed.BeginCapture, "BeginCapture: stream was closed"},
		{"BeginCapture twice", capturing.BeginCapture, "already capturing"},
		{"nil EndCapture", func() error { return second(nilS.EndCapture()) }, "EndCapture: nil stream"},
		{"closed EndCapture", func() error { return second(closed.EndCapture()) }, "EndCapture: stream was closed"},
		{"EndCapture not capturing", func() error { return second(s.EndCapture()) }, "not capturing"},
		{"nil SetMultiprocessors", func() error { return nilS.SetMultiprocessors(1) }, "SetMultiprocessors: nil stream"},
		{"closed SetMultiprocessors", func() error { return closed.SetMultiprocessors(1) }, "SetMultiprocessors: stream was closed"},
		{"SetMultiprocessors negative", func() error { return s.SetMultiprocessors(-1) }, "n is -1, want 0 (all) to"},
		{"SetMultiprocessors past the device's", func() error { return s.SetMultiprocessors(c.Multiprocessors() + 1) }, "want 0 (all) to"},
		{"nil WaitAtLeast", func() error { return nilS.WaitAtLeast(0, 1) }, "WaitAtLeast: nil stream"},
		{"WaitAtLeast on cpu", func() error { return s.WaitAtLeast(0, 1) }, "WaitAtLeast on cpu"},

		// Events.
		{"nil NewEvent", func() error { return second(nilD.NewEvent()) }, "NewEvent: nil device"},
		{"nil Event.Record", func() error { return nilE.Record(s) }, "Event.Record: event is nil"},
		{"closed Event.Record", func() error { return closedE.Record(s) }, "Event.Record: event was closed"},
		{"Event.Record nil stream", func() error { return e.Record(nilS) }, "Event.Record: nil stream"},
		{"Event.Record closed stream", func() error { return e.Record(closed) }, "Event.Record: stream was closed"},
		{"nil Event.Synchronize", nilE.Synchronize, "Event.Synchronize: event is nil"},
		{"nil Event.Done", func() error { return second(nilE.Done()) }, "Event.Done: event is nil"},
		{"closed Event.Done", func() error { return second(closedE.Done()) }, "Event.Done: event was closed"},
		{"nil Event.Since", func() error { return second(nilE.Since(e)) }, "Event.Since: event is nil"},
		{"Since nil start", func() error { return second(e.Since(nilE)) }, "Event.Since: start is nil"},
		{"Since closed start", func() error { return second(e.Since(closedE)) }, "Event.Since: start was closed"},
		{"Since of an event never recorded", func() error { return second(unrecorded.Since(e)) }, "Event.Since: event was never recorded"},
		{"Since a start never recorded", func() error { return second(e.Since(unrecorded)) }, "Event.Since: start was never recorded"},
		{"nil Event.Close", nilE.Close, "Event.Close: nil event"},

		// Graphs.
		{"nil Graph.Launch", func() error { return nilG.Launch(s) }, "Graph.Launch: nil graph"},
		{"Graph.Launch after Close", func() error { return closedG.Launch(s) }, "Graph.Launch: graph was closed"},
		{"Graph.Launch nil stream", func() error { return g.Launch(nilS) }, "Graph.Launch: nil stream"},
		{"Graph.Launch closed stream", func() error { return g.Launch(closed) }, "Graph.Launch: stream was closed"},
		{"nil Graph.Close", nilG.Close, "Graph.Close: nil graph"},

		// Allocation.
		{"nil Stream.Alloc", func() error { return second(nilS.Alloc(device.F32, 1)) }, "Alloc: nil stream"},
		{"closed Stream.Alloc", func() error { return second(closed.Alloc(device.F32, 1)) }, "Alloc: stream was closed"},
		{"nil Device.Alloc", func() error { return second(nilD.Alloc(device.F32, 1)) }, "Alloc: nil device"},
		{"Alloc invalid dtype", func() error { return second(s.Alloc(device.Invalid, 1)) }, "invalid dtype"},
		{"Alloc negative dimension", func() error { return second(s.Alloc(device.F32, 2, -1)) }, "dimension 1 is negative"},
		{"Alloc 2^50 f32", func() error { return second(s.Alloc(device.F32, 1<<50)) }, "(4503599627370496 bytes) on cpu: out of memory"},
		{"nil AllocPinned", func() error { return second(nilD.AllocPinned(1)) }, "AllocPinned: nil device"},
		{"AllocPinned negative", func() error { return second(c.AllocPinned(-1)) }, "AllocPinned(-1)"},
		{"AllocPinned 2^50", func() error { return second(c.AllocPinned(1 << 50)) }, "AllocPinned(1125899906842624) on cpu: out of memory"},
		{"nil Wrap", func() error { return second(nilD.Wrap(1, device.F32, 1)) }, "Wrap: nil device"},
		{"Wrap on cpu", func() error { return second(c.Wrap(1, device.F32, 1)) }, "Wrap on cpu"},

		// Tensors.
		{"nil Tensor.Free", nilT.Free, "Free: nil tensor"},
		{"zero Tensor.Free", new(device.Tensor).Free, "Free: nil tensor"},
		{"Free after its stream closed", orphan.Free, "Free of f32[4]@cpu: the stream that allocated it was closed"},
		{"nil Tensor.FreeOn", func() error { return nilT.FreeOn(s) }, "FreeOn: nil tensor"},
		{"FreeOn nil stream", func() error { return x.FreeOn(nilS) }, "FreeOn: nil stream"},
		{"FreeOn closed stream", func() error { return x.FreeOn(closed) }, "FreeOn: stream was closed"},
		{"nil View", func() error { return second(nilT.View(0, 1)) }, "View of a nil tensor"},
		{"View of freed", func() error { return second(freed.View(0, 1)) }, "View of f32[6]@cpu: tensor was freed"},
		{"View past the end", func() error { return second(x.View(5, 2)) }, "View(5, [2]) of f32[2 3]@cpu"},
		{"View negative offset", func() error { return second(x.View(-1, 1)) }, "View(-1, [1])"},
		{"View negative shape", func() error { return second(x.View(0, -1)) }, "dimension 0 is negative"},
		{"nil Reshape", func() error { return second(nilT.Reshape(1)) }, "Reshape of a nil tensor"},
		{"Reshape of freed", func() error { return second(freed.Reshape(6)) }, "Reshape of f32[6]@cpu: tensor was freed"},
		{"Reshape wrong size", func() error { return second(x.Reshape(4)) }, "Reshape f32[2 3]@cpu to [4]"},
		{"nil Rows", func() error { return second(nilT.Rows(0, 1)) }, "Rows of a nil tensor"},
		{"Rows of freed", func() error { return second(freed.Rows(0, 1)) }, "Rows of f32[6]@cpu: tensor was freed"},
		{"Rows past the end", func() error { return second(x.Rows(1, 5)) }, "Rows(1, 5) of f32[2 3]@cpu"},
		{"nil Check", func() error { return nilT.Check(s, "arg") }, "arg is nil"},
		{"Check nil stream", func() error { return x.Check(nilS, "arg") }, "arg: nil stream"},
		{"Check closed stream", func() error { return x.Check(closed, "arg") }, "arg: stream was closed"},
		{"Check freed", func() error { return freed.Check(s, "arg") }, "arg f32[6]@cpu was freed"},

		// Host copies.
		{"nil CopyFromHost", func() error { return nilT.CopyFromHost(s, nil) }, "CopyFromHost destination is nil"},
		{"CopyFromHost nil stream", func() error { return x.CopyFromHost(nilS, bytes6) }, "CopyFromHost destination: nil stream"},
		{"CopyFromHost closed stream", func() error { return x.CopyFromHost(closed, bytes6) }, "CopyFromHost destination: stream was closed"},
		{"CopyFromHost freed", func() error { return freed.CopyFromHost(s, bytes6) }, "CopyFromHost destination f32[6]@cpu was freed"},
		{"CopyFromHost wrong length", func() error { return x.CopyFromHost(s, make([]byte, 5)) }, "CopyFromHost: 5 bytes"},
		{"nil CopyToHost", func() error { return nilT.CopyToHost(s, nil) }, "CopyToHost source is nil"},
		{"CopyToHost nil stream", func() error { return x.CopyToHost(nilS, bytes6) }, "CopyToHost source: nil stream"},
		{"CopyToHost freed", func() error { return freed.CopyToHost(s, bytes6) }, "CopyToHost source f32[6]@cpu was freed"},
		{"CopyToHost wrong length", func() error { return x.CopyToHost(s, make([]byte, 5)) }, "destination 5"},
		{"CopyToHost capturing", func() error { return x.CopyToHost(capturing, bytes6) }, "capturing"},
		{"Upload nil tensor", func() error { return device.Upload(s, nilT, []float32{1}) }, "Upload destination is nil"},
		{"Upload nil stream", func() error { return device.Upload(nilS, x, make([]float32, 6)) }, "Upload destination: nil stream"},
		{"Upload freed", func() error { return device.Upload(s, freed, make([]float32, 6)) }, "Upload destination f32[6]@cpu was freed"},
		{"Upload wrong type", func() error { return device.Upload(s, x, make([]uint16, 6)) }, "Upload of []uint16 into f32[2 3]@cpu"},
		{"Upload wrong length", func() error { return device.Upload(s, x, make([]float32, 5)) }, "Upload of 5 elements"},
		{"Download nil tensor", func() error { return device.Download(s, nilT, []float32{1}) }, "Download source is nil"},
		{"Download nil stream", func() error { return device.Download(nilS, x, make([]float32, 6)) }, "Download source: nil stream"},
		{"Download wrong type", func() error { return device.Download(s, x, make([]int64, 6)) }, "into []int64: element sizes differ"},
		{"Download wrong length", func() error { return device.Download(s, x, make([]float32, 7)) }, "into 7"},
		{"FromSlice nil stream", func() error { return second(device.FromSlice(nilS, device.F32, []float32{1}, 1)) }, "Alloc: nil stream"},
		{"FromSlice wrong length", func() error { return second(device.FromSlice(s, device.F32, []float32{1}, 2)) }, "Upload of 1 elements"},
		{"FromSlice wrong type", func() error { return second(device.FromSlice(s, device.BF16, []float32{1}, 1)) }, "element sizes differ"},
		{"FromFloat32 nil stream", func() error { return second(device.FromFloat32(nilS, device.F32, []float32{1}, 1)) }, "Alloc: nil stream"},
		{"FromFloat32 wrong length", func() error { return second(device.FromFloat32(s, device.BF16, []float32{1}, 3)) }, "SetFloat32: 1 values"},
		{"nil SetFloat32", func() error { return nilT.SetFloat32(s, nil) }, "SetFloat32 destination is nil"},
		{"SetFloat32 nil stream", func() error { return x.SetFloat32(nilS, make([]float32, 6)) }, "SetFloat32 destination: nil stream"},
		{"SetFloat32 freed", func() error { return freed.SetFloat32(s, make([]float32, 6)) }, "SetFloat32 destination f32[6]@cpu was freed"},
		{"SetFloat32 wrong length", func() error { return x.SetFloat32(s, make([]float32, 5)) }, "SetFloat32: 5 values"},
		{"nil Float32s", func() error { return second(nilT.Float32s(s)) }, "Float32s source is nil"},
		{"Float32s nil stream", func() error { return second(x.Float32s(nilS)) }, "Float32s source: nil stream"},
		{"Float32s closed stream", func() error { return second(x.Float32s(closed)) }, "Float32s source: stream was closed"},
		{"Float32s freed", func() error { return second(freed.Float32s(s)) }, "Float32s source f32[6]@cpu was freed"},

		// Pinned memory.
		{"nil HostBuffer.Free", nilH.Free, "HostBuffer.Free: nil buffer"},
		{"CopyFromPinned nil tensor", func() error { return nilT.CopyFromPinned(s, h, 0) }, "CopyFromPinned destination is nil"},
		{"CopyFromPinned nil stream", func() error { return x.CopyFromPinned(nilS, h, 0) }, "CopyFromPinned destination: nil stream"},
		{"CopyFromPinned closed stream", func() error { return x.CopyFromPinned(closed, h, 0) }, "CopyFromPinned destination: stream was closed"},
		{"CopyFromPinned nil buffer", func() error { return x.CopyFromPinned(s, nilH, 0) }, "CopyFromPinned: nil host buffer"},
		{"CopyFromPinned freed buffer", func() error { return x.CopyFromPinned(s, freedH, 0) }, "CopyFromPinned: host buffer was freed"},
		{"CopyFromPinned past the end", func() error { return x.CopyFromPinned(s, h, 48) }, "bytes [48, 72) out of the host buffer's [0, 64)"},
		{"CopyFromPinned negative offset", func() error { return x.CopyFromPinned(s, h, -1) }, "bytes [-1, 23)"},
		{"CopyToPinned nil tensor", func() error { return nilT.CopyToPinned(s, h, 0) }, "CopyToPinned source is nil"},
		{"CopyToPinned nil stream", func() error { return x.CopyToPinned(nilS, h, 0) }, "CopyToPinned source: nil stream"},
		{"CopyToPinned freed tensor", func() error { return freed.CopyToPinned(s, h, 0) }, "CopyToPinned source f32[6]@cpu was freed"},
		{"CopyToPinned nil buffer", func() error { return x.CopyToPinned(s, nilH, 0) }, "CopyToPinned: nil host buffer"},
		{"CopyToPinned past the end", func() error { return x.CopyToPinned(s, h, 41) }, "bytes [41, 65)"},

		// Ops.
		{"Fill nil stream", func() error { return device.Fill(nilS, x, 1) }, "Fill destination: nil stream"},
		{"Fill closed stream", func() error { return device.Fill(closed, x, 1) }, "Fill destination: stream was closed"},
		{"Fill nil tensor", func() error { return device.Fill(s, nilT, 1) }, "Fill destination is nil"},
		{"Fill freed", func() error { return device.Fill(s, freed, 1) }, "Fill destination f32[6]@cpu was freed"},
		{"Memset nil stream", func() error { return device.Memset(nilS, x, 0) }, "Memset destination: nil stream"},
		{"Memset closed stream", func() error { return device.Memset(closed, x, 0) }, "Memset destination: stream was closed"},
		{"Memset nil tensor", func() error { return device.Memset(s, nilT, 0) }, "Memset destination is nil"},
		{"Memset freed", func() error { return device.Memset(s, freed, 0) }, "Memset destination f32[6]@cpu was freed"},
		{"Copy nil stream", func() error { return device.Copy(nilS, x, x) }, "Copy destination: nil stream"},
		{"Copy closed stream", func() error { return device.Copy(closed, x, x) }, "Copy destination: stream was closed"},
		{"Copy nil destination", func() error { return device.Copy(s, nilT, x) }, "Copy destination is nil"},
		{"Copy nil source", func() error { return device.Copy(s, x, nilT) }, "Copy source is nil"},
		{"Copy freed source", func() error { return device.Copy(s, x, freed) }, "Copy source f32[6]@cpu was freed"},
		{"Copy dtypes", func() error { return device.Copy(s, x, b) }, "differ in dtype"},
		{"Copy lengths", func() error { return device.Copy(s, x, z) }, "destination f32[2 3]@cpu has 6 elements, source f32[7]@cpu has 7"},
		{"Copy overlapping", func() error { return device.Copy(s, hi, lo) }, "Copy: destination f32[4]@cpu overlaps source f32[4]@cpu"},
		{"CopyRect nil stream", func() error { return device.CopyRect(nilS, z, 3, x, 3, 2, 3) }, "CopyRect destination: nil stream"},
		{"CopyRect closed stream", func() error { return device.CopyRect(closed, z, 3, x, 3, 2, 3) }, "CopyRect destination: stream was closed"},
		{"CopyRect nil destination", func() error { return device.CopyRect(s, nilT, 3, x, 3, 2, 3) }, "CopyRect destination is nil"},
		{"CopyRect nil source", func() error { return device.CopyRect(s, z, 3, nilT, 3, 2, 3) }, "CopyRect source is nil"},
		{"CopyRect freed destination", func() error { return device.CopyRect(s, freed, 3, x, 3, 2, 3) }, "CopyRect destination f32[6]@cpu was freed"},
		{"CopyRect freed source", func() error { return device.CopyRect(s, z, 3, freed, 3, 2, 3) }, "CopyRect source f32[6]@cpu was freed"},
		{"CopyRect dtypes", func() error { return device.CopyRect(s, b, 3, x, 3, 2, 3) }, "CopyRect: destination bf16[6]@cpu and source f32[2 3]@cpu differ in dtype"},
		{"CopyRect negative rows", func() error { return device.CopyRect(s, z, 3, x, 3, -1, 3) }, "CopyRect: rows = -1 < 0"},
		{"CopyRect negative cols", func() error { return device.CopyRect(s, z, 3, x, 3, 2, -3) }, "CopyRect: cols = -3 < 0"},
		{"CopyRects negative batch", func() error {
			return device.CopyRects(s, z, device.Strides{Row: 3}, x, device.Strides{Row: 3}, -2, 1, 3)
		}, "CopyRects: batch = -2 < 0"},
		{"CopyRect destination stride", func() error { return device.CopyRect(s, z, 2, x, 3, 2, 3) }, "CopyRect: destination row stride 2 < cols 3"},
		{"CopyRect source stride", func() error { return device.CopyRect(s, z, 3, x, 2, 2, 3) }, "CopyRect: source row stride 2 < cols 3"},
		{"CopyRect negative stride", func() error { return device.CopyRect(s, z, 3, x, -1, 0, 0) }, "CopyRect: source row stride -1 < cols 0"},
		{"CopyRects negative batch stride", func() error {
			return device.CopyRects(s, z, device.Strides{Row: 3, Batch: -1}, x, device.Strides{Row: 3}, 1, 1, 3)
		}, "CopyRects: destination batch stride -1 < 0"},
		{"CopyRects source batch stride", func() error {
			return device.CopyRects(s, z, device.Strides{Row: 2, Batch: 2}, x, device.Strides{Row: 2, Batch: 1}, 3, 1, 2)
		}, "CopyRects: source batch stride 1 < rows·row stride 1·2"},
		{"CopyRects destination batch stride", func() error {
			return device.CopyRects(s, w, device.Strides{Row: 2, Batch: 3}, z, device.Strides{Row: 2, Batch: 4}, 2, 2, 2)
		}, "CopyRects: destination batch stride 3 < rows·row stride 2·2"},
		{"CopyRect past the destination", func() error { return device.CopyRect(s, x, 4, z, 3, 2, 3) }, "CopyRect: the destination rectangle (2×3, row stride 4) ends at element 7 of f32[2 3]@cpu, which has 6"},
		{"CopyRect past the source", func() error { return device.CopyRect(s, w, 3, x, 3, 3, 3) }, "CopyRect: the source rectangle (3×3, row stride 3) ends at element 9 of f32[2 3]@cpu, which has 6"},
		{"CopyRects past the source", func() error {
			return device.CopyRects(s, z, device.Strides{Row: 3, Batch: 3}, x, device.Strides{Row: 2, Batch: 5}, 2, 1, 2)
		}, "CopyRects: the source rectangle (2×1×2, strides 5, 2) ends at element 7 of f32[2 3]@cpu, which has 6"},
		{"CopyRect past 2^63", func() error { return device.CopyRect(s, z, 3, x, 1<<62, 3, 1) }, "ends at element past 2^63"},
		{"CopyRect overlapping", func() error { return device.CopyRect(s, hi, 2, lo, 2, 2, 2) }, "CopyRect: destination f32[4]@cpu overlaps source f32[4]@cpu"},
		{"Cast nil stream", func() error { return device.Cast(nilS, b, x) }, "Cast destination: nil stream"},
		{"Cast closed stream", func() error { return device.Cast(closed, b, x) }, "Cast destination: stream was closed"},
		{"Cast nil destination", func() error { return device.Cast(s, nilT, x) }, "Cast destination is nil"},
		{"Cast nil source", func() error { return device.Cast(s, b, nilT) }, "Cast source is nil"},
		{"Cast freed source", func() error { return device.Cast(s, b, freed) }, "Cast source f32[6]@cpu was freed"},
		{"Cast lengths", func() error { return device.Cast(s, b, z) }, "destination bf16[6]@cpu has 6 elements"},
		{"Cast overlapping", func() error { return device.Cast(s, lo, hi) }, "Cast: destination f32[4]@cpu overlaps source"},

		// Peer memory.
		{"nil AllocPeerMemory", func() error { return second(nilD.AllocPeerMemory(16)) }, "AllocPeerMemory: nil device"},
		{"AllocPeerMemory on cpu", func() error { return second(c.AllocPeerMemory(16)) }, "AllocPeerMemory on cpu"},
		{"nil PeerMemory.Free", nilP.Free, "PeerMemory.Free: nil memory"},
		{"nil PeerMemory.Handle", func() error { return second(nilP.Handle()) }, "PeerMemory.Handle: nil memory"},
		{"nil OpenPeerMemory", func() error { _, _, err := nilD.OpenPeerMemory(device.PeerHandle{}); return err }, "OpenPeerMemory: nil device"},
		{"OpenPeerMemory on cpu", func() error { _, _, err := c.OpenPeerMemory(device.PeerHandle{}); return err }, "OpenPeerMemory on cpu"},
		{"nil CanAccessPeer", func() error { return second(nilD.CanAccessPeer(c)) }, "CanAccessPeer: nil device"},
		{"CanAccessPeer nil peer", func() error { return second(c.CanAccessPeer(nilD)) }, "CanAccessPeer: nil peer"},
		{"EnablePeerAccess nil peer", func() error { return c.EnablePeerAccess(nilD) }, "nil peer"},
		{"EnablePeerAccess on cpu", func() error { return c.EnablePeerAccess(c) }, "cpu cannot address the memory of cpu"},
		{"nil WrapPeer", func() error { return second(nilD.WrapPeer(1, device.F32, 1)) }, "WrapPeer: nil device"},
		{"WrapPeer on cpu", func() error { return second(c.WrapPeer(1, device.F32, 1)) }, "WrapPeer on cpu"},

		// DTypes.
		{"ParseDType unknown", func() error { return second(device.ParseDType("f33")) }, `unknown dtype "f33"`},
		{"ParseDType invalid", func() error { return second(device.ParseDType("invalid")) }, `unknown dtype "invalid"`},
	}
	if runtime.GOOS == "linux" {
		// Under the address space Go allows but over the host's memory: only a bound
		// read from the system keeps Go from ending the process.
		cases = append(cases, badCase{"Alloc 2^40 f32", func() error { return second(s.Alloc(device.F32, 1<<40)) }, "(4398046511104 bytes) on cpu: out of memory"})
	}
	runBad(t, cases)
	dt.NoErr(t, capturing.Close())
	dt.NoErr(t, gs.Close())
}

// TestNilAccessors checks that the accessors of nil values, which cannot return an
// error, return zero values.
func TestNilAccessors(t *testing.T) {
	var (
		d *device.Device
		s *device.Stream
		x *device.Tensor
		h *device.HostBuffer
		m *device.PeerMemory
	)
	get := func(fn func() any) (v any) {
		defer func() {
			if p := recover(); p != nil {
				v = fmt.Sprintf("panic: %v", p)
			}
		}()
		return fn()
	}
	got := map[string]any{
		"Device.String":          get(func() any { return d.String() }),
		"Device.Kind":            get(func() any { return d.Kind() }),
		"Device.IsCUDA":          get(func() any { return d.IsCUDA() }),
		"Device.Stream":          get(func() any { return d.Stream() == nil }),
		"Device.CanWaitOnMemory": get(func() any { return d.CanWaitOnMemory() }),
		"Stream.Device":          get(func() any { return s.Device() == nil }),
		"Stream.Handle":          get(func() any { return s.Handle() }),
		"Stream.Closed":          get(func() any { return s.Closed() }),
		"Tensor.DType":           get(func() any { return x.DType() }),
		"Tensor.Shape":           get(func() any { return x.Shape() == nil }),
		"Tensor.Rank":            get(func() any { return x.Rank() }),
		"Tensor.Dim":             get(func() any { return x.Dim(0) }),
		"Tensor.Len":             get(func() any { return x.Len() }),
		"Tensor.Bytes":           get(func() any { return x.Bytes() }),
		"Tensor.Device":          get(func() any { return x.Device() == nil }),
		"Tensor.Freed":           get(func() any { return x.Freed() }),
		"Tensor.String":          get(func() any { return x.String() }),
		"Tensor.Ptr":             get(func() any { return x.Ptr() }),
		"Tensor.HostBytes":       get(func() any { return x.HostBytes() == nil }),
		"HostBuffer.Bytes":       get(func() any { return h.Bytes() == nil }),
		"HostBuffer.Len":         get(func() any { return h.Len() }),
		"PeerMemory.Ptr":         get(func() any { return m.Ptr() }),
		"PeerMemory.Bytes":       get(func() any { return m.Bytes() }),
		"PeerMemory.Device":      get(func() any { return m.Device() == nil }),
	}
	want := map[string]any{
		"Device.String":          "<nil>",
		"Device.Kind":            device.KindCPU,
		"Device.IsCUDA":          false,
		"Device.Stream":          true,
		"Device.CanWaitOnMemory": false,
		"Stream.Device":          true,
		"Stream.Handle":          uintptr(0),
		"Stream.Closed":          false,
		"Tensor.DType":           device.Invalid,
		"Tensor.Shape":           true,
		"Tensor.Rank":            0,
		"Tensor.Dim":             0,
		"Tensor.Len":             0,
		"Tensor.Bytes":           0,
		"Tensor.Device":          true,
		"Tensor.Freed":           false,
		"Tensor.String":          "<nil>",
		"Tensor.Ptr":             uintptr(0),
		"Tensor.HostBytes":       true,
		"HostBuffer.Bytes":       true,
		"HostBuffer.Len":         0,
		"PeerMemory.Ptr":         uintptr(0),
		"PeerMemory.Bytes":       0,
		"PeerMemory.Device":      true,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("accessors of nil values (-want +got):\n%s", diff)
	}
}

// TestDimOutOfRange checks that Dim returns 0 for a dimension the tensor lacks.
func TestDimOutOfRange(t *testing.T) {
	x := dt.Must(device.CPU().Alloc(device.F32, 2, 3))
	got := map[int]int{}
	for i := -4; i <= 5; i++ {
		p, err := dt.Recover(func() error { got[i] = x.Dim(i); return nil })
		if err != nil || p != nil {
			t.Fatalf("Dim(%d) of %v: panic %v", i, x, p)
		}
	}
	want := map[int]int{-4: 0, -3: 0, -2: 2, -1: 3, 0: 2, 1: 3, 2: 0, 3: 0, 4: 0, 5: 0}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Dim of %v (-want +got):\n%s", x, diff)
	}
}

// TestClosed checks that closing a stream ends it, and only it: the ops that fail on it
// leave their operands alone, the default stream outlives Close, and closing twice is
// not an error.
func TestClosed(t *testing.T) {
	c := device.CPU()
	s := c.Stream()
	x := dt.Must(device.FromFloat32(s, device.F32, []float32{1, 2, 3}, 3))
	a := dt.Must(c.NewStream())
	dt.NoErr(t, a.Close())
	dt.NoErr(t, a.Close())
	if err := device.Fill(a, x, 7); err == nil {
		t.Error("Fill on a closed stream: no error")
	}
	ran := false
	if err := a.EnqueueCPU(func() { ran = true }); err == nil || ran {
		t.Errorf("EnqueueCPU on a closed stream: %v, ran %v", err, ran)
	}
	dt.NoErr(t, s.Close())
	if !a.Closed() || s.Closed() {
		t.Errorf("Closed: %v for a closed stream, %v for the default stream after Close", a.Closed(), s.Closed())
	}
	if diff := cmp.Diff([]float32{1, 2, 3}, dt.Must(x.Float32s(s))); diff != "" {
		t.Errorf("x after ops on a closed stream, read on the default stream after its Close (-want +got):\n%s", diff)
	}
	dt.NoErr(t, x.Free())
}
