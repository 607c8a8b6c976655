// Command bench prints a table of the throughput of dropless's primitives on the device
// present (a GPU if one works, else the CPU): the cases of the packages' benchmarks.
//
//	go run ./examples/bench                  # every primitive
//	go run ./examples/bench -only gemm,moe   # some
//
// On a GPU the sizes are those of the baselines measured on the H200 (shown beside the
// results); on the CPU they are small. Times are measured with device events around
// repeated calls on one stream, after warm-up calls that compile the kernels and warm
// the memory pool.
package main

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/quant"
)

// primitives are the benchmarks, in the order of the table.
var primitives = []string{"copy", "gemm", "quant", "ep", "moe"}

type options struct {
	Device, Only, Gemm, Shape, EPTransport string
	MinTime                                time.Duration
	CopyBytes, QuantM, QuantK              int
	MoeT, MoeH, MoeF, MoeE, MoeK           int
	EPRanks, EPT, EPH, EPE, EPK            int
}

func main() {
	var o options
	flag.StringVar(&o.Device, "device", "", "device: cpu, cuda or cuda:N (default: $DROPLESS_DEVICE, else GPU 0 if one works, else the CPU)")
	flag.StringVar(&o.Only, "only", strings.Join(primitives, ","), "comma-separated primitives to run: "+strings.Join(primitives, ", "))
	flag.DurationVar(&o.MinTime, "time", 0, "least time spent timing each case (default 300ms on a GPU, 100ms on the CPU)")
	flag.IntVar(&o.CopyBytes, "copy-bytes", 0, "bytes of the device copy (default 2 GiB on a GPU, 64 MiB on the CPU)")
	flag.StringVar(&o.Gemm, "gemm", "", "comma-separated gemm cases (default: the seven baseline cases on a GPU, "+cpuGemm.name+" on the CPU); known: "+caseNames())
	flag.StringVar(&o.Shape, "gemm-shape", "", "an extra gemm case `G,M,K,N` with uniform group sizes")
	flag.IntVar(&o.QuantM, "quant-m", 0, "rows of the MXFP8 quantization (default 65536 on a GPU, 2048 on the CPU)")
	flag.IntVar(&o.QuantK, "quant-k", 0, "columns of the MXFP8 quantization (default 7168 on a GPU, 1024 on the CPU)")
	flag.StringVar(&o.EPTransport, "ep-transport", "auto", "transport of ep: world (in-process ranks on the device), nccl (one GPU per rank), auto (nccl with 2 or more GPUs, else world)")
	flag.IntVar(&o.EPRanks, "ep-ranks", 2, "ranks of ep")
	flag.IntVar(&o.EPT, "ep-tokens", 0, "tokens per rank of ep (default 16384 on GPUs, 512 on the CPU)")
	flag.IntVar(&o.EPH, "ep-hidden", 0, "row width of ep, bf16 (default 7168 on GPUs, 256 on the CPU)")
	flag.IntVar(&o.EPE, "ep-experts", 0, "experts of ep over all ranks (default 64 on GPUs, 16 on the CPU)")
	flag.IntVar(&o.EPK, "ep-topk", 0, "experts per token of ep (default 8 on GPUs, 4 on the CPU)")
	flag.IntVar(&o.MoeT, "moe-tokens", 0, "tokens T of the MoE layer (default 16384 on a GPU, 256 on the CPU)")
	flag.IntVar(&o.MoeH, "moe-hidden", 0, "width H of the MoE layer (default 7168 on a GPU, 64 on the CPU)")
	flag.IntVar(&o.MoeF, "moe-ffn", 0, "expert width F of the MoE layer (default 2048 on a GPU, 32 on the CPU)")
	flag.IntVar(&o.MoeE, "moe-experts", 0, "experts E of the MoE layer (default 32 on a GPU, 8 on the CPU)")
	flag.IntVar(&o.MoeK, "moe-topk", 0, "experts per token K of the MoE layer (default 8 on a GPU, 2 on the CPU)")
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), `usage: bench [flags]

Prints the throughput of the primitives on the device present: the device copy,
ragged_dot forward and weight gradient (gemm), MXFP8 quantization (quant), expert-
parallel dispatch+combine (ep) and the MoE layer's forward and backward (moe), at the
sizes of the packages' benchmarks: the H200 baseline cases on a GPU, small ones on the
CPU. Zero-valued size flags take those defaults.

`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// row is a line of the table.
type row struct {
	prim, name string
	t          time.Duration
	rate       float64
	unit       string
	baseline   string
}

func def(v *int, gpu bool, onGPU, onCPU int) {
	if *v == 0 {
		*v = onCPU
		if gpu {
			*v = onGPU
		}
	}
}

func run(o options) error {
	want := map[string]bool{}
	for _, p := range strings.Split(o.Only, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		known := false
		for _, q := range primitives {
			known = known || p == q
		}
		if !known {
			return fmt.Errorf("-only: unknown primitive %q; known: %s", p, strings.Join(primitives, ", "))
		}
		want[p] = true
	}
	d, err := device.Open(o.Device)
	if err != nil {
		return err
	}
	gpu := d.IsCUDA()
	if o.MinTime == 0 {
		o.MinTime = 100 * time.Millisecond
		if gpu {
			o.MinTime = 300 * time.Millisecond
		}
	}
	def(&o.CopyBytes, gpu, 2<<30, 64<<20)
	def(&o.QuantM, gpu, 65536, 2048)
	def(&o.QuantK, gpu, 7168, 1024)
	def(&o.EPT, gpu, 16384, 512)
	def(&o.EPH, gpu, 7168, 256)
	def(&o.EPE, gpu, 64, 16)
	def(&o.EPK, gpu, 8, 4)
	def(&o.MoeT, gpu, 16384, 256)
	def(&o.MoeH, gpu, 7168, 64)
	def(&o.MoeF, gpu, 2048, 32)
	def(&o.MoeE, gpu, 32, 8)
	def(&o.MoeK, gpu, 8, 2)
	cases, err := gemmCases(o, gpu)
	if err != nil {
		return err
	}
	fmt.Printf("device: %v (%s)  %s\n", d, d.Name(), time.Now().Format("2006-01-02 15:04"))
	line := func(prim, name, t, rate, base string) {
		l := fmt.Sprintf("%-20s  %-62s  %10s  %-30s", prim, name, t, rate)
		if gpu {
			l += "  " + base
		}
		fmt.Println(strings.TrimRight(l, " "))
	}
	line("primitive", "case", "time", "throughput", "H200 peer baseline")
	emit := func(rows []row, err error) error {
		for _, r := range rows {
			line(r.prim, r.name, fmtDur(r.t), fmtRate(r.rate, r.unit), r.baseline)
		}
		return err
	}
	s := d.Stream()
	b := &bench{s: s, min: o.MinTime}
	var errs []error
	for _, p := range primitives {
		if !want[p] {
			continue
		}
		var err error
		switch p {
		case "copy":
			err = emit(b.copy(o.CopyBytes))
		case "gemm":
			for _, c := range cases {
				if err = emit(b.gemm(c)); err != nil {
					break
				}
			}
		case "quant":
			err = emit(b.quant(o.QuantM, o.QuantK))
		case "ep":
			err = emit(b.ep(o))
		case "moe":
			err = emit(b.moe(o))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p, err))
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", p, err)
		}
	}
	return errors.Join(errs...)
}

func fmtDur(t time.Duration) string {
	switch {
	case t >= time.Second:
		return fmt.Sprintf("%.3f s", t.Seconds())
	case t >= time.Millisecond:
		return fmt.Sprintf("%.3f ms", t.Seconds()*1e3)
	}
	return fmt.Sprintf("%.1f µs", t.Seconds()*1e6)
}

// fmtRate formats v in unit, a rate in tera- or giga- units ("TFLOP/s", "GB/s ..."),
// switching from tera to giga below 1.
func fmtRate(v float64, unit string) string {
	if v < 1 && strings.HasPrefix(unit, "T") {
		v, unit = v*1e3, "G"+unit[1:]
	}
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f %s", v, unit)
	case v >= 1:
		return fmt.Sprintf("%.1f %s", v, unit)
	}
	return fmt.Sprintf("%.3f %s", v, unit)
}

// bench times calls on one stream.
type bench struct {
	s   *device.Stream
	min time.Duration
}

// time returns the mean time of fn on b.s: two warm-up calls, one timed call to size
// the run, then enough calls to last b.min, between two events.
func (b *bench) time(fn func() error) (time.Duration, error) {
	s := b.s
	for range 2 {
		if err := fn(); err != nil {
			return 0, err
		}
	}
	if err := s.Synchronize(); err != nil {
		return 0, err
	}
	d := s.Device()
	start, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer start.Close()
	stop, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer stop.Close()
	n := 1
	for {
		if err := start.Record(s); err != nil {
			return 0, err
		}
		for range n {
			if err := fn(); err != nil {
				return 0, err
			}
		}
		if err := stop.Record(s); err != nil {
			return 0, err
		}
		if err := stop.Synchronize(); err != nil {
			return 0, err
		}
		el, err := stop.Since(start)
		if err != nil {
			return 0, err
		}
		if el >= b.min || n >= 10000 {
			return el / time.Duration(n), nil
		}
		// Aim at 1.2·min from this estimate.
		n = int(min(max(float64(n)*1.2*float64(b.min)/float64(max(el, time.Microsecond)), float64(n+1)), 10000))
	}
}

// tensors allocates on s and frees everything at once.
type tensors struct {
	s   *device.Stream
	all []*device.Tensor
	err error
}

func (ts *tensors) alloc(dt device.DType, shape ...int) *device.Tensor {
	if ts.err != nil {
		return nil
	}
	t, err := ts.s.Alloc(dt, shape...)
	if err != nil {
		ts.err = err
		return nil
	}
	ts.all = append(ts.all, t)
	return t
}

// random allocates a tensor of N(0, scale²) values: a random block uploaded once and
// tiled over it.
func (ts *tensors) random(seed uint64, scale float32, dt device.DType, shape ...int) *device.Tensor {
	t := ts.alloc(dt, shape...)
	if t == nil {
		return nil
	}
	n := t.Len()
	blk := min(n, 1<<22)
	r := rand.New(rand.NewPCG(seed, 1))
	v := make([]float32, blk)
	for i := range v {
		v[i] = float32(r.NormFloat64()) * scale
	}
	src, err := device.FromFloat32(ts.s, dt, v, blk)
	if err != nil {
		ts.err = err
		return nil
	}
	defer src.Free()
	flat, err := t.Reshape(n)
	for off := 0; off < n && err == nil; off += blk {
		m := min(blk, n-off)
		var dst, sv *device.Tensor
		if dst, err = flat.View(off, m); err == nil {
			if sv, err = src.View(0, m); err == nil {
				err = device.Copy(ts.s, dst, sv)
			}
		}
	}
	if err != nil {
		ts.err = err
	}
	return t
}

func (ts *tensors) free() {
	for _, t := range ts.all {
		t.Free()
	}
}

func (b *bench) copy(n int) ([]row, error) {
	ts := &tensors{s: b.s}
	defer ts.free()
	x, y := ts.alloc(device.E4M3, n), ts.alloc(device.E4M3, n)
	if ts.err != nil {
		return nil, ts.err
	}
	if err := device.Fill(b.s, x, 1); err != nil {
		return nil, err
	}
	t, err := b.time(func() error { return device.Copy(b.s, y, x) })
	if err != nil {
		return nil, err
	}
	return []row{{"copy", fmt.Sprintf("%s device to device", bytesName(n)), t, 2 * float64(n) / t.Seconds() / 1e9, "GB/s (read+write)", "4,170 GB/s"}}, nil
}

func bytesName(n int) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d B", n)
}

func (b *bench) gemm(c gemmCase) ([]row, error) {
	s := b.s
	ts := &tensors{s: s}
	defer ts.free()
	G, M, K, N := c.G, c.M, c.K, c.N
	sizes, err := device.FromSlice(s, device.I32, baseline.GroupSizes(G, M, c.dist), G)
	if err != nil {
		return nil, err
	}
	ts.all = append(ts.all, sizes)
	x := ts.random(1, 1, device.BF16, M, K)
	w := ts.random(2, 0.02, device.BF16, G, K, N)
	y := ts.alloc(device.BF16, M, N)
	dy := ts.random(3, 1, device.BF16, M, N)
	dw := ts.alloc(device.BF16, G, K, N)
	if ts.err != nil {
		return nil, ts.err
	}
	flops := 2 * float64(M) * float64(K) * float64(N)
	name := fmt.Sprintf("%s G=%d M=%d K=%d N=%d", c.name, G, M, K, N)
	var rows []row
	for _, f := range []struct {
		prim, base string
		fn         func() error
	}{
		{"gemm forward", c.fwd, func() error { return gemm.RaggedDot(s, y, x, w, sizes, nil) }},
		{"gemm weight grad", c.wgrad, func() error { return gemm.RaggedDotWeightGrad(s, dw, x, dy, sizes, nil) }},
	} {
		t, err := b.time(f.fn)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row{f.prim, name, t, flops / t.Seconds() / 1e12, "TFLOP/s", f.base})
	}
	return rows, gemm.CheckStatus(s)
}

// quant times MXFP8 quantization of an m×k bf16 source: rowwise, both directions, and
// both directions over 128 skewed expert groups, as the quant package's benchmarks,
// counting the bytes of the source and of every output tensor (scale padding included).
func (b *bench) quant(m, k int) ([]row, error) {
	s := b.s
	ts := &tensors{s: s}
	defer ts.free()
	x := ts.random(4, 1, device.BF16, m, k)
	if ts.err != nil {
		return nil, ts.err
	}
	sizes, err := device.FromSlice(s, device.I32, baseline.ZipfSizes(128, m, 1), 128)
	if err != nil {
		return nil, err
	}
	ts.all = append(ts.all, sizes)
	var rows []row
	for _, c := range []struct {
		name, base string
		opt        quant.Options
	}{
		{"quant rowwise", "2,741–2,826 GB/s (torch.compile)", quant.Options{Dir: quant.Rowwise}},
		{"quant both", "", quant.Options{Dir: quant.Both}},
		{"quant grouped both", "", quant.Options{Dir: quant.Both, GroupSizes: sizes}},
	} {
		q, err := quant.Alloc(s, m, k, c.opt)
		if err != nil {
			return rows, err
		}
		moved := x.Bytes()
		for _, t := range []*device.Tensor{q.Row, q.RowScale, q.Col, q.ColScale} {
			if t != nil {
				moved += t.Bytes()
			}
		}
		t, err := b.time(func() error { return quant.QuantizeInto(s, q, x, c.opt) })
		if err == nil {
			err = q.Err(s)
		}
		q.Free()
		if err != nil {
			return rows, err
		}
		name := fmt.Sprintf("%d×%d bf16 → mxfp8 e4m3", m, k)
		if c.opt.GroupSizes != nil {
			name += ", 128 skewed groups"
		}
		rows = append(rows, row{c.name, name, t, float64(moved) / t.Seconds() / 1e9, "GB/s (read+write)", c.base})
	}
	return rows, nil
}

func (b *bench) moe(o options) ([]row, error) {
	s := b.s
	ts := &tensors{s: s}
	defer ts.free()
	T, H, F, E, K := o.MoeT, o.MoeH, o.MoeF, o.MoeE, o.MoeK
	lay, err := moe.NewLayer(moe.Config{Hidden: H, FFN: F, Router: moe.RouterConfig{Experts: E, TopK: K, Renormalize: true}})
	if err != nil {
		return nil, err
	}
	typ := device.BF16
	x := ts.random(1, 1, typ, T, H)
	dy := ts.random(2, 1, typ, T, H)
	p := &moe.Params{Router: ts.random(3, 0.02, typ, E, H), W1: ts.random(4, 0.02, typ, E, H, 2*F), W2: ts.random(5, 0.02, typ, E, F, H)}
	g := &moe.Grads{X: ts.alloc(typ, T, H), Router: ts.alloc(device.F32, E, H), W1: ts.alloc(typ, E, H, 2*F), W2: ts.alloc(typ, E, F, H)}
	y := ts.alloc(typ, T, H)
	if ts.err != nil {
		return nil, ts.err
	}
	flops := 6 * float64(T) * float64(K) * float64(H) * float64(F) // expert GEMMs, forward
	name := fmt.Sprintf("T=%d H=%d F=%d E=%d K=%d bf16", T, H, F, E, K)
	var rows []row
	for _, pass := range []struct {
		name, base string
		bwd        bool
	}{{"moe layer forward", "29.9 ms (eager PyTorch)", false}, {"moe layer fwd+bwd", "76.5 ms (eager PyTorch)", true}} {
		t, err := b.time(func() error {
			act, err := lay.Forward(s, y, x, p)
			if err != nil {
				return err
			}
			if pass.bwd {
				err = lay.Backward(s, g, dy, act)
			}
			return errors.Join(err, act.Free())
		})
		if err != nil {
			return rows, err
		}
		f := flops
		if pass.bwd {
			f *= 3
		}
		rows = append(rows, row{pass.name, name, t, f / t.Seconds() / 1e12, "TFLOP/s (expert GEMMs)", pass.base})
	}
	return rows, gemm.CheckStatus(s)
}

// ep times Dispatch followed by Combine (identity experts) with uniform routing under
// the Dropless capacity, and reports the rate of the bytes rank 0 sends.
func (b *bench) ep(o options) ([]row, error) {
	d := b.s.Device()
	R := o.EPRanks
	kind := o.EPTransport
	if kind == "auto" {
		kind = "world"
		if n, err := device.CUDACount(); err == nil && n >= 2 && d.IsCUDA() {
			kind = "nccl"
		}
	}
	var trs []ep.Transport
	switch kind {
	case "world":
		w, err := ep.NewWorld(R, d)
		if err != nil {
			return nil, err
		}
		for r := range R {
			trs = append(trs, w.Transport(r))
		}
	case "nccl":
		devs := make([]*device.Device, R)
		for i := range devs {
			var err error
			if devs[i], err = device.Open(fmt.Sprintf("cuda:%d", i)); err != nil {
				return nil, fmt.Errorf("-ep-transport nccl with %d ranks: %w", R, err)
			}
		}
		var err error
		if trs, err = ep.NewNCCLWorld(devs, 0); err != nil {
			return nil, err
		}
		defer func() {
			for _, tr := range trs {
				tr.Close()
			}
		}()
	default:
		return nil, fmt.Errorf("-ep-transport %q: want auto, world or nccl", o.EPTransport)
	}
	type result struct {
		t          time.Duration
		sent, base int64
	}
	res := make([]result, R)
	errs := make([]error, R)
	var wg sync.WaitGroup
	for i, tr := range trs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].t, res[i].sent, res[i].base, errs[i] = epRank(tr, o)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("rank %d: %w", i, errs[i])
				tr.Close() // the others fail instead of waiting
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	r0 := res[0]
	name := fmt.Sprintf("%s R=%d T=%d H=%d bf16 E=%d K=%d, sent %.2f× T·K rows", kind, R, o.EPT, o.EPH, o.EPE, o.EPK, float64(r0.sent)/float64(r0.base))
	base := ""
	if kind == "nccl" && R == 2 {
		base = "2.82 ms all_to_all_single (one way, every entry)"
	}
	return []row{{"ep dispatch+combine", name, r0.t, float64(r0.sent) / r0.t.Seconds() / 1e9, "GB/s (rank 0 sent)", base}}, nil
}

// epRank runs one rank of the ep benchmark: its time per dispatch+combine, the bytes it
// sends in one (rows and weights to other ranks, partial sums back), and T·K·row bytes.
func epRank(tr ep.Transport, o options) (time.Duration, int64, int64, error) {
	d := tr.Device()
	s, err := d.NewStream()
	if err != nil {
		return 0, 0, 0, err
	}
	defer s.Close()
	T, H, E, K := o.EPT, o.EPH, o.EPE, o.EPK
	g, err := ep.NewGroup(tr, ep.Config{Experts: E, TopK: K})
	if err != nil {
		return 0, 0, 0, err
	}
	defer g.Close()
	r := rand.New(rand.NewPCG(42, uint64(tr.Rank())))
	idxv := make([]int32, 0, T*K)
	for range T {
		for _, e := range r.Perm(E)[:K] {
			idxv = append(idxv, int32(e))
		}
	}
	ts := &tensors{s: s}
	defer ts.free()
	idx, err := device.FromSlice(s, device.I32, idxv, T, K)
	if err != nil {
		return 0, 0, 0, err
	}
	ts.all = append(ts.all, idx)
	w := ts.alloc(device.F32, T, K)
	x := ts.random(7, 1, device.BF16, T, H)
	if ts.err != nil {
		return 0, 0, 0, ts.err
	}
	if err := device.Fill(s, w, 1/float64(K)); err != nil {
		return 0, 0, 0, err
	}
	l, err := g.Layout(s, idx)
	if err != nil {
		return 0, 0, 0, err
	}
	defer l.Free()
	rowB := int64(H * device.BF16.Size())
	var sent int64
	for p, c := range l.TokensTo() {
		if p != tr.Rank() {
			sent += int64(c) * (rowB + int64(4*K))
		}
	}
	for p, c := range l.TokensFrom() {
		if p != tr.Rank() {
			sent += int64(c) * rowB
		}
	}
	step := func() error {
		D, err := l.Dispatch(s, x, w)
		if err != nil {
			return err
		}
		out, err := l.Combine(s, D.X, D.Weights)
		err = errors.Join(err, D.Free())
		if out != nil {
			err = errors.Join(err, out.Free())
		}
		return err
	}
	for range 2 {
		if err := step(); err != nil {
			return 0, 0, 0, err
		}
	}
	if err := tr.Sync(s); err != nil {
		return 0, 0, 0, err
	}
	// Every rank runs the same number of steps: collective calls must match.
	const n = 20
	start, err := d.NewEvent()
	if err != nil {
		return 0, 0, 0, err
	}
	defer start.Close()
	stop, err := d.NewEvent()
	if err != nil {
		return 0, 0, 0, err
	}
	defer stop.Close()
	if err := start.Record(s); err != nil {
		return 0, 0, 0, err
	}
	for range n {
		if err := step(); err != nil {
			return 0, 0, 0, err
		}
	}
	if err := stop.Record(s); err != nil {
		return 0, 0, 0, err
	}
	if err := tr.Sync(s); err != nil {
		return 0, 0, 0, err
	}
	if err := stop.Synchronize(); err != nil {
		return 0, 0, 0, err
	}
	el, err := stop.Since(start)
	return el / n, sent, int64(T*K) * rowB, err
}

// gemmCase is a ragged_dot case: G groups over M rows, K×N weights.
type gemmCase struct {
	name       string
	G, M, K, N int
	dist       string // uniform or skewed
	fwd, wgrad string // H200 peer baselines: torch._grouped_mm and its dW form
}

// gemmTable holds the baseline cases of the GPU README and the CPU case of the gemm
// package's benchmarks.
var gemmTable = []gemmCase{
	{"dsv3_wi_ep8_uniform", 32, 65536, 7168, 4096, "uniform", "690 TFLOP/s", "642 TFLOP/s"},
	{"dsv3_wi_ep8_skewed", 32, 65536, 7168, 4096, "skewed", "640 TFLOP/s", "619 TFLOP/s"},
	{"dsv3_wo_ep8_uniform", 32, 65536, 2048, 7168, "uniform", "658 TFLOP/s", "674 TFLOP/s"},
	{"mixtral_wi_uniform", 8, 32768, 4096, 28672, "uniform", "657 TFLOP/s", "678 TFLOP/s"},
	{"qwen3_30b_wi_uniform", 128, 32768, 2048, 1536, "uniform", "585 TFLOP/s", "377 TFLOP/s"},
	{"qwen3_30b_wi_skewed", 128, 32768, 2048, 1536, "skewed", "457 TFLOP/s", "340 TFLOP/s"},
	{"qwen3_30b_small_uniform", 128, 2048, 2048, 1536, "uniform", "47 TFLOP/s", "33 TFLOP/s"},
	cpuGemm,
}

var cpuGemm = gemmCase{name: "tiny_uniform", G: 8, M: 512, K: 256, N: 256, dist: "uniform"}

func caseNames() string {
	var n []string
	for _, c := range gemmTable {
		n = append(n, c.name)
	}
	return strings.Join(n, ", ")
}

func gemmCases(o options, gpu bool) ([]gemmCase, error) {
	var out []gemmCase
	switch {
	case o.Gemm != "":
		for _, name := range strings.Split(o.Gemm, ",") {
			name = strings.TrimSpace(name)
			found := false
			for _, c := range gemmTable {
				if c.name == name {
					out, found = append(out, c), true
				}
			}
			if !found {
				return nil, fmt.Errorf("-gemm: unknown case %q; known: %s", name, caseNames())
			}
		}
	case gpu:
		out = gemmTable[:7]
	default:
		out = []gemmCase{cpuGemm}
	}
	if o.Shape != "" {
		var c gemmCase
		if n, err := fmt.Sscanf(o.Shape, "%d,%d,%d,%d", &c.G, &c.M, &c.K, &c.N); err != nil || n != 4 || c.G < 1 || c.M < 0 || c.K < 1 || c.N < 1 {
			return nil, fmt.Errorf("-gemm-shape %q: want G,M,K,N with G, K, N ≥ 1 and M ≥ 0", o.Shape)
		}
		c.name, c.dist = "custom_uniform", "uniform"
		out = append(out, c)
	}
	return out, nil
}
