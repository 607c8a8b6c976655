package ep

import (
	"bytes"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skip(err)
	}
	return l
}

func TestRendezvous(t *testing.T) {
	l := listen(t)
	id := bytes.Repeat([]byte("dropless"), 16)
	const size = 4
	deadline := time.Now().Add(10 * time.Second)
	got := make([][]byte, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r == 0 {
				errs[0] = serveID(l, size, id, deadline)
				got[0] = id
				return
			}
			got[r], errs[r] = fetchID(l.Addr().String(), r, size, deadline)
		}()
	}
	wg.Wait()
	for r := range size {
		if errs[r] != nil || !bytes.Equal(got[r], id) {
			t.Errorf("rank %d: %v, id %q", r, errs[r], got[r])
		}
	}
}

// TestRendezvousMissingRank: a rank that never arrives makes the others fail within the
// timeout, with an error that names it.
func TestRendezvousMissingRank(t *testing.T) {
	l := listen(t)
	start := time.Now()
	deadline := start.Add(500 * time.Millisecond)
	var serr, cerr error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); serr = serveID(l, 3, []byte("id"), deadline) }()
	go func() { defer wg.Done(); _, cerr = fetchID(l.Addr().String(), 1, 3, deadline.Add(time.Second)) }()
	wg.Wait()
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("took %v", el)
	}
	if serr == nil || !strings.Contains(serr.Error(), "[2]") || !strings.Contains(serr.Error(), "did not arrive") {
		t.Errorf("rank 0: %v", serr)
	}
	if cerr == nil || !strings.Contains(cerr.Error(), "[2]") {
		t.Errorf("rank 1: %v", cerr)
	}
	t.Log(serr, "|", cerr)
}

// TestRendezvousNoRankZero: with nobody listening, a rank fails at the deadline.
func TestRendezvousNoRankZero(t *testing.T) {
	l := listen(t)
	addr := l.Addr().String()
	l.Close()
	start := time.Now()
	_, err := fetchID(addr, 1, 2, start.Add(300*time.Millisecond))
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("took %v", el)
	}
	if err == nil || !strings.Contains(err.Error(), "no rank 0") {
		t.Errorf("got %v", err)
	}
}

// TestRendezvousSilentRankZero: a rank 0 that accepts but never publishes fails the
// others at the deadline.
func TestRendezvousSilentRankZero(t *testing.T) {
	l := listen(t)
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err == nil {
			defer c.Close()
			time.Sleep(2 * time.Second)
		}
	}()
	_, err := fetchID(l.Addr().String(), 1, 2, time.Now().Add(300*time.Millisecond))
	if err == nil || !strings.Contains(err.Error(), "did not publish") {
		t.Errorf("got %v", err)
	}
}

func TestRendezvousSizeMismatch(t *testing.T) {
	l := listen(t)
	deadline := time.Now().Add(5 * time.Second)
	var serr, cerr error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); serr = serveID(l, 2, []byte("id"), deadline) }()
	go func() { defer wg.Done(); _, cerr = fetchID(l.Addr().String(), 1, 3, deadline) }()
	wg.Wait()
	for _, err := range []error{serr, cerr} {
		if err == nil || !strings.Contains(err.Error(), "says the world has 3 ranks, rank 0 says 2") {
			t.Errorf("got %v", err)
		}
	}
}

// TestRendezvousAddr runs rendezvous as InitFromEnv does, on a free port.
func TestRendezvousAddr(t *testing.T) {
	l := listen(t)
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	id := []byte("the id")
	got := make([][]byte, 3)
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for r := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := []byte(nil)
			if r == 0 {
				mine = id
			}
			got[r], errs[r] = rendezvous(addr, r, 3, mine, 10*time.Second)
		}()
	}
	wg.Wait()
	for r := range 3 {
		if errs[r] != nil || !bytes.Equal(got[r], id) {
			t.Errorf("rank %d: %v %q", r, errs[r], got[r])
		}
	}
}

func TestInitFromEnv(t *testing.T) {
	t.Setenv("DROPLESS_DEVICE", "cpu")
	for _, v := range []string{"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} {
		t.Setenv(v, "")
	}
	tr, err := InitFromEnv()
	if err != nil || tr.Size() != 1 || tr.Rank() != 0 {
		t.Fatalf("without WORLD_SIZE: %v %v", tr, err)
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"WORLD_SIZE": "x"}, "WORLD_SIZE"},
		{map[string]string{"WORLD_SIZE": "2"}, "RANK is not set"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 with WORLD_SIZE=2"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_PORT is not set"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK"},
	} {
		for _, v := range []string{"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"} {
			t.Setenv(v, tc.env[v])
		}
		if _, err := InitFromEnv(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: got %v, want %q", tc.env, err, tc.want)
		}
	}
}
