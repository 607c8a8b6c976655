// Command ep runs expert-parallel dispatch and combine between ranks and reports what
// each rank sent and received, checks that combine(dispatch(x)) gives x back, and times
// a dispatch+combine.
//
// Three ways to make the ranks:
//
//	go run ./examples/ep                   # 4 ranks in one process, goroutines on the CPU
//	go run ./examples/ep -nccl             # one rank per GPU, NCCL, all driven by this process
//	RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ep &
//	RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ep  # a process per GPU (ep.InitFromEnv)
//
// Every rank routes its T tokens to K distinct experts of E (E/R on each rank) with
// weights 1/K, dispatches them (each token goes once to every rank that holds one of its
// experts: the deduplication), and combines the expert rows back unchanged (identity
// experts), so each token's output is its input up to the rounding of the partial sums.
package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
)

type options struct {
	Ranks, Tokens, Hidden, Experts, TopK, Iters int
	DType, Route, Capacity, Device              string
	NCCL, TransportOnly                         bool
	Seed                                        uint64
}

func main() {
	o := options{DType: "bf16", Route: "uniform", Capacity: "dropless", Device: "cpu", Experts: 64, TopK: 8, Seed: 1}
	flag.IntVar(&o.Ranks, "ranks", 0, "ranks: in process, default 4; with -nccl, default every GPU (ignored under WORLD_SIZE)")
	flag.IntVar(&o.Tokens, "tokens", 0, "tokens T per rank (default 1024 on the CPU, 16384 on GPUs)")
	flag.IntVar(&o.Hidden, "hidden", 0, "row width H (default 512 on the CPU, 7168 on GPUs)")
	flag.IntVar(&o.Experts, "experts", o.Experts, "experts E over all ranks (a multiple of the ranks)")
	flag.IntVar(&o.TopK, "topk", o.TopK, "experts K per token")
	flag.StringVar(&o.DType, "dtype", o.DType, "dtype of the rows: f32, bf16 or f16")
	flag.StringVar(&o.Route, "route", o.Route, "routing: uniform or zipf (Zipf(1.1) over a random order of the experts)")
	flag.StringVar(&o.Capacity, "capacity", o.Capacity, "expert buffer size: dropless (the worst case), exact (this step's demand), or a factor of the balanced load such as 1.25 (rows past it are dropped)")
	flag.StringVar(&o.Device, "device", o.Device, "device of the in-process ranks: cpu, cuda or cuda:N (all ranks on it)")
	flag.BoolVar(&o.NCCL, "nccl", false, "one rank per GPU over NCCL, all driven by this process")
	flag.BoolVar(&o.TransportOnly, "transport-only", false, "move all payload through NCCL, never directly into another GPU's memory")
	flag.IntVar(&o.Iters, "iters", 0, "timed dispatch+combine steps (default 10 on the CPU, 50 on GPUs)")
	flag.Uint64Var(&o.Seed, "seed", o.Seed, "seed of the routing and the rows")
	flag.Usage = func() {
		w := flag.CommandLine.Output()
		fmt.Fprint(w, `usage: ep [flags]

Runs expert-parallel dispatch and combine among ranks made in one of three ways:
  in process (default)  -ranks goroutine ranks on -device (the CPU by default)
  -nccl                 one rank per GPU over NCCL, driven by this process
  WORLD_SIZE set        this process is rank RANK of WORLD_SIZE processes, on GPU
                        LOCAL_RANK (default RANK), meeting at MASTER_ADDR:MASTER_PORT
                        (as torchrun sets them; see ep.InitFromEnv)
Prints the rows and bytes each rank sent and received (deduplicated, and what an
all-to-all of every routing entry would move), checks the round trip and times a
dispatch+combine.

`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "ep:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	dtype, err := device.ParseDType(o.DType)
	if err != nil || (dtype != device.F32 && dtype != device.BF16 && dtype != device.F16) {
		return fmt.Errorf("-dtype %q: want f32, bf16 or f16", o.DType)
	}
	capacity, err := parseCapacity(o.Capacity)
	if err != nil {
		return err
	}
	if o.Route != "uniform" && o.Route != "zipf" {
		return fmt.Errorf("-route %q: want uniform or zipf", o.Route)
	}
	var trs []ep.Transport
	var world *ep.World
	mode := ""
	switch ws := os.Getenv("WORLD_SIZE"); {
	case ws != "":
		tr, err := ep.InitFromEnv()
		if err != nil {
			return err
		}
		defer tr.Close()
		trs = []ep.Transport{tr}
		mode = fmt.Sprintf("this process is rank %d of %d (NCCL; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)", tr.Rank(), tr.Size())
		if tr.Size() == 1 {
			mode = fmt.Sprintf("a single rank on %v (WORLD_SIZE=1)", tr.Device())
		}
	case o.NCCL:
		n, err := device.CUDACount()
		if err != nil {
			return fmt.Errorf("-nccl: %w", err)
		}
		if o.Ranks == 0 {
			o.Ranks = n
		}
		if o.Ranks > n {
			return fmt.Errorf("-ranks %d with -nccl: only %d GPUs", o.Ranks, n)
		}
		devs := make([]*device.Device, o.Ranks)
		for i := range devs {
			if devs[i], err = device.Open(fmt.Sprintf("cuda:%d", i)); err != nil {
				return err
			}
		}
		if trs, err = ep.NewNCCLWorld(devs, 0); err != nil {
			return err
		}
		defer func() {
			for _, tr := range trs {
				tr.Close()
			}
		}()
		mode = fmt.Sprintf("%d ranks over NCCL, one per GPU, in one process", o.Ranks)
	default:
		if o.Ranks == 0 {
			o.Ranks = 4
		}
		d, err := device.Open(o.Device)
		if err != nil {
			return err
		}
		if world, err = ep.NewWorld(o.Ranks, d); err != nil {
			return err
		}
		for r := range o.Ranks {
			trs = append(trs, world.Transport(r))
		}
		mode = fmt.Sprintf("%d in-process ranks (goroutines) on %v", o.Ranks, d)
	}
	R := trs[0].Size()
	gpu := trs[0].Device().IsCUDA()
	if o.Tokens == 0 {
		o.Tokens = map[bool]int{false: 1024, true: 16384}[gpu]
	}
	if o.Hidden == 0 {
		o.Hidden = map[bool]int{false: 512, true: 7168}[gpu]
	}
	if o.Iters == 0 {
		o.Iters = map[bool]int{false: 10, true: 50}[gpu]
	}
	if o.Tokens < 0 || o.Hidden < 1 || o.Iters < 1 {
		return fmt.Errorf("-tokens %d, -hidden %d, -iters %d: want ≥ 0, ≥ 1, ≥ 1", o.Tokens, o.Hidden, o.Iters)
	}
	if o.Experts < R || o.Experts%R != 0 {
		return fmt.Errorf("-experts %d: want a multiple of the %d ranks", o.Experts, R)
	}
	if o.TopK < 1 || o.TopK > min(o.Experts, ep.MaxTopK) {
		return fmt.Errorf("-topk %d: want 1 to %d", o.TopK, min(o.Experts, ep.MaxTopK))
	}
	fmt.Printf("ep: %s\n", mode)
	fmt.Printf("ep: T=%d tokens per rank, H=%d %v, E=%d experts (%d per rank), K=%d, %s routing, capacity %v\n",
		o.Tokens, o.Hidden, dtype, o.Experts, o.Experts/R, o.TopK, o.Route, capacity)

	cfg := ep.Config{Experts: o.Experts, TopK: o.TopK, Capacity: capacity, TransportOnly: o.TransportOnly}
	if o.Capacity != "dropless" && o.Capacity != "exact" {
		cfg.Overflow = ep.DropOverflow
	}
	res := make([]*rankResult, len(trs))
	body := func(i int, tr ep.Transport) error {
		r, err := runRank(tr, cfg, o, dtype)
		res[i] = r
		return err
	}
	if world != nil {
		err = world.Run(func(tr ep.Transport) error { return body(tr.Rank(), tr) })
	} else {
		errs := make([]error, len(trs))
		var wg sync.WaitGroup
		for i, tr := range trs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if errs[i] = body(i, tr); errs[i] != nil {
					errs[i] = fmt.Errorf("rank %d: %w", tr.Rank(), errs[i])
				}
			}()
		}
		wg.Wait()
		err = errors.Join(errs...)
	}
	if err != nil {
		return err
	}
	printResults(res, R, dtype)
	for _, r := range res {
		if r.bad > 0 {
			return fmt.Errorf("rank %d: %d of %d values did not survive the round trip (worst error %g)", r.rank, r.bad, r.checked, r.worst)
		}
	}
	return nil
}

func parseCapacity(s string) (ep.Capacity, error) {
	switch s {
	case "dropless":
		return ep.Dropless, nil
	case "exact":
		return ep.Exact, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || !(f > 0) || math.IsInf(f, 0) {
		return ep.Capacity{}, fmt.Errorf("-capacity %q: want dropless, exact or a factor > 0", s)
	}
	return ep.Factor(f), nil
}

// rankResult is what one rank did.
type rankResult struct {
	rank, tokens            int
	tokensTo, tokensFrom    []int // rows sent to and received from each rank (deduplicated)
	entriesTo               []int // routing entries for each rank's experts (an all-to-all would send these)
	rows, capacity, dropped int
	counts                  []int
	rowBytes                int
	layout, step            time.Duration
	checked, bad            int
	worst                   float64
	direct                  bool // payload written into the peers' memory
}

// routing returns T rows of K distinct experts of E.
func routing(r *rand.Rand, T, E, K int, route string) []int32 {
	cum := make([]float64, E)
	acc := 0.0
	for i, p := range r.Perm(E) {
		acc += 1 / math.Pow(float64(p+1), 1.1)
		cum[i] = acc
	}
	idx := make([]int32, 0, T*K)
	used := make([]bool, E)
	for range T {
		row := idx[len(idx):]
		for range K {
			var e int
			for {
				if route == "zipf" {
					u := r.Float64() * acc
					e = E - 1
					for i, c := range cum {
						if u < c {
							e = i
							break
						}
					}
				} else {
					e = r.IntN(E)
				}
				if !used[e] {
					break
				}
			}
			used[e] = true
			row = append(row, int32(e))
		}
		for _, e := range row {
			used[e] = false
		}
		idx = idx[:len(idx)+K]
	}
	return idx
}

// barrier returns when every rank has reached it: a one-element all-gather.
func barrier(tr ep.Transport, s *device.Stream) error {
	send, err := s.Alloc(device.I32, 1)
	if err != nil {
		return err
	}
	defer send.Free()
	recv, err := s.Alloc(device.I32, tr.Size())
	if err != nil {
		return err
	}
	defer recv.Free()
	if err := device.Fill(s, send, 1); err != nil {
		return err
	}
	if err := tr.AllGather(s, send, recv); err != nil {
		return err
	}
	return tr.Sync(s)
}

func runRank(tr ep.Transport, cfg ep.Config, o options, dtype device.DType) (*rankResult, error) {
	d := tr.Device()
	s, err := d.NewStream()
	if err != nil {
		return nil, err
	}
	defer s.Close()
	g, err := ep.NewGroup(tr, cfg)
	if err != nil {
		return nil, err
	}
	defer g.Close()
	rank, R := tr.Rank(), tr.Size()
	T, H, E, K := o.Tokens, o.Hidden, o.Experts, o.TopK
	rng := rand.New(rand.NewPCG(o.Seed, uint64(rank)))
	idxv := routing(rng, T, E, K, o.Route)
	xv := make([]float32, T*H)
	for i := range xv {
		xv[i] = float32(rng.NormFloat64())
	}
	wv := make([]float32, T*K)
	for i := range wv {
		wv[i] = 1 / float32(K)
	}
	var ts []*device.Tensor
	defer func() {
		for _, t := range ts {
			t.Free()
		}
	}()
	keep := func(t *device.Tensor, err error) *device.Tensor {
		if t != nil {
			ts = append(ts, t)
		}
		return t
	}
	idx := keep(device.FromSlice(s, device.I32, idxv, T, K))
	w := keep(device.FromFloat32(s, device.F32, wv, T, K))
	x := keep(device.FromFloat32(s, dtype, xv, T, H))
	if idx == nil || w == nil || x == nil {
		return nil, errors.New("cannot allocate the inputs")
	}
	xr, err := x.Float32s(s) // x as stored, rounded to the dtype
	if err != nil {
		return nil, err
	}

	t0 := time.Now()
	l, err := g.Layout(s, idx)
	if err != nil {
		return nil, err
	}
	defer l.Free()
	res := &rankResult{rank: rank, tokens: T, tokensTo: l.TokensTo(), tokensFrom: l.TokensFrom(),
		rows: l.Rows(), capacity: l.Capacity(), dropped: l.Dropped(), counts: l.Counts(), rowBytes: H * dtype.Size(),
		layout: time.Since(t0)}
	res.entriesTo = make([]int, R)
	for e, n := range l.ExpertEntries() {
		res.entriesTo[e/(E/R)] += n
	}

	step := func() (*device.Tensor, error) {
		D, err := l.Dispatch(s, x, w)
		if err != nil {
			return nil, err
		}
		out, err := l.Combine(s, D.X, D.Weights)
		if ferr := D.Free(); err == nil {
			err = ferr
		}
		return out, err
	}
	// The round trip: identity experts and weights 1/K give each token back.
	out, err := step()
	if err != nil {
		return nil, err
	}
	got, err := out.Float32s(s)
	out.Free()
	if err != nil {
		return nil, err
	}
	res.direct = g.Direct()
	if cfg.Overflow != ep.DropOverflow {
		// Each rank's partial sum is rounded to the dtype, and so is the total.
		ulp := map[device.DType]float64{device.F32: 0x1p-23, device.BF16: 0x1p-8, device.F16: 0x1p-11}[dtype]
		for i, v := range got {
			e := math.Abs(float64(v) - float64(xr[i]))
			res.checked++
			res.worst = max(res.worst, e)
			if !(e <= 2*ulp*float64(R)*math.Abs(float64(xr[i]))+1e-30) {
				res.bad++
			}
		}
	}

	// Timing: two warm-up steps, then Iters steps between two events.
	for range 2 {
		out, err := step()
		if err != nil {
			return nil, err
		}
		out.Free()
	}
	if err := barrier(tr, s); err != nil {
		return nil, err
	}
	start, err := d.NewEvent()
	if err != nil {
		return nil, err
	}
	defer start.Close()
	stop, err := d.NewEvent()
	if err != nil {
		return nil, err
	}
	defer stop.Close()
	if err := start.Record(s); err != nil {
		return nil, err
	}
	for range o.Iters {
		out, err := step()
		if err != nil {
			return nil, err
		}
		if err := out.Free(); err != nil {
			return nil, err
		}
	}
	if err := stop.Record(s); err != nil {
		return nil, err
	}
	if err := tr.Sync(s); err != nil {
		return nil, err
	}
	if err := stop.Synchronize(); err != nil {
		return nil, err
	}
	el, err := stop.Since(start)
	if err != nil {
		return nil, err
	}
	res.step = el / time.Duration(o.Iters)
	return res, nil
}

func mb(b int64) string { return fmt.Sprintf("%.2f MB", float64(b)/1e6) }

func printResults(res []*rankResult, R int, dtype device.DType) {
	tw := tabwriter.NewWriter(os.Stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "rank\ttokens\trows sent to ranks\trows received\texpert rows\tcapacity\tdropped\tbytes sent\twithout dedup\tratio\tlayout\tdispatch+combine\t")
	for _, r := range res {
		var sent, plain, recv int64
		for p := range R {
			if p != r.rank {
				sent += int64(r.tokensTo[p])
				plain += int64(r.entriesTo[p])
				recv += int64(r.tokensFrom[p])
			}
		}
		// Dispatch sends each row once per rank (with its K weights); combine sends one
		// partial sum back per received row.
		rb := int64(r.rowBytes)
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%d\t%d\t%d\t%s\t%s\t%.2f\t%.2f ms\t%.3f ms\t\n",
			r.rank, r.tokens, ints(r.tokensTo), ints(r.tokensFrom), r.rows, r.capacity, r.dropped,
			mb(sent*rb+recv*rb), mb(2*plain*rb), float64(sent+recv)/float64(max(2*plain, 1)),
			r.layout.Seconds()*1e3, r.step.Seconds()*1e3)
	}
	tw.Flush()
	fmt.Println("bytes sent: the rows this rank sent to other ranks in one dispatch (each token once per rank)")
	fmt.Println("and one combine (a partial sum per received token); without dedup: an all-to-all of every")
	fmt.Println("routing entry each way. Rows kept on the rank itself are not sent.")
	if len(res) > 0 && res[0].direct {
		fmt.Println("transfers: written straight into the other GPUs' memory (ep.Config.TransportOnly turns it off)")
	}
	for _, r := range res {
		switch {
		case r.checked == 0:
			fmt.Printf("rank %d: round trip not checked: rows past the capacity factor are dropped (%d here)\n", r.rank, r.dropped)
		case r.bad == 0:
			fmt.Printf("rank %d: round trip ok: combine(dispatch(x)) = x for all %d values of %v (largest difference %.3g)\n", r.rank, r.checked, dtype, r.worst)
		}
	}
}

func ints(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return "[" + strings.Join(s, " ") + "]"
}
