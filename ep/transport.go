package ep

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/dropless/dropless/device"
)

// Transport is one rank's endpoint of a group of ranks that move tensors among
// themselves: NCCL between GPUs (NewNCCL, NewNCCLWorld, InitFromEnv) or goroutines of
// one process (NewWorld). Every rank makes the same calls in the same order, each from
// its own goroutine; the calls are collective. A Transport is not safe for concurrent
// use. A rank that fails, leaves or never calls makes the others fail with an error
// within the transport's timeout, never hang.
type Transport interface {
	// Rank returns this rank, in [0, Size).
	Rank() int
	// Size returns the number of ranks.
	Size() int
	// Device returns the device whose tensors the transport moves.
	Device() *device.Device
	// AllGather enqueues on s a gather of every rank's send into recv, in rank order:
	// recv holds Size()·send.Bytes() bytes, of any dtypes and shapes; both are on
	// Device(), as is s. recv must not overlap send, except that send may be this
	// rank's own segment of recv (in place). Every rank sends as many bytes.
	AllGather(s *device.Stream, send, recv *device.Tensor) error
	// AllToAllV enqueues on s, a stream of Device(), the moves x describes. The receive
	// tensors must not overlap the send tensors.
	AllToAllV(s *device.Stream, x *Exchange) error
	// Sync waits until the work enqueued on s (a stream of Device()) is done, failing
	// (instead of hanging) when a peer is gone or the transport's timeout passes.
	Sync(s *device.Stream) error
	// Close releases the endpoint. The other ranks' calls fail afterwards.
	Close() error
}

// Exchange describes an all-to-all-v: for each pair i, rows [SendOff[p], SendOff[p] +
// SendCount[p]) of Send[i] go to rank p, and rows [RecvOff[p], RecvOff[p] +
// RecvCount[p]) of Recv[i] come from rank p. A row is everything past the first
// dimension; Send[i] and Recv[i] have rows of the same size. Counts are the same for
// every pair, and what rank a sends to b must be what b expects from a.
type Exchange struct {
	Send, Recv         []*device.Tensor
	SendOff, SendCount []int
	RecvOff, RecvCount []int

	// The op of this package that moves the tensors, and their names in it, so that an
	// in-process world can say which of its settings the ranks disagree on.
	op    string
	names []string
}

// rowKind is what the rows of a tensor are: their dtype and elements.
type rowKind struct {
	dt device.DType
	n  int
}

func rowKindOf(t *device.Tensor) rowKind {
	return rowKind{t.DType(), rowBytes(t) / max(t.DType().Size(), 1)}
}

func (k rowKind) String() string { return fmt.Sprintf("%v rows of %d", k.dt, k.n) }

// checkStream returns an error unless s is a stream of tr's device; op names the call.
func checkStream(tr Transport, s *device.Stream, op string) error {
	switch {
	case s == nil:
		return fmt.Errorf("ep: %s: nil stream", op)
	case s.Device() != tr.Device():
		return fmt.Errorf("ep: %s on a stream of %v, rank %d on %v", op, s.Device(), tr.Rank(), tr.Device())
	}
	return nil
}

// checkAllGather checks the arguments of tr.AllGather.
func checkAllGather(tr Transport, s *device.Stream, send, recv *device.Tensor) error {
	if err := checkStream(tr, s, "AllGather"); err != nil {
		return err
	}
	for _, x := range []struct {
		t    *device.Tensor
		name string
	}{{send, "send"}, {recv, "recv"}} {
		if x.t == nil {
			return fmt.Errorf("ep: AllGather: %s is nil", x.name)
		}
		if err := x.t.Check(s, "ep: AllGather "+x.name); err != nil {
			return err
		}
	}
	if n := tr.Size(); recv.Bytes() != n*send.Bytes() {
		return fmt.Errorf("ep: AllGather: recv %v holds %d bytes, want %d ranks × %d", recv, recv.Bytes(), n, send.Bytes())
	}
	return nil
}

// rowBytes returns the bytes of one row of t: everything past its first dimension.
func rowBytes(t *device.Tensor) int {
	n := t.DType().Size()
	for _, d := range t.Shape()[1:] {
		n *= d
	}
	return n
}

func (x *Exchange) check(tr Transport, s *device.Stream) error {
	n := tr.Size()
	if x == nil || len(x.Send) == 0 || len(x.Send) != len(x.Recv) {
		return errors.New("ep: exchange: want one or more send and receive tensors, as many of each")
	}
	if len(x.SendOff) != n || len(x.SendCount) != n || len(x.RecvOff) != n || len(x.RecvCount) != n {
		return fmt.Errorf("ep: exchange: offsets and counts must have %d entries, one per rank", n)
	}
	if err := checkStream(tr, s, "AllToAllV"); err != nil {
		return err
	}
	for i := range x.Send {
		for _, side := range []struct {
			t        *device.Tensor
			what     string
			off, cnt []int
		}{{x.Send[i], "send", x.SendOff, x.SendCount}, {x.Recv[i], "receive", x.RecvOff, x.RecvCount}} {
			if side.t == nil {
				return fmt.Errorf("ep: exchange: %s tensor %d is nil", side.what, i)
			}
			if err := side.t.Check(s, fmt.Sprintf("ep: exchange %s tensor %d", side.what, i)); err != nil {
				return err
			}
			if side.t.Rank() < 1 {
				return fmt.Errorf("ep: exchange: %s tensor %d is a scalar", side.what, i)
			}
			rows := side.t.Dim(0)
			for p := range n {
				if side.off[p] < 0 || side.cnt[p] < 0 || side.off[p] > rows-side.cnt[p] {
					return fmt.Errorf("ep: exchange: %s rows [%d, %d) for rank %d out of %v", side.what, side.off[p], side.off[p]+side.cnt[p], p, side.t)
				}
			}
		}
		if rowBytes(x.Send[i]) != rowBytes(x.Recv[i]) {
			return fmt.Errorf("ep: exchange: send %v and receive %v rows differ in size", x.Send[i], x.Recv[i])
		}
	}
	return nil
}

// Timeout is how long a transport waits for its peers by default: $DROPLESS_EP_TIMEOUT
// when set, else 5 minutes. The variable must hold a positive Go duration with its unit
// ("90s", "5m"); anything else, a bare number included, is an error.
func Timeout() (time.Duration, error) {
	v := os.Getenv("DROPLESS_EP_TIMEOUT")
	if v == "" {
		return 5 * time.Minute, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return d, nil
	}
	return 0, fmt.Errorf("ep: $DROPLESS_EP_TIMEOUT=%q: want a positive Go duration with its unit, such as 90s or 5m", v)
}
