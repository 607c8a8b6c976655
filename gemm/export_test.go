package gemm

import (
	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm/internal/hopper"
)

// ForceMMA sets forceMMA (DROPLESS_GEMM_KERNEL=mma) for a test and returns the
// function that restores it.
func ForceMMA(on bool) (restore func()) {
	old := forceMMA
	forceMMA = on
	return func() { forceMMA = old }
}

// FailPadAlloc sets padAllocFault for a test: fn is called before each allocation of a
// padded copy with its index, and an error it returns stands for that allocation's. It
// returns the function that restores the hook.
func FailPadAlloc(fn func(i int) error) (restore func()) {
	old := padAllocFault
	padAllocFault = fn
	return func() { padAllocFault = old }
}

// HopperKernels reports whether bf16 calls on d run the Hopper kernels, directly or
// through padded copies, where their shapes allow.
func HopperKernels(d *device.Device) bool { return !forceMMA && hopper.Supported(d) == nil }

// SetMXFP8Path makes MXFP8 calls that the Hopper MXFP8 kernels take run on those kernels
// ("wgmma"), on their operands dequantized to bf16 ("bf16") or as the estimate chooses
// (""), as DROPLESS_MXFP8_PATH does, and returns the function that restores the choice.
func SetMXFP8Path(p string) (restore func()) {
	old := mxPath
	mxPath = parseMXPath(p)
	return func() { mxPath = old }
}

// MXFP8Vector turns the vector kernels that dequantize MXFP8 operands into bf16 on or off
// (then the element kernels do) and returns the function that restores them.
func MXFP8Vector(on bool) (restore func()) {
	old := mxNoVector
	mxNoVector = !on
	return func() { mxNoVector = old }
}

// FailDequantAlloc sets dequantAllocFault for a test: fn is called after the FP8 forms'
// bf16 temporaries are allocated, and an error it returns stands for theirs. It returns
// the function that restores the hook.
func FailDequantAlloc(fn func() error) (restore func()) {
	old := dequantAllocFault
	dequantAllocFault = fn
	return func() { dequantAllocFault = old }
}

// FP8HopperKernels reports whether FP8 calls on d can run the Hopper FP8 kernels.
func FP8HopperKernels(d *device.Device) bool { return !forceMMA && hopper.BlockwiseSupported(d) == nil }
