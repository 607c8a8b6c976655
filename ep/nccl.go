package ep

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/cuda"
)

// UniqueID identifies an NCCL communicator being created: rank 0 makes it with
// NewUniqueID and every rank passes it to NewNCCL.
type UniqueID [128]byte

// NewUniqueID returns the id of a new NCCL communicator. It loads NCCL (libnccl.so.2, or
// $DROPLESS_NCCL; 2.23 or later) and needs no GPU.
func NewUniqueID() (UniqueID, error) {
	if err := cuda.LoadNCCL(); err != nil {
		return UniqueID{}, fmt.Errorf("ep: NCCL: %w", err)
	}
	id, err := cuda.NCCLGetUniqueID()
	if err != nil {
		return UniqueID{}, fmt.Errorf("ep: NCCL: %w", err)
	}
	return UniqueID(id), nil
}

// ncclTransport is one rank of an NCCL communicator. The communicator is non-blocking:
// after each call the host polls its state with a deadline, so that a peer that is gone
// ends in an error (and the communicator aborted), not a hang.
type ncclTransport struct {
	dev        *device.Device
	rank, size int
	timeout    time.Duration

	mu   sync.Mutex
	init *cuda.NCCLCommInit // keeps what NCCL was handed alive
	comm cuda.NCCLComm
	err  error // sticky: set when the communicator was aborted or closed
}

// NewNCCL creates rank rank of an NCCL communicator of size ranks on the GPU dev, from
// the id rank 0 made (ncclCommInitRankScalable with a non-blocking configuration). Every
// rank calls it, from its own goroutine or process. It fails, having aborted the
// communicator, when the others do not join within timeout (0: Timeout()).
func NewNCCL(dev *device.Device, id UniqueID, rank, size int, timeout time.Duration) (Transport, error) {
	switch {
	case dev == nil || !dev.IsCUDA():
		return nil, fmt.Errorf("ep: NewNCCL: device %v is not a GPU", dev)
	case size < 1 || size > MaxRanks:
		return nil, fmt.Errorf("ep: NewNCCL: %d ranks: want 1 to %d", size, MaxRanks)
	case rank < 0 || rank >= size:
		return nil, fmt.Errorf("ep: NewNCCL: rank %d of %d", rank, size)
	}
	if timeout <= 0 {
		var err error
		if timeout, err = Timeout(); err != nil {
			return nil, err
		}
	}
	if err := cuda.LoadNCCL(); err != nil {
		return nil, fmt.Errorf("ep: NCCL: %w", err)
	}
	t := &ncclTransport{dev: dev, rank: rank, size: size, timeout: timeout}
	err := t.call(fmt.Sprintf("communicator setup (%d ranks, %v)", size, dev), func() error {
		c, err := cuda.NCCLCommInitRankScalable(size, rank, []cuda.NCCLUniqueID{cuda.NCCLUniqueID(id)}, false)
		if err != nil {
			return err
		}
		t.mu.Lock()
		t.init, t.comm = c, c.Comm
		t.mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return t, nil
}

// NewNCCLWorld creates an NCCL communicator over the given GPUs, driven from this
// process: rank r is devs[r], to be used from its own goroutine. It fails when any rank
// fails or the ranks do not all join within timeout (0: Timeout()).
func NewNCCLWorld(devs []*device.Device, timeout time.Duration) ([]Transport, error) {
	n := len(devs)
	if n < 1 || n > MaxRanks {
		return nil, fmt.Errorf("ep: NewNCCLWorld: %d devices: want 1 to %d", n, MaxRanks)
	}
	seen := map[*device.Device]bool{}
	for i, d := range devs {
		if d == nil || !d.IsCUDA() {
			return nil, fmt.Errorf("ep: NewNCCLWorld: device %d (%v) is not a GPU", i, d)
		}
		if seen[d] {
			return nil, fmt.Errorf("ep: NewNCCLWorld: %v given twice: NCCL wants one rank per GPU", d)
		}
		seen[d] = true
	}
	var id UniqueID
	if err := devs[0].Do(func() error {
		var err error
		id, err = NewUniqueID()
		return err
	}); err != nil {
		return nil, err
	}
	trs := make([]Transport, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range devs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			trs[i], errs[i] = NewNCCL(devs[i], id, i, n, timeout)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, tr := range trs {
			if tr != nil {
				tr.(*ncclTransport).fail(errors.New("ep: NCCL world not created"))
			}
		}
		return nil, err
	}
	return trs, nil
}

// InitFromEnv returns this process's transport from the variables torchrun sets:
// WORLD_SIZE ranks, this one RANK, on GPU LOCAL_RANK (default RANK), where rank 0
// publishes the NCCL id over TCP at MASTER_ADDR (default 127.0.0.1):MASTER_PORT. Each
// step (the rendezvous, the communicator's setup) fails within Timeout() when a rank is
// missing. Without WORLD_SIZE, or with WORLD_SIZE=1, it returns a transport of one rank
// on device.Open("") (a GPU if one works, else the CPU), which needs no NCCL.
func InitFromEnv() (Transport, error) {
	size := 1
	if v := os.Getenv("WORLD_SIZE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxRanks {
			return nil, fmt.Errorf("ep: WORLD_SIZE=%q: want 1 to %d", v, MaxRanks)
		}
		size = n
	}
	timeout, err := Timeout()
	if err != nil {
		return nil, err
	}
	if size == 1 {
		dev, err := device.Open("")
		if err != nil {
			return nil, err
		}
		w, err := NewWorld(1, dev)
		if err != nil {
			return nil, err
		}
		return w.Transport(0), nil
	}
	envInt := func(name string, def int) (int, error) {
		v := os.Getenv(name)
		if v == "" {
			if def < 0 {
				return 0, fmt.Errorf("ep: WORLD_SIZE=%d but %s is not set", size, name)
			}
			return def, nil
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("ep: %s=%q: want a number 0 or more", name, v)
		}
		return n, nil
	}
	rank, err := envInt("RANK", -1)
	if err != nil {
		return nil, err
	}
	if rank >= size {
		return nil, fmt.Errorf("ep: RANK=%d with WORLD_SIZE=%d", rank, size)
	}
	local, err := envInt("LOCAL_RANK", rank)
	if err != nil {
		return nil, err
	}
	port, err := envInt("MASTER_PORT", -1)
	if err != nil {
		return nil, err
	}
	host := os.Getenv("MASTER_ADDR")
	if host == "" {
		host = "127.0.0.1"
	}
	dev, err := device.Open(fmt.Sprintf("cuda:%d", local))
	if err != nil {
		return nil, fmt.Errorf("ep: rank %d (LOCAL_RANK=%d): %w", rank, local, err)
	}
	var id UniqueID
	if rank == 0 {
		if err := dev.Do(func() error {
			var err error
			id, err = NewUniqueID()
			return err
		}); err != nil {
			return nil, err
		}
	}
	got, err := rendezvous(net.JoinHostPort(host, strconv.Itoa(port)), rank, size, id[:], timeout)
	if err != nil {
		return nil, err
	}
	if len(got) != len(id) {
		return nil, fmt.Errorf("ep: rendezvous: rank %d got an id of %d bytes, want %d", rank, len(got), len(id))
	}
	copy(id[:], got)
	return NewNCCL(dev, id, rank, size, timeout)
}

func (t *ncclTransport) Rank() int              { return t.rank }
func (t *ncclTransport) Size() int              { return t.size }
func (t *ncclTransport) Device() *device.Device { return t.dev }

func (t *ncclTransport) sticky() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// fail records err, aborts the communicator (once) and returns the first error recorded.
func (t *ncclTransport) fail(err error) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err == nil {
		t.err = err
		if c := t.comm; c != 0 {
			t.comm = 0
			t.dev.Do(func() error { return cuda.NCCLCommAbort(c) })
		}
	}
	return t.err
}

// backoff waits a little before poll i+1 of a wait that began at start. It spins
// (yielding the processor) for the first 2 ms, the time NCCL takes to enqueue a group
// and short transfers take to finish, so that the caller learns at once; then it sleeps
// between polls, up to 1 ms.
func backoff(start time.Time, i int) {
	if time.Since(start) < 2*time.Millisecond {
		runtime.Gosched()
		return
	}
	time.Sleep(min(time.Duration(i+1)*10*time.Microsecond, time.Millisecond))
}

// state polls the communicator's asynchronous state.
func (t *ncclTransport) state() (pending bool, err error) {
	t.mu.Lock()
	c := t.comm
	t.mu.Unlock()
	if c == 0 {
		return false, t.sticky()
	}
	err = t.dev.Do(func() error {
		var err error
		pending, err = cuda.NCCLCommGetAsyncError(c)
		return err
	})
	return pending, err
}

// call makes the NCCL calls of issue on the device's locked OS thread and, still on that
// thread, waits until they are done. A non-blocking communicator's ncclGroupEnd (and
// every call, which is a group of its own) that has to wait for the peers, as when it
// sets up connections, leaves its state in the thread-local variables of the OS thread
// that called it until ncclCommGetAsyncError finds it done. Go runs other goroutines on
// a thread once Do unlocks it, and another rank's NCCL calls there would mix their group
// with this one's, so the thread stays locked until then.
func (t *ncclTransport) call(what string, issue func() error) error {
	var err error
	derr := t.dev.Do(func() error {
		if err = issue(); err != nil {
			err = t.fail(fmt.Errorf("ep: NCCL %s on rank %d: %w", what, t.rank, err))
			return nil
		}
		err = t.wait(what)
		return nil
	})
	if derr != nil {
		return t.fail(fmt.Errorf("ep: NCCL %s on rank %d: %w", what, t.rank, derr))
	}
	return err
}

// wait polls until the communicator's last call is done, failing at the deadline. Call
// it inside the Do of that call (see call).
func (t *ncclTransport) wait(what string) error {
	start := time.Now()
	deadline := start.Add(t.timeout)
	for i := 0; ; i++ {
		pending, err := t.state()
		if err != nil {
			return t.fail(fmt.Errorf("ep: NCCL %s on rank %d: %w", what, t.rank, err))
		}
		if !pending {
			return nil
		}
		if time.Now().After(deadline) {
			return t.fail(fmt.Errorf("ep: NCCL %s on rank %d did not finish within %v: a peer is gone or stuck", what, t.rank, t.timeout))
		}
		backoff(start, i)
	}
}

func (t *ncclTransport) AllGather(s *device.Stream, send, recv *device.Tensor) error {
	if err := t.sticky(); err != nil {
		return err
	}
	if err := checkAllGather(t, s, send, recv); err != nil {
		return t.fail(err)
	}
	if send.Bytes() == 0 {
		return nil
	}
	return t.call("AllGather", func() error {
		return cuda.NCCLAllGather(cuda.DevicePtr(send.Ptr()), cuda.DevicePtr(recv.Ptr()), uint64(send.Bytes()), cuda.NCCLUint8, t.comm, cuda.Stream(s.Handle()))
	})
}

// AllToAllV issues the exchange as one group of ncclSend and ncclRecv calls, one per
// peer and tensor with rows to move, on s.
func (t *ncclTransport) AllToAllV(s *device.Stream, x *Exchange) error {
	if err := t.sticky(); err != nil {
		return err
	}
	if err := x.check(t, s); err != nil {
		return t.fail(err)
	}
	h := cuda.Stream(s.Handle())
	return t.call("AllToAllV", func() error {
		if err := cuda.NCCLGroupStart(); err != nil {
			return err
		}
		var errs []error
		for p := range t.size {
			for i := range x.Send {
				if c := x.SendCount[p]; c > 0 {
					rb := rowBytes(x.Send[i])
					ptr := cuda.DevicePtr(x.Send[i].Ptr()) + cuda.DevicePtr(x.SendOff[p]*rb)
					errs = append(errs, cuda.NCCLSend(ptr, uint64(c*rb), cuda.NCCLUint8, p, t.comm, h))
				}
				if c := x.RecvCount[p]; c > 0 {
					rb := rowBytes(x.Recv[i])
					ptr := cuda.DevicePtr(x.Recv[i].Ptr()) + cuda.DevicePtr(x.RecvOff[p]*rb)
					errs = append(errs, cuda.NCCLRecv(ptr, uint64(c*rb), cuda.NCCLUint8, p, t.comm, h))
				}
			}
		}
		return errors.Join(append(errs, cuda.NCCLGroupEnd())...)
	})
}

// Sync waits for s by polling an event, so that a peer that is gone (which leaves
// NCCL's kernels waiting on the GPU) ends in an error at the deadline: the communicator
// is then aborted, which also stops its kernels.
func (t *ncclTransport) Sync(s *device.Stream) error {
	if err := t.sticky(); err != nil {
		return err
	}
	if err := checkStream(t, s, "Sync"); err != nil {
		return err
	}
	e, err := s.Record()
	if err != nil {
		return err
	}
	defer e.Close()
	start := time.Now()
	deadline := start.Add(t.timeout)
	for i := 0; ; i++ {
		done, err := e.Done()
		if err != nil {
			return t.fail(fmt.Errorf("ep: rank %d: waiting for %v: %w", t.rank, t.dev, err))
		}
		if done {
			return nil
		}
		if _, err := t.state(); err != nil {
			return t.fail(fmt.Errorf("ep: NCCL on rank %d: %w", t.rank, err))
		}
		if time.Now().After(deadline) {
			return t.fail(fmt.Errorf("ep: rank %d: the stream's NCCL work did not finish within %v: a peer is gone or stuck", t.rank, t.timeout))
		}
		backoff(start, i)
	}
}

// Close finalizes and destroys the communicator (or aborts it if that does not finish
// within the timeout).
func (t *ncclTransport) Close() error {
	if t.sticky() != nil {
		return nil
	}
	t.mu.Lock()
	c := t.comm
	t.mu.Unlock()
	if err := t.call("finalize", func() error { return cuda.NCCLCommFinalize(c) }); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.comm, t.err = 0, errors.New("ep: NCCL transport closed")
	return t.dev.Do(func() error { return cuda.NCCLCommDestroy(c) })
}
