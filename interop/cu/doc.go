// Package cu converts between the handles of gorgonia.org/cu, a cgo binding of the CUDA
// driver, and those of dropless, both ways and without copies:
//
//	Wrap        cu.DevicePtr → *device.Tensor  (a dtype and shape over cu's memory)
//	Ptr         *device.Tensor → cu.DevicePtr
//	WrapStream  cu.Stream → *device.Stream
//	Stream      *device.Stream → cu.Stream
//	Device      *device.Device → cu.Device
//	Context     *device.Device → cu.CUContext (the GPU's primary context)
//
// Import it under another name than gorgonia's cu, such as dlcu.
//
// # Contexts
//
// dropless makes every driver call for a GPU in the GPU's primary context (see
// device.Device.Do); memory and streams of another context cannot be used by its ops.
// cu's Device.MakeContext, NewContext and NewManuallyManagedContext create such other
// contexts: Wrap and WrapStream refuse their memory and streams. cu code shares
// dropless's context by making the primary context current on a locked OS thread,
//
//	ctx, err := dlcu.Context(d) // or dev.RetainPrimaryCtx() of d's cu.Device, the same context
//	runtime.LockOSThread()
//	defer runtime.UnlockOSThread()
//	err = cu.SetCurrentContext(ctx)
//	p, err := cu.MemAlloc(n) // in d's primary context
//
// or by calling cu inside d.Do, which locks the thread and makes the context current:
//
//	err := d.Do(func() error { var err error; s, err = cu.MakeStream(cu.NonBlocking); return err })
//
// Do not wrap the primary context in a cu.Ctx (CtxFromCUContext): its Close and its
// finalizer call cuCtxDestroy on it.
//
// # Who owns what
//
// Nothing changes hands:
//   - memory that cu allocated stays cu's: the tensor of Wrap does not free it (its Free
//     does nothing); the caller frees it with cu.MemFree after the work that uses it;
//   - a tensor's memory seen through Ptr stays dropless's: cu must not free it, and it
//     is valid until the tensor is freed, which happens in stream order on the stream
//     that allocated it (order cu's work on other streams before that);
//   - a cu stream stays cu's: closing the stream of WrapStream ends the *device.Stream
//     only, and the creator destroys the CUDA stream (Stream.Destroy) once no work on it
//     is pending; a dropless stream seen through Stream stays dropless's, valid until it
//     is closed, and cu must not destroy it;
//   - tensors that dropless ops allocate on a wrapped stream (quant.Quantize's outputs,
//     say) are dropless's, freed with their Free, in stream order on that stream.
//
// Ordering across the two bindings is the stream's: cu work and dropless ops enqueued on
// one stream run in the order they were enqueued; on different streams, order them with
// events as usual.
//
// # Building
//
// Unlike dropless itself, which loads the CUDA driver at run time, this package needs
// cgo and, at build time, cuda.h and libcuda.so of CUDA 12 or older (gorgonia.org/cu
// v0.9.6 does not build with CUDA 13's cuda.h); programs built with them run on newer
// drivers. Point cgo at them with CGO_CFLAGS=-I<dir of cuda.h> and CGO_LDFLAGS=-L<dir of
// libcuda.so> where they are not in /usr/local/cuda. build-test.sh builds this package's
// test binary so, from Debian's nvidia-cuda-dev when no toolkit is at hand.
//
// gorgonia.org/cu initializes the driver when the program starts and exits the process
// where that fails (no driver, no GPU): a program that imports this package, its test
// binary included, cannot run on a machine without a working GPU. Keep it out of code
// that must also run on the CPU.
package cu
