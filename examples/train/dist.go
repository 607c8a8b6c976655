package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
)

// dist is one rank's view of the ranks that train a model together: its transport, or
// nil for a single rank (a nil *dist is one rank too).
type dist struct {
	tr ep.Transport
}

// Size returns the number of ranks.
func (d *dist) Size() int {
	if d == nil || d.tr == nil {
		return 1
	}
	return d.tr.Size()
}

// Rank returns this rank.
func (d *dist) Rank() int {
	if d == nil || d.tr == nil {
		return 0
	}
	return d.tr.Rank()
}

// gatherFloat32 returns the elements of t (any float dtype) of every rank, in rank
// order, waiting for s. Every rank calls it with a tensor of the same size.
func (d *dist) gatherFloat32(s *device.Stream, t *device.Tensor) ([]float32, error) {
	if d.Size() == 1 {
		return t.Float32s(s)
	}
	all, err := s.Alloc(t.DType(), d.Size()*t.Len())
	if err != nil {
		return nil, err
	}
	defer all.Free()
	if err := d.tr.AllGather(s, t, all); err != nil {
		return nil, err
	}
	if err := d.tr.Sync(s); err != nil {
		return nil, err
	}
	return all.Float32s(s)
}

// gatherInt64 returns v of every rank, in rank order. Every rank calls it with as many
// values.
func (d *dist) gatherInt64(s *device.Stream, v []int64) ([]int64, error) {
	if d.Size() == 1 {
		return v, nil
	}
	ts := device.NewTemps(s)
	defer ts.Free()
	send, all := ts.Alloc(device.I64, len(v)), ts.Alloc(device.I64, d.Size()*len(v))
	if err := ts.Err(); err != nil {
		return nil, err
	}
	if err := device.Upload(s, send, v); err != nil {
		return nil, err
	}
	if err := d.tr.AllGather(s, send, all); err != nil {
		return nil, err
	}
	if err := d.tr.Sync(s); err != nil {
		return nil, err
	}
	out := make([]int64, all.Len())
	return out, device.Download(s, all, out)
}

// cluster is the set of ranks this process drives: one (no transport), goroutine ranks
// of an in-process world, NCCL ranks on this process's GPUs, or this process's NCCL
// rank under torchrun's variables.
type cluster struct {
	size  int
	dev   *device.Device // the device of the single rank
	world *ep.World
	trs   []ep.Transport // the transports this process drives
	desc  string
}

// underTorchrun reports whether this process is one of several ranks that torchrun's
// variables describe (WORLD_SIZE > 1).
func underTorchrun() bool {
	ws := os.Getenv("WORLD_SIZE")
	return ws != "" && ws != "1"
}

// newCluster sets up the ranks -ep, -nccl and the environment ask for; the single rank
// or the in-process ranks are on d.
func newCluster(o options, d *device.Device) (*cluster, error) {
	if underTorchrun() {
		if n, err := strconv.Atoi(os.Getenv("WORLD_SIZE")); err == nil && o.EP != 1 && o.EP != n {
			return nil, fmt.Errorf("-ep %d, but WORLD_SIZE is %d: want -ep 1 or %d", o.EP, n, n)
		}
		tr, err := ep.InitFromEnv()
		if err != nil {
			return nil, err
		}
		return &cluster{size: tr.Size(), trs: []ep.Transport{tr},
			desc: fmt.Sprintf("rank %d of %d, one per process over NCCL (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), on %v", tr.Rank(), tr.Size(), tr.Device())}, nil
	}
	switch {
	case o.NCCL:
		n, err := device.CUDACount()
		if err != nil {
			return nil, fmt.Errorf("-nccl: %w", err)
		}
		if o.EP > n {
			return nil, fmt.Errorf("-ep %d with -nccl: only %d GPUs", o.EP, n)
		}
		devs := make([]*device.Device, o.EP)
		for i := range devs {
			if devs[i], err = device.Open(fmt.Sprintf("cuda:%d", i)); err != nil {
				return nil, err
			}
		}
		trs, err := ep.NewNCCLWorld(devs, 0)
		if err != nil {
			return nil, err
		}
		return &cluster{size: o.EP, trs: trs, desc: fmt.Sprintf("%d NCCL ranks in this process, on GPUs 0 to %d", o.EP, o.EP-1)}, nil
	case o.EP > 1:
		w, err := ep.NewWorld(o.EP, d)
		if err != nil {
			return nil, err
		}
		return &cluster{size: o.EP, world: w, desc: fmt.Sprintf("%d in-process ranks (goroutines) on %v", o.EP, d)}, nil
	}
	return &cluster{size: 1, dev: d, trs: []ep.Transport{nil}}, nil
}

// rank0 returns the lowest rank this process drives.
func (c *cluster) rank0() int {
	if c.world == nil && c.trs[0] != nil {
		return c.trs[0].Rank()
	}
	return 0
}

// device returns the device of the rank of tr.
func (c *cluster) device(tr ep.Transport) *device.Device {
	if tr == nil {
		return c.dev
	}
	return tr.Device()
}

// run calls fn for each rank this process drives, each in its own goroutine when there
// are several, and returns their errors joined.
func (c *cluster) run(fn func(tr ep.Transport) error) error {
	if c.world != nil {
		return c.world.Run(fn)
	}
	if len(c.trs) == 1 {
		return fn(c.trs[0])
	}
	errs := make([]error, len(c.trs))
	var wg sync.WaitGroup
	for i, tr := range c.trs {
		wg.Go(func() {
			if errs[i] = fn(tr); errs[i] != nil {
				errs[i] = fmt.Errorf("rank %d: %w", tr.Rank(), errs[i])
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Close closes the transports of NCCL ranks.
func (c *cluster) Close() error {
	if c.world != nil {
		return nil
	}
	var errs []error
	for _, tr := range c.trs {
		if tr != nil {
			errs = append(errs, tr.Close())
		}
	}
	return errors.Join(errs...)
}
