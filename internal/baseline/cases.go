package baseline

// Case is a ragged_dot case of the peer baselines: x is M×K, sorted by group, the
// weights are G×K×N and the G group sizes are GroupSizes(G, M, Skew).
type Case struct {
	Name       string
	G, M, K, N int
	Skew       string // "uniform" or "skewed"
	Peer       Peer   // zero where no peer figure was measured
}

// Sizes returns the case's G group sizes, summing to M.
func (c Case) Sizes() []int32 { return GroupSizes(c.G, c.M, c.Skew) }

// Peer holds the throughput of torch._grouped_mm on a case, bf16 in and out, in TFLOP/s
// of 2·M·K·N per call: the forward form, its dX form and its dW form, as measured on the
// device of PeerDevice on the date of PeerDate (medians; runs differ by about 5%).
type Peer struct {
	Forward, DX, DW float64
}

// PeerDevice and PeerDate say where and when the figures of Cases were measured.
const (
	PeerDevice = "H200"
	PeerDate   = "2026-12-01"
)

// cases are the seven baseline cases: DeepSeek-V3's expert projections on 8-way expert
// parallelism, Mixtral's, and Qwen3-30B's at full and small batches.
var cases = [...]Case{
	{"dsv3_wi_ep8_uniform", 32, 65536, 7168, 4096, "uniform", Peer{653, 657, 626}},
	{"dsv3_wi_ep8_skewed", 32, 65536, 7168, 4096, "skewed", Peer{605, 592, 589}},
	{"dsv3_wo_ep8_uniform", 32, 65536, 2048, 7168, "uniform", Peer{650, 662, 639}},
	{"mixtral_wi_uniform", 8, 32768, 4096, 28672, "uniform", Peer{635, 636, 650}},
	{"qwen3_30b_wi_uniform", 128, 32768, 2048, 1536, "uniform", Peer{556, 528, 368}},
	{"qwen3_30b_wi_skewed", 128, 32768, 2048, 1536, "skewed", Peer{418, 414, 331}},
	{"qwen3_30b_small_uniform", 128, 2048, 2048, 1536, "uniform", Peer{45, 41, 32}},
}

// Cases returns the baseline cases with their peer figures, in the order of the
// baseline table. The slice is the caller's.
func Cases() []Case { return append([]Case(nil), cases[:]...) }

// CPUCase returns the small case that the benchmarks run on the CPU in place of Cases.
// It has no peer figure.
func CPUCase() Case {
	return Case{Name: "tiny_uniform", G: 8, M: 512, K: 256, N: 256, Skew: "uniform"}
}
