// Command devices lists the devices dropless finds and runs a smoke test on each: fill,
// cast and copy a tensor, check the result against the expected values and time it.
//
//	go run ./examples/devices
package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"time"

	"github.com/dropless/dropless/device"
)

func main() {
	n := flag.Int("n", 1<<24, "elements in the smoke test's tensors")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: devices [-n N]\n\nLists the CPU and the CUDA GPUs and runs a smoke test on each.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	infos, err := device.List()
	if err != nil {
		fmt.Printf("no GPU: %v\n", err)
	}
	failed := false
	for _, in := range infos {
		fmt.Printf("%-8s %-24s %s\n", in.Spec, in.Name, in.Detail)
		d, err := device.Open(in.Spec)
		if err == nil {
			err = smoke(d, *n)
		}
		if err != nil {
			fmt.Printf("         smoke test FAILED: %v\n", err)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

// smoke fills an f32 tensor, casts it to bf16 and back, copies it and checks the values.
func smoke(d *device.Device, n int) error {
	s, err := d.NewStream()
	if err != nil {
		return err
	}
	defer s.Close()
	a, err := s.Alloc(device.F32, n)
	if err != nil {
		return err
	}
	defer a.Free()
	b, err := s.Alloc(device.BF16, n)
	if err != nil {
		return err
	}
	defer b.Free()
	c, err := s.Alloc(device.F32, n)
	if err != nil {
		return err
	}
	defer c.Free()
	start := time.Now()
	const v = 1.0 / 3
	for _, step := range []func() error{
		func() error { return device.Fill(s, a, v) },
		func() error { return device.Cast(s, b, a) },
		func() error { return device.Cast(s, a, b) },
		func() error { return device.Copy(s, c, a) },
		s.Synchronize,
	} {
		if err := step(); err != nil {
			return err
		}
	}
	el := time.Since(start)
	got, err := c.Float32s(s)
	if err != nil {
		return err
	}
	want := device.BF16ToFloat32(device.BF16FromFloat32(v))
	for i, g := range got {
		if g != want || math.IsNaN(float64(g)) {
			return fmt.Errorf("element %d = %v, want %v", i, g, want)
		}
	}
	fmt.Printf("         smoke test ok: fill, cast f32→bf16→f32, copy of %d elements in %v\n", n, el.Round(time.Microsecond))
	return nil
}
