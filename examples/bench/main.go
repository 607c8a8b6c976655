// Command bench prints a table of the throughput of dropless's primitives on the device
// present (a GPU if one works, else the CPU): the cases of the packages' benchmarks.
//
//	go run ./examples/bench                  # every primitive
//	go run ./examples/bench -only gemm,moe   # some
//	go run ./examples/bench -only fp8        # ragged_dot in FP8, both recipes
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
	"io"
	"os"
	"strings"
	"time"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/baseline"
)

// primitives are the benchmarks, in the order of the table.
var primitives = []string{"copy", "gemm", "fp8", "quant", "ep", "moe"}

type options struct {
	Device, Only, Gemm, Shape, EPTransport string
	MoePrecision                           string
	MinTime                                time.Duration
	CopyBytes, QuantM, QuantK              int
	MoeT, MoeH, MoeF, MoeE, MoeK           int
	EPRanks, EPT, EPH, EPE, EPK            int
}

// The GPU defaults of the primitives' shapes that have peer figures: a row's peer figure is
// shown only at these shapes, where it was measured.
const (
	gpuQuantM, gpuQuantK                        = 65536, 7168
	gpuEPT, gpuEPH, gpuEPK                      = 16384, 7168, 8
	gpuMoeT, gpuMoeH, gpuMoeF, gpuMoeE, gpuMoeK = 16384, 7168, 2048, 32, 8
)

func main() {
	var o options
	flag.StringVar(&o.Device, "device", "", "device: cpu, cuda or cuda:N (default: $DROPLESS_DEVICE, else GPU 0 if one works, else the CPU)")
	flag.StringVar(&o.Only, "only", strings.Join(primitives, ","), "comma-separated primitives to run: "+strings.Join(primitives, ", "))
	flag.DurationVar(&o.MinTime, "time", 0, "least time spent timing each case (default 300ms on a GPU, 100ms on the CPU)")
	flag.IntVar(&o.CopyBytes, "copy-bytes", 0, "bytes of the device copy (default 2 GiB on a GPU, 64 MiB on the CPU)")
	flag.StringVar(&o.Gemm, "gemm", "", "comma-separated gemm cases (default: the seven baseline cases on a GPU, "+baseline.CPUCase().Name+" on the CPU); known: "+caseNames())
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
	flag.StringVar(&o.MoePrecision, "moe-precision", precisionNames(","), "comma-separated precisions of the MoE layer's expert GEMMs: "+precisionNames(", ")+" (an FP8 layer's timed passes include quantizing W1 and W2 each time, as after an optimizer step)")
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), `usage: bench [flags]

Prints the throughput of the primitives on the device present: the device copy,
ragged_dot forward, input and weight gradient (gemm), its three forms in FP8, blockwise and
MXFP8, with the quantization of their operands (fp8), MXFP8 quantization (quant),
expert-parallel dispatch+combine (ep) and the MoE layer's forward and backward in each
precision (moe), at the sizes of the packages' benchmarks: the H200 baseline cases on a
GPU, small ones on the CPU. Zero-valued size flags take those defaults.

`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func def(v *int, gpu bool, onGPU, onCPU int) {
	if *v == 0 {
		*v = onCPU
		if gpu {
			*v = onGPU
		}
	}
}

// run prints the table to w.
func run(w io.Writer, o options) error {
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
	precs, err := moePrecisions(o.MoePrecision)
	if err != nil {
		return err
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
	def(&o.QuantM, gpu, gpuQuantM, 2048)
	def(&o.QuantK, gpu, gpuQuantK, 1024)
	def(&o.EPT, gpu, gpuEPT, 512)
	def(&o.EPH, gpu, gpuEPH, 256)
	def(&o.EPE, gpu, 64, 16)
	def(&o.EPK, gpu, gpuEPK, 4)
	def(&o.MoeT, gpu, gpuMoeT, 256)
	def(&o.MoeH, gpu, gpuMoeH, 64)
	def(&o.MoeF, gpu, gpuMoeF, 32)
	def(&o.MoeE, gpu, gpuMoeE, 8)
	def(&o.MoeK, gpu, gpuMoeK, 2)
	cases, err := gemmCases(o, gpu)
	if err != nil {
		return err
	}
	if want["fp8"] {
		if err := fp8Check(cases); err != nil {
			return err
		}
	}
	if want["moe"] {
		if err := moeCheck(precs, o.MoeH, o.MoeF); err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "device: %v (%s)  %s\n", d, d.Name(), time.Now().Format("2006-01-02 15:04"))
	line := func(prim, name, t, rate, base string) {
		l := fmt.Sprintf("%-20s  %-62s  %10s  %-30s", prim, name, t, rate)
		if gpu {
			l += "  " + base
		}
		fmt.Fprintln(w, strings.TrimRight(l, " "))
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
		case "fp8":
			for _, c := range cases {
				if err = emit(b.fp8(c)); err != nil {
					break
				}
			}
		case "quant":
			err = emit(b.quant(o.QuantM, o.QuantK))
		case "ep":
			err = emit(b.ep(o))
		case "moe":
			err = emit(b.moe(o, precs))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p, err))
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", p, err)
		}
	}
	return errors.Join(errs...)
}
