package device

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dropless/dropless/internal/cuda"
)

// Stream is an ordered queue of device work. On a GPU it is a CUDA stream and every op
// enqueued on it returns without waiting for the work; on the CPU ops run when they are
// enqueued, in the caller's goroutine, unless the stream is capturing. Every op on a nil
// or closed stream is an error.
type Stream struct {
	dev    *Device
	h      cuda.Stream
	owned  bool
	closed atomic.Bool
	sms    atomic.Int32 // SetMultiprocessors' count, 0 for all

	mu        sync.Mutex // CPU capture state
	capturing bool
	captured  []func()
}

// NewStream creates a stream on d. Close it when done.
func (d *Device) NewStream() (*Stream, error) {
	if err := d.check("NewStream"); err != nil {
		return nil, err
	}
	if d.kind != KindCUDA {
		return &Stream{dev: d}, nil
	}
	s := &Stream{dev: d, owned: true}
	err := d.Do(func() error {
		var err error
		s.h, err = cuda.StreamCreate(cuda.StreamNonBlocking)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// NewPriorityStream creates a stream on d with the highest priority the GPU offers:
// when multiprocessors free up, blocks of its kernels are scheduled before those of
// ordinary streams (running blocks are not preempted). Use it for work that others wait
// on, such as transfers. On the CPU it is NewStream. Close it when done.
func (d *Device) NewPriorityStream() (*Stream, error) {
	if err := d.check("NewPriorityStream"); err != nil {
		return nil, err
	}
	if d.kind != KindCUDA {
		return d.NewStream()
	}
	s := &Stream{dev: d, owned: true}
	err := d.Do(func() error {
		_, hi, err := cuda.StreamPriorityRange()
		if err != nil {
			return err
		}
		s.h, err = cuda.StreamCreateWithPriority(cuda.StreamNonBlocking, hi)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// WrapStream returns a Stream for a CUDA stream handle created elsewhere (by
// gorgonia.org/cu or another binding) in d's primary context. Closing it ends the
// Stream, not the CUDA stream.
func (d *Device) WrapStream(handle uintptr) (*Stream, error) {
	if err := d.check("WrapStream"); err != nil {
		return nil, err
	}
	if d.kind != KindCUDA {
		return nil, fmt.Errorf("device: WrapStream on %v: foreign streams are CUDA streams", d)
	}
	return &Stream{dev: d, h: cuda.Stream(handle)}, nil
}

// Device returns the stream's device (nil for a nil stream).
func (s *Stream) Device() *Device {
	if s == nil {
		return nil
	}
	return s.dev
}

// Handle returns the CUstream handle (0 on the CPU and for a nil stream), for passing to
// other bindings.
func (s *Stream) Handle() uintptr {
	if s == nil {
		return 0
	}
	return uintptr(s.h)
}

// Close ends the stream: every op enqueued on it afterwards is an error. It destroys the
// CUDA stream after its pending work, except for wrapped streams, whose CUDA stream is
// left to its creator. Closing the device's default stream does nothing: it stays usable.
// Closing twice is not an error.
func (s *Stream) Close() error {
	if s == nil {
		return errors.New("device: Stream.Close: nil stream")
	}
	if s == s.dev.stream || s.closed.Swap(true) || !s.owned {
		return nil
	}
	s.owned = false
	return s.dev.Do(func() error { return cuda.StreamDestroy(s.h) })
}

// SetMultiprocessors sets how many multiprocessors the persistent kernels enqueued on s
// from now on size their grids for: n in [1, Device().Multiprocessors()], or 0 for all
// of them (the default). A persistent kernel (the gemm package's products, which keep one
// block per multiprocessor and hand each its tiles) then leaves the other multiprocessors
// to work on other streams, as cuBLAS's SM count target does: on a GPU kept busy by
// products on s, a bandwidth-bound kernel on another stream runs beside them instead of
// between them. It changes no result, only the time; kernels launched before the call
// keep their grids, and kernels that are not persistent are not affected. The count is
// the stream's: set on the device's default stream, it holds for every caller of that
// stream. On the CPU it is recorded and bounds nothing.
func (s *Stream) SetMultiprocessors(n int) error {
	if err := s.live("Stream.SetMultiprocessors"); err != nil {
		return err
	}
	if all := s.dev.Multiprocessors(); n < 0 || n > all {
		return fmt.Errorf("device: Stream.SetMultiprocessors: n is %d, want 0 (all) to %d, the multiprocessors of %v", n, all, s.dev)
	}
	s.sms.Store(int32(n))
	return nil
}

// Multiprocessors returns the multiprocessors persistent kernels enqueued on s size their
// grids for: the count of SetMultiprocessors, or the device's (0 for a nil stream).
func (s *Stream) Multiprocessors() int {
	if s == nil {
		return 0
	}
	if n := s.sms.Load(); n > 0 {
		return int(n)
	}
	return s.dev.Multiprocessors()
}

// Closed reports whether s was closed (false for a nil stream and for the device's
// default stream, which Close leaves open). Ops on a closed stream are errors; packages
// whose ops may enqueue nothing check it themselves.
func (s *Stream) Closed() bool { return s != nil && s.closed.Load() }

// live returns an error unless s is a stream that is not closed; op names the caller.
// Every exported function taking a stream calls it first (ops on tensors through
// Tensor.Check), so that the error names the function; run calls it again, so that no
// work is enqueued on a closed stream.
func (s *Stream) live(op string) error {
	if s == nil {
		return fmt.Errorf("device: %s: nil stream", op)
	}
	if s.closed.Load() {
		return fmt.Errorf("device: %s: stream was closed", op)
	}
	return nil
}

// Synchronize waits until all work enqueued on s has finished.
func (s *Stream) Synchronize() error {
	if err := s.live("Stream.Synchronize"); err != nil {
		return err
	}
	if s.dev.kind != KindCUDA {
		return nil
	}
	return s.dev.Do(func() error { return cuda.StreamSynchronize(s.h) })
}

// run enqueues work: on the CPU it calls cpu now, or records it while capturing; on a
// GPU it calls gpu inside Do. Every op of the library goes through run, which refuses a
// closed stream.
func (s *Stream) run(cpu func(), gpu func() error) error {
	if err := s.live("op"); err != nil {
		return err
	}
	if s.dev.kind != KindCUDA {
		s.mu.Lock()
		if s.capturing {
			s.captured = append(s.captured, cpu)
			s.mu.Unlock()
			return nil
		}
		s.mu.Unlock()
		cpu()
		return nil
	}
	return s.dev.Do(gpu)
}

// isCapturing reports whether a CPU stream is capturing.
func (s *Stream) isCapturing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.capturing
}

// EnqueueCPU runs fn as an op on a CPU stream (recorded when the stream is capturing).
// Packages that implement ops call it for their CPU paths. On a GPU stream it is an error.
func (s *Stream) EnqueueCPU(fn func()) error {
	if err := s.live("EnqueueCPU"); err != nil {
		return err
	}
	if fn == nil {
		return errors.New("device: EnqueueCPU: nil function")
	}
	if s.dev.kind == KindCUDA {
		return fmt.Errorf("device: EnqueueCPU on %v stream", s.dev)
	}
	return s.run(fn, nil)
}

// Event marks a point in a stream's work. On a GPU it is a CUDA event with timing; on
// the CPU it holds the time its stream reached it.
type Event struct {
	dev    *Device
	h      cuda.Event
	mu     sync.Mutex
	at     time.Time
	closed atomic.Bool
}

// NewEvent creates an event on d. Close it when done.
func (d *Device) NewEvent() (*Event, error) {
	if err := d.check("NewEvent"); err != nil {
		return nil, err
	}
	e := &Event{dev: d}
	if d.kind != KindCUDA {
		return e, nil
	}
	err := d.Do(func() error {
		var err error
		e.h, err = cuda.EventCreate(0)
		return err
	})
	if err != nil {
		return nil, err
	}
	return e, nil
}

// live returns an error unless e is an event that is not closed; op names the caller
// and what the event.
func (e *Event) live(op, what string) error {
	if e == nil {
		return fmt.Errorf("device: %s: %s is nil", op, what)
	}
	if e.closed.Load() {
		return fmt.Errorf("device: %s: %s was closed", op, what)
	}
	return nil
}

// Device returns the device of e, or nil for a nil or closed event.
func (e *Event) Device() *Device {
	if e == nil || e.closed.Load() {
		return nil
	}
	return e.dev
}

// Record marks the current end of s's work with e.
func (e *Event) Record(s *Stream) error {
	if err := e.live("Event.Record", "event"); err != nil {
		return err
	}
	if err := s.live("Event.Record"); err != nil {
		return err
	}
	if s.dev != e.dev {
		return fmt.Errorf("device: Event.Record: event of %v on a stream of %v", e.dev, s.dev)
	}
	return s.run(func() {
		e.mu.Lock()
		e.at = time.Now()
		e.mu.Unlock()
	}, func() error { return cuda.EventRecord(e.h, s.h) })
}

// Record creates an event and records it on s.
func (s *Stream) Record() (*Event, error) {
	if err := s.live("Stream.Record"); err != nil {
		return nil, err
	}
	e, err := s.dev.NewEvent()
	if err != nil {
		return nil, err
	}
	if err := e.Record(s); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// Wait makes work enqueued on s after this call wait until e has completed. It does
// not block the host.
func (s *Stream) Wait(e *Event) error {
	if err := s.live("Stream.Wait"); err != nil {
		return err
	}
	if err := e.live("Stream.Wait", "event"); err != nil {
		return err
	}
	if s.dev != e.dev {
		return fmt.Errorf("device: Stream.Wait: event of %v on a stream of %v", e.dev, s.dev)
	}
	return s.run(func() {}, func() error { return cuda.StreamWaitEvent(s.h, e.h) })
}

// Synchronize blocks the host until e has completed.
func (e *Event) Synchronize() error {
	if err := e.live("Event.Synchronize", "event"); err != nil {
		return err
	}
	if e.dev.kind != KindCUDA {
		return nil
	}
	return e.dev.Do(func() error { return cuda.EventSynchronize(e.h) })
}

// Done reports whether e has completed, without blocking.
func (e *Event) Done() (bool, error) {
	if err := e.live("Event.Done", "event"); err != nil {
		return false, err
	}
	if e.dev.kind != KindCUDA {
		return true, nil
	}
	var ok bool
	err := e.dev.Do(func() error {
		var err error
		ok, err = cuda.EventQuery(e.h)
		return err
	})
	return ok, err
}

// Since returns the time between start and e, both recorded on streams of one device
// and completed. An event that was never recorded (or, on the CPU, whose recording was
// captured into a graph not launched yet) is an error.
func (e *Event) Since(start *Event) (time.Duration, error) {
	if err := e.live("Event.Since", "event"); err != nil {
		return 0, err
	}
	if err := start.live("Event.Since", "start"); err != nil {
		return 0, err
	}
	if start.dev != e.dev {
		return 0, fmt.Errorf("device: Event.Since: event of %v, start of %v", e.dev, start.dev)
	}
	if e.dev.kind != KindCUDA {
		at, from := e.recorded(), start.recorded()
		switch {
		case at.IsZero():
			return 0, errors.New("device: Event.Since: event was never recorded")
		case from.IsZero():
			return 0, errors.New("device: Event.Since: start was never recorded")
		}
		return at.Sub(from), nil
	}
	var ms float32
	err := e.dev.Do(func() error {
		var err error
		ms, err = cuda.EventElapsedTime(start.h, e.h)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("device: Event.Since: %w", err)
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// recorded returns the time a CPU event was reached, zero if never.
func (e *Event) recorded() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.at
}

// Close destroys e; using it afterwards is an error. Closing twice is not.
func (e *Event) Close() error {
	if e == nil {
		return errors.New("device: Event.Close: nil event")
	}
	if e.closed.Swap(true) || e.dev.kind != KindCUDA || e.h == 0 {
		return nil
	}
	h := e.h
	e.h = 0
	return e.dev.Do(func() error { return cuda.EventDestroy(h) })
}

// Graph is work captured from a stream, replayable with one launch. On a GPU it is an
// instantiated CUDA graph; on the CPU it is the captured ops, run in order.
type Graph struct {
	dev    *Device
	g      cuda.Graph
	exec   cuda.GraphExec
	ops    []func()
	closed atomic.Bool
}

// BeginCapture starts recording the work enqueued on s instead of running it, until
// EndCapture. Stream-ordered allocations made while capturing become part of the graph.
func (s *Stream) BeginCapture() error {
	if err := s.live("BeginCapture"); err != nil {
		return err
	}
	if s.dev.kind != KindCUDA {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.capturing {
			return errors.New("device: BeginCapture: stream is already capturing")
		}
		s.capturing, s.captured = true, nil
		return nil
	}
	return s.dev.Do(func() error { return cuda.StreamBeginCapture(s.h) })
}

// EndCapture stops recording on s and returns the captured work as a Graph. Close it when done.
func (s *Stream) EndCapture() (*Graph, error) {
	if err := s.live("EndCapture"); err != nil {
		return nil, err
	}
	g := &Graph{dev: s.dev}
	if s.dev.kind != KindCUDA {
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.capturing {
			return nil, errors.New("device: EndCapture: stream is not capturing")
		}
		g.ops, s.capturing, s.captured = s.captured, false, nil
		return g, nil
	}
	err := s.dev.Do(func() error {
		var err error
		if g.g, err = cuda.StreamEndCapture(s.h); err != nil {
			return err
		}
		if g.exec, err = cuda.GraphInstantiate(g.g); err != nil {
			cuda.GraphDestroy(g.g)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// Launch enqueues the graph's work on s. Launching a closed graph is an error.
func (g *Graph) Launch(s *Stream) error {
	switch {
	case g == nil:
		return errors.New("device: Graph.Launch: nil graph")
	case g.closed.Load():
		return errors.New("device: Graph.Launch: graph was closed")
	}
	if err := s.live("Graph.Launch"); err != nil {
		return err
	}
	if s.dev != g.dev {
		return fmt.Errorf("device: Graph.Launch: graph of %v on a stream of %v", g.dev, s.dev)
	}
	return s.run(func() {
		for _, op := range g.ops {
			op()
		}
	}, func() error { return cuda.GraphLaunch(g.exec, s.h) })
}

// Close destroys the graph; launching it afterwards is an error. Closing twice is not.
func (g *Graph) Close() error {
	if g == nil {
		return errors.New("device: Graph.Close: nil graph")
	}
	if g.closed.Swap(true) || g.dev.kind != KindCUDA || g.exec == 0 {
		return nil
	}
	exec, gr := g.exec, g.g
	g.exec, g.g = 0, 0
	return g.dev.Do(func() error {
		return errors.Join(cuda.GraphExecDestroy(exec), cuda.GraphDestroy(gr))
	})
}
