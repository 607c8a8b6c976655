package hopper

import (
	"regexp"
	"strconv"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestFP8KernelsCompile(t *testing.T) { dt.CheckCompiles(t, fp8) }

// TestFP8KernelsCompileBodies compiles the sm_90a bodies of the FP8 kernels where NVRTC
// cannot target sm_90a (before 12.0): with __CUDA_ARCH_FEAT_SM90_ALL defined by hand, to
// PTX for compute_90, so that every line of C++ goes through the compiler. (The inline PTX
// is checked only by ptxas, on a machine with NVRTC 12 or later, by TestFP8KernelsCompile.)
func TestFP8KernelsCompileBodies(t *testing.T) {
	dt.RequireNVRTC(t)
	target, err := device.Target(90)
	if err != nil {
		t.Skip(err)
	}
	if target == "sm_90a" {
		t.Skip("NVRTC targets sm_90a: TestFP8KernelsCompile compiles the bodies")
	}
	p := *fp8
	p.Options = append(append([]string(nil), p.Options...), "-D__CUDA_ARCH_FEAT_SM90_ALL")
	img, _, log, err := p.Compile("compute_90")
	if err != nil {
		t.Fatal(err)
	}
	// The bodies are there: the PTX holds the kernels' wgmma instructions.
	for _, want := range []string{"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2", "setmaxnreg.inc.sync.aligned.u32 232"} {
		if !regexp.MustCompile(regexp.QuoteMeta(want)).Match(img) {
			t.Errorf("the PTX has no %q", want)
		}
	}
	if log != "" {
		t.Logf("NVRTC log:\n%s", log)
	}
}

// TestFP8StagesMirrorC checks that fp8Stages (and so fp8Smem) is HF_STAGES of the source.
func TestFP8StagesMirrorC(t *testing.T) {
	m := regexp.MustCompile(`#define HF_STAGES (\d+)`).FindStringSubmatch(fp8Src)
	if m == nil {
		t.Fatal("kernels/fp8.cu has no HF_STAGES")
	}
	if n, _ := strconv.Atoi(m[1]); n != fp8Stages {
		t.Errorf("HF_STAGES is %d, fp8Stages %d", n, fp8Stages)
	}
}

// TestFP8ClusterGrid: on a GPU that runs the FP8 kernels, the two-CTA kernels' persistent
// grid holds whole clusters and covers most of the multiprocessors (else the one-CTA
// kernels would serve better); it logs the grid.
func TestFP8ClusterGrid(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		if !d.IsCUDA() {
			t.Skip("CPU")
		}
		if err := BlockwiseSupported(d); err != nil {
			t.Skip(err)
		}
		for _, name := range []string{"dl_hopper_fp8_x2_e4m3_e4m3", "dl_hopper_fp8_wgrad_x2_e4m3_e4m3", "dl_hopper_mx_x2_e4m3_e4m3"} {
			k, err := d.Kernel(fp8, name)
			if err != nil {
				t.Fatal(err)
			}
			n, err := k.MaxActiveClusters(2, 384, fp8Smem)
			if err != nil {
				t.Fatal(err)
			}
			g := fp8Grid(d, k, name)
			t.Logf("%s: %d clusters fit at once on %d multiprocessors: grid %d", name, n, d.Multiprocessors(), g)
			if g%2 != 0 || g > d.Multiprocessors() || 4*g < 3*d.Multiprocessors() {
				t.Errorf("%s: grid %d for %d multiprocessors", name, g, d.Multiprocessors())
			}
		}
	})
}
