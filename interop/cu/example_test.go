package cu_test

import (
	"fmt"
	"runtime"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/gemm"
	dlcu "github.com/dropless/dropless/interop/cu"
	"github.com/dropless/dropless/quant"
)

// Memory and a stream of cu, used by gemm and quant in place: a ragged_dot of two
// experts (rows 0-1 to expert 0, which doubles; row 2 to expert 1, which swaps the
// columns; row 3 to none) and an MXFP8 quantization of x, copied back by cu.
func Example() {
	d, err := device.Open("cuda:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	// cu calls on this goroutine run in d's primary context, dropless's own.
	ctx, err := dlcu.Context(d)
	if err != nil {
		fmt.Println(err)
		return
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.SetCurrentContext(ctx); err != nil {
		fmt.Println(err)
		return
	}
	cs, err := cu.MakeStream(cu.NonBlocking)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cs.Destroy()

	xv := []float32{1, 2, 3, 4, 5, 6, 7, 8}
	wv := []float32{2, 0, 0, 2, 0, 1, 1, 0} // w[0] = 2·I, w[1] swaps
	sv := []int32{2, 1}
	var ptrs []cu.DevicePtr // freed by cu, once the stream is done
	defer func() {
		cs.Synchronize()
		for _, p := range ptrs {
			cu.MemFree(p)
		}
	}()
	alloc := func(bytes int64, host unsafe.Pointer) (cu.DevicePtr, error) {
		p, err := cu.MemAlloc(bytes)
		if err != nil {
			return 0, err
		}
		ptrs = append(ptrs, p)
		if host == nil {
			return p, nil
		}
		return p, cu.MemcpyHtoDAsync(p, host, bytes, cs)
	}
	px, err1 := alloc(4*8, unsafe.Pointer(&xv[0]))
	pw, err2 := alloc(4*8, unsafe.Pointer(&wv[0]))
	ps, err3 := alloc(4*2, unsafe.Pointer(&sv[0]))
	py, err4 := alloc(4*8, nil)
	if err := firstErr(err1, err2, err3, err4); err != nil {
		fmt.Println(err)
		return
	}

	// The same memory and stream, seen by dropless.
	s, err := dlcu.WrapStream(d, cs)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close() // ends the *device.Stream; cs stays cu's
	x, err1 := dlcu.Wrap(d, px, device.F32, 4, 2)
	w, err2 := dlcu.Wrap(d, pw, device.F32, 2, 2, 2)
	sizes, err3 := dlcu.Wrap(d, ps, device.I32, 2)
	y, err4 := dlcu.Wrap(d, py, device.F32, 4, 2)
	if err := firstErr(err1, err2, err3, err4); err != nil {
		fmt.Println(err)
		return
	}
	if err := gemm.RaggedDot(s, y, x, w, sizes, nil); err != nil {
		fmt.Println(err)
		return
	}
	xq, err := x.Reshape(1, 8) // quantize all of x as one row
	if err != nil {
		fmt.Println(err)
		return
	}
	q, err := quant.Quantize(s, xq, quant.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer q.Free() // q's tensors are dropless's, allocated on s

	// Back to the host through cu, on the same stream.
	yv := make([]float32, 8)
	scale := make([]byte, 1)
	pscale, err := dlcu.Ptr(q.RowScale)
	if err != nil {
		fmt.Println(err)
		return
	}
	err1 = cu.MemcpyDtoHAsync(unsafe.Pointer(&yv[0]), py, 4*8, cs)
	err2 = cu.MemcpyDtoHAsync(unsafe.Pointer(&scale[0]), pscale, 1, cs)
	if err := firstErr(err1, err2, cs.Synchronize()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("y:", yv)
	fmt.Printf("scale of x's block: 2^%d\n", int(scale[0])-127)
	// Output:
	// y: [2 4 6 8 6 5 0 0]
	// scale of x's block: 2^-5
}

// firstErr returns the first non-nil error of errs.
func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
