// Package cuda binds the CUDA driver API (libcuda.so.1), NVRTC (libnvrtc) and NCCL
// (libnccl.so.2) at run time with purego: no cgo, no CUDA toolkit at build time.
//
// Every binding returns an error for a failed call. An *Error carries the name of the
// call and the library's own name for the code (CUDA_ERROR_OUT_OF_MEMORY,
// NVRTC_ERROR_COMPILATION, ncclUnhandledCudaError, ...).
//
// The functions here are thin: they do not make a context current. Package device owns
// the rule for CUDA contexts and OS threads; call these only from inside it.
package cuda
