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
