package gemm

import "testing"

// TestMXFP8PathChoice: on the H200's rates the shapes of DeepSeek-V3 and Mixtral run
// their MXFP8 forms on bf16 after dequantizing, every weight gradient does, and the
// forwards and input gradients bound by reading the weights (Qwen3's 256 or 16 rows a
// group) stay on the MXFP8 kernels.
func TestMXFP8PathChoice(t *testing.T) {
	defer func(p int) { mxPath = p }(mxPath)
	mxPath = mxAuto
	for _, tc := range []struct {
		name       string
		G, M, K, N int
		f          form
		want       bool
	}{
		{"dsv3_wi forward", 32, 65536, 7168, 4096, forward, true},
		{"dsv3_wi input gradient", 32, 65536, 7168, 4096, inputGrad, true},
		{"dsv3_wo forward", 32, 65536, 2048, 7168, forward, true},
		{"mixtral forward", 8, 32768, 4096, 28672, forward, true},
		{"qwen3 forward", 128, 32768, 2048, 1536, forward, false},
		{"qwen3 input gradient", 128, 32768, 2048, 1536, inputGrad, false},
		{"qwen3 weight gradient", 128, 32768, 2048, 1536, weightGrad, true},
		{"qwen3 small forward", 128, 2048, 2048, 1536, forward, false},
		{"qwen3 small weight gradient", 128, 2048, 2048, 1536, weightGrad, true},
		{"dsv3_wi weight gradient", 32, 65536, 7168, 4096, weightGrad, true},
	} {
		mc := &mxCall{c: &call{f: tc.f, M: tc.M, K: tc.K, N: tc.N, G: tc.G}}
		if got := mc.viaBF16(); got != tc.want {
			t.Errorf("%s: viaBF16 = %v, want %v", tc.name, got, tc.want)
		}
	}
	for p, want := range map[int]bool{mxWGMMA: false, mxBF16: true} {
		mxPath = p
		mc := &mxCall{c: &call{f: forward, M: 2048, K: 2048, N: 1536, G: 128}}
		if got := mc.viaBF16(); got != want {
			t.Errorf("mxPath %d: viaBF16 = %v, want %v", p, got, want)
		}
	}
}
