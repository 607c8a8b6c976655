// Package kernelset records which CUDA programs each capability of the library runs, so
// that a caller that knows what it will run (a moe.Layer, say) can have them all
// compiled at once with device.Device.Load, before the first kernel needs them.
// Packages register their programs when they are initialized.
package kernelset

import (
	"sync"

	"github.com/dropless/dropless/device"
)

// The capabilities, the keys of Register and For.
const (
	Gemm           = "gemm"            // bf16 and f32 ragged_dot, its plan and its Status
	GemmFP8        = "gemm/fp8"        // the FP8 ragged_dot forms, both recipes
	QuantMXFP8     = "quant/mxfp8"     // MXFP8 quantization
	QuantBlockwise = "quant/blockwise" // blockwise FP8 quantization
	QuantGather    = "quant/gather"    // gathers of quantized rows
	EP             = "ep"              // dispatch and combine
)

type entry struct {
	on func(*device.Device) bool
	p  *device.Program
}

var (
	mu    sync.Mutex
	byKey = map[string][]entry{}
)

// Register records that the capability key runs progs on the devices for which on
// reports true (every CUDA device when on is nil).
func Register(key string, on func(*device.Device) bool, progs ...*device.Program) {
	mu.Lock()
	defer mu.Unlock()
	for _, p := range progs {
		byKey[key] = append(byKey[key], entry{on, p})
	}
}

// For returns the programs that the capabilities keys run on d, in the order they were
// registered, each once.
func For(d *device.Device, keys ...string) []*device.Program {
	mu.Lock()
	defer mu.Unlock()
	var out []*device.Program
	seen := map[*device.Program]bool{}
	for _, k := range keys {
		for _, e := range byKey[k] {
			if !seen[e.p] && (e.on == nil || e.on(d)) {
				seen[e.p] = true
				out = append(out, e.p)
			}
		}
	}
	return out
}
