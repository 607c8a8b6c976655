package device

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/dropless/dropless/internal/cuda"
)

//go:embed kernels/*.cuh
var headerFS embed.FS

// A Header is a CUDA header that a Program's source can #include by name.
type Header struct {
	Name   string // the name in #include "..."
	Source string
}

// libraryHeaders are the headers every Program can include: dl.cuh (integer names,
// warp and block sums, status records; it includes dtype.cuh) and dtype.cuh (bit-exact
// conversions of the dtypes).
var libraryHeaders = sync.OnceValue(func() []cuda.Header {
	var hs []cuda.Header
	fs.WalkDir(headerFS, "kernels", func(path string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() {
			b, _ := headerFS.ReadFile(path)
			hs = append(hs, cuda.Header{Name: filepath.Base(path), Source: string(b)})
		}
		return nil
	})
	sort.Slice(hs, func(i, j int) bool { return hs[i].Name < hs[j].Name })
	return hs
})

// Program is CUDA C source that the library compiles at run time with NVRTC for the GPU
// it runs on, caching the result in memory and on disk ($DROPLESS_CACHE_DIR, default the
// user cache dir's dropless/kernels), keyed by source, headers, options, target and NVRTC
// version. Sources include "dl.cuh", the library's kernel header, and the Program's own
// Headers; they need no CUDA headers. A Program must not change once it was compiled.
type Program struct {
	Name    string   // file name shown in compile errors, e.g. "gemm.cu"
	Source  string   // CUDA C++ source with extern "C" kernels
	Headers []Header // the Program's own headers, beside the library's
	Options []string // extra NVRTC options
}

// NewProgram returns a Program; declare one per source file as a package variable.
func NewProgram(name, source string, options ...string) *Program {
	return &Program{Name: name, Source: source, Options: options}
}

// WithHeaders returns a copy of p that can also include hs.
func (p *Program) WithHeaders(hs ...Header) *Program {
	q := *p
	q.Headers = append(append([]Header(nil), p.Headers...), hs...)
	return &q
}

// headers returns the library's headers followed by the Program's own.
func (p *Program) headers() []cuda.Header {
	hs := libraryHeaders()
	if len(p.Headers) == 0 {
		return hs
	}
	out := append([]cuda.Header(nil), hs...)
	for _, h := range p.Headers {
		out = append(out, cuda.Header{Name: h.Name, Source: h.Source})
	}
	return out
}

// Target returns the NVRTC architecture option for a GPU of compute capability cc
// (10·major+minor): the real architecture with its family-specific "a" features where
// NVRTC knows them (sm_90a on H100/H200), else the newest virtual architecture NVRTC
// supports below it, as PTX for the driver to finish. cc 0 means the newest NVRTC
// supports, up to sm_90: the target used to check kernels on machines without a GPU.
func Target(cc int) (string, error) {
	if err := cuda.LoadNVRTC(); err != nil {
		return "", err
	}
	archs, err := cuda.NVRTCSupportedArchs()
	if err != nil {
		return "", err
	}
	major, minor, err := cuda.NVRTCVersion()
	if err != nil {
		return "", err
	}
	want := cc
	if cc == 0 {
		want = 90
	}
	best := 0
	for _, a := range archs {
		if a <= want {
			best = a
		}
	}
	if best == 0 {
		return "", fmt.Errorf("device: NVRTC %d.%d supports no architecture up to sm_%d (it has %v)", major, minor, want, archs)
	}
	if best != want {
		if cc == 0 {
			return fmt.Sprintf("sm_%d", best), nil
		}
		return fmt.Sprintf("compute_%d", best), nil
	}
	ver := 10*major + minor
	if (want == 90 && ver >= 120) || (want >= 100 && ver >= 128) {
		return fmt.Sprintf("sm_%da", want), nil
	}
	return fmt.Sprintf("sm_%d", want), nil
}

// Compile compiles p for target (see Target) and returns the image and NVRTC's log.
// It needs NVRTC, not a GPU. A failed compile is an error holding NVRTC's log.
func (p *Program) Compile(target string) (image []byte, ptx bool, log string, err error) {
	if err := cuda.LoadNVRTC(); err != nil {
		return nil, false, "", err
	}
	opts := append([]string{"--gpu-architecture=" + target, "--std=c++17"}, p.Options...)
	headers := p.headers()
	key, cacheDir := p.cacheKey(opts, headers)
	ext := ".cubin"
	if strings.HasPrefix(target, "compute_") {
		ext = ".ptx"
	}
	if cacheDir != "" {
		if b, err := os.ReadFile(filepath.Join(cacheDir, key+ext)); err == nil && len(b) > 0 {
			return b, ext == ".ptx", "", nil
		}
	}
	out, err := cuda.Compile(p.Name, p.Source, headers, opts)
	if err != nil {
		return nil, false, "", fmt.Errorf("device: compiling %s for %s: %w", p.Name, target, err)
	}
	if cacheDir != "" {
		writeCache(cacheDir, key+ext, out.Image)
	}
	return out.Image, out.PTX, out.Log, nil
}

func (p *Program) cacheKey(opts []string, headers []cuda.Header) (key, dir string) {
	major, minor, _ := cuda.NVRTCVersion()
	h := sha256.New()
	fmt.Fprintf(h, "nvrtc %d.%d\x00%s\x00%s\x00%s\x00", major, minor, strings.Join(opts, "\x01"), p.Name, p.Source)
	for _, hd := range headers {
		fmt.Fprintf(h, "%s\x00%s\x00", hd.Name, hd.Source)
	}
	key = hex.EncodeToString(h.Sum(nil))[:32]
	dir = os.Getenv("DROPLESS_CACHE_DIR")
	if dir == "" {
		if d, err := os.UserCacheDir(); err == nil {
			dir = filepath.Join(d, "dropless", "kernels")
		}
	}
	return key, dir
}

// writeCache stores a compiled image; a cache that cannot be written only costs a compile.
func writeCache(dir, name string, b []byte) {
	if os.MkdirAll(dir, 0o755) != nil {
		return
	}
	f, err := os.CreateTemp(dir, name+".tmp*")
	if err != nil {
		return
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil && cerr == nil {
		if os.Rename(f.Name(), filepath.Join(dir, name)) == nil {
			return
		}
	}
	os.Remove(f.Name())
}

// module is a Program loaded on one device.
type module struct {
	once   sync.Once
	err    error
	loaded atomic.Bool // set once the module is loaded
	mod    cuda.Module
	mu     sync.Mutex
	funcs  map[string]*Kernel
}

// Kernel returns the kernel called name from p, compiling and loading p on d the first
// time. On the CPU it is an error: CPU paths are Go code.
func (d *Device) Kernel(p *Program, name string) (*Kernel, error) {
	if d.kind != KindCUDA {
		return nil, fmt.Errorf("device: kernel %s: %v runs no CUDA kernels", name, d)
	}
	m := d.module(p)
	if m.err != nil {
		return nil, m.err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if k := m.funcs[name]; k != nil {
		return k, nil
	}
	k := &Kernel{dev: d, name: name}
	err := d.Do(func() error {
		var err error
		k.f, err = cuda.ModuleGetFunction(m.mod, name)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("device: kernel %s in %s: %w", name, p.Name, err)
	}
	m.funcs[name] = k
	return k, nil
}

// module returns p's module on d, compiling and loading it the first time; a failure
// stays in m.err.
func (d *Device) module(p *Program) *module {
	v, ok := d.modules.Load(p)
	if !ok {
		v, _ = d.modules.LoadOrStore(p, &module{funcs: map[string]*Kernel{}})
	}
	m := v.(*module)
	m.once.Do(func() {
		m.err = d.load(p, m)
		m.loaded.Store(m.err == nil)
	})
	return m
}

func (d *Device) load(p *Program, m *module) error {
	target, err := Target(d.cc)
	if err != nil {
		return fmt.Errorf("device: %s on %v: %w", p.Name, d, err)
	}
	img, ptx, _, err := p.Compile(target)
	if err != nil {
		return err
	}
	if ptx && img[len(img)-1] != 0 {
		img = append(img, 0)
	}
	return d.Do(func() error {
		var err error
		m.mod, err = cuda.ModuleLoadData(img)
		if err != nil {
			return fmt.Errorf("device: loading %s (%s) on %v: %w", p.Name, target, d, err)
		}
		return nil
	})
}

const maxArgs = 32

// launchArgs is a kernel's parameter block; blob holds by-value structs, 64-byte aligned.
type launchArgs struct {
	vals [maxArgs]uint64
	ptrs [maxArgs]unsafe.Pointer
	blob [1024]byte
}

var argPool = sync.Pool{New: func() any { return new(launchArgs) }}

// Kernel is one compiled kernel on one GPU.
type Kernel struct {
	dev  *Device
	f    cuda.Function
	name string

	smemMu  sync.Mutex
	smemMax atomic.Int64 // the dynamic shared memory launches may use, raised on demand
}

// Dim3 is a grid or block size.
type Dim3 struct{ X, Y, Z int }

// D1 returns the Dim3 {x, 1, 1}.
func D1(x int) Dim3 { return Dim3{x, 1, 1} }

func (d Dim3) norm() [3]uint32 {
	y, z := max(d.Y, 1), max(d.Z, 1)
	return [3]uint32{uint32(d.X), uint32(y), uint32(z)}
}

// defaultSmem is the dynamic shared memory every kernel may use without asking.
const defaultSmem = 48 << 10

// SetMaxDynamicSharedMemory allows launches with up to n bytes of dynamic shared memory.
// Launch and MaxActiveBlocksPerSM raise the limit themselves when they need more, once
// per kernel and size, so callers need not.
func (k *Kernel) SetMaxDynamicSharedMemory(n int) error {
	k.smemMu.Lock()
	defer k.smemMu.Unlock()
	return k.setSmem(n)
}

// setSmem sets the limit; k.smemMu is held.
func (k *Kernel) setSmem(n int) error {
	if err := k.dev.Do(func() error { return cuda.FuncSetAttribute(k.f, cuda.FuncAttrMaxDynamicSmem, n) }); err != nil {
		return fmt.Errorf("device: kernel %s: %d bytes of dynamic shared memory: %w", k.name, n, err)
	}
	k.smemMax.Store(int64(n))
	return nil
}

// allowSmem raises the kernel's dynamic shared-memory limit to at least n bytes.
func (k *Kernel) allowSmem(n int) error {
	if n <= defaultSmem || int64(n) <= k.smemMax.Load() {
		return nil
	}
	k.smemMu.Lock()
	defer k.smemMu.Unlock()
	if int64(n) <= k.smemMax.Load() {
		return nil
	}
	return k.setSmem(n)
}

// MaxActiveClusters returns how many clusters of k can run on its device at once, with
// blocks of block threads and smem bytes of dynamic shared memory, for a kernel compiled
// with a fixed cluster shape (__cluster_dims__) of clusterSize blocks along x: the most
// blocks a persistent grid of such a kernel may have is that times clusterSize.
func (k *Kernel) MaxActiveClusters(clusterSize, block, smem int) (int, error) {
	if clusterSize < 1 {
		return 0, fmt.Errorf("device: kernel %s: cluster size %d, want ≥ 1", k.name, clusterSize)
	}
	if err := k.allowSmem(smem); err != nil {
		return 0, err
	}
	var n int
	err := k.dev.Do(func() error {
		var err error
		grid := uint32(clusterSize * k.dev.Multiprocessors())
		n, err = cuda.OccupancyMaxActiveClusters(k.f, [3]uint32{grid, 1, 1}, block, smem)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("device: kernel %s: %w", k.name, err)
	}
	return n, nil
}

// MaxActiveBlocksPerSM returns how many blocks of the given size and dynamic shared
// memory fit on one multiprocessor.
func (k *Kernel) MaxActiveBlocksPerSM(block, smem int) (int, error) {
	if err := k.allowSmem(smem); err != nil {
		return 0, err
	}
	var n int
	err := k.dev.Do(func() error {
		var err error
		n, err = cuda.OccupancyMaxActiveBlocksPerMultiprocessor(k.f, block, smem)
		return err
	})
	return n, err
}

// Launch enqueues the kernel on s with the given grid, block and dynamic shared memory,
// raising the kernel's shared-memory limit first where smem needs it. Arguments are
// passed in order:
//   - *Tensor as its device address, a nil *Tensor as a null pointer;
//   - *Status as its record's address, a nil *Status as a null pointer;
//   - bool as a 32-bit int (0 or 1: declare it int in the kernel);
//   - int32, uint32, int64, uint64, uintptr, float32 and float64 by value (Go's int is
//     refused: say the width);
//   - a struct by value, laid out as C lays out a struct of the same fields in order
//     (fields: the scalar types above, bool as int, *Tensor as a pointer, and arrays of
//     them; unexported fields are not allowed);
//   - a []byte as a by-value struct of those bytes (a CUtensorMap, say).
//
// It returns without waiting.
func (k *Kernel) Launch(s *Stream, grid, block Dim3, smem int, args ...any) error {
	if s == nil {
		return fmt.Errorf("device: launch %s: nil stream", k.name)
	}
	if s.dev != k.dev {
		return fmt.Errorf("device: launch %s of %v on a stream of %v", k.name, k.dev, s.dev)
	}
	if grid.X <= 0 || grid.Y < 0 || grid.Z < 0 || grid.X > math.MaxInt32 || grid.Y > 65535 || grid.Z > 65535 {
		return fmt.Errorf("device: launch %s: grid %+v out of range", k.name, grid)
	}
	if bx := block.norm(); block.X <= 0 || block.Y < 0 || block.Z < 0 || int(bx[0])*int(bx[1])*int(bx[2]) > 1024 {
		return fmt.Errorf("device: launch %s: block %+v: want 1 to 1024 threads", k.name, block)
	}
	if smem < 0 {
		return fmt.Errorf("device: launch %s: negative shared memory", k.name)
	}
	if len(args) > maxArgs {
		return fmt.Errorf("device: launch %s: %d arguments, at most %d", k.name, len(args), maxArgs)
	}
	if err := k.allowSmem(smem); err != nil {
		return err
	}
	// The parameter block lives in pooled heap memory: the driver reads it through raw
	// addresses, which must not point into a goroutine stack that may move.
	la := argPool.Get().(*launchArgs)
	defer argPool.Put(la)
	blob := int((64 - uintptr(unsafe.Pointer(&la.blob[0]))%64) % 64)
	for i, a := range args {
		switch v := a.(type) {
		case *Tensor:
			if v == nil {
				la.vals[i] = 0
				break
			}
			if err := v.usable(s, "argument"); err != nil {
				// Name the argument only on failure: formatting costs an allocation per launch.
				return fmt.Errorf("%w (argument %d of %s)", err, i, k.name)
			}
			la.vals[i] = uint64(v.dptr())
		case *Status:
			if v == nil {
				la.vals[i] = 0
				break
			}
			if err := v.Usable(s, "status"); err != nil {
				return fmt.Errorf("%w (argument %d of %s)", err, i, k.name)
			}
			la.vals[i] = uint64(v.t.dptr())
		case bool:
			la.vals[i] = 0
			if v {
				la.vals[i] = 1
			}
		case int32:
			la.vals[i] = uint64(uint32(v))
		case uint32:
			la.vals[i] = uint64(v)
		case int64:
			la.vals[i] = uint64(v)
		case uint64:
			la.vals[i] = v
		case uintptr:
			la.vals[i] = uint64(v)
		case float32:
			la.vals[i] = uint64(math.Float32bits(v))
		case float64:
			la.vals[i] = math.Float64bits(v)
		case []byte:
			if len(v) == 0 || blob+len(v) > len(la.blob) {
				return fmt.Errorf("device: launch %s: struct argument %d of %d bytes (at most %d in all)", k.name, i, len(v), len(la.blob))
			}
			copy(la.blob[blob:], v)
			la.ptrs[i] = unsafe.Pointer(&la.blob[blob])
			blob += (len(v) + 63) &^ 63
			continue
		default:
			n, err := packStruct(s, la.blob[min(blob, len(la.blob)):], a)
			if err != nil {
				return fmt.Errorf("device: launch %s: argument %d: %w", k.name, i, err)
			}
			la.ptrs[i] = unsafe.Pointer(&la.blob[blob])
			blob += (n + 63) &^ 63
			continue
		}
		la.ptrs[i] = unsafe.Pointer(&la.vals[i])
	}
	var pp unsafe.Pointer
	if len(args) > 0 {
		pp = unsafe.Pointer(&la.ptrs[0])
	}
	err := s.dev.Do(func() error { return cuda.LaunchKernel(k.f, grid.norm(), block.norm(), uint32(smem), s.h, pp) })
	if err != nil {
		return fmt.Errorf("device: launch %s: %w", k.name, err)
	}
	return nil
}

// CheckCompile compiles p for target (see Target; "" picks the GPU present if any, else
// the newest target NVRTC supports up to sm_90) without loading it. It needs NVRTC only,
// so machines without a GPU can catch kernel compile errors.
func (p *Program) CheckCompile(target string) error {
	if target == "" {
		cc := 0
		if n, err := CUDACount(); err == nil && n > 0 {
			if d, err := openCUDA(0); err == nil {
				cc = d.cc
			}
		}
		var err error
		if target, err = Target(cc); err != nil {
			return err
		}
	}
	_, _, _, err := p.Compile(target)
	return err
}
