// Package device holds what every primitive of dropless runs on: the CPU or one CUDA
// GPU (Device), dense row-major arrays on either (Tensor) with exact dtype conversions
// (DType), ordered queues of work (Stream, Event, Graph), a stream-ordered memory pool,
// pinned host memory (HostBuffer), and CUDA C kernels compiled at run time (Program,
// Kernel).
//
// # Devices
//
// Open("") picks GPU 0 if one works, else the CPU; DROPLESS_DEVICE=cpu|cuda|cuda:N
// overrides it. The CUDA driver (libcuda.so.1, or $DROPLESS_LIBCUDA) and NVRTC
// (libnvrtc.so.13, .12, .11.2, or $DROPLESS_NVRTC) are loaded at run time: building and
// testing need neither, and without them everything runs on the CPU.
//
// # Streams
//
// Every op takes a *Stream and is enqueued on it. On a GPU an op returns without waiting
// for its work; only host copies (CopyToHost, Float32s, ...), Synchronize and event
// waits block. On the CPU ops run when enqueued, in the caller's goroutine, spread over
// GOMAXPROCS threads. Stream.BeginCapture and EndCapture record a stream's work as a
// Graph that Launch replays with one call, on both devices. Stream.SetMultiprocessors
// bounds the grids of the persistent kernels enqueued on a stream (the gemm products),
// leaving the other multiprocessors to kernels of other streams.
//
// # Memory
//
// GPU tensors come from the device's stream-ordered pool (cuMemAllocAsync with the
// release threshold raised), so allocating per op costs no driver allocation once the
// pool is warm; free them with Tensor.Free, which is ordered on the allocating stream.
// CPU tensors are Go memory. HostBuffer is pinned host memory for asynchronous copies.
//
// # Kernels
//
// A Program is CUDA C source, embedded with go:embed by the package that owns it,
// compiled by NVRTC for the GPU present (sm_90a on H100 and H200), cached in memory and
// on disk ($DROPLESS_CACHE_DIR). Sources may include the headers of Headers, such as
// dtype.cuh, whose conversions are bit-identical to this package's Go conversions.
// A program compiles when a kernel of it is first asked for (Device.Kernel); Device.Load
// compiles a list of them concurrently beforehand.
//
// # Contexts and threads
//
// A GPU's primary context is retained once when it is opened. Every call into the
// driver goes through Device.Do, which locks the goroutine to its OS thread and makes
// the device's context current for the call: goroutines may move between threads and
// devices freely, and one process may drive several GPUs from several goroutines.
package device
