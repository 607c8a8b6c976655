package cu

// The two context queries that gorgonia.org/cu does not bind.

/*
#cgo LDFLAGS: -lcuda
#include <stdint.h>
#include <cuda.h>

static CUresult dl_pointer_context(uintptr_t p, uintptr_t *ctx) {
	CUcontext c = NULL;
	CUresult r = cuPointerGetAttribute(&c, CU_POINTER_ATTRIBUTE_CONTEXT, (CUdeviceptr)p);
	*ctx = (uintptr_t)c;
	return r;
}

static CUresult dl_stream_context(uintptr_t s, uintptr_t *ctx) {
	CUcontext c = NULL;
	CUresult r = cuStreamGetCtx((CUstream)s, &c);
	*ctx = (uintptr_t)c;
	return r;
}

static CUresult dl_current_context(uintptr_t *ctx) {
	CUcontext c = NULL;
	CUresult r = cuCtxGetCurrent(&c);
	*ctx = (uintptr_t)c;
	return r;
}

static const char *dl_error_name(CUresult r) {
	const char *s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS || s == NULL) {
		return "unknown CUresult";
	}
	return s;
}
*/
import "C"

import "fmt"

// check returns nil for CUDA_SUCCESS, else an error naming call and the result.
func check(call string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("%s: %s (%d)", call, C.GoString(C.dl_error_name(r)), int(r))
}

// pointerContext returns the context of the device memory at p: 0 for memory of no
// context (stream-ordered pools, virtual memory management).
func pointerContext(p uintptr) (uintptr, error) {
	var ctx C.uintptr_t
	err := check("cuPointerGetAttribute(CONTEXT)", C.dl_pointer_context(C.uintptr_t(p), &ctx))
	return uintptr(ctx), err
}

// streamContext returns the context of the CUDA stream h.
func streamContext(h uintptr) (uintptr, error) {
	var ctx C.uintptr_t
	err := check("cuStreamGetCtx", C.dl_stream_context(C.uintptr_t(h), &ctx))
	return uintptr(ctx), err
}

// currentContext returns the calling thread's current context.
func currentContext() (uintptr, error) {
	var ctx C.uintptr_t
	err := check("cuCtxGetCurrent", C.dl_current_context(&ctx))
	return uintptr(ctx), err
}
