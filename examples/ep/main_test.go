package main

import (
	"strings"
	"testing"
)

// TestRun runs the in-process ranks on the CPU, whose round trip run checks, with each
// routing, dtype and capacity.
func TestRun(t *testing.T) {
	t.Setenv("WORLD_SIZE", "")
	for _, o := range []options{
		{Ranks: 4, Tokens: 64, Hidden: 32, Experts: 16, TopK: 4, DType: "bf16", Route: "uniform", Capacity: "dropless"},
		{Ranks: 3, Tokens: 50, Hidden: 24, Experts: 12, TopK: 5, DType: "f32", Route: "zipf", Capacity: "exact"},
		{Ranks: 2, Tokens: 40, Hidden: 8, Experts: 8, TopK: 8, DType: "f16", Route: "zipf", Capacity: "0.5"},
		{Ranks: 2, Tokens: 0, Hidden: 8, Experts: 8, TopK: 2, DType: "bf16", Route: "uniform", Capacity: "dropless"},
	} {
		o.Device, o.Iters, o.Seed = "cpu", 2, 3
		if err := run(o); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
}

func TestErrors(t *testing.T) {
	t.Setenv("WORLD_SIZE", "")
	base := options{Ranks: 2, Tokens: 8, Hidden: 8, Experts: 8, TopK: 2, DType: "bf16", Route: "uniform", Capacity: "dropless", Device: "cpu", Iters: 1}
	for _, c := range []struct {
		mod  func(*options)
		want string
	}{
		{func(o *options) { o.Experts = 7 }, "-experts"},
		{func(o *options) { o.TopK = 9 }, "-topk"},
		{func(o *options) { o.DType = "e4m3" }, "-dtype"},
		{func(o *options) { o.Route = "skewed" }, "-route"},
		{func(o *options) { o.Capacity = "-1" }, "-capacity"},
	} {
		o := base
		c.mod(&o)
		if err := run(o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("error %v, want one naming %s", err, c.want)
		}
	}
}
