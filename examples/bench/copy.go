package main

import (
	"fmt"

	"github.com/dropless/dropless/device"
)

func (b *bench) copy(n int) ([]row, error) {
	ts := newTensors(b.s)
	defer ts.Free()
	x, y := ts.Alloc(device.E4M3, n), ts.Alloc(device.E4M3, n)
	if err := ts.Err(); err != nil {
		return nil, err
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
