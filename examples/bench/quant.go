package main

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/internal/baseline"
	"github.com/dropless/dropless/quant"
)

// quant times MXFP8 quantization of an m×k bf16 source: rowwise, both directions, and
// both directions over 128 skewed expert groups, as the quant package's benchmarks,
// counting the bytes of the source and of every output tensor (scale padding included).
func (b *bench) quant(m, k int) ([]row, error) {
	s := b.s
	ts := newTensors(s)
	defer ts.Free()
	x := ts.random(4, 1, device.BF16, m, k)
	if err := ts.Err(); err != nil {
		return nil, err
	}
	sizes, err := device.FromSlice(s, device.I32, baseline.ZipfSizes(128, m, 1), 128)
	if err != nil {
		return nil, err
	}
	ts.Add(sizes)
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
		if err == nil && q.Status != nil {
			err = q.Status.Check(s)
		}
		q.Free()
		if err != nil {
			return rows, err
		}
		name := fmt.Sprintf("%d×%d bf16 → mxfp8 e4m3", m, k)
		if c.opt.GroupSizes != nil {
			name += ", 128 skewed groups"
		}
		base := c.base
		if m != gpuQuantM || k != gpuQuantK {
			base = "" // the peer's figure is of 65536×7168
		}
		rows = append(rows, row{c.name, name, t, float64(moved) / t.Seconds() / 1e9, "GB/s (read+write)", base})
	}
	return rows, nil
}
