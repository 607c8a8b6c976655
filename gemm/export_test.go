package gemm

// ForceMMA sets forceMMA (DROPLESS_GEMM_KERNEL=mma) for a test and returns the
// function that restores it.
func ForceMMA(on bool) (restore func()) {
	old := forceMMA
	forceMMA = on
	return func() { forceMMA = old }
}
