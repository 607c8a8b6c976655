package cuda

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Handles of the driver API. Zero is the null handle.
type (
	Device    int32   // CUdevice
	Context   uintptr // CUcontext
	Stream    uintptr // CUstream
	Event     uintptr // CUevent
	DevicePtr uint64  // CUdeviceptr
	Module    uintptr // CUmodule
	Function  uintptr // CUfunction
	MemPool   uintptr // CUmemoryPool
	Graph     uintptr // CUgraph
	GraphExec uintptr // CUgraphExec
)

// Device attributes (CUdevice_attribute).
const (
	AttrMaxThreadsPerBlock           = 1
	AttrClockRate                    = 13
	AttrMultiprocessorCount          = 16
	AttrL2CacheSize                  = 38
	AttrComputeCapabilityMajor       = 75
	AttrComputeCapabilityMinor       = 76
	AttrMaxSharedMemoryPerBlockOptin = 97
	AttrMemoryPoolsSupported         = 115
)

// Memory pool attributes (CUmemPool_attribute).
const (
	PoolReleaseThreshold   = 4
	PoolReservedMemCurrent = 5
	PoolReservedMemHigh    = 6
	PoolUsedMemCurrent     = 7
	PoolUsedMemHigh        = 8
)

// Flags.
const (
	StreamNonBlocking        = 0x1 // CU_STREAM_NON_BLOCKING
	EventDisableTiming       = 0x2 // CU_EVENT_DISABLE_TIMING
	MemHostAllocPortable     = 0x1 // CU_MEMHOSTALLOC_PORTABLE
	CaptureModeRelaxed       = 2   // CU_STREAM_CAPTURE_MODE_RELAXED
	FuncAttrMaxDynamicSmem   = 8   // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
	PointerAttrDeviceOrdinal = 9   // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
	PointerAttrMemoryType    = 2   // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
)

// Result codes the library tests for.
const (
	Success        = 0
	ErrNotReady    = 600 // CUDA_ERROR_NOT_READY
	ErrNoDevice    = 100 // CUDA_ERROR_NO_DEVICE
	ErrOutOfMemory = 2   // CUDA_ERROR_OUT_OF_MEMORY
)

type driver struct {
	lib *library

	// Raw addresses of the calls on the launch path, called with purego.SyscallN,
	// which costs less than a reflect-built function.
	pCtxSetCurrent, pLaunchKernel uintptr

	cuGetErrorName   func(res int32, s **byte) int32
	cuGetErrorString func(res int32, s **byte) int32

	cuInit                func(flags uint32) int32
	cuDriverGetVersion    func(v *int32) int32
	cuDeviceGetCount      func(n *int32) int32
	cuDeviceGet           func(d *Device, ordinal int32) int32
	cuDeviceGetName       func(name *byte, n int32, d Device) int32
	cuDeviceGetAttribute  func(v *int32, attr int32, d Device) int32
	cuDeviceTotalMem      func(b *uint64, d Device) int32
	cuDeviceCanAccessPeer func(ok *int32, d, peer Device) int32

	cuDevicePrimaryCtxRetain  func(c *Context, d Device) int32
	cuDevicePrimaryCtxRelease func(d Device) int32
	cuCtxSetCurrent           func(c Context) int32
	cuCtxSynchronize          func() int32
	cuCtxEnablePeerAccess     func(peer Context, flags uint32) int32
	cuStreamWaitValue32       func(s Stream, addr DevicePtr, v, flags uint32) int32
	cuIpcGetMemHandle         func(h *IPCMemHandle, p DevicePtr) int32
	cuIpcOpenMemHandle        func(p *DevicePtr, h IPCMemHandle, flags uint32) int32
	cuIpcCloseMemHandle       func(p DevicePtr) int32

	cuStreamCreate              func(s *Stream, flags uint32) int32
	cuStreamCreateWithPriority  func(s *Stream, flags uint32, priority int32) int32
	cuCtxGetStreamPriorityRange func(least, greatest *int32) int32
	cuStreamDestroy             func(s Stream) int32
	cuStreamSynchronize         func(s Stream) int32
	cuStreamQuery               func(s Stream) int32
	cuStreamWaitEvent           func(s Stream, e Event, flags uint32) int32

	cuEventCreate      func(e *Event, flags uint32) int32
	cuEventDestroy     func(e Event) int32
	cuEventRecord      func(e Event, s Stream) int32
	cuEventSynchronize func(e Event) int32
	cuEventQuery       func(e Event) int32
	cuEventElapsedTime func(ms *float32, start, end Event) int32

	cuMemGetInfo              func(free, total *uint64) int32
	cuMemAlloc                func(p *DevicePtr, n uint64) int32
	cuMemFree                 func(p DevicePtr) int32
	cuMemAllocAsync           func(p *DevicePtr, n uint64, s Stream) int32
	cuMemFreeAsync            func(p DevicePtr, s Stream) int32
	cuDeviceGetDefaultMemPool func(p *MemPool, d Device) int32
	cuMemPoolSetAttribute     func(p MemPool, attr int32, v unsafe.Pointer) int32
	cuMemPoolGetAttribute     func(p MemPool, attr int32, v unsafe.Pointer) int32
	cuMemPoolTrimTo           func(p MemPool, keep uint64) int32
	cuMemHostAlloc            func(p *unsafe.Pointer, n uint64, flags uint32) int32
	cuMemFreeHost             func(p unsafe.Pointer) int32
	cuMemcpyHtoDAsync         func(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) int32
	cuMemcpyDtoHAsync         func(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) int32
	cuMemcpyDtoDAsync         func(dst, src DevicePtr, n uint64, s Stream) int32
	cuMemcpyPeerAsync         func(dst DevicePtr, dctx Context, src DevicePtr, sctx Context, n uint64, s Stream) int32
	cuMemsetD8Async           func(dst DevicePtr, v uint8, n uint64, s Stream) int32
	cuMemsetD32Async          func(dst DevicePtr, v uint32, n uint64, s Stream) int32
	cuPointerGetAttribute     func(data unsafe.Pointer, attr int32, p DevicePtr) int32

	cuModuleLoadData                            func(m *Module, image unsafe.Pointer) int32
	cuModuleUnload                              func(m Module) int32
	cuModuleGetFunction                         func(f *Function, m Module, name *byte) int32
	cuFuncSetAttribute                          func(f Function, attr int32, v int32) int32
	cuFuncGetAttribute                          func(v *int32, attr int32, f Function) int32
	cuLaunchKernel                              func(f Function, gx, gy, gz, bx, by, bz, smem uint32, s Stream, params unsafe.Pointer, extra unsafe.Pointer) int32
	cuOccupancyMaxActiveBlocksPerMultiprocessor func(n *int32, f Function, block int32, smem uint64) int32
	cuOccupancyMaxActiveClusters                func(n *int32, f Function, config unsafe.Pointer) int32

	cuTensorMapEncodeTiled func(tmap unsafe.Pointer, dtype int32, rank uint32, addr DevicePtr, dims, strides unsafe.Pointer,
		box, elemStrides unsafe.Pointer, interleave, swizzle, l2 int32, oob int32) int32

	cuStreamBeginCapture        func(s Stream, mode int32) int32
	cuStreamEndCapture          func(s Stream, g *Graph) int32
	cuGraphInstantiateWithFlags func(e *GraphExec, g Graph, flags uint64) int32
	cuGraphLaunch               func(e GraphExec, s Stream) int32
	cuGraphExecDestroy          func(e GraphExec) int32
	cuGraphDestroy              func(g Graph) int32
}

var (
	drv     driver
	drvOnce sync.Once
	drvErr  error
)

// DriverPath is the library LoadDriver opens: $DROPLESS_LIBCUDA if set, else libcuda.so.1.
func DriverPath() string {
	if p := os.Getenv("DROPLESS_LIBCUDA"); p != "" {
		return p
	}
	return "libcuda.so.1"
}

// LoadDriver loads the CUDA driver from DriverPath and calls cuInit once per process.
// Later calls return the first call's result.
func LoadDriver() error {
	drvOnce.Do(func() { drvErr = loadDriver(DriverPath()) })
	return drvErr
}

// OpenDriver tries to load the driver library at path without keeping it: it reports
// what LoadDriver would say for that path. Use it to diagnose a setup.
func OpenDriver(path string) error {
	var d driver
	return d.load(path)
}

func loadDriver(path string) error {
	if err := drv.load(path); err != nil {
		return err
	}
	if err := check("cuInit", drv.cuInit(0)); err != nil {
		return err
	}
	return nil
}

func (d *driver) load(path string) error {
	lib, err := open("the CUDA driver", path)
	if err != nil {
		return fmt.Errorf("%w (is an NVIDIA driver installed?)", err)
	}
	d.lib = lib
	d.pCtxSetCurrent = lib.sym("cuCtxSetCurrent")
	d.pLaunchKernel = lib.sym("cuLaunchKernel")
	lib.bind(&d.cuGetErrorName, "cuGetErrorName")
	lib.bind(&d.cuGetErrorString, "cuGetErrorString")
	lib.bind(&d.cuInit, "cuInit")
	lib.bind(&d.cuDriverGetVersion, "cuDriverGetVersion")
	lib.bind(&d.cuDeviceGetCount, "cuDeviceGetCount")
	lib.bind(&d.cuDeviceGet, "cuDeviceGet")
	lib.bind(&d.cuDeviceGetName, "cuDeviceGetName")
	lib.bind(&d.cuDeviceGetAttribute, "cuDeviceGetAttribute")
	lib.bind(&d.cuDeviceTotalMem, "cuDeviceTotalMem_v2")
	lib.bind(&d.cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer")
	lib.bind(&d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
	lib.bind(&d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")
	lib.bind(&d.cuCtxSetCurrent, "cuCtxSetCurrent")
	lib.bind(&d.cuCtxSynchronize, "cuCtxSynchronize")
	lib.bind(&d.cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess")
	lib.optional(&d.cuStreamWaitValue32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
	lib.bind(&d.cuIpcGetMemHandle, "cuIpcGetMemHandle")
	lib.bind(&d.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
	lib.bind(&d.cuIpcCloseMemHandle, "cuIpcCloseMemHandle")
	lib.bind(&d.cuStreamCreate, "cuStreamCreate")
	lib.bind(&d.cuStreamCreateWithPriority, "cuStreamCreateWithPriority")
	lib.bind(&d.cuCtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange")
	lib.bind(&d.cuStreamDestroy, "cuStreamDestroy_v2")
	lib.bind(&d.cuStreamSynchronize, "cuStreamSynchronize")
	lib.bind(&d.cuStreamQuery, "cuStreamQuery")
	lib.bind(&d.cuStreamWaitEvent, "cuStreamWaitEvent")
	lib.bind(&d.cuEventCreate, "cuEventCreate")
	lib.bind(&d.cuEventDestroy, "cuEventDestroy_v2")
	lib.bind(&d.cuEventRecord, "cuEventRecord")
	lib.bind(&d.cuEventSynchronize, "cuEventSynchronize")
	lib.bind(&d.cuEventQuery, "cuEventQuery")
	lib.bind(&d.cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime")
	lib.bind(&d.cuMemGetInfo, "cuMemGetInfo_v2")
	lib.bind(&d.cuMemAlloc, "cuMemAlloc_v2")
	lib.bind(&d.cuMemFree, "cuMemFree_v2")
	lib.bind(&d.cuMemAllocAsync, "cuMemAllocAsync")
	lib.bind(&d.cuMemFreeAsync, "cuMemFreeAsync")
	lib.bind(&d.cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool")
	lib.bind(&d.cuMemPoolSetAttribute, "cuMemPoolSetAttribute")
	lib.bind(&d.cuMemPoolGetAttribute, "cuMemPoolGetAttribute")
	lib.bind(&d.cuMemPoolTrimTo, "cuMemPoolTrimTo")
	lib.bind(&d.cuMemHostAlloc, "cuMemHostAlloc")
	lib.bind(&d.cuMemFreeHost, "cuMemFreeHost")
	lib.bind(&d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2")
	lib.bind(&d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2")
	lib.bind(&d.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")
	lib.bind(&d.cuMemcpyPeerAsync, "cuMemcpyPeerAsync")
	lib.bind(&d.cuMemsetD8Async, "cuMemsetD8Async")
	lib.bind(&d.cuMemsetD32Async, "cuMemsetD32Async")
	lib.bind(&d.cuPointerGetAttribute, "cuPointerGetAttribute")
	lib.bind(&d.cuModuleLoadData, "cuModuleLoadData")
	lib.bind(&d.cuModuleUnload, "cuModuleUnload")
	lib.bind(&d.cuModuleGetFunction, "cuModuleGetFunction")
	lib.bind(&d.cuFuncSetAttribute, "cuFuncSetAttribute")
	lib.bind(&d.cuFuncGetAttribute, "cuFuncGetAttribute")
	lib.bind(&d.cuLaunchKernel, "cuLaunchKernel")
	lib.bind(&d.cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
	lib.optional(&d.cuTensorMapEncodeTiled, "cuTensorMapEncodeTiled")
	lib.optional(&d.cuOccupancyMaxActiveClusters, "cuOccupancyMaxActiveClusters")
	lib.bind(&d.cuStreamBeginCapture, "cuStreamBeginCapture_v2")
	lib.bind(&d.cuStreamEndCapture, "cuStreamEndCapture")
	lib.bind(&d.cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags")
	lib.bind(&d.cuGraphLaunch, "cuGraphLaunch")
	lib.bind(&d.cuGraphExecDestroy, "cuGraphExecDestroy")
	lib.bind(&d.cuGraphDestroy, "cuGraphDestroy")
	return lib.err()
}

// driverNames holds names for common codes, used when cuGetErrorName is unavailable.
var driverNames = map[int32]string{
	1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
	4: "CUDA_ERROR_DEINITIALIZED", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 100: "CUDA_ERROR_NO_DEVICE",
	101: "CUDA_ERROR_INVALID_DEVICE", 200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT",
	209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	702: "CUDA_ERROR_LAUNCH_TIMEOUT", 719: "CUDA_ERROR_LAUNCH_FAILED", 999: "CUDA_ERROR_UNKNOWN",
}

// check turns a CUresult into an *Error naming call, or nil for CUDA_SUCCESS.
func check(call string, res int32) error {
	if res == Success {
		return nil
	}
	e := &Error{Call: call, Code: int(res)}
	if drv.cuGetErrorName != nil {
		var p *byte
		if drv.cuGetErrorName(res, &p) == Success {
			e.Name = goString(p)
		}
		if drv.cuGetErrorString(res, &p) == Success {
			e.Desc = goString(p)
		}
	}
	if e.Name == "" {
		e.Name = driverNames[res]
	}
	if e.Name == "" {
		e.Name = fmt.Sprintf("CUresult(%d)", res)
	}
	return e
}

// DriverVersion returns the CUDA version the driver supports, as 1000·major + 10·minor.
func DriverVersion() (int, error) {
	var v int32
	err := check("cuDriverGetVersion", drv.cuDriverGetVersion(&v))
	return int(v), err
}

// DeviceCount returns the number of CUDA devices.
func DeviceCount() (int, error) {
	var n int32
	err := check("cuDeviceGetCount", drv.cuDeviceGetCount(&n))
	return int(n), err
}

// DeviceGet returns the device with the given ordinal.
func DeviceGet(ordinal int) (Device, error) {
	var d Device
	err := check("cuDeviceGet", drv.cuDeviceGet(&d, int32(ordinal)))
	return d, err
}

// DeviceName returns the device's marketing name.
func DeviceName(d Device) (string, error) {
	buf := make([]byte, 256)
	if err := check("cuDeviceGetName", drv.cuDeviceGetName(&buf[0], int32(len(buf)), d)); err != nil {
		return "", err
	}
	return goString(&buf[0]), nil
}

// DeviceAttribute returns one CUdevice_attribute of d.
func DeviceAttribute(d Device, attr int) (int, error) {
	var v int32
	err := check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(&v, int32(attr), d))
	return int(v), err
}

// DeviceTotalMem returns the device memory in bytes.
func DeviceTotalMem(d Device) (uint64, error) {
	var b uint64
	err := check("cuDeviceTotalMem", drv.cuDeviceTotalMem(&b, d))
	return b, err
}

// DeviceCanAccessPeer reports whether d can map peer's memory.
func DeviceCanAccessPeer(d, peer Device) (bool, error) {
	var ok int32
	err := check("cuDeviceCanAccessPeer", drv.cuDeviceCanAccessPeer(&ok, d, peer))
	return ok != 0, err
}

// PrimaryCtxRetain retains the device's primary context.
func PrimaryCtxRetain(d Device) (Context, error) {
	var c Context
	err := check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(&c, d))
	return c, err
}

// CtxSetCurrent binds c to the calling OS thread.
func CtxSetCurrent(c Context) error {
	r, _, _ := purego.SyscallN(drv.pCtxSetCurrent, uintptr(c))
	return check("cuCtxSetCurrent", int32(r))
}

// CtxSynchronize waits for all work of the current context.
func CtxSynchronize() error { return check("cuCtxSynchronize", drv.cuCtxSynchronize()) }

// CtxEnablePeerAccess lets the current context access peer's memory. Enabling it twice is not an error.
func CtxEnablePeerAccess(peer Context) error {
	res := drv.cuCtxEnablePeerAccess(peer, 0)
	if res == 704 { // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
		return nil
	}
	return check("cuCtxEnablePeerAccess", res)
}

// MemGetInfo returns the free and total memory of the current context's device.
func MemGetInfo() (free, total uint64, err error) {
	err = check("cuMemGetInfo", drv.cuMemGetInfo(&free, &total))
	return
}

// StreamCreate creates a stream with the given flags.
func StreamCreate(flags int) (Stream, error) {
	var s Stream
	err := check("cuStreamCreate", drv.cuStreamCreate(&s, uint32(flags)))
	return s, err
}

// StreamCreateWithPriority creates a stream with the given flags and priority (lower
// numbers are higher priorities; see StreamPriorityRange).
func StreamCreateWithPriority(flags, priority int) (Stream, error) {
	var s Stream
	err := check("cuStreamCreateWithPriority", drv.cuStreamCreateWithPriority(&s, uint32(flags), int32(priority)))
	return s, err
}

// StreamPriorityRange returns the current context's least and greatest stream
// priorities (greatest is the numerically lowest).
func StreamPriorityRange() (least, greatest int, err error) {
	var l, g int32
	err = check("cuCtxGetStreamPriorityRange", drv.cuCtxGetStreamPriorityRange(&l, &g))
	return int(l), int(g), err
}

// StreamDestroy destroys s once its work is done.
func StreamDestroy(s Stream) error { return check("cuStreamDestroy", drv.cuStreamDestroy(s)) }

// StreamSynchronize waits for s.
func StreamSynchronize(s Stream) error {
	return check("cuStreamSynchronize", drv.cuStreamSynchronize(s))
}

// StreamQuery reports whether s has finished its work.
func StreamQuery(s Stream) (bool, error) {
	res := drv.cuStreamQuery(s)
	if res == ErrNotReady {
		return false, nil
	}
	return res == Success, check("cuStreamQuery", res)
}

// StreamWaitEvent makes future work on s wait for e.
func StreamWaitEvent(s Stream, e Event) error {
	return check("cuStreamWaitEvent", drv.cuStreamWaitEvent(s, e, 0))
}

// EventCreate creates an event.
func EventCreate(flags int) (Event, error) {
	var e Event
	err := check("cuEventCreate", drv.cuEventCreate(&e, uint32(flags)))
	return e, err
}

// EventDestroy destroys e.
func EventDestroy(e Event) error { return check("cuEventDestroy", drv.cuEventDestroy(e)) }

// EventRecord records e on s.
func EventRecord(e Event, s Stream) error { return check("cuEventRecord", drv.cuEventRecord(e, s)) }

// EventSynchronize waits for e.
func EventSynchronize(e Event) error {
	return check("cuEventSynchronize", drv.cuEventSynchronize(e))
}

// EventQuery reports whether e has completed.
func EventQuery(e Event) (bool, error) {
	res := drv.cuEventQuery(e)
	if res == ErrNotReady {
		return false, nil
	}
	return res == Success, check("cuEventQuery", res)
}

// EventElapsedTime returns the milliseconds between two completed events.
func EventElapsedTime(start, end Event) (float32, error) {
	var ms float32
	err := check("cuEventElapsedTime", drv.cuEventElapsedTime(&ms, start, end))
	return ms, err
}

// StreamWaitValueGEQ makes s wait until the 32-bit word at addr is at least v (unsigned).
// It reports false when the driver lacks stream memory operations.
func StreamWaitValueGEQ(s Stream, addr DevicePtr, v uint32) (bool, error) {
	if drv.cuStreamWaitValue32 == nil {
		return false, nil
	}
	const geq = 0x0 // CU_STREAM_WAIT_VALUE_GEQ
	return true, check("cuStreamWaitValue32", drv.cuStreamWaitValue32(s, addr, v, geq))
}

// IPCMemHandle is a CUipcMemHandle: what another process needs to map an allocation.
type IPCMemHandle struct{ Reserved [64]byte }

// IpcGetMemHandle returns the handle of the allocation (from MemAlloc) at p.
func IpcGetMemHandle(p DevicePtr) (IPCMemHandle, error) {
	var h IPCMemHandle
	err := check("cuIpcGetMemHandle", drv.cuIpcGetMemHandle(&h, p))
	return h, err
}

// IpcOpenMemHandle maps another process's allocation into the current context, enabling
// peer access to its device as needed.
func IpcOpenMemHandle(h IPCMemHandle) (DevicePtr, error) {
	var p DevicePtr
	const lazyPeer = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	err := check("cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle(&p, h, lazyPeer))
	return p, err
}

// IpcCloseMemHandle unmaps what IpcOpenMemHandle mapped.
func IpcCloseMemHandle(p DevicePtr) error {
	return check("cuIpcCloseMemHandle", drv.cuIpcCloseMemHandle(p))
}

// MemAlloc allocates n bytes of device memory synchronously.
func MemAlloc(n uint64) (DevicePtr, error) {
	var p DevicePtr
	err := check("cuMemAlloc", drv.cuMemAlloc(&p, n))
	return p, err
}

// MemFree frees memory from MemAlloc.
func MemFree(p DevicePtr) error { return check("cuMemFree", drv.cuMemFree(p)) }

// MemAllocAsync allocates n bytes from the device's current pool, ordered on s.
func MemAllocAsync(n uint64, s Stream) (DevicePtr, error) {
	var p DevicePtr
	err := check("cuMemAllocAsync", drv.cuMemAllocAsync(&p, n, s))
	return p, err
}

// MemFreeAsync returns p to its pool, ordered on s.
func MemFreeAsync(p DevicePtr, s Stream) error {
	return check("cuMemFreeAsync", drv.cuMemFreeAsync(p, s))
}

// DeviceGetDefaultMemPool returns d's default memory pool.
func DeviceGetDefaultMemPool(d Device) (MemPool, error) {
	var p MemPool
	err := check("cuDeviceGetDefaultMemPool", drv.cuDeviceGetDefaultMemPool(&p, d))
	return p, err
}

// MemPoolSetAttribute64 sets a 64-bit pool attribute.
func MemPoolSetAttribute64(p MemPool, attr int, v uint64) error {
	return check("cuMemPoolSetAttribute", drv.cuMemPoolSetAttribute(p, int32(attr), unsafe.Pointer(&v)))
}

// MemPoolGetAttribute64 reads a 64-bit pool attribute.
func MemPoolGetAttribute64(p MemPool, attr int) (uint64, error) {
	v := new(uint64)
	err := check("cuMemPoolGetAttribute", drv.cuMemPoolGetAttribute(p, int32(attr), unsafe.Pointer(v)))
	return *v, err
}

// MemPoolTrimTo releases pool memory down to keep bytes.
func MemPoolTrimTo(p MemPool, keep uint64) error {
	return check("cuMemPoolTrimTo", drv.cuMemPoolTrimTo(p, keep))
}

// MemHostAlloc allocates n bytes of page-locked host memory.
func MemHostAlloc(n uint64, flags int) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := check("cuMemHostAlloc", drv.cuMemHostAlloc(&p, n, uint32(flags)))
	return p, err
}

// MemFreeHost frees memory from MemHostAlloc.
func MemFreeHost(p unsafe.Pointer) error { return check("cuMemFreeHost", drv.cuMemFreeHost(p)) }

// MemcpyHtoDAsync copies n bytes from host src to device dst on s.
func MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) error {
	return check("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync(dst, src, n, s))
}

// MemcpyDtoHAsync copies n bytes from device src to host dst on s.
func MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) error {
	return check("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync(dst, src, n, s))
}

// MemcpyDtoDAsync copies n bytes between device buffers on s.
func MemcpyDtoDAsync(dst, src DevicePtr, n uint64, s Stream) error {
	return check("cuMemcpyDtoDAsync", drv.cuMemcpyDtoDAsync(dst, src, n, s))
}

// MemcpyPeerAsync copies n bytes between the memory of two contexts on s.
func MemcpyPeerAsync(dst DevicePtr, dctx Context, src DevicePtr, sctx Context, n uint64, s Stream) error {
	return check("cuMemcpyPeerAsync", drv.cuMemcpyPeerAsync(dst, dctx, src, sctx, n, s))
}

// MemsetD8Async sets n bytes at dst to v on s.
func MemsetD8Async(dst DevicePtr, v uint8, n uint64, s Stream) error {
	return check("cuMemsetD8Async", drv.cuMemsetD8Async(dst, v, n, s))
}

// MemsetD32Async sets n 32-bit words at dst to v on s.
func MemsetD32Async(dst DevicePtr, v uint32, n uint64, s Stream) error {
	return check("cuMemsetD32Async", drv.cuMemsetD32Async(dst, v, n, s))
}

// PointerDeviceOrdinal returns the ordinal of the device that owns p.
func PointerDeviceOrdinal(p DevicePtr) (int, error) {
	v := new(int32)
	err := check("cuPointerGetAttribute", drv.cuPointerGetAttribute(unsafe.Pointer(v), PointerAttrDeviceOrdinal, p))
	return int(*v), err
}

// ModuleLoadData loads a cubin or PTX image into the current context.
func ModuleLoadData(image []byte) (Module, error) {
	var m Module
	err := check("cuModuleLoadData", drv.cuModuleLoadData(&m, unsafe.Pointer(&image[0])))
	return m, err
}

// ModuleUnload unloads m.
func ModuleUnload(m Module) error { return check("cuModuleUnload", drv.cuModuleUnload(m)) }

// ModuleGetFunction returns the kernel called name in m.
func ModuleGetFunction(m Module, name string) (Function, error) {
	var f Function
	b := cString(name)
	err := check("cuModuleGetFunction("+name+")", drv.cuModuleGetFunction(&f, m, &b[0]))
	return f, err
}

// FuncSetAttribute sets a CUfunction_attribute of f.
func FuncSetAttribute(f Function, attr, v int) error {
	return check("cuFuncSetAttribute", drv.cuFuncSetAttribute(f, int32(attr), int32(v)))
}

// FuncGetAttribute reads a CUfunction_attribute of f.
func FuncGetAttribute(f Function, attr int) (int, error) {
	var v int32
	err := check("cuFuncGetAttribute", drv.cuFuncGetAttribute(&v, int32(attr), f))
	return int(v), err
}

// OccupancyMaxActiveBlocksPerMultiprocessor returns how many blocks of f fit on one SM.
func OccupancyMaxActiveBlocksPerMultiprocessor(f Function, block, smem int) (int, error) {
	var n int32
	err := check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
		drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, f, int32(block), uint64(smem)))
	return int(n), err
}

// launchConfig mirrors CUlaunchConfig: a launch's grid, block, dynamic shared memory
// and stream, with no launch attributes (a kernel's cluster shape then comes from its
// __cluster_dims__).
type launchConfig struct {
	grid, block [3]uint32
	smem        uint32
	stream      Stream
	attrs       uintptr
	nattrs      uint32
}

// OccupancyMaxActiveClusters returns how many clusters of f, launched with blocks of
// block threads and smem bytes of dynamic shared memory, can run on the device at once.
// f's cluster shape is its compile-time one (__cluster_dims__); grid is a grid of whole
// clusters. It fails on drivers older than CUDA 11.8, which lack the call.
func OccupancyMaxActiveClusters(f Function, grid [3]uint32, block, smem int) (int, error) {
	if drv.cuOccupancyMaxActiveClusters == nil {
		return 0, errors.New("cuda: the driver has no cuOccupancyMaxActiveClusters (CUDA 11.8 or newer)")
	}
	cfg := &launchConfig{grid: grid, block: [3]uint32{uint32(block), 1, 1}, smem: uint32(smem)}
	var n int32
	err := check("cuOccupancyMaxActiveClusters", drv.cuOccupancyMaxActiveClusters(&n, f, unsafe.Pointer(cfg)))
	return int(n), err
}

// LaunchKernel enqueues f on s. params points to an array of pointers, one per kernel
// parameter, each to the parameter's value; the caller keeps them alive for the call.
// params must point to Go heap memory (it does not move) or C memory.
func LaunchKernel(f Function, grid, block [3]uint32, smem uint32, s Stream, params unsafe.Pointer) error {
	r, _, _ := purego.SyscallN(drv.pLaunchKernel, uintptr(f), uintptr(grid[0]), uintptr(grid[1]), uintptr(grid[2]),
		uintptr(block[0]), uintptr(block[1]), uintptr(block[2]), uintptr(smem), uintptr(s), uintptr(params), 0)
	return check("cuLaunchKernel", int32(r))
}

// StreamBeginCapture starts capturing the work enqueued on s into a graph.
func StreamBeginCapture(s Stream) error {
	return check("cuStreamBeginCapture", drv.cuStreamBeginCapture(s, CaptureModeRelaxed))
}

// StreamEndCapture ends capture on s and returns the graph.
func StreamEndCapture(s Stream) (Graph, error) {
	var g Graph
	err := check("cuStreamEndCapture", drv.cuStreamEndCapture(s, &g))
	return g, err
}

// GraphInstantiate makes an executable graph.
func GraphInstantiate(g Graph) (GraphExec, error) {
	var e GraphExec
	err := check("cuGraphInstantiateWithFlags", drv.cuGraphInstantiateWithFlags(&e, g, 0))
	return e, err
}

// GraphLaunch enqueues e on s.
func GraphLaunch(e GraphExec, s Stream) error {
	return check("cuGraphLaunch", drv.cuGraphLaunch(e, s))
}

// GraphExecDestroy destroys e.
func GraphExecDestroy(e GraphExec) error {
	return check("cuGraphExecDestroy", drv.cuGraphExecDestroy(e))
}

// GraphDestroy destroys g.
func GraphDestroy(g Graph) error { return check("cuGraphDestroy", drv.cuGraphDestroy(g)) }

// Tensor map element types and swizzles (CUtensorMapDataType, CUtensorMapSwizzle).
const (
	TensorMapUint8       = 0
	TensorMapUint16      = 1
	TensorMapFloat32     = 7
	TensorMapBFloat16    = 9
	TensorMapSwizzleNone = 0
	TensorMapSwizzle128B = 3
)

// TensorMapEncodeTiled describes a tiled view of global memory for the Hopper tensor
// memory accelerator and returns the 128-byte CUtensorMap. dims and box are innermost
// first; strides are the byte strides of dims[1:].
func TensorMapEncodeTiled(dtype int, addr DevicePtr, dims, strides []uint64, box []uint32, swizzle int) ([]byte, error) {
	if drv.cuTensorMapEncodeTiled == nil {
		return nil, &Error{Call: "cuTensorMapEncodeTiled", Name: "CUDA_ERROR_NOT_SUPPORTED", Desc: "the driver lacks tensor maps (CUDA 12 or later needed)"}
	}
	rank := len(dims)
	buf := make([]uint64, 16+3*rank)
	tm := buf[:16]
	d := buf[16 : 16+rank]
	st := buf[16+rank : 16+2*rank]
	copy(d, dims)
	copy(st, strides)
	b32 := make([]uint32, 2*rank)
	copy(b32, box)
	for i := range rank {
		b32[rank+i] = 1
	}
	var stp unsafe.Pointer
	if rank > 1 {
		stp = unsafe.Pointer(&st[0])
	}
	err := check("cuTensorMapEncodeTiled", drv.cuTensorMapEncodeTiled(unsafe.Pointer(&tm[0]), int32(dtype), uint32(rank), addr,
		unsafe.Pointer(&d[0]), stp, unsafe.Pointer(&b32[0]), unsafe.Pointer(&b32[rank]), 0, int32(swizzle), 3, 0))
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&tm[0])), 128), nil
}

// HasStreamWaitValue reports whether the driver has cuStreamWaitValue32.
func HasStreamWaitValue() bool { return drv.cuStreamWaitValue32 != nil }
