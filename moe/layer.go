package moe

import (
	"sync"

	"github.com/dropless/dropless/device"
)

// Layer is an MoE layer: router, permutation (or expert-parallel dispatch), SwiGLU
// experts through ragged_dot, the weighted combine and an optional shared expert. One
// Layer may serve many calls. With PrecisionBF16 it holds no tensors; with an FP8
// Config.Precision it caches W1 and W2 quantized (see InvalidateWeights), those of one
// Params at a time: a Layer that serves several sets of weights in turn quantizes them
// again at each switch, so give each its own Layer.
type Layer struct {
	cfg Config
	// trace, when set (by benchmarks), is called on the stream after each stage of
	// Forward and Backward with the stage's name.
	trace func(s *device.Stream, stage string)
	// gradTwoPass, when set (by tests), makes an FP8 Backward quantize each incoming
	// gradient by two passes, rowwise for the input gradient and columnwise for the
	// weight gradient, the reference of the one pass it otherwise makes.
	gradTwoPass bool
	// unfusedSwiGLU, when set (by tests), makes an FP8 layer compute SwiGLU's output in
	// the activations' dtype, keep it so, and quantize it by a pass before each GEMM that
	// reads it: the reference of the fused SwiGLU and quantization it otherwise runs.
	unfusedSwiGLU bool
	// fusedGrad are the operands that an FP8 Backward without Config.EP quantizes as it
	// computes them (grad_fp8.go); it writes the others in the activations' dtype and
	// quantizes them. NewLayer sets defaultFusedGrad; tests and benchmarks set others.
	fusedGrad gradParts
	// serialEP, when set (by tests and benchmarks), makes a layer with Config.EP run its
	// work in the order of its data flow, none of it while ep's ops move rows: the
	// reference of the overlap it otherwise runs (Forward, Backward).
	serialEP bool

	mu sync.Mutex  // guards q
	q  *fp8Weights // FP8 precisions: W1 and W2 quantized, or nil
}

func (l *Layer) mark(s *device.Stream, stage string) {
	if l.trace != nil {
		l.trace(s, stage)
	}
}

// NewLayer returns the layer of cfg.
func NewLayer(cfg Config) (*Layer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Layer{cfg: cfg, fusedGrad: defaultFusedGrad}, nil
}

// Config returns the layer's configuration.
func (l *Layer) Config() Config { return l.cfg }
