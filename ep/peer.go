package ep

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"os"
	"strings"

	"github.com/dropless/dropless/device"
)

// Direct transfers. When every rank's GPU can address every other rank's memory (GPUs
// of one host over NVLink or PCIe, ranks in one process or in several), a group moves
// the payload of Dispatch, Combine and their backward passes without the transport: the
// kernel that packs a rank's rows for a peer writes them straight into a buffer of the
// peer, its window, and a flag in the peer's window tells the peer's stream when a
// piece is there. That saves the transport's send-buffer read and receive-buffer write,
// its kernels beside the packing and placing, and the host's calls per piece; nothing
// on the way waits for the host. Layout's small count and routing exchanges still go
// through the transport.
//
// A window is PeerMemory: flags, then the receive buffers of the op in flight. For op
// number e (every rank counts the same ops), sender r writes into receiver q's window
// once q's ack flag for r says q has placed op e-1 (the window holds one op at a time),
// then sets q's data flag (r, c) to e after each piece c. q's stream waits for the data
// flags of a piece from every sender before placing it, and sets its ack flag in every
// sender's window after its last piece.

// Windows grow in steps of winGrain bytes. After maxEpoch ops a window is set up anew,
// which zeroes its flags before the op count wraps around.
var (
	winGrain        = 64 << 20
	maxEpoch uint32 = 1 << 31
)

const (
	winAlign = 256 // alignment of each receive buffer in a window

	// directChunks is the default of Config.Chunks with direct transfers: with no
	// transport calls per piece, two pieces overlap as well as four (measured on two
	// H200s: docs/perf.md).
	directChunks = 2
)

// window is this rank's window and the addresses of every rank's, as seen here.
type window struct {
	mem   *device.PeerMemory
	r, me int
	head  int            // bytes of flags before the data
	size  int            // bytes of data
	addr  []uintptr      // [R] every rank's window as this device addresses it
	close []func() error // unmaps the windows of other processes
	bases *device.Tensor // I64 [R]: addr on the device, for ep_signal
	epoch uint32         // ops done through the window
}

// dataFlag is the byte offset of the flag that says piece c from rank src is in the window.
func (w *window) dataFlag(src, c int) int { return 4 * (src*maxChunks + c) }

// ackFlag is the byte offset of the flag that says rank src has placed what this rank
// wrote into its window.
func (w *window) ackFlag(src int) int { return 4 * (w.r*maxChunks + src) }

// at returns the address of byte off of rank q's window.
func (w *window) at(q, off int) uintptr { return w.addr[q] + uintptr(off) }

func (w *window) release() error {
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	for _, c := range w.close {
		keep(c())
	}
	if w.bases != nil {
		keep(w.bases.Free())
	}
	if w.mem != nil {
		keep(w.mem.Free())
	}
	return first
}

// A peer record is what a rank tells the others when windows are set up: whether it
// takes part, its process, host and GPU, its window's address and IPC handle (8 words).
const (
	recOK = iota
	recPID
	recHost
	recGPU
	recPtr
	recHandle
	peerRecord = recHandle + 8
)

// peerAllowed reports whether this rank may write into other ranks' memory: not with
// Config.TransportOnly or DROPLESS_EP_PEER=0, nor without stream memory waits.
func (g *Group) peerAllowed() bool {
	return !g.cfg.TransportOnly && os.Getenv("DROPLESS_EP_PEER") != "0" && g.dev.CanWaitOnMemory()
}

// hostID identifies this host and boot, so that ranks in other processes know whether
// they can map each other's windows.
func hostID() int64 {
	h := fnv.New64a()
	name, _ := os.Hostname()
	h.Write([]byte(name))
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		h.Write([]byte(strings.TrimSpace(string(b))))
	}
	return int64(h.Sum64() >> 1)
}

// peerWindow returns the group's window with room for need bytes of data, setting it up
// or growing it first. It is collective: every rank asks for the same need at the same
// call. It returns nil when payload goes through the transport: on the CPU, with one
// rank, or when some rank cannot or may not write into another's memory (decided once,
// alike on every rank).
func (g *Group) peerWindow(s *device.Stream, need int) (*window, error) {
	if g.noPeer {
		return nil, nil
	}
	if g.win != nil && g.win.size >= need && g.win.epoch < maxEpoch {
		return g.win, nil
	}
	if g.win != nil {
		if err := g.dropWindow(s); err != nil {
			return nil, err
		}
	}
	size := (need + need/4 + winGrain - 1) / winGrain * winGrain
	w, err := g.setupWindow(s, size)
	if err != nil {
		return nil, err
	}
	g.win, g.noPeer = w, w == nil
	return w, nil
}

// dropWindow releases the group's window once no rank uses it: this rank's streams
// (s and the transfer stream) are done, and so are every other rank's, whose writes
// into this window all go on their transfer streams (a barrier through the transport).
// It is collective. When that fails (a peer is gone), the window is left allocated:
// this rank's streams may still wait on its flags, and freeing it would wait for them.
func (g *Group) dropWindow(s *device.Stream) error {
	w := g.win
	g.win = nil
	err := g.tr.Sync(s)
	if err == nil {
		err = g.tr.Sync(g.cs)
	}
	if err == nil {
		_, err = g.allGather64(g.cs, []int64{0})
	}
	if err != nil {
		return err
	}
	return w.release()
}

// setupWindow allocates this rank's window and maps every other rank's, or returns nil
// (having released everything) when some rank cannot.
func (g *Group) setupWindow(s *device.Stream, size int) (out *window, err error) {
	R, me := g.r, g.rank
	w := &window{r: R, me: me, head: (4*R*(maxChunks+1) + 4095) / 4096 * 4096, size: size, addr: make([]uintptr, R)}
	defer func() {
		if out == nil || err != nil {
			w.release()
			out = nil
		}
	}()
	rec := make([]int64, peerRecord)
	if g.peerAllowed() {
		rec[recOK] = 1
		if w.mem, err = g.dev.AllocPeerMemory(w.head + size); err != nil {
			rec[recOK] = 0
		} else if h, err := w.mem.Handle(); err != nil {
			rec[recOK] = 0
		} else {
			for i := range 8 {
				rec[recHandle+i] = int64(binary.LittleEndian.Uint64(h[8*i:]))
			}
		}
		err = nil
	}
	rec[recPID], rec[recHost], rec[recGPU] = int64(os.Getpid()), hostID(), int64(g.dev.Ordinal())
	if w.mem != nil {
		rec[recPtr] = int64(w.mem.Ptr())
	}
	all, err := g.allGather64(s, rec)
	if err != nil {
		return nil, err
	}
	ok := int64(1)
	for q := range R {
		ok &= all[q*peerRecord+recOK]
		// Ranks that share a GPU go through the transport: streams that wait on memory
		// would hold the GPU's hardware queues that the others need.
		for p := range q {
			if all[p*peerRecord+recPID] == all[q*peerRecord+recPID] && all[p*peerRecord+recGPU] == all[q*peerRecord+recGPU] {
				ok = 0
			}
		}
	}
	// Map every other rank's window: in this process by peer access, in another by its
	// handle.
	for q := range R {
		if ok == 0 {
			break
		}
		o := all[q*peerRecord : (q+1)*peerRecord]
		switch {
		case q == me:
			w.addr[q] = w.mem.Ptr()
		case o[recPID] == rec[recPID]:
			var peer *device.Device
			if peer, err = device.Open(fmt.Sprintf("cuda:%d", o[recGPU])); err == nil {
				err = g.dev.EnablePeerAccess(peer)
			}
			if err != nil {
				ok, err = 0, nil
			}
			w.addr[q] = uintptr(o[recPtr])
		case o[recHost] == rec[recHost]:
			var h device.PeerHandle
			for i := range 8 {
				binary.LittleEndian.PutUint64(h[8*i:], uint64(o[recHandle+i]))
			}
			addr, closeFn, err := g.dev.OpenPeerMemory(h)
			if err != nil {
				ok = 0
				break
			}
			w.addr[q] = addr
			w.close = append(w.close, closeFn)
		default:
			ok = 0
		}
	}
	// Every rank must have mapped every other.
	if all, err = g.allGather64(s, []int64{ok}); err != nil {
		return nil, err
	}
	for _, v := range all {
		if v == 0 {
			return nil, nil
		}
	}
	addr := make([]int64, R)
	for q, a := range w.addr {
		addr[q] = int64(a)
	}
	if w.bases, err = device.FromSlice(s, device.I64, addr, R); err != nil {
		return nil, err
	}
	return w, nil
}

// allGather64 gathers v (the same length on every rank) from every rank, in rank order,
// and waits for it.
func (g *Group) allGather64(s *device.Stream, v []int64) ([]int64, error) {
	send, err := device.FromSlice(s, device.I64, v, len(v))
	if err != nil {
		return nil, err
	}
	defer send.Free()
	recv, err := s.Alloc(device.I64, g.r*len(v))
	if err != nil {
		return nil, err
	}
	defer recv.Free()
	if err := g.tr.AllGather(s, send, recv); err != nil {
		return nil, err
	}
	if err := g.tr.Sync(s); err != nil {
		return nil, err
	}
	out := make([]int64, g.r*len(v))
	return out, device.Download(s, recv, out)
}

// bufSpec is one tensor an op moves: rows of cols elements of dt.
type bufSpec struct {
	dt   device.DType
	cols int
}

func (b bufSpec) rowBytes() int { return b.cols * b.dt.Size() }

// recvGeom gives, for a receiving rank q, the rows of q's receive tensors and where the
// rows that this rank sends q begin among them.
type recvGeom func(q int) (rows, at int)

// dispatchGeom is the recvGeom of a dispatch: rank q receives the tokens of every other
// rank, by rank.
func (l *Layout) dispatchGeom(q int) (rows, at int) {
	R, r := l.g.r, l.g.rank
	for p := range R {
		if p == r {
			at = rows
		}
		if p != q {
			rows += l.pair[p*R+q]
		}
	}
	return rows, at
}

// combineGeom is the recvGeom of a combine: rank q receives back a partial sum of each
// token it sent, in its send order (its own included).
func (l *Layout) combineGeom(q int) (rows, at int) {
	R, r := l.g.r, l.g.rank
	for d := range R {
		if d == r {
			at = rows
		}
		rows += l.pair[q*R+d]
	}
	return rows, at
}

// xfer is the buffers of one op's transfers: through the transport, send and receive
// temporaries; directly, the receive tensors in this rank's window and, for each peer,
// the rows of its window's receive tensors that this rank fills.
type xfer struct {
	win        *window // nil: through the transport
	send, recv []*device.Tensor
	to         [][]*device.Tensor // direct: to[p][i], sendCnt[p] rows of p's receive tensor i

	sendOff, sendCnt, recvOff, recvCnt []int

	op     string         // the op moving the buffers (for Exchange.op)
	names  []string       // its names for them (Exchange.names)
	during []func() error // the caller's work while the transfers move (see Overlap)
}

// dst returns where rows [lo, hi) of rank p's send segment go, one tensor per buffer.
func (x *xfer) dst(p, lo, hi int) []*device.Tensor {
	d := make([]*device.Tensor, len(x.recv))
	for i := range d {
		if x.win != nil {
			d[i] = rows(x.to[p][i], lo, hi)
		} else {
			d[i] = rows(x.send[i], x.sendOff[p]+lo, x.sendOff[p]+hi)
		}
	}
	return d
}

// buffers sets up the buffers of an op that moves specs: sendCnt[p] rows of each to
// rank p (from sendOff[p] of nSend send rows through the transport) and recvCnt[p] from
// p (at recvOff[p] of the receive tensors), where geom describes every rank's receive
// tensors. Temporaries go to tmp.
func (l *Layout) buffers(s *device.Stream, tmp *device.Temps, specs []bufSpec, nSend int, sendOff, sendCnt, recvOff, recvCnt []int, geom recvGeom) (*xfer, error) {
	g := l.g
	R, r := g.r, g.rank
	x := &xfer{sendOff: sendOff, sendCnt: sendCnt, recvOff: recvOff, recvCnt: recvCnt}
	// carve places rank q's receive tensors in its window.
	carve := func(q int) (offs []int, total int) {
		rows, _ := geom(q)
		for _, b := range specs {
			offs = append(offs, total)
			total += (rows*b.rowBytes() + winAlign - 1) / winAlign * winAlign
		}
		return offs, total
	}
	var w *window
	if !g.noPeer {
		need := 0
		for q := range R {
			_, n := carve(q)
			need = max(need, n)
		}
		var err error
		if w, err = g.peerWindow(s, need); err != nil {
			return nil, err
		}
	}
	if w == nil {
		n, _ := geom(r)
		for _, b := range specs {
			x.send = append(x.send, tmp.Alloc(b.dt, nSend, b.cols))
			x.recv = append(x.recv, tmp.Alloc(b.dt, n, b.cols))
		}
		return x, tmp.Err()
	}
	x.win = w
	view := func(q int) ([]*device.Tensor, int, error) {
		offs, _ := carve(q)
		n, at := geom(q)
		ts := make([]*device.Tensor, len(specs))
		for i, b := range specs {
			var err error
			if ts[i], err = g.dev.WrapPeer(w.at(q, w.head+offs[i]), b.dt, n, b.cols); err != nil {
				return nil, 0, err
			}
		}
		return ts, at, nil
	}
	var err error
	if x.recv, _, err = view(r); err != nil {
		return nil, err
	}
	x.to = make([][]*device.Tensor, R)
	for p := range R {
		if p == r {
			continue
		}
		ts, at, err := view(p)
		if err != nil {
			return nil, err
		}
		for i := range ts {
			ts[i] = rows(ts[i], at, at+sendCnt[p])
		}
		x.to[p] = ts
	}
	return x, nil
}

// direct is transfers through the window: the packing of each piece, on the transfer
// stream, writes into the peers' windows and then sets their data flags; s does local(),
// then for each piece waits for every peer's data flag and calls arrive. At the end s
// acknowledges to every peer and waits for the transfer stream.
func (l *Layout) direct(s *device.Stream, x *xfer, pack func(st *device.Stream, p, lo, hi int, dst []*device.Tensor) error,
	local func() error, arrive func(c int) error) (err error) {
	g := l.g
	w, R, r, C, cs := x.win, g.r, g.rank, g.chunks(), g.cs
	be, ok := g.be.(*gpuBackend)
	if !ok {
		return fmt.Errorf("ep: direct transfers on %v", g.dev)
	}
	w.epoch++
	e := w.epoch
	if err := follow(cs, s); err != nil {
		return err
	}
	defer func() {
		// s waits for the transfer stream, which reads the op's inputs.
		if ferr := follow(s, cs); err == nil {
			err = ferr
		}
	}()
	// Write into a peer's window once it has placed the last op's rows.
	for p := range R {
		if p != r {
			if err := cs.WaitAtLeast(w.at(r, w.ackFlag(p)), e-1); err != nil {
				return err
			}
		}
	}
	for c := range C {
		for p := range R {
			if lo, hi := chunk(x.sendCnt[p], c, C); p != r && hi > lo {
				if err := pack(cs, p, lo, hi, x.dst(p, lo, hi)); err != nil {
					return err
				}
			}
		}
		if err := be.signal(cs, w, w.dataFlag(r, c), e); err != nil {
			return err
		}
		g.mark(cs, "sent", c)
	}
	if err := local(); err != nil {
		return err
	}
	if err := x.overlap(); err != nil {
		return err
	}
	for c := range C {
		for p := range R {
			if p != r {
				if err := s.WaitAtLeast(w.at(r, w.dataFlag(p, c)), e); err != nil {
					return err
				}
			}
		}
		g.mark(s, "wait", c)
		if err := arrive(c); err != nil {
			return err
		}
	}
	// Hand the window back to the peers once s has placed everything. Every write into
	// another rank's memory goes on the transfer stream, so that Close and growing the
	// window know when all of them are done.
	if err := follow(cs, s); err != nil {
		return err
	}
	return be.signal(cs, w, w.ackFlag(r), e)
}

// follow makes the work enqueued on waiter from now on wait for the work enqueued on s
// so far.
func follow(waiter, s *device.Stream) error {
	e, err := s.Record()
	if err != nil {
		return err
	}
	defer e.Close()
	return waiter.Wait(e)
}
