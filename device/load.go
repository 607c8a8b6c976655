package device

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
)

// Load compiles and loads progs on d, and the package's own kernels (fill, copy, cast),
// compiling up to GOMAXPROCS programs at a time with NVRTC, so that the first Kernel
// call of each finds its program ready. Without it each program compiles when a kernel
// of it is first asked for, one after the other, on the caller's goroutine: on a cold
// cache (see Program) the first calls of a large model wait minutes. Programs already
// loaded, or being loaded by another goroutine, are not compiled again; a program whose
// compile fails fails every later Kernel call on d the same way. Load waits for the
// compiles and enqueues nothing. On the CPU it checks its arguments and does nothing.
func (d *Device) Load(progs ...*Program) error {
	if d == nil {
		return errors.New("device: Load: nil device")
	}
	for i, p := range progs {
		if p == nil {
			return fmt.Errorf("device: Load: progs[%d] is nil", i)
		}
	}
	if d.kind != KindCUDA {
		return nil
	}
	all := []*Program{elementwise}
	seen := map[*Program]bool{elementwise: true}
	for _, p := range progs {
		if !seen[p] {
			seen[p] = true
			all = append(all, p)
		}
	}
	errs := make([]error, len(all))
	sem := make(chan struct{}, max(1, runtime.GOMAXPROCS(0)))
	var wg sync.WaitGroup
	for i, p := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			errs[i] = d.module(p).err
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Loaded returns the programs compiled and loaded on d so far, by Load or by Kernel,
// in no particular order; those still loading or that failed to load are left out. On
// the CPU it is empty.
func (d *Device) Loaded() []*Program {
	if d == nil {
		return nil
	}
	var ps []*Program
	d.modules.Range(func(k, v any) bool {
		if v.(*module).loaded.Load() {
			ps = append(ps, k.(*Program))
		}
		return true
	})
	return ps
}
