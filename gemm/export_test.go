package gemm

import "github.com/dropless/dropless/gemm/internal/hopper"

// ForceMMA sets forceMMA (DROPLESS_GEMM_KERNEL=mma) for a test and returns the
// function that restores it.
func ForceMMA(on bool) (restore func()) {
	old := forceMMA
	forceMMA = on
	return func() { forceMMA = old }
}

// FP8Turns sets whether the blockwise Hopper kernels' consumers take turns
// (DROPLESS_FP8_TURNS) for a test and returns the function that restores it.
func FP8Turns(on bool) (restore func()) {
	old := hopper.SetFP8Turns(on)
	return func() { hopper.SetFP8Turns(old) }
}
