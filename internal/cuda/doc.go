// Package cuda binds the CUDA driver API (libcuda.so.1), NVRTC (libnvrtc) and NCCL
// (libnccl.so.2) at run time with purego: no cgo, no CUDA toolkit at build time.
//
// Every binding returns an error for a failed call. An *Error carries the name of the
// call and the library's own name for the code (CUDA_ERROR_OUT_OF_MEMORY,
// NVRTC_ERROR_COMPILATION, ncclUnhandledCudaError, ...).
//
// The functions here are thin: they do not make a context current. Package device owns
// the rule for CUDA contexts and OS threads: a call that needs a context is made inside
// Device.Do of its device. Besides device, two packages call these functions: ep, whose
// NCCL transport loads NCCL and drives its communicators, and hopper, which encodes the
// TMA tensor maps of gemm's Hopper kernels.
package cuda
