package cuda

import (
	"fmt"
	"math"
	"os"
	"sync"
	"unsafe"
)

// NCCLComm is an NCCL communicator (ncclComm_t). Zero is the null handle.
type NCCLComm uintptr

// NCCLUniqueID is the 128-byte ncclUniqueId that rank 0 creates and every rank passes
// to NCCLCommInitRankScalable.
type NCCLUniqueID [128]byte

// NCCL data types (ncclDataType_t).
const (
	NCCLInt8     = 0
	NCCLUint8    = 1
	NCCLInt32    = 2
	NCCLUint32   = 3
	NCCLInt64    = 4
	NCCLUint64   = 5
	NCCLFloat16  = 6
	NCCLFloat32  = 7
	NCCLFloat64  = 8
	NCCLBfloat16 = 9
)

// NCCL reduction operations (ncclRedOp_t).
const (
	NCCLSum  = 0
	NCCLProd = 1
	NCCLMax  = 2
	NCCLMin  = 3
	NCCLAvg  = 4
)

// NCCL result codes (ncclResult_t).
const (
	NCCLSuccess            = 0
	NCCLUnhandledCudaError = 1
	NCCLSystemError        = 2
	NCCLInternalError      = 3
	NCCLInvalidArgument    = 4
	NCCLInvalidUsage       = 5
	NCCLRemoteError        = 6
	NCCLInProgress         = 7
	NCCLTimeout            = 8
)

// ncclNames are NCCL's names for its result codes.
var ncclNames = []string{
	"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress", "ncclTimeout",
}

// NCCLMinVersion is the oldest NCCL the bindings accept (2.23.0: ncclCommInitRankScalable),
// as NCCL_VERSION_CODE.
const NCCLMinVersion = 22300

// ncclConfig mirrors ncclConfig_t as NCCL 2.31 lays it out. Only the first
// ncclConfigSize bytes (the layout of NCCL 2.17) are declared to NCCL through size and
// version; the rest holds NCCL_CONFIG_UNDEF_INT so that whatever NCCL reads there means
// "default".
type ncclConfig struct {
	size           uint64
	magic          uint32
	version        uint32
	blocking       int32
	cgaClusterSize int32
	minCTAs        int32
	maxCTAs        int32
	netName        uintptr
	splitShare     int32
	trafficClass   int32
	commName       uintptr
	rest           [32]int32
}

const (
	ncclConfigSize    = 40         // bytes of ncclConfig_t up to netName (NCCL 2.17)
	ncclConfigVersion = 21700      // NCCL_VERSION(2, 17, 0)
	ncclConfigMagic   = 0xcafebeef // NCCL_API_MAGIC
	ncclUndefInt      = math.MinInt32
)

func newNCCLConfig(blocking bool) *ncclConfig {
	c := &ncclConfig{size: ncclConfigSize, magic: ncclConfigMagic, version: ncclConfigVersion,
		cgaClusterSize: ncclUndefInt, minCTAs: ncclUndefInt, maxCTAs: ncclUndefInt,
		splitShare: ncclUndefInt, trafficClass: ncclUndefInt}
	if !blocking {
		c.blocking = 0
	} else {
		c.blocking = 1
	}
	for i := range c.rest {
		c.rest[i] = ncclUndefInt
	}
	return c
}

type ncclLib struct {
	lib *library

	ncclGetErrorString       func(res int32) string
	ncclGetLastError         func(comm NCCLComm) string
	ncclGetVersion           func(v *int32) int32
	ncclGetUniqueId          func(id *NCCLUniqueID) int32
	ncclCommInitRankScalable func(comm *NCCLComm, nranks, rank, nID int32, ids *NCCLUniqueID, config unsafe.Pointer) int32
	ncclCommFinalize         func(comm NCCLComm) int32
	ncclCommDestroy          func(comm NCCLComm) int32
	ncclCommAbort            func(comm NCCLComm) int32
	ncclCommGetAsyncError    func(comm NCCLComm, res *int32) int32
	ncclGroupStart           func() int32
	ncclGroupEnd             func() int32
	ncclSend                 func(buf DevicePtr, count uint64, dtype int32, peer int32, comm NCCLComm, s Stream) int32
	ncclRecv                 func(buf DevicePtr, count uint64, dtype int32, peer int32, comm NCCLComm, s Stream) int32
	ncclAllGather            func(send, recv DevicePtr, count uint64, dtype int32, comm NCCLComm, s Stream) int32
	ncclAllReduce            func(send, recv DevicePtr, count uint64, dtype, op int32, comm NCCLComm, s Stream) int32
	hasScalable              bool
	hasFinalize              bool
}

var (
	nccl     ncclLib
	ncclOnce sync.Once
	ncclErr  error
)

// NCCLPath is the library LoadNCCL opens: $DROPLESS_NCCL if set, else libnccl.so.2.
func NCCLPath() string {
	if p := os.Getenv("DROPLESS_NCCL"); p != "" {
		return p
	}
	return "libnccl.so.2"
}

// LoadNCCL loads NCCL from NCCLPath once per process and checks its version (at least
// 2.23). Later calls return the first call's result. It needs no GPU.
func LoadNCCL() error {
	ncclOnce.Do(func() { ncclErr = nccl.load(NCCLPath()) })
	return ncclErr
}

func (n *ncclLib) load(path string) error {
	lib, err := open("NCCL", path)
	if err != nil {
		return fmt.Errorf("%w (install NCCL 2.23 or later, or set DROPLESS_NCCL)", err)
	}
	n.lib = lib
	lib.bind(&n.ncclGetErrorString, "ncclGetErrorString")
	lib.bind(&n.ncclGetLastError, "ncclGetLastError")
	lib.bind(&n.ncclGetVersion, "ncclGetVersion")
	lib.bind(&n.ncclGetUniqueId, "ncclGetUniqueId")
	lib.bind(&n.ncclCommDestroy, "ncclCommDestroy")
	lib.bind(&n.ncclCommAbort, "ncclCommAbort")
	lib.bind(&n.ncclCommGetAsyncError, "ncclCommGetAsyncError")
	lib.bind(&n.ncclGroupStart, "ncclGroupStart")
	lib.bind(&n.ncclGroupEnd, "ncclGroupEnd")
	lib.bind(&n.ncclSend, "ncclSend")
	lib.bind(&n.ncclRecv, "ncclRecv")
	lib.bind(&n.ncclAllGather, "ncclAllGather")
	lib.bind(&n.ncclAllReduce, "ncclAllReduce")
	n.hasScalable = lib.optional(&n.ncclCommInitRankScalable, "ncclCommInitRankScalable")
	n.hasFinalize = lib.optional(&n.ncclCommFinalize, "ncclCommFinalize")
	if err := lib.err(); err != nil {
		return err
	}
	v, err := NCCLVersion()
	if err != nil {
		return err
	}
	if v < NCCLMinVersion || !n.hasScalable {
		return fmt.Errorf("%s is NCCL %s: need 2.23 or later (ncclCommInitRankScalable); set DROPLESS_NCCL to a newer one", path, NCCLVersionString(v))
	}
	return nil
}

// NCCLVersionString formats an NCCL_VERSION_CODE as "2.28.3".
func NCCLVersionString(v int) string {
	if v < 10000 { // NCCL_VERSION of 2.8 and older: X*1000 + Y*100 + Z
		return fmt.Sprintf("%d.%d.%d", v/1000, v%1000/100, v%100)
	}
	return fmt.Sprintf("%d.%d.%d", v/10000, v%10000/100, v%100)
}

// NCCLResultName returns NCCL's name for a result code: "ncclInvalidUsage", ...
func NCCLResultName(res int) string {
	if res >= 0 && res < len(ncclNames) {
		return ncclNames[res]
	}
	return fmt.Sprintf("ncclResult_t(%d)", res)
}

// checkNCCL turns an ncclResult_t into an *Error naming call, or nil for ncclSuccess
// and for ncclInProgress, which a non-blocking communicator returns for work it has
// accepted (poll NCCLCommGetAsyncError for its outcome). comm, if not zero, supplies
// ncclGetLastError's message.
func checkNCCL(call string, res int32, comm NCCLComm) error {
	if res == NCCLSuccess || res == NCCLInProgress {
		return nil
	}
	e := &Error{Call: call, Code: int(res), Name: NCCLResultName(int(res))}
	if nccl.ncclGetErrorString != nil {
		e.Desc = nccl.ncclGetErrorString(res)
	}
	if nccl.ncclGetLastError != nil {
		if msg := nccl.ncclGetLastError(comm); msg != "" && msg != e.Desc {
			e.Log = msg
		}
	}
	return e
}

// NCCLVersion returns NCCL's NCCL_VERSION_CODE (22803 for 2.28.3).
func NCCLVersion() (int, error) {
	var v int32
	err := checkNCCL("ncclGetVersion", nccl.ncclGetVersion(&v), 0)
	return int(v), err
}

// NCCLGetUniqueID creates the id of a new communicator: rank 0 calls it and sends the
// result to the other ranks.
func NCCLGetUniqueID() (NCCLUniqueID, error) {
	id := new(NCCLUniqueID)
	err := checkNCCL("ncclGetUniqueId", nccl.ncclGetUniqueId(id), 0)
	return *id, err
}

// NCCLCommInit is a communicator being created by NCCLCommInitRankScalable. It keeps the
// memory NCCL was handed alive for the communicator's life.
type NCCLCommInit struct {
	Comm   NCCLComm
	ids    []NCCLUniqueID
	config *ncclConfig
}

// NCCLCommInitRankScalable creates this thread's rank of a communicator of nranks ranks
// from the ids every rank passes alike (ncclCommInitRankScalable; the ids go by pointer).
// The current CUDA context's device becomes the rank's GPU. With blocking false the
// communicator is non-blocking: the call returns at once and NCCLCommGetAsyncError tells
// when the communicator is ready; every later call on it may return before its host-side
// work is done, and must be followed by polling NCCLCommGetAsyncError.
func NCCLCommInitRankScalable(nranks, rank int, ids []NCCLUniqueID, blocking bool) (*NCCLCommInit, error) {
	if len(ids) == 0 {
		return nil, &Error{Call: "ncclCommInitRankScalable", Code: NCCLInvalidArgument, Name: ncclNames[NCCLInvalidArgument], Desc: "no unique id"}
	}
	c := &NCCLCommInit{ids: append([]NCCLUniqueID(nil), ids...), config: newNCCLConfig(blocking)}
	res := nccl.ncclCommInitRankScalable(&c.Comm, int32(nranks), int32(rank), int32(len(c.ids)), &c.ids[0], unsafe.Pointer(c.config))
	if err := checkNCCL("ncclCommInitRankScalable", res, c.Comm); err != nil {
		return nil, err
	}
	return c, nil
}

// NCCLCommGetAsyncError returns the communicator's state: pending while a non-blocking
// call is still at work, else the error it ended with (an *Error named as NCCL names
// the code), or nil.
func NCCLCommGetAsyncError(comm NCCLComm) (pending bool, err error) {
	var state int32
	if err := checkNCCL("ncclCommGetAsyncError", nccl.ncclCommGetAsyncError(comm, &state), comm); err != nil {
		return false, err
	}
	if state == NCCLInProgress {
		return true, nil
	}
	return false, checkNCCL("ncclCommGetAsyncError", state, comm)
}

// NCCLCommFinalize flushes the communicator's pending work (ncclCommFinalize); on a
// non-blocking communicator poll NCCLCommGetAsyncError until it is no longer pending.
// Without ncclCommFinalize in the library it does nothing.
func NCCLCommFinalize(comm NCCLComm) error {
	if !nccl.hasFinalize {
		return nil
	}
	return checkNCCL("ncclCommFinalize", nccl.ncclCommFinalize(comm), comm)
}

// NCCLCommDestroy frees the communicator once its work is done.
func NCCLCommDestroy(comm NCCLComm) error {
	return checkNCCL("ncclCommDestroy", nccl.ncclCommDestroy(comm), 0)
}

// NCCLCommAbort frees the communicator and aborts its unfinished operations, on the
// host and on the GPU.
func NCCLCommAbort(comm NCCLComm) error {
	return checkNCCL("ncclCommAbort", nccl.ncclCommAbort(comm), 0)
}

// NCCLGroupStart opens a group of NCCL calls that NCCLGroupEnd issues together.
func NCCLGroupStart() error { return checkNCCL("ncclGroupStart", nccl.ncclGroupStart(), 0) }

// NCCLGroupEnd issues the calls made since NCCLGroupStart. On a non-blocking communicator
// poll NCCLCommGetAsyncError until it is no longer pending.
func NCCLGroupEnd() error { return checkNCCL("ncclGroupEnd", nccl.ncclGroupEnd(), 0) }

// NCCLSend enqueues on s a send of count elements of dtype at buf to rank peer.
func NCCLSend(buf DevicePtr, count uint64, dtype, peer int, comm NCCLComm, s Stream) error {
	return checkNCCL("ncclSend", nccl.ncclSend(buf, count, int32(dtype), int32(peer), comm, s), comm)
}

// NCCLRecv enqueues on s a receive of count elements of dtype from rank peer into buf.
func NCCLRecv(buf DevicePtr, count uint64, dtype, peer int, comm NCCLComm, s Stream) error {
	return checkNCCL("ncclRecv", nccl.ncclRecv(buf, count, int32(dtype), int32(peer), comm, s), comm)
}

// NCCLAllGather enqueues on s an all-gather: recv receives every rank's count elements
// of send, in rank order.
func NCCLAllGather(send, recv DevicePtr, count uint64, dtype int, comm NCCLComm, s Stream) error {
	return checkNCCL("ncclAllGather", nccl.ncclAllGather(send, recv, count, int32(dtype), comm, s), comm)
}

// NCCLAllReduce enqueues on s an all-reduce of count elements with op.
func NCCLAllReduce(send, recv DevicePtr, count uint64, dtype, op int, comm NCCLComm, s Stream) error {
	return checkNCCL("ncclAllReduce", nccl.ncclAllReduce(send, recv, count, int32(dtype), int32(op), comm, s), comm)
}
