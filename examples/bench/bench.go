package main

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/dropless/dropless/device"
)

// row is a line of the table.
type row struct {
	prim, name string
	t          time.Duration
	rate       float64
	unit       string
	baseline   string
}

func fmtDur(t time.Duration) string {
	switch {
	case t >= time.Second:
		return fmt.Sprintf("%.3f s", t.Seconds())
	case t >= time.Millisecond:
		return fmt.Sprintf("%.3f ms", t.Seconds()*1e3)
	}
	return fmt.Sprintf("%.1f µs", t.Seconds()*1e6)
}

// fmtRate formats v in unit, a rate in tera- or giga- units ("TFLOP/s", "GB/s ..."),
// switching from tera to giga below 1.
func fmtRate(v float64, unit string) string {
	if v < 1 && strings.HasPrefix(unit, "T") {
		v, unit = v*1e3, "G"+unit[1:]
	}
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f %s", v, unit)
	case v >= 1:
		return fmt.Sprintf("%.1f %s", v, unit)
	}
	return fmt.Sprintf("%.3f %s", v, unit)
}

// bench times calls on one stream.
type bench struct {
	s   *device.Stream
	min time.Duration
}

// time returns the mean time of fn on b.s: two warm-up calls, one timed call to size
// the run, then enough calls to last b.min, between two events.
func (b *bench) time(fn func() error) (time.Duration, error) {
	s := b.s
	for range 2 {
		if err := fn(); err != nil {
			return 0, err
		}
	}
	if err := s.Synchronize(); err != nil {
		return 0, err
	}
	d := s.Device()
	start, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer start.Close()
	stop, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer stop.Close()
	n := 1
	for {
		if err := start.Record(s); err != nil {
			return 0, err
		}
		for range n {
			if err := fn(); err != nil {
				return 0, err
			}
		}
		if err := stop.Record(s); err != nil {
			return 0, err
		}
		if err := stop.Synchronize(); err != nil {
			return 0, err
		}
		el, err := stop.Since(start)
		if err != nil {
			return 0, err
		}
		if el >= b.min || n >= 10000 {
			return el / time.Duration(n), nil
		}
		// Aim at 1.2·min from this estimate.
		n = int(min(max(float64(n)*1.2*float64(b.min)/float64(max(el, time.Microsecond)), float64(n+1)), 10000))
	}
}

// tensors is a benchmark's tensors on one stream, freed together (see device.Temps),
// some of them filled with random values.
type tensors struct {
	*device.Temps
	s   *device.Stream
	err error // the first failure to fill a tensor of random
}

func newTensors(s *device.Stream) *tensors { return &tensors{Temps: device.NewTemps(s), s: s} }

// Err returns the first error of an allocation or of random.
func (ts *tensors) Err() error {
	if err := ts.Temps.Err(); err != nil {
		return err
	}
	return ts.err
}

// random allocates a tensor of N(0, scale²) values: a random block uploaded once and
// tiled over it.
func (ts *tensors) random(seed uint64, scale float32, dt device.DType, shape ...int) *device.Tensor {
	if ts.err != nil {
		return nil
	}
	t := ts.Alloc(dt, shape...)
	if t == nil {
		return nil
	}
	n := t.Len()
	blk := min(n, 1<<22)
	r := rand.New(rand.NewPCG(seed, 1))
	v := make([]float32, blk)
	for i := range v {
		v[i] = float32(r.NormFloat64()) * scale
	}
	src, err := device.FromFloat32(ts.s, dt, v, blk)
	if err != nil {
		ts.err = err
		return nil
	}
	defer src.Free()
	flat, err := t.Reshape(n)
	for off := 0; off < n && err == nil; off += blk {
		m := min(blk, n-off)
		var dst, sv *device.Tensor
		if dst, err = flat.View(off, m); err == nil {
			if sv, err = src.View(0, m); err == nil {
				err = device.Copy(ts.s, dst, sv)
			}
		}
	}
	if err != nil {
		ts.err = err
	}
	return t
}
