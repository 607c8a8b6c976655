package device

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/dropless/dropless/internal/cuda"
)

// Kind says what a Device is.
type Kind int

const (
	KindCPU  Kind = iota // the host processor
	KindCUDA             // one CUDA GPU
)

func (k Kind) String() string {
	if k == KindCUDA {
		return "cuda"
	}
	return "cpu"
}

// Device is the CPU or one CUDA GPU. Devices are opened once per process and shared:
// two Opens of the same GPU return the same *Device. A Device is safe for concurrent use.
type Device struct {
	kind    Kind
	ordinal int
	name    string

	// CUDA only.
	cu        cuda.Device
	ctx       cuda.Context
	pool      cuda.MemPool
	cc        int // compute capability, 10·major + minor
	sms       int
	smemOptin int
	l2        int
	totalMem  uint64

	stream  *Stream  // the device's default stream
	modules sync.Map // program key → *module
}

var (
	cpuDev   = &Device{kind: KindCPU, name: "cpu"}
	gpuMu    sync.Mutex
	gpuDevs  = map[int]*Device{}
	cpuSetup sync.Once
)

// CPU returns the host device. Work on it runs in the calling goroutine, spread over
// GOMAXPROCS threads where it pays.
func CPU() *Device {
	cpuSetup.Do(func() { cpuDev.stream = &Stream{dev: cpuDev} })
	return cpuDev
}

// Open returns the device named by spec: "cpu", "cuda" (GPU 0) or "cuda:N".
// The empty spec means $DROPLESS_DEVICE if set, else GPU 0 if one works, else the CPU.
// Asking for a GPU that cannot be used is an error that says why.
func Open(spec string) (*Device, error) {
	if spec == "" {
		spec = os.Getenv("DROPLESS_DEVICE")
		if spec == "" {
			if d, err := openCUDA(0); err == nil {
				return d, nil
			}
			return CPU(), nil
		}
	}
	switch {
	case spec == "cpu":
		return CPU(), nil
	case spec == "cuda" || spec == "gpu":
		return openCUDA(0)
	case strings.HasPrefix(spec, "cuda:"):
		n, err := strconv.Atoi(spec[5:])
		if err != nil || n < 0 {
			return nil, fmt.Errorf("device: bad device %q: want cpu, cuda or cuda:N with N ≥ 0", spec)
		}
		return openCUDA(n)
	}
	return nil, fmt.Errorf("device: bad device %q: want cpu, cuda or cuda:N", spec)
}

// MustOpen is Open that panics on error, for examples and tests.
func MustOpen(spec string) *Device {
	d, err := Open(spec)
	if err != nil {
		panic(err)
	}
	return d
}

// CUDACount returns the number of CUDA GPUs, or an error saying why there are none usable.
func CUDACount() (int, error) {
	if err := cuda.LoadDriver(); err != nil {
		return 0, fmt.Errorf("device: no CUDA: %w", err)
	}
	n, err := cuda.DeviceCount()
	if err != nil {
		return 0, fmt.Errorf("device: no CUDA: %w", err)
	}
	return n, nil
}

func openCUDA(n int) (*Device, error) {
	gpuMu.Lock()
	defer gpuMu.Unlock()
	if d := gpuDevs[n]; d != nil {
		return d, nil
	}
	spec := fmt.Sprintf("cuda:%d", n)
	count, err := CUDACount()
	if err != nil {
		return nil, fmt.Errorf("device: %s: %w", spec, err)
	}
	if n >= count {
		if count == 0 {
			return nil, fmt.Errorf("device: %s: the CUDA driver sees no GPU", spec)
		}
		return nil, fmt.Errorf("device: %s: no such GPU: %d present (cuda:0 to cuda:%d)", spec, count, count-1)
	}
	d := &Device{kind: KindCUDA, ordinal: n}
	if err := d.initCUDA(); err != nil {
		return nil, fmt.Errorf("device: %s: %w", spec, err)
	}
	gpuDevs[n] = d
	return d, nil
}

func (d *Device) initCUDA() error {
	var err error
	if d.cu, err = cuda.DeviceGet(d.ordinal); err != nil {
		return err
	}
	if d.name, err = cuda.DeviceName(d.cu); err != nil {
		return err
	}
	attr := func(a int) int {
		if err != nil {
			return 0
		}
		var v int
		v, err = cuda.DeviceAttribute(d.cu, a)
		return v
	}
	d.cc = 10*attr(cuda.AttrComputeCapabilityMajor) + attr(cuda.AttrComputeCapabilityMinor)
	d.sms = attr(cuda.AttrMultiprocessorCount)
	d.smemOptin = attr(cuda.AttrMaxSharedMemoryPerBlockOptin)
	d.l2 = attr(cuda.AttrL2CacheSize)
	pools := attr(cuda.AttrMemoryPoolsSupported)
	if err != nil {
		return err
	}
	if pools == 0 {
		return fmt.Errorf("%s does not support stream-ordered memory pools (driver too old?)", d.name)
	}
	if d.totalMem, err = cuda.DeviceTotalMem(d.cu); err != nil {
		return err
	}
	if d.ctx, err = cuda.PrimaryCtxRetain(d.cu); err != nil {
		return err
	}
	return d.Do(func() error {
		var err error
		if d.pool, err = cuda.DeviceGetDefaultMemPool(d.cu); err != nil {
			return err
		}
		// Keep freed memory in the pool: ops then never pay for the driver's allocator.
		if err := cuda.MemPoolSetAttribute64(d.pool, cuda.PoolReleaseThreshold, ^uint64(0)); err != nil {
			return err
		}
		h, err := cuda.StreamCreate(cuda.StreamNonBlocking)
		if err != nil {
			return err
		}
		d.stream = &Stream{dev: d, h: h, owned: true}
		return nil
	})
}

// check returns an error for a nil device; op names the caller.
func (d *Device) check(op string) error {
	if d == nil {
		return fmt.Errorf("device: %s: nil device", op)
	}
	return nil
}

// Do runs fn on a locked OS thread with d's CUDA context current, and returns its error.
// It is the library's one rule for contexts and threads: every call into the CUDA driver
// for d goes through Do. On the CPU it just calls fn.
func (d *Device) Do(fn func() error) error {
	if err := d.check("Do"); err != nil {
		return err
	}
	if fn == nil {
		return errors.New("device: Do: nil function")
	}
	if d.kind != KindCUDA {
		return fn()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cuda.CtxSetCurrent(d.ctx); err != nil {
		return err
	}
	return fn()
}

// Kind reports whether d is the CPU or a GPU (KindCPU for a nil device).
func (d *Device) Kind() Kind {
	if d == nil {
		return KindCPU
	}
	return d.kind
}

// IsCUDA reports whether d is a CUDA GPU (false for a nil device).
func (d *Device) IsCUDA() bool { return d != nil && d.kind == KindCUDA }

// Ordinal returns the GPU's index (0 for the CPU).
func (d *Device) Ordinal() int { return d.ordinal }

// Name returns the GPU's name, or "cpu".
func (d *Device) Name() string { return d.name }

// String returns the device's spec: "cpu" or "cuda:N" ("<nil>" for a nil device).
func (d *Device) String() string {
	if d == nil {
		return "<nil>"
	}
	if d.kind == KindCUDA {
		return fmt.Sprintf("cuda:%d", d.ordinal)
	}
	return "cpu"
}

// ComputeCapability returns the GPU's compute capability as 10·major + minor (90 on
// H100 and H200), or 0 for the CPU.
func (d *Device) ComputeCapability() int { return d.cc }

// Multiprocessors returns the GPU's SM count, or GOMAXPROCS for the CPU.
func (d *Device) Multiprocessors() int {
	if d.kind != KindCUDA {
		return runtime.GOMAXPROCS(0)
	}
	return d.sms
}

// MaxSharedMemory returns the most shared memory one block may opt in to, in bytes.
func (d *Device) MaxSharedMemory() int { return d.smemOptin }

// L2Size returns the GPU's L2 cache size in bytes.
func (d *Device) L2Size() int { return d.l2 }

// TotalMemory returns the GPU's memory in bytes (0 for the CPU).
func (d *Device) TotalMemory() uint64 { return d.totalMem }

// Stream returns the device's default stream: a non-blocking stream the library creates,
// not CUDA's legacy stream 0, so work on it can be captured into a graph. A nil device
// has none: ops on the nil stream it returns are errors.
func (d *Device) Stream() *Stream {
	if d == nil {
		return nil
	}
	if d.kind != KindCUDA {
		return CPU().stream
	}
	return d.stream
}

// Synchronize waits for all work on the device.
func (d *Device) Synchronize() error {
	if err := d.check("Device.Synchronize"); err != nil {
		return err
	}
	return d.Do(func() error {
		if d.kind == KindCUDA {
			return cuda.CtxSynchronize()
		}
		return nil
	})
}

// PoolStats reports the bytes the device's stream-ordered pool holds from the driver and
// the bytes in use by live allocations. Both are 0 on the CPU.
func (d *Device) PoolStats() (reserved, used uint64, err error) {
	if err := d.check("PoolStats"); err != nil {
		return 0, 0, err
	}
	if d.kind != KindCUDA {
		return 0, 0, nil
	}
	err = d.Do(func() error {
		var err error
		if reserved, err = cuda.MemPoolGetAttribute64(d.pool, cuda.PoolReservedMemCurrent); err != nil {
			return err
		}
		used, err = cuda.MemPoolGetAttribute64(d.pool, cuda.PoolUsedMemCurrent)
		return err
	})
	return
}

// TrimPool returns the pool's unused memory to the driver, keeping at most keep bytes.
func (d *Device) TrimPool(keep uint64) error {
	if err := d.check("TrimPool"); err != nil {
		return err
	}
	if d.kind != KindCUDA {
		return nil
	}
	return d.Do(func() error { return cuda.MemPoolTrimTo(d.pool, keep) })
}

// Info describes one device for listings.
type Info struct {
	Spec   string // "cpu" or "cuda:N"
	Name   string
	Detail string // compute capability, SMs, memory
}

// List returns the CPU and every CUDA GPU present. When there is no usable GPU,
// why is the returned error; the CPU is listed regardless.
func List() ([]Info, error) {
	out := []Info{{Spec: "cpu", Name: "cpu", Detail: fmt.Sprintf("%d threads (GOMAXPROCS), %s/%s", runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH)}}
	n, err := CUDACount()
	if err != nil {
		return out, err
	}
	if n == 0 {
		return out, fmt.Errorf("device: the CUDA driver sees no GPU")
	}
	for i := range n {
		d, err := openCUDA(i)
		if err != nil {
			return out, err
		}
		out = append(out, Info{Spec: d.String(), Name: d.name,
			Detail: fmt.Sprintf("sm_%d, %d SMs, %.1f GiB", d.cc, d.sms, float64(d.totalMem)/(1<<30))})
	}
	return out, nil
}
