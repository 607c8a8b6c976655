package ep_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// twoGPUs returns GPUs 0 and 1 with NCCL loaded, or skips. Fewer than two GPUs always
// skip; with two, a missing NCCL fails under DROPLESS_REQUIRE_GPU=1.
func twoGPUs(t testing.TB) []*device.Device {
	t.Helper()
	n, err := device.CUDACount()
	if err != nil || n < 2 {
		t.Skipf("needs 2 GPUs (found %d: %v)", n, err)
	}
	if _, err := ep.NewUniqueID(); err != nil {
		if dt.RequireGPU() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	return []*device.Device{dt.Must(device.Open("cuda:0")), dt.Must(device.Open("cuda:1"))}
}

// ncclScenarios are the suite's two-rank cases and two larger ones, each with direct
// transfers (when the GPUs can address each other's memory) and through NCCL only.
func ncclScenarios() []scen {
	var out []scen
	for _, sc := range scenarios() {
		if sc.R == 2 {
			out = append(out, sc)
		}
	}
	out = append(out,
		scen{name: "R2/large/bf16", R: 2, E: 64, K: 8, H: 1024, T: []int{4096, 3000}, dt: device.BF16, route: "uniform", seed: 31},
		scen{name: "R2/large/zipf/chunks5", R: 2, E: 64, K: 8, H: 1024, T: []int{2500, 4096}, dt: device.BF16, route: "zipf", chunks: 5, seed: 32})
	for _, sc := range out[:len(out):len(out)] {
		sc.name += "/transport-only"
		sc.transportOnly = true
		out = append(out, sc)
	}
	return out
}

// cpuReference runs sc on a CPU world; outputs lose their byte counts, which only
// in-process worlds have.
func cpuReference(t *testing.T, sc scen, ins []rankIn) []*rankOut {
	want := runWorld(t, device.CPU(), sc, ins, nil)
	for _, o := range want {
		o.Bytes = nil
	}
	return want
}

// TestNCCLInProcess runs the suite over NCCL on two GPUs driven from this process, a
// goroutine each, and checks every invariant and bit-equality with the CPU.
func TestNCCLInProcess(t *testing.T) {
	devs := twoGPUs(t)
	trs, err := ep.NewNCCLWorld(devs, 60*time.Second)
	dt.NoErr(t, err)
	defer func() {
		for _, tr := range trs {
			tr.Close()
		}
	}()
	run := func(t *testing.T, sc scen) {
		ins := sc.inputs()
		outs, errs := runAll(trs, sc, ins, nil)
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		check(t, sc, ins, outs)
		if diff := diffOuts(cpuReference(t, sc, ins), outs); diff != "" {
			t.Errorf("NCCL differs from the CPU (got, want CPU):\n%s", diff)
		}
	}
	for _, sc := range ncclScenarios() {
		t.Run(sc.name, func(t *testing.T) { run(t, sc) })
	}
	// Direct transfers with windows that grow at almost every op and are set up anew
	// every second op.
	defer ep.TuneWindow(4096, 2)()
	for _, sc := range ncclScenarios() {
		if !sc.transportOnly {
			t.Run(sc.name+"/small-windows", func(t *testing.T) { run(t, sc) })
		}
	}
}

// TestNCCLTwoProcesses runs the suite as two processes, one per GPU, that find each
// other as torchrun's would: this test binary runs itself twice with RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
func TestNCCLTwoProcesses(t *testing.T) {
	if os.Getenv("DROPLESS_EP_CHILD") == "1" {
		ncclChild(t)
		return
	}
	twoGPUs(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	dt.NoErr(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmds := make([]*exec.Cmd, 2)
	outs := make([]strings.Builder, 2)
	for r := range cmds {
		c := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestNCCLTwoProcesses$", "-test.v")
		c.Env = append(os.Environ(), "DROPLESS_EP_CHILD=1", "RANK="+strconv.Itoa(r), "WORLD_SIZE=2",
			"LOCAL_RANK="+strconv.Itoa(r), "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port), "DROPLESS_EP_TIMEOUT=60s")
		c.Stdout, c.Stderr = &outs[r], &outs[r]
		dt.NoErr(t, c.Start())
		cmds[r] = c
	}
	for r, c := range cmds {
		err := c.Wait()
		t.Logf("rank %d:\n%s", r, outs[r].String())
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// ncclChild is one process of TestNCCLTwoProcesses: it runs its rank of each scenario
// and compares it with its rank of a CPU world.
func ncclChild(t *testing.T) {
	tr, err := ep.InitFromEnv()
	dt.NoErr(t, err)
	defer tr.Close()
	r := tr.Rank()
	t.Logf("rank %d of %d on %v", r, tr.Size(), tr.Device())
	for _, sc := range ncclScenarios() {
		ins := sc.inputs()
		got, err := runRank(tr, sc, ins[r], nil, nil)
		if err != nil {
			t.Fatalf("%s: %v", sc.name, err)
		}
		want, mine := cpuReference(t, sc, ins), make([]*rankOut, sc.R)
		for q := range want {
			if q != r {
				want[q] = nil // the other process checks its rank
			}
		}
		mine[r] = got
		if diff := diffOuts(want, mine); diff != "" {
			t.Errorf("%s: rank %d differs from the CPU (got, want CPU):\n%s", sc.name, r, diff)
		}
	}
}

// TestNCCLMissingRank: a communicator whose other rank never arrives fails within the
// timeout instead of hanging. One GPU is enough.
func TestNCCLMissingRank(t *testing.T) {
	d := dt.GPU(t)
	id, err := ep.NewUniqueID()
	if err != nil {
		if dt.RequireGPU() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := ep.NewNCCL(d, id, 0, 2, 3*time.Second)
		done <- err
	}()
	select {
	case err := <-done:
		t.Logf("after %v: %v", time.Since(start), err)
		if err == nil {
			t.Fatal("a communicator of 2 formed with one rank")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("NewNCCL with a missing rank hung for 60 s")
	}
}

// ExampleNewWorld shows a step of an expert-parallel layer on two in-process ranks.
func ExampleNewWorld() {
	w, _ := ep.NewWorld(2)
	outs := make([]string, 2)
	err := w.Run(func(tr ep.Transport) error {
		s := device.CPU().Stream()
		g, err := ep.NewGroup(tr, ep.Config{Experts: 4, TopK: 2})
		if err != nil {
			return err
		}
		defer g.Close()
		// Three tokens per rank; experts 0, 1 live on rank 0 and 2, 3 on rank 1.
		idx, _ := device.FromSlice(s, device.I32, []int32{0, 1, 0, 2, 3, -1}, 3, 2)
		wts, _ := device.FromFloat32(s, device.F32, []float32{0.5, 0.5, 0.75, 0.25, 1, 0}, 3, 2)
		x, _ := device.FromFloat32(s, device.F32, []float32{1, 2, 3, 4, 5, 6}, 3, 2)
		l, err := g.Layout(s, idx)
		if err != nil {
			return err
		}
		defer l.Free()
		d, err := l.Dispatch(s, x, wts)
		if err != nil {
			return err
		}
		defer d.Free()
		// The experts would run on d.X here, l.Counts() rows each; here they are identities.
		out, err := l.Combine(s, d.X, d.Weights)
		if err != nil {
			return err
		}
		v, _ := out.Float32s(s)
		outs[tr.Rank()] = fmt.Sprintf("rank %d: sends %v tokens, expert rows %v, out %v", tr.Rank(), l.TokensTo(), l.Counts(), v)
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	for _, o := range outs {
		fmt.Println(o)
	}
	// Output:
	// rank 0: sends [2 2] tokens, expert rows [4 2], out [1 2 3 4 5 6]
	// rank 1: sends [2 2] tokens, expert rows [2 2], out [1 2 3 4 5 6]
}
