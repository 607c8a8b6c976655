package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/internal/baseline"
)

// gemmCase is ragged_dot case c's tensors, in ts: the group sizes, random
// bf16 operands x [M,K], w [G,K,N] and dy [M,N], and bf16 outputs y [M,N], dx [M,K] and dw
// [G,K,N]; name describes the case and its shape, flops counts one call, 2·M·K·N.
type gemmCase struct {
	ts        *tensors
	c         baseline.Case
	name      string
	flops     float64
	sizes     *device.Tensor
	x, w, dy  *device.Tensor
	y, dx, dw *device.Tensor
}

// newGemmCase allocates case c's tensors on b's stream; Free releases them.
func (b *bench) newGemmCase(c baseline.Case) (*gemmCase, error) {
	G, M, K, N := c.G, c.M, c.K, c.N
	ts := newTensors(b.s)
	sizes, err := device.FromSlice(b.s, device.I32, c.Sizes(), G)
	if err != nil {
		return nil, errors.Join(err, ts.Free())
	}
	ts.Add(sizes)
	g := &gemmCase{
		ts: ts, c: c, name: fmt.Sprintf("%s G=%d M=%d K=%d N=%d", c.Name, G, M, K, N),
		flops: 2 * float64(M) * float64(K) * float64(N), sizes: sizes,
		x: ts.random(1, 1, device.BF16, M, K), w: ts.random(2, 0.02, device.BF16, G, K, N),
		dy: ts.random(3, 1, device.BF16, M, N),
		y:  ts.Alloc(device.BF16, M, N), dx: ts.Alloc(device.BF16, M, K), dw: ts.Alloc(device.BF16, G, K, N),
	}
	if err := ts.Err(); err != nil {
		return nil, errors.Join(err, ts.Free())
	}
	return g, nil
}

// Free releases g's tensors.
func (g *gemmCase) Free() error { return g.ts.Free() }

// gemm times the forward, input-gradient and weight-gradient forms of ragged_dot on case
// c, bf16 in and out, counting 2·M·K·N flops per call, beside c's peer figures (if any:
// torch._grouped_mm's forward, its dX and its dW form).
func (b *bench) gemm(c baseline.Case) ([]row, error) {
	g, err := b.newGemmCase(c)
	if err != nil {
		return nil, err
	}
	defer g.Free()
	s := b.s
	x, w, y, dy, dx, dw, sizes, flops, name := g.x, g.w, g.y, g.dy, g.dx, g.dw, g.sizes, g.flops, g.name
	var rows []row
	for _, f := range []struct {
		prim, base string
		fn         func() error
	}{
		{"gemm forward", peerRate(c.Peer.Forward), func() error { return gemm.RaggedDot(s, y, x, w, sizes, nil) }},
		{"gemm input grad", peerRate(c.Peer.DX), func() error { return gemm.RaggedDotInputGrad(s, dx, dy, w, sizes, nil) }},
		{"gemm weight grad", peerRate(c.Peer.DW), func() error { return gemm.RaggedDotWeightGrad(s, dw, x, dy, sizes, nil) }},
	} {
		t, err := b.time(f.fn)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row{f.prim, name, t, flops / t.Seconds() / 1e12, "TFLOP/s", f.base})
	}
	return rows, gemm.CheckStatus(s)
}

// peerRate formats a peer figure in TFLOP/s as measured; zero (none) gives "".
func peerRate(v float64) string {
	if v == 0 {
		return ""
	}
	return fmt.Sprintf("%g TFLOP/s", v)
}

// gemmTable holds the baseline cases and the CPU case of the gemm package's benchmarks.
var gemmTable = append(baseline.Cases(), baseline.CPUCase())

func caseNames() string {
	var n []string
	for _, c := range gemmTable {
		n = append(n, c.Name)
	}
	return strings.Join(n, ", ")
}

// gemmCases returns the cases of -gemm (default: the baseline cases on a GPU, the CPU
// case on the CPU) and the case of -gemm-shape after them.
func gemmCases(o options, gpu bool) ([]baseline.Case, error) {
	var out []baseline.Case
	switch {
	case o.Gemm != "":
		for _, name := range strings.Split(o.Gemm, ",") {
			name = strings.TrimSpace(name)
			found := false
			for _, c := range gemmTable {
				if c.Name == name {
					out, found = append(out, c), true
				}
			}
			if !found {
				return nil, fmt.Errorf("-gemm: unknown case %q; known: %s", name, caseNames())
			}
		}
	case gpu:
		out = baseline.Cases()
	default:
		out = []baseline.Case{baseline.CPUCase()}
	}
	if o.Shape != "" {
		var c baseline.Case
		if n, err := fmt.Sscanf(o.Shape, "%d,%d,%d,%d", &c.G, &c.M, &c.K, &c.N); err != nil || n != 4 || c.G < 1 || c.M < 0 || c.K < 1 || c.N < 1 {
			return nil, fmt.Errorf("-gemm-shape %q: want G,M,K,N with G, K, N ≥ 1 and M ≥ 0", o.Shape)
		}
		c.Name, c.Skew = "custom_uniform", "uniform"
		out = append(out, c)
	}
	return out, nil
}
