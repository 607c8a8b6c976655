// Command train trains a small Mixture-of-Experts language model on the Go standard
// library's source, byte by byte, on the GPU when one works and on the CPU otherwise:
//
//	go run ./examples/train
//
// The model predicts each byte from the W bytes before it: the sum of position-specific
// embeddings of those bytes, L residual blocks h += MoE(rmsnorm(h)) whose feed-forward
// layers are dropless moe.Layers (top-K routing over E SwiGLU experts), and a linear
// output over the 256 byte values. It is trained with AdamW on the .go files of a few
// standard packages (every 20th file held out), once dropless and once, from the same
// initialization and on the same batches, as a capacity-factor layer that drops the
// assignments past ⌈factor·T·K/E⌉ per expert. A line per -eval-every steps gives the
// training and held-out losses, the throughput, the step time and the MoE layers'
// share of it, the model FLOP utilization (or, without a known peak, the FLOP/s) and
// the experts' load; at the end each model is saved to -out/<name>.ckpt (see
// Checkpoint; -resume continues from there), the loss curves are drawn into
// -out/loss.png, and the final held-out losses are compared with the unigram entropy
// of the held-out text.
//
// # The step
//
// A training step is enqueued on one stream and nothing waits for the device: the
// losses and the routing statistics are summed on the device and read back at the
// progress lines only. The batches are prepared ahead by a goroutine into pinned host
// buffers and uploaded on a stream of their own that the step's stream waits for. The
// step is
//
//	embed+norm      h = Σ_w emb[w, tok], xn = rmsnorm(h)      one kernel
//	per layer       y = MoE(xn)                                package moe
//	                h += y, xn = rmsnorm(h)                   one kernel
//	output+loss     logits = xn·out                            gemm.RaggedDot, one group
//	                loss, dlogits = softmax cross-entropy     one kernel, a warp per row
//	output bwd      dout, dxn                                  gemm.RaggedDotWeightGrad, RaggedDotInputGrad
//	                dh = rmsnorm'(dxn)                         one kernel
//	per layer       dxn = MoE'(dh); dh += rmsnorm'(dxn)        package moe; one kernel
//	embed bwd       demb                                       a counting sort of each position's rows by token, then one sum per row of demb
//	grad sum        (over ranks) the replicated gradients      an all-gather, then one kernel
//	adamw           every parameter                            one kernel over a device table of the parameters
//
// -dtype bf16 runs the MoE layers and the output projection in bf16, on tensor cores:
// they read bf16 copies of their weights, which the AdamW kernel writes, while the
// weights, gradients, AdamW's moments (but see -moments), the residual stream and the
// logits stay f32. -moments bf16 keeps AdamW's first and second moments in bf16, as
// DeepSeek-V3 does: each step computes them in f32 as with -moments f32 and rounds them
// to nearest even, and AdamW moves 8 bytes less per parameter (20 instead of 28; 22
// instead of 30 with a bf16 compute copy). A checkpoint records the moments' dtype;
// resuming with the other converts them (f32 to bf16 rounds, bf16 to f32 is exact).
// -grads bf16 has the MoE layers write their experts' weight gradients in bf16, their
// f32 sums rounded once, which AdamW widens: 4 bytes less per expert parameter and step
// (2 written, 2 read), for the weights that hold nearly all the model's parameters. It
// is a numerics choice: without gradient accumulation over micro-batches (the reason
// DeepSeek-V3 keeps f32 gradients) the rounding is one of 2^-9 relative, below that of
// bf16 moments.
// -precision fp8 or mxfp8 runs the six expert GEMMs of every MoE layer in FP8
// (moe.Config.Precision): E4M3 operands, quantized right before each GEMM with
// DeepSeek-V3's blockwise f32 scales or MXFP8's power-of-two ones per 32 elements,
// multiplied with f32 sums. The rest runs in the -dtype as before; FP8 goes with -dtype
// bf16 (with f32 the GEMMs quantize f32 operands and write f32 results). The layers
// quantize W1 and W2 at their first forward pass and after each AdamW step, which
// invalidates their copies; checkpoints are the same in every precision.
// -profile prints, for one step after warm-up, the device time of each stage above
// with the rate its estimated work implies. The kernels are in kernels/train.cu; on
// the CPU their Go twins run, which the tests compare them with.
//
// # Expert parallelism and offloading
//
// -ep N trains each model over N ranks: goroutine ranks in this process (on the CPU or
// all on one GPU, through ep.NewWorld), or with -nccl NCCL ranks on GPUs 0 to N-1
// (ep.NewNCCLWorld), or one process per GPU under torchrun's variables (ep.InitFromEnv;
// WORLD_SIZE > 1 makes this process rank RANK). Each rank holds E/N experts of every
// layer (moe.Config.EP) and B/N rows of every global batch of B; the other parameters
// are replicated and their gradients summed over the ranks. Checkpoints hold every
// rank's experts, gathered by rank 0, so they resume over any N that divides E. On the
// same global batch the losses are those of -ep 1 within float tolerance, the
// load-balancing loss (-aux) included, which is over the global batch (each rank's
// layers compute their share from the loads of all ranks); they differ only in that a
// capacity model's capacity is per rank (ep.Factor), which is per expert only when N = E.
//
// -offload POLICY sends the MoE layers' activations named by the policy (package
// offload's syntax, MaxText's names) to pinned host memory during the forward pass and
// back for the backward (moe.Config.Offload), or drops them for recompute; the losses
// are bit-identical to the run without it, and the progress lines show the bytes moved
// to the host per step.
package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/moe"
	"github.com/dropless/dropless/offload"
)

// options are the command's flags.
type options struct {
	Steps, Batch, Window, Hidden, FFN, SharedFFN, Experts, TopK, Layers int
	LR, MinLR, WeightDecay, Beta1, Beta2, Eps, AuxLoss                  float64
	Warmup                                                              int
	Capacity                                                            float64
	Seed                                                                uint64
	Device, Out, Data, Packages                                         string
	MaxBytes, EvalEvery, EvalTokens                                     int
	Resume, NoPlot                                                      bool
	DType, Moments, Grads, Precision, Offload                           string
	EP                                                                  int
	NCCL, Profile                                                       bool
}

func defaultOptions() options {
	return options{
		Steps: 600, Batch: 256, Window: 16, Hidden: 128, FFN: 64, Experts: 8, TopK: 2, Layers: 2,
		LR: 8e-3, MinLR: 0.1, WeightDecay: 0.01, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8, AuxLoss: 0.01, Warmup: 20,
		Capacity: 1, Seed: 1, Out: "train-out",
		Packages: "strings,bytes,fmt,sort,strconv,bufio,unicode/utf8,text/template,io,errors,regexp,go/scanner",
		MaxBytes: 4 << 20, EvalEvery: 50, EvalTokens: 4096,
		DType: "f32", Moments: "f32", Grads: "f32", Precision: "bf16", EP: 1,
	}
}

func (o *options) register(fs *flag.FlagSet) {
	fs.IntVar(&o.Steps, "steps", o.Steps, "training steps of each model (after -resume: that many more)")
	fs.IntVar(&o.Batch, "batch", o.Batch, "tokens (predicted bytes) per step: the T of the MoE layers")
	fs.IntVar(&o.Window, "window", o.Window, "bytes of context W each prediction sees")
	fs.IntVar(&o.Hidden, "hidden", o.Hidden, "model width H")
	fs.IntVar(&o.FFN, "ffn", o.FFN, "intermediate width F of each expert")
	fs.IntVar(&o.SharedFFN, "shared", o.SharedFFN, "intermediate width of a shared expert in every MoE layer (0: none)")
	fs.IntVar(&o.Experts, "experts", o.Experts, "experts E per MoE layer")
	fs.IntVar(&o.TopK, "topk", o.TopK, "experts K each token is routed to")
	fs.IntVar(&o.Layers, "layers", o.Layers, "MoE blocks L")
	fs.Float64Var(&o.LR, "lr", o.LR, "peak learning rate of AdamW")
	fs.Float64Var(&o.MinLR, "min-lr", o.MinLR, "final learning rate, as a fraction of -lr (cosine decay after the warmup)")
	fs.IntVar(&o.Warmup, "warmup", o.Warmup, "steps of linear learning-rate warmup")
	fs.Float64Var(&o.WeightDecay, "wd", o.WeightDecay, "AdamW's decoupled weight decay (not applied to the embeddings)")
	fs.Float64Var(&o.Beta1, "beta1", o.Beta1, "AdamW's β1")
	fs.Float64Var(&o.Beta2, "beta2", o.Beta2, "AdamW's β2")
	fs.Float64Var(&o.Eps, "eps", o.Eps, "AdamW's ε")
	fs.Float64Var(&o.AuxLoss, "aux", o.AuxLoss, "coefficient of the load-balancing loss (0: none)")
	fs.Float64Var(&o.Capacity, "capacity", o.Capacity, "capacity factor of the comparison model, trained after the dropless one (0: train only the dropless model)")
	fs.Uint64Var(&o.Seed, "seed", o.Seed, "seed of the initialization and of the data order (the same for both models)")
	fs.StringVar(&o.Device, "device", o.Device, "device: cpu, cuda or cuda:N (default: $DROPLESS_DEVICE, else GPU 0 if one works, else the CPU)")
	fs.StringVar(&o.Out, "out", o.Out, "`directory` of the checkpoints and the plot")
	fs.BoolVar(&o.Resume, "resume", o.Resume, "continue from the checkpoints in -out (their model shape wins over the flags)")
	fs.BoolVar(&o.NoPlot, "noplot", o.NoPlot, "do not draw -out/loss.png")
	fs.IntVar(&o.EvalEvery, "eval-every", o.EvalEvery, "steps between progress lines and held-out evaluations")
	fs.IntVar(&o.EvalTokens, "eval-tokens", o.EvalTokens, "held-out tokens per evaluation (rounded down to a multiple of -batch)")
	fs.StringVar(&o.Data, "data", o.Data, "a text `file or directory` to train on instead of the Go source (a directory's files are read recursively, leaving out hidden and binary files)")
	fs.StringVar(&o.Packages, "packages", o.Packages, "comma-separated standard packages whose .go files make the corpus")
	fs.IntVar(&o.MaxBytes, "max-bytes", o.MaxBytes, "most bytes of text to read")
	fs.StringVar(&o.DType, "dtype", o.DType, "compute dtype of the MoE layers and the output projection: f32, or bf16 (tensor cores; weights and gradients stay f32 but see -grads, AdamW's moments as -moments says)")
	fs.StringVar(&o.Moments, "moments", o.Moments, "dtype of AdamW's first and second moments: f32, or bf16 (computed in f32, rounded to nearest even after each step: AdamW moves 8 bytes less per parameter)")
	fs.StringVar(&o.Grads, "grads", o.Grads, "dtype of the experts' weight gradients: f32, or bf16 (the GEMMs' f32 sums rounded to nearest even once: the weight gradients write, and AdamW reads, 2 bytes less per expert parameter; the other gradients stay f32)")
	fs.StringVar(&o.Precision, "precision", o.Precision, "arithmetic of the MoE layers' expert GEMMs: bf16 (in the -dtype, f32 or bf16), fp8 (E4M3 with DeepSeek-V3's blockwise f32 scales) or mxfp8 (E4M3 with a power-of-two scale per 32 elements); FP8 needs -hidden and -ffn multiples of 16")
	fs.IntVar(&o.EP, "ep", o.EP, "expert-parallel ranks N: each holds E/N experts of every layer and B/N rows of every batch, the other parameters data parallel (goroutine ranks in this process, or see -nccl)")
	fs.BoolVar(&o.NCCL, "nccl", o.NCCL, "make the -ep ranks NCCL ranks on GPUs 0 to N-1 of this process (under torchrun's WORLD_SIZE, RANK, ... this process is one rank)")
	fs.StringVar(&o.Offload, "offload", o.Offload, "offload `policy` of the MoE layers' activations during training, as package offload parses it (MaxText's names: moe_permuted, moe_mlpwi, moe_mlp_swiglu, moe_mlpwo, mlpwi, mlp_swiglu; e.g. \"*=offload\" or \"moe_mlpwi=offload,moe_mlp_swiglu=remat\")")
	fs.BoolVar(&o.Profile, "profile", o.Profile, "print the time of each stage of one step after warm-up, from device events")
}

func main() {
	o := defaultOptions()
	o.register(flag.CommandLine)
	flag.Usage = func() {
		w := flag.CommandLine.Output()
		fmt.Fprint(w, `usage: train [flags]

Trains a byte-level Mixture-of-Experts language model on the Go standard library's
source, first with dropless MoE layers, then the same model with capacity-factor
layers (-capacity), on the same batches from the same initialization. Prints the
training and held-out losses (nats per byte), tokens per second and the experts' load
every -eval-every steps; saves -out/dropless.ckpt, -out/capacity.ckpt and
-out/loss.png. Runs on the GPU when one works, else on the CPU; -ep spreads the
experts over ranks, -offload sends activations to host memory, -profile times the
stages of a step.

`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "train: unexpected arguments %q\n", flag.Args())
		flag.Usage()
		os.Exit(2)
	}
	if _, err := run(o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "train:", err)
		os.Exit(1)
	}
}

// result is what run reports of each model.
type result struct {
	Name     string
	Heldout  float64 // final held-out loss, nats per byte
	First    float64 // held-out loss before the first step (NaN after -resume)
	Dropped  int64   // assignments dropped for capacity
	Assigned int64   // assignments routed
	Path     string  // checkpoint
	History  History
}

type report struct {
	Unigram float64 // entropy of the held-out bytes, nats
	Models  []result
}

func (o options) validate() error {
	switch {
	case o.Steps < 0:
		return fmt.Errorf("-steps %d, want ≥ 0", o.Steps)
	case o.Batch < 1:
		return fmt.Errorf("-batch %d, want ≥ 1", o.Batch)
	case o.EvalEvery < 1:
		return fmt.Errorf("-eval-every %d, want ≥ 1", o.EvalEvery)
	case o.EvalTokens < 0:
		return fmt.Errorf("-eval-tokens %d, want ≥ 0", o.EvalTokens)
	case o.LR <= 0 || math.IsInf(o.LR, 0) || math.IsNaN(o.LR):
		return fmt.Errorf("-lr %v, want > 0", o.LR)
	case o.MinLR < 0 || o.MinLR > 1:
		return fmt.Errorf("-min-lr %v, want in [0, 1]", o.MinLR)
	case o.Warmup < 0:
		return fmt.Errorf("-warmup %d, want ≥ 0", o.Warmup)
	case o.Beta1 < 0 || o.Beta1 >= 1 || o.Beta2 < 0 || o.Beta2 >= 1:
		return fmt.Errorf("-beta1 %v, -beta2 %v: want each in [0, 1)", o.Beta1, o.Beta2)
	case o.Eps <= 0:
		return fmt.Errorf("-eps %v, want > 0", o.Eps)
	case o.WeightDecay < 0:
		return fmt.Errorf("-wd %v, want ≥ 0", o.WeightDecay)
	case o.AuxLoss < 0:
		return fmt.Errorf("-aux %v, want ≥ 0", o.AuxLoss)
	case o.Capacity < 0:
		return fmt.Errorf("-capacity %v, want ≥ 0", o.Capacity)
	case o.MaxBytes < 1:
		return fmt.Errorf("-max-bytes %d, want ≥ 1", o.MaxBytes)
	case o.EP < 1:
		return fmt.Errorf("-ep %d, want ≥ 1", o.EP)
	case o.Batch%o.EP != 0:
		return fmt.Errorf("-batch %d over -ep %d ranks: want a multiple of the ranks", o.Batch, o.EP)
	case o.Experts%o.EP != 0:
		return fmt.Errorf("-experts %d over -ep %d ranks: want a multiple of the ranks", o.Experts, o.EP)
	}
	if _, err := o.computeType(); err != nil {
		return err
	}
	if _, err := o.momentType(); err != nil {
		return err
	}
	if _, err := o.precision(); err != nil {
		return err
	}
	_, err := o.offloadPolicy()
	return err
}

// computeType returns the dtype of -dtype.
func (o options) computeType() (device.DType, error) { return floatType("-dtype", o.DType) }

// momentType returns the dtype of -moments.
func (o options) momentType() (device.DType, error) { return floatType("-moments", o.Moments) }

// gradType returns the dtype of -grads.
func (o options) gradType() (device.DType, error) { return floatType("-grads", o.Grads) }

// floatType returns the dtype named by name, F32 or BF16; what names it in the error.
func floatType(what, name string) (device.DType, error) {
	dt, err := device.ParseDType(name)
	if err != nil || (dt != device.F32 && dt != device.BF16) {
		return 0, fmt.Errorf("%s %q, want f32 or bf16", what, name)
	}
	return dt, nil
}

// precision returns the expert GEMMs' precision of -precision.
func (o options) precision() (moe.Precision, error) {
	for _, p := range []moe.Precision{moe.PrecisionBF16, moe.PrecisionBlockwise, moe.PrecisionMXFP8} {
		if o.Precision == precisionName(p) {
			return p, nil
		}
	}
	return 0, fmt.Errorf("-precision %q, want bf16, fp8 or mxfp8", o.Precision)
}

// precisionName returns the -precision of p: bf16, fp8 (blockwise) or mxfp8.
func precisionName(p moe.Precision) string {
	if p == moe.PrecisionBlockwise {
		return "fp8"
	}
	return p.String()
}

// offloadPolicy returns the policy of -offload; the zero Policy when it is empty.
func (o options) offloadPolicy() (offload.Policy, error) {
	p, err := offload.ParsePolicy(o.Offload)
	if err != nil {
		return p, fmt.Errorf("-offload: %w", err)
	}
	return p, nil
}

func (o options) modelConfig(capacity float64) ModelConfig {
	return ModelConfig{
		Vocab: 256, Window: o.Window, Hidden: o.Hidden, FFN: o.FFN, SharedFFN: o.SharedFFN,
		Experts: o.Experts, TopK: o.TopK, Layers: o.Layers, AuxLoss: float32(o.AuxLoss),
		CapacityFactor: capacity,
	}
}

// run trains the models o describes, writing progress to w.
func run(o options, w io.Writer) (*report, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	if err := o.modelConfig(o.Capacity).validate(); err != nil {
		return nil, err
	}
	prec, _ := o.precision() // validate checked it
	if err := o.modelConfig(o.Capacity).validatePrecision(prec); err != nil {
		return nil, err
	}
	var pkgs []string
	for _, p := range strings.Split(o.Packages, ",") {
		if p = strings.TrimSpace(p); p != "" {
			pkgs = append(pkgs, p)
		}
	}
	c, err := loadCorpus(o.Data, pkgs, o.MaxBytes)
	if err != nil {
		return nil, err
	}
	if len(c.Train) <= o.Window || len(c.Heldout) <= o.Window {
		return nil, fmt.Errorf("corpus: %d training and %d held-out bytes, want more than -window %d of each", len(c.Train), len(c.Heldout), o.Window)
	}
	var d *device.Device
	if !underTorchrun() && !o.NCCL {
		if d, err = device.Open(o.Device); err != nil {
			return nil, err
		}
	}
	cl, err := newCluster(o, d)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	if cl.rank0() != 0 {
		w = io.Discard // one process of several: rank 0 reports
	}
	rep := &report{Unigram: unigramEntropy(c.Heldout)}
	fmt.Fprintf(w, "corpus: %s\n", c.Source)
	fmt.Fprintf(w, "corpus: %d files, %d bytes to train on, %d held out (%d files)\n", c.Files, len(c.Train), len(c.Heldout), c.HeldoutFiles)
	fmt.Fprintf(w, "unigram entropy of the held-out bytes: %.3f nats (%.3f bits) per byte\n", rep.Unigram, rep.Unigram/math.Ln2)
	if d != nil {
		fmt.Fprintf(w, "device: %v (%s)\n", d, d.Name())
	}
	if cl.desc != "" {
		fmt.Fprintf(w, "ranks: %s; experts and batch rows split over them, the other parameters replicated\n", cl.desc)
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return nil, err
	}
	nev := max(o.EvalTokens/o.Batch, 1) * o.Batch
	evalSet := evalBatches(c.Heldout, nev, o.Batch, o.Window)

	type job struct {
		name     string
		capacity float64
	}
	jobs := []job{{"dropless", 0}}
	if o.Capacity > 0 {
		jobs = append(jobs, job{"capacity", o.Capacity})
	}
	var curves []curve
	for _, j := range jobs {
		res, err := trainModel(cl, j.name, o.modelConfig(j.capacity), o, c, evalSet, w)
		if err != nil {
			return nil, fmt.Errorf("%s model: %w", j.name, err)
		}
		rep.Models = append(rep.Models, *res)
		label := j.name
		if j.capacity > 0 {
			label = fmt.Sprintf("capacity factor %g", j.capacity)
		}
		curves = append(curves, curve{label, res.History})
	}
	if !o.NoPlot && cl.rank0() == 0 {
		path := filepath.Join(o.Out, "loss.png")
		if err := plotLosses(path, curves, rep.Unigram); err != nil {
			return nil, fmt.Errorf("plot: %w", err)
		}
		fmt.Fprintf(w, "loss curves: %s\n", path)
	}
	fmt.Fprintf(w, "\nunigram entropy of the held-out text: %.3f nats/byte (%.3f bits)\n", rep.Unigram, rep.Unigram/math.Ln2)
	for _, r := range rep.Models {
		fmt.Fprintf(w, "%-9s final held-out loss:  %.3f nats/byte (%.3f bits), %.0f%% of the unigram entropy",
			r.Name, r.Heldout, r.Heldout/math.Ln2, 100*r.Heldout/rep.Unigram)
		if r.Name != "dropless" {
			fmt.Fprintf(w, "; dropped %d of %d assignments (%.2f%%)", r.Dropped, r.Assigned, 100*float64(r.Dropped)/float64(max(r.Assigned, 1)))
		}
		fmt.Fprintln(w)
	}
	return rep, nil
}

// lrAt returns the learning rate of step t (1, 2, ..., total): a linear warmup over
// the first warmup steps, then a cosine decay to minLR·lr at step total.
func lrAt(t, total, warmup int, lr, minLR float64) float64 {
	if t <= warmup {
		return lr * float64(t) / float64(warmup)
	}
	if total <= warmup {
		return lr
	}
	f := float64(t-warmup) / float64(total-warmup)
	return lr * (minLR + (1-minLR)*0.5*(1+math.Cos(math.Pi*min(f, 1))))
}

// loadRange returns the smallest and largest entries of load over their mean.
func loadRange(load []int64) (lo, hi float64) {
	var sum int64
	for _, n := range load {
		sum += n
	}
	if sum == 0 {
		return 0, 0
	}
	mean := float64(sum) / float64(len(load))
	lo = math.Inf(1)
	for _, n := range load {
		lo = min(lo, float64(n)/mean)
		hi = max(hi, float64(n)/mean)
	}
	return lo, hi
}
