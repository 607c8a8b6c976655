package moe

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
	"github.com/dropless/dropless/ep"
)

// BenchmarkLayerEP times the expert-parallel layer's forward+backward over two ranks:
// on two GPUs NCCL ranks of this process (direct transfers where the GPUs address each
// other's memory), on one GPU two in-process ranks sharing it (rows moved device to
// device; each step does two GPUs' work, so only its two variants compare). T = 16384
// tokens per rank, H = 7168, F = 2048, E = 64 (32 a rank), K = 8, bf16 activations, in
// each precision, with the layer's work overlapping ep's transfers (the default) and
// serial (Layer.serialEP). The one-GPU layer with the same work per GPU as the two-GPU
// run is BenchmarkLayer's (E = 32, no EP). Metrics: ms per step (the slower rank's),
// and the expert GEMMs' TFLOP/s per rank over it. It skips without a GPU.
func BenchmarkLayerEP(b *testing.B) {
	n, err := device.CUDACount()
	if err != nil || n < 1 {
		b.Skipf("needs a GPU (found %d: %v)", n, err)
	}
	var devs []*device.Device
	var trs []ep.Transport
	world := "nccl"
	if n >= 2 {
		devs = []*device.Device{dt.Must(device.Open("cuda:0")), dt.Must(device.Open("cuda:1"))}
		trs, err = ep.NewNCCLWorld(devs, 120*time.Second)
		dt.NoErr(b, err)
	} else {
		d := dt.Must(device.Open("cuda:0"))
		w := dt.Must(ep.NewWorld(2, d))
		devs, trs, world = []*device.Device{d, d}, []ep.Transport{w.Transport(0), w.Transport(1)}, "one-gpu"
	}
	const R, T, H, F, E, K = 2, 16384, 7168, 2048, 64, 8
	L, typ := E/R, device.BF16
	ranks := make([]*epBenchRank, R)
	for r, d := range devs {
		s := dt.Must(d.NewStream())
		rk := &epBenchRank{s: s, g: dt.Must(ep.NewGroup(trs[r], ep.Config{Experts: E, TopK: K}))}
		mk := func(dt_ device.DType, shape ...int) *device.Tensor {
			t := dt.Must(s.Alloc(dt_, shape...))
			rk.allocated = append(rk.allocated, t)
			return t
		}
		rk.x, rk.y, rk.dy = mk(typ, T, H), mk(typ, T, H), mk(typ, T, H)
		rk.p = &Params{Router: mk(typ, E, H), W1: mk(typ, L, H, 2*F), W2: mk(typ, L, F, H)}
		rk.grads = &Grads{X: mk(typ, T, H), Router: mk(device.F32, E, H), W1: mk(typ, L, H, 2*F), W2: mk(typ, L, F, H)}
		seed := uint64(10 * r)
		fillRandom(b, s, rk.x, seed+1, 1)
		fillRandom(b, s, rk.dy, seed+2, 1)
		fillRandom(b, s, rk.p.Router, 3, 0.02) // the same router on every rank
		fillRandom(b, s, rk.p.W1, seed+4, 0.02)
		fillRandom(b, s, rk.p.W2, seed+5, 0.02)
		dt.NoErr(b, s.Synchronize())
		ranks[r] = rk
	}
	defer func() {
		// Each rank on its own goroutine: closing a group with direct transfers, and an
		// NCCL transport, waits for the other ranks.
		var wg sync.WaitGroup
		for r, rk := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				device.FreeAll(rk.allocated...)
				rk.g.Close()
				rk.s.Close()
				trs[r].Close()
			}()
		}
		wg.Wait()
	}()
	flops := 3 * 6 * float64(T) * float64(K) * float64(H) * float64(F) // per rank: the group's routed rows over R ranks
	for _, prec := range []Precision{PrecisionBF16, PrecisionBlockwise, PrecisionMXFP8} {
		for _, serial := range []bool{false, true} {
			mode := "overlapped"
			if serial {
				mode = "serial"
			}
			b.Run(fmt.Sprintf("%s/R=%d,T=%d,H=%d,F=%d,E=%d,K=%d/%v/%s", world, R, T, H, F, E, K, prec, mode), func(b *testing.B) {
				times := make([]time.Duration, R)
				errs := make([]error, R)
				var wg sync.WaitGroup
				for r, rk := range ranks {
					wg.Add(1)
					go func() {
						defer wg.Done()
						times[r], errs[r] = rk.steps(trs[r], prec, serial, b.N)
					}()
				}
				wg.Wait()
				dt.NoErr(b, errors.Join(errs...))
				step := max(times[0], times[1]) / time.Duration(b.N)
				b.ReportMetric(float64(step)/1e6, "ms")
				b.ReportMetric(flops/step.Seconds()/1e12, "TFLOP/s")
			})
		}
	}
}

// epBenchRank is one rank of BenchmarkLayerEP: its stream, group and tensors.
type epBenchRank struct {
	s         *device.Stream
	g         *ep.Group
	x, y, dy  *device.Tensor
	p         *Params
	grads     *Grads
	allocated []*device.Tensor
}

// steps runs one untimed forward+backward (compiling the kernels), then n timed ones
// in precision prec, serial or overlapped, and returns the time of the n.
func (rk *epBenchRank) steps(tr ep.Transport, prec Precision, serial bool, n int) (time.Duration, error) {
	s := rk.s
	lay, err := NewLayer(Config{Hidden: rk.x.Dim(1), FFN: rk.p.W2.Dim(1), Precision: prec, EP: rk.g,
		Router: RouterConfig{Experts: rk.p.Router.Dim(0), TopK: rk.g.Config().TopK, Renormalize: true}})
	if err != nil {
		return 0, err
	}
	lay.serialEP = serial
	defer lay.InvalidateWeights()
	step := func() error {
		if prec.fp8() {
			// As after an optimizer step: W1 and W2 are quantized again.
			if err := lay.InvalidateWeights(); err != nil {
				return err
			}
		}
		act, err := lay.Forward(s, rk.y, rk.x, rk.p)
		if err != nil {
			return err
		}
		return errors.Join(lay.Backward(s, rk.grads, rk.dy, act), act.Free())
	}
	if err := step(); err != nil {
		return 0, err
	}
	if err := tr.Sync(s); err != nil {
		return 0, err
	}
	t0 := time.Now()
	for range n {
		if err := step(); err != nil {
			return 0, err
		}
	}
	err = tr.Sync(s)
	return time.Since(t0), err
}
