package moe

import "github.com/dropless/dropless/device"

// Layer is an MoE layer: router, permutation (or expert-parallel dispatch), SwiGLU
// experts through ragged_dot, the weighted combine and an optional shared expert. It
// holds no tensors; one Layer may serve many calls.
type Layer struct {
	cfg Config
	// trace, when set (by benchmarks), is called on the stream after each stage of
	// Forward and Backward with the stage's name.
	trace func(s *device.Stream, stage string)
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
	return &Layer{cfg: cfg}, nil
}

// Config returns the layer's configuration.
func (l *Layer) Config() Config { return l.cfg }
