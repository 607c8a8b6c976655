package ep

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"time"
)

// The rendezvous publishes rank 0's NCCL unique id to the other ranks over TCP. Rank 0
// listens; every other rank connects (retrying until rank 0 is up) and says who it is;
// once all have, rank 0 sends each the id. Everything has a deadline: a rank that never
// arrives, a rank 0 that never publishes, or ranks that disagree on the world size make
// every rank fail with an error saying so.
//
// Messages: hello = magic, version, rank, size (4 bytes each, big-endian); reply =
// magic, status (0 ok, 1 error), length, then the id or the error text.

var rdvMagic = [4]byte{'D', 'L', 'E', 'P'}

const rdvVersion = 1

type hello struct {
	rank, size int
	c          net.Conn
}

// serveID publishes id to the size-1 ranks that connect to l, and closes l. It returns
// once all have it, or with an error (which the connected ranks also receive) at the
// deadline or on a bad hello.
func serveID(l net.Listener, size int, id []byte, deadline time.Time) error {
	defer l.Close()
	done := make(chan struct{})
	defer close(done)
	hellos := make(chan hello)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				c.SetDeadline(deadline)
				var b [16]byte
				if _, err := io.ReadFull(c, b[:]); err != nil || !bytes.Equal(b[:4], rdvMagic[:]) || binary.BigEndian.Uint32(b[4:]) != rdvVersion {
					c.Close() // not one of ours
					return
				}
				h := hello{int(int32(binary.BigEndian.Uint32(b[8:]))), int(int32(binary.BigEndian.Uint32(b[12:]))), c}
				select {
				case hellos <- h:
				case <-done:
					reply(c, 1, []byte("ep: rendezvous: rank 0 is no longer waiting"))
					c.Close()
				}
			}()
		}
	}()
	conns := map[int]net.Conn{}
	fail := func(err error) error {
		for _, c := range conns {
			reply(c, 1, []byte(err.Error()))
			c.Close()
		}
		return err
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for len(conns) < size-1 {
		select {
		case h := <-hellos:
			switch {
			case h.size != size:
				conns[-1] = h.c
				return fail(fmt.Errorf("ep: rendezvous: rank %d says the world has %d ranks, rank 0 says %d", h.rank, h.size, size))
			case h.rank < 1 || h.rank >= size:
				conns[-1] = h.c
				return fail(fmt.Errorf("ep: rendezvous: a rank calls itself %d in a world of %d", h.rank, size))
			case conns[h.rank] != nil:
				conns[-1] = h.c
				return fail(fmt.Errorf("ep: rendezvous: two processes call themselves rank %d", h.rank))
			}
			conns[h.rank] = h.c
		case <-t.C:
			var missing []int
			for r := 1; r < size; r++ {
				if conns[r] == nil {
					missing = append(missing, r)
				}
			}
			return fail(fmt.Errorf("ep: rendezvous: rank(s) %v of %d did not arrive at rank 0 (%v) within the timeout", missing, size, l.Addr()))
		}
	}
	var errs []error
	ranks := make([]int, 0, len(conns))
	for r := range conns {
		ranks = append(ranks, r)
	}
	sort.Ints(ranks)
	for _, r := range ranks {
		if err := reply(conns[r], 0, id); err != nil {
			errs = append(errs, fmt.Errorf("ep: rendezvous: sending the id to rank %d: %w", r, err))
		}
		conns[r].Close()
	}
	return errors.Join(errs...)
}

// reply sends a reply, with a deadline of its own: the rendezvous's may have passed.
func reply(c net.Conn, status uint32, payload []byte) error {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 12+len(payload))
	copy(b, rdvMagic[:])
	binary.BigEndian.PutUint32(b[4:], status)
	binary.BigEndian.PutUint32(b[8:], uint32(len(payload)))
	copy(b[12:], payload)
	_, err := c.Write(b)
	return err
}

// fetchID connects to rank 0 at addr (retrying until the deadline while nothing
// listens there) and returns the id it publishes.
func fetchID(addr string, rank, size int, deadline time.Time) ([]byte, error) {
	var c net.Conn
	for {
		var err error
		c, err = net.DialTimeout("tcp", addr, min(time.Until(deadline), 5*time.Second))
		if err == nil {
			break
		}
		if !time.Now().Before(deadline) {
			return nil, fmt.Errorf("ep: rendezvous: rank %d found no rank 0 at %s within the timeout: %w", rank, addr, err)
		}
		time.Sleep(min(100*time.Millisecond, time.Until(deadline)))
	}
	defer c.Close()
	c.SetDeadline(deadline)
	var h [16]byte
	copy(h[:], rdvMagic[:])
	binary.BigEndian.PutUint32(h[4:], rdvVersion)
	binary.BigEndian.PutUint32(h[8:], uint32(rank))
	binary.BigEndian.PutUint32(h[12:], uint32(size))
	if _, err := c.Write(h[:]); err != nil {
		return nil, fmt.Errorf("ep: rendezvous: rank %d: %w", rank, err)
	}
	var r [12]byte
	if _, err := io.ReadFull(c, r[:]); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, fmt.Errorf("ep: rendezvous: rank %d: rank 0 at %s did not publish the id within the timeout (other ranks missing?)", rank, addr)
		}
		return nil, fmt.Errorf("ep: rendezvous: rank %d: rank 0 at %s: %w", rank, addr, err)
	}
	if !bytes.Equal(r[:4], rdvMagic[:]) {
		return nil, fmt.Errorf("ep: rendezvous: rank %d: %s is not a rank 0 of ours", rank, addr)
	}
	n := binary.BigEndian.Uint32(r[8:])
	if n > 1<<16 {
		return nil, fmt.Errorf("ep: rendezvous: rank %d: reply of %d bytes", rank, n)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(c, payload); err != nil {
		return nil, fmt.Errorf("ep: rendezvous: rank %d: %w", rank, err)
	}
	if binary.BigEndian.Uint32(r[4:]) != 0 {
		return nil, fmt.Errorf("%s (as rank 0 told rank %d)", payload, rank)
	}
	return payload, nil
}

// rendezvous returns, on every rank, the id rank 0 passes in. Rank 0 listens on port of
// addr on every interface; the others connect to addr.
func rendezvous(addr string, rank, size int, id []byte, timeout time.Duration) ([]byte, error) {
	deadline := time.Now().Add(timeout)
	if size == 1 {
		return id, nil
	}
	if rank != 0 {
		return fetchID(addr, rank, size, deadline)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("ep: rendezvous: MASTER_ADDR:MASTER_PORT %q: %w", addr, err)
	}
	l, err := net.Listen("tcp", net.JoinHostPort("", port))
	if err != nil {
		return nil, fmt.Errorf("ep: rendezvous: rank 0 cannot listen on port %s: %w", port, err)
	}
	if err := serveID(l, size, id, deadline); err != nil {
		return nil, err
	}
	return id, nil
}
