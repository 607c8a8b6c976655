package main

import (
	"bytes"
	"encoding/gob"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, program) }

// up uploads v as an F32 tensor of the shape.
func up(t *testing.T, s *device.Stream, v []float32, shape ...int) *device.Tensor {
	t.Helper()
	return dt.Must(device.FromFloat32(s, device.F32, v, shape...))
}

func down(t *testing.T, s *device.Stream, x *device.Tensor) []float32 {
	t.Helper()
	return dt.Must(x.Float32s(s))
}

// near reports the first element of got that is not within tol·(1 + |want|) of want.
func near(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= tol*(1+math.Abs(want[i]))) {
			t.Fatalf("%s[%d] = %v, want %v", what, i, got[i], want[i])
		}
	}
}

// randTokens returns n ids in [0, V), with an id outside it at every 17th place when
// invalid.
func randTokens(seed uint64, n, V int, invalid bool) []int32 {
	r := dt.Rand(seed)
	tok := make([]int32, n)
	for i := range tok {
		tok[i] = int32(r.IntN(V))
		if invalid && i%17 == 16 {
			tok[i] = int32(V) // outside [0, V)
		}
	}
	return tok
}

// TestGradients compares the model's gradients with central differences of its loss,
// on a few entries of every parameter.
func TestGradients(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, shared := range []int{0, 6} {
			t.Run(fmt.Sprintf("shared=%d", shared), func(t *testing.T) {
				cfg := ModelConfig{Vocab: 13, Window: 3, Hidden: 8, FFN: 4, SharedFFN: shared, Experts: 4, TopK: 2, Layers: 2}
				m := dt.Must(newModel(d, cfg, 3, modelOptions{DType: device.F32}))
				defer m.Free()
				s := m.s
				// A random output layer, so that every parameter gets a gradient.
				dt.NoErr(t, m.out.w.SetFloat32(s, dt.Normal(dt.Rand(5), m.out.w.Len(), 0.5)))
				const B = 16
				tok := randTokens(11, B*(cfg.Window+1), cfg.Vocab, false)
				ws := dt.Must(m.workspace(B))
				tt := dt.Must(device.FromSlice(s, device.I32, tok, B, cfg.Window+1))
				defer tt.Free()
				dt.NoErr(t, m.groupEmbed(ws, tt))
				acts := dt.Must(m.forward(ws, tt, ws.trainLoss, true, m.layers))
				dt.NoErr(t, m.backward(ws, acts, nil))
				loss := func() float64 { return dt.Must(m.evalLoss([][]int32{tok})) }
				r := dt.Rand(13)
				const eps = 1e-3
				l0 := loss()
				checked := 0
				for _, p := range m.params {
					g := down(t, s, p.g)
					w := down(t, s, p.w)
					for range 4 {
						i := r.IntN(len(w))
						set := func(v float32) {
							w2 := append([]float32(nil), w...)
							w2[i] = v
							dt.NoErr(t, p.w.SetFloat32(s, w2))
						}
						set(w[i] + eps)
						lp := loss()
						set(w[i] - eps)
						lm := loss()
						set(w[i])
						// A step that changes a top-k choice is a kink of the loss: one-sided
						// differences that disagree mark it, and the entry is skipped.
						fwd, bwd := (lp-l0)/eps, (l0-lm)/eps
						if math.Abs(fwd-bwd) > 0.02+0.5*math.Max(math.Abs(fwd), math.Abs(bwd)) {
							continue
						}
						checked++
						num := (lp - lm) / (2 * eps)
						if d := math.Abs(num - float64(g[i])); d > 2e-3+0.05*math.Abs(num) {
							t.Errorf("%s[%d]: gradient %.6f, central difference %.6f", p.name, i, g[i], num)
						}
					}
				}
				if checked < 3*len(m.params) {
					t.Errorf("only %d of %d entries checked: too many kinks", checked, 4*len(m.params))
				}
			})
		}
	})
}

// writeText writes a small corpus that a model can learn in a few steps: 40 files of
// repetitive lines, so that every 20th file is held out.
func writeText(t *testing.T) string {
	dir := t.TempDir()
	for i := range 40 {
		var b strings.Builder
		for j := range 30 {
			fmt.Fprintf(&b, "func f%d(x int) int { return x * %d }\n", (i+j)%10, j%7)
		}
		dt.NoErr(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%02d.go", i)), []byte(b.String()), 0o644))
	}
	return dir
}

func tinyOptions(t *testing.T) options {
	o := defaultOptions()
	o.Data = writeText(t)
	o.Out = t.TempDir()
	o.Steps, o.Batch, o.Window, o.Hidden, o.FFN, o.Experts, o.TopK, o.Layers = 30, 32, 4, 16, 8, 4, 2, 2
	o.LR, o.Warmup, o.EvalEvery, o.EvalTokens = 1e-2, 2, 10, 64
	o.Device = "cpu"
	return o
}

// TestTrain trains a tiny dropless and capacity model pair on each device and checks
// that the losses fall, that the checkpoint holds the trained model, and that -resume
// continues it; a GPU's final losses must be close to the CPU's.
func TestTrain(t *testing.T) {
	var cpu []float64
	dt.Run(t, func(t *testing.T, d *device.Device) {
		o := tinyOptions(t)
		o.Device = d.String()
		var out bytes.Buffer
		rep, err := run(o, &out)
		if err != nil {
			t.Fatalf("%v\n%s", err, out.String())
		}
		if len(rep.Models) != 2 {
			t.Fatalf("%d models, want 2 (dropless and capacity)", len(rep.Models))
		}
		var final []float64
		for _, r := range rep.Models {
			h := r.History
			if len(h.Train) != 3 || len(h.Eval) != 4 {
				t.Fatalf("%s: %d train and %d held-out points, want 3 and 4", r.Name, len(h.Train), len(h.Eval))
			}
			if !(h.Train[2] < h.Train[0]) || !(r.Heldout < r.First-0.5) {
				t.Errorf("%s: losses did not fall: train %.3f, held-out %.3f", r.Name, h.Train, h.Eval)
			}
			final = append(final, r.Heldout)
		}
		if d.IsCUDA() && cpu != nil {
			for i, v := range final {
				if math.Abs(v-cpu[i]) > 0.05*cpu[i] {
					t.Errorf("%s: final held-out loss %.4f on the GPU, %.4f on the CPU", rep.Models[i].Name, v, cpu[i])
				}
			}
		} else if !d.IsCUDA() {
			cpu = final
		}
		if rep.Models[1].Dropped <= 0 || rep.Models[0].Dropped != 0 {
			t.Errorf("dropped %d (dropless) and %d (capacity), want 0 and > 0", rep.Models[0].Dropped, rep.Models[1].Dropped)
		}
		if _, err := os.Stat(filepath.Join(o.Out, "loss.png")); err != nil {
			t.Error(err)
		}
		for _, want := range []string{"dropless  step    30/30", "capacity  step    30/30", "dropped", "unigram entropy"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("output lacks %q:\n%s", want, out.String())
			}
		}

		// The checkpoint reloads to the same parameters and the same held-out loss.
		r0 := rep.Models[0]
		ck := dt.Must(readCheckpoint(r0.Path))
		m := dt.Must(loadModel(d, ck, modelOptions{DType: device.F32}))
		defer m.Free()
		path2 := filepath.Join(t.TempDir(), "again.ckpt")
		dt.NoErr(t, m.save(path2, ck.Seed, ck.History))
		ck2 := dt.Must(readCheckpoint(path2))
		if diff := cmp.Diff(ck, ck2, cmpopts.EquateNaNs()); diff != "" {
			t.Errorf("checkpoint round trip (-saved +reloaded and saved again):\n%s", diff)
		}
		if ck.Step != o.Steps {
			t.Errorf("checkpoint at step %d, want %d", ck.Step, o.Steps)
		}
		c := dt.Must(loadCorpus(o.Data, nil, o.MaxBytes))
		ev := dt.Must(m.evalLoss(evalBatches(c.Heldout, o.EvalTokens, o.Batch, o.Window)))
		if ev != r0.Heldout {
			t.Errorf("reloaded model's held-out loss %v, want %v", ev, r0.Heldout)
		}

		// -resume continues both models for -steps more.
		o.Resume, o.Steps = true, 10
		rep2, err := run(o, io.Discard)
		dt.NoErr(t, err)
		for i, r := range rep2.Models {
			h := r.History
			if got := h.TrainStep[len(h.TrainStep)-1]; got != 40 || len(h.Eval) != len(rep.Models[i].History.Eval)+1 {
				t.Errorf("%s: resumed history ends at step %d with %d held-out points, want 40 and %d", r.Name, got, len(h.Eval), len(rep.Models[i].History.Eval)+1)
			}
		}
	})
}

// TestCorpus checks that a -data directory leaves out hidden and binary files and holds
// out every 20th file.
func TestCorpus(t *testing.T) {
	dir := writeText(t)
	dt.NoErr(t, os.WriteFile(filepath.Join(dir, "zz.bin"), []byte{'a', 0, 'b'}, 0o644))
	dt.NoErr(t, os.Mkdir(filepath.Join(dir, ".hidden"), 0o755))
	dt.NoErr(t, os.WriteFile(filepath.Join(dir, ".hidden", "x.go"), []byte("hidden"), 0o644))
	c := dt.Must(loadCorpus(dir, nil, 1<<20))
	if c.Files != 40 || c.HeldoutFiles != 2 {
		t.Errorf("%d files, %d held out; want 40 and 2", c.Files, c.HeldoutFiles)
	}
	if bytes.Contains(c.Train, []byte("hidden")) || bytes.IndexByte(c.Train, 0) >= 0 {
		t.Error("corpus holds a hidden or binary file")
	}
	c = dt.Must(loadCorpus(dir, nil, 1000))
	if n := len(c.Train) + len(c.Heldout); n != 1000 {
		t.Errorf("%d bytes read with -max-bytes 1000", n)
	}
}

// TestErrors checks that bad flags and a missing checkpoint are errors naming the flag.
func TestErrors(t *testing.T) {
	for _, c := range []struct {
		mod  func(*options)
		want string
	}{
		{func(o *options) { o.Batch = 0 }, "-batch"},
		{func(o *options) { o.TopK = 9 }, "TopK"},
		{func(o *options) { o.Window = 0 }, "-window"},
		{func(o *options) { o.LR = -1 }, "-lr"},
		{func(o *options) { o.EvalEvery = 0 }, "-eval-every"},
		{func(o *options) { o.Resume = true }, "-resume"},
		{func(o *options) { o.Data = filepath.Join(t.TempDir(), "missing") }, "-data"},
		{func(o *options) { o.EP = 0 }, "-ep"},
		{func(o *options) { o.EP = 3 }, "-batch 32 over -ep 3"},
		{func(o *options) { o.EP, o.Batch = 8, 64 }, "-experts 4 over -ep 8"},
		{func(o *options) { o.DType = "f16" }, "-dtype"},
		{func(o *options) { o.Moments = "f16" }, "-moments"},
		{func(o *options) { o.Moments = "" }, "-moments"},
		{func(o *options) { o.Grads = "f16" }, "-grads"},
		{func(o *options) { o.Offload = "moe_mlpwi=disk" }, "-offload"},
		{func(o *options) { o.Precision = "fp16" }, `-precision "fp16", want bf16, fp8 or mxfp8`},
		{func(o *options) { o.Precision = "" }, `-precision "", want bf16, fp8 or mxfp8`},
		{func(o *options) { o.Precision = "fp8" }, "-precision fp8 with -hidden 16 and -ffn 8: moe: Config.FFN = 8"},
		{func(o *options) { o.Precision, o.Hidden, o.FFN = "mxfp8", 24, 16 }, "-precision mxfp8 with -hidden 24 and -ffn 16: moe: Config.Hidden = 24"},
	} {
		o := tinyOptions(t)
		c.mod(&o)
		_, err := run(o, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("error %v, want one naming %s", err, c.want)
		}
	}
}

// runOK runs o and returns its report and output, failing t on an error.
func runOK(t *testing.T, o options) (*report, string) {
	t.Helper()
	var out bytes.Buffer
	rep, err := run(o, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	return rep, out.String()
}

// closeHistories reports where two runs' losses differ by more than tol·(1 + |loss|).
func closeHistories(t *testing.T, what string, want, got *report, tol float64) {
	t.Helper()
	for i, r := range want.Models {
		g := got.Models[i]
		for _, c := range []struct {
			name      string
			want, got []float64
		}{{"train", r.History.Train, g.History.Train}, {"held-out", r.History.Eval, g.History.Eval}} {
			if len(c.want) != len(c.got) {
				t.Fatalf("%s %s: %d %s losses, want %d", what, r.Name, len(c.got), c.name, len(c.want))
			}
			for j := range c.want {
				if d := math.Abs(c.got[j] - c.want[j]); !(d <= tol*(1+math.Abs(c.want[j]))) {
					t.Errorf("%s %s: %s loss %d is %.7f, want %.7f", what, r.Name, c.name, j, c.got[j], c.want[j])
				}
			}
		}
	}
}

// TestEP trains the tiny models with -ep 4 (four in-process ranks of one expert each,
// eight rows of every batch each) and checks that the losses at every evaluation are
// those of -ep 1 within float tolerance, with the default load-balancing loss (which
// is over the global batch) and without it; and that the checkpoints, which hold every
// rank's experts, resume under -ep 2 as the -ep 1 ones do under -ep 1.
func TestEP(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, aux := range []float64{defaultOptions().AuxLoss, 0} {
			t.Run(fmt.Sprint("aux=", aux), func(t *testing.T) {
				o := tinyOptions(t)
				o.Device, o.NoPlot, o.AuxLoss = d.String(), true, aux
				rep1, _ := runOK(t, o)
				o4 := o
				o4.EP, o4.Out = 4, t.TempDir()
				rep4, out := runOK(t, o4)
				if !strings.Contains(out, "4 in-process ranks") {
					t.Errorf("output does not name the ranks:\n%s", out)
				}
				closeHistories(t, "-ep 4", rep1, rep4, 1e-5)
				if aux == 0 {
					return
				}
				// Resume the dropless models for 10 steps: -ep 1's under -ep 1, -ep 4's
				// under -ep 2.
				o.Resume, o.Steps, o.Capacity = true, 10, 0
				o4.Resume, o4.Steps, o4.Capacity, o4.EP = true, 10, 0, 2
				again1, _ := runOK(t, o)
				again2, _ := runOK(t, o4)
				closeHistories(t, "-ep 4 resumed with -ep 2", again1, again2, 1e-5)
			})
		}
	})
}

// TestOffload trains the tiny models with the MoE layers' activations offloaded to
// pinned host memory (or some dropped and recomputed) and checks that the losses are
// bit-identical to those of the run that keeps them on the device, in each compute
// dtype, and that the progress lines show the bytes sent to the host.
func TestOffload(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, typ := range []string{"f32", "bf16"} {
			o := tinyOptions(t)
			o.Device, o.NoPlot, o.DType, o.Steps = d.String(), true, typ, 20
			plain, _ := runOK(t, o)
			for _, pol := range []string{"*=offload", "moe_permuted=remat,moe_mlpwi=offload,moe_mlp_swiglu=remat,moe_mlpwo=offload"} {
				t.Run(typ+"/"+pol, func(t *testing.T) {
					o.Offload, o.Out = pol, t.TempDir()
					rep, out := runOK(t, o)
					for i, r := range plain.Models {
						if diff := cmp.Diff(r.History, rep.Models[i].History); diff != "" {
							t.Errorf("%s: losses differ from the run without offload (-without +with):\n%s", r.Name, diff)
						}
					}
					if !strings.Contains(out, "host ") || strings.Contains(out, "host 0 B/step") || strings.Contains(out, "pool full") {
						t.Errorf("output lacks the bytes offloaded:\n%s", out)
					}
				})
			}
		}
	})
}

// TestProfile checks that -profile prints the time of every stage of a step.
func TestProfile(t *testing.T) {
	o := tinyOptions(t)
	o.NoPlot, o.Profile, o.Capacity, o.EP = true, true, 0, 2
	_, out := runOK(t, o)
	want := []string{"profile of step 4", stageEmbed, layerStage(1, stageMoEFwd), layerStage(0, stageAddNorm), stageOutput,
		stageOutputBwd, layerStage(0, stageMoEBwd), layerStage(1, stageNormBwd), stageEmbedBwd, stageGradSum, stageAdamW,
		stageEmbedSort, layerStage(1, stageAdamWW2), layerStage(0, stageAdamWW1), // on the second stream
		"MoE layers", "TFLOP/s", "GB/s", "ms/step (MoE", "GFLOP/s", "MFU: none"}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
}

// TestBF16 trains the tiny models with bf16 compute on each device: the losses fall
// and end near those of f32 compute on the CPU.
func TestBF16(t *testing.T) {
	o := tinyOptions(t)
	o.NoPlot = true
	f32, _ := runOK(t, o)
	dt.Run(t, func(t *testing.T, d *device.Device) {
		o := tinyOptions(t)
		o.Device, o.NoPlot, o.DType = d.String(), true, "bf16"
		rep, out := runOK(t, o)
		if !strings.Contains(out, "bf16 compute") {
			t.Errorf("output does not say bf16 compute:\n%s", out)
		}
		for i, r := range rep.Models {
			if !(r.Heldout < r.First-0.5) {
				t.Errorf("%s: held-out loss did not fall: %.3f", r.Name, r.History.Eval)
			}
			if want := f32.Models[i].Heldout; math.Abs(r.Heldout-want) > 0.05*want {
				t.Errorf("%s: final held-out loss %.4f with bf16 compute, %.4f with f32 on the CPU", r.Name, r.Heldout, want)
			}
		}
	})
}

// TestGrads trains the tiny dropless model with -grads bf16 on each device, in f32 and
// bf16 compute, and checks that the experts' gradients are bf16 and the others f32, that
// the losses fall and end near those of f32 gradients, and that the output says so.
func TestGrads(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, dtype := range []string{"f32", "bf16"} {
			o := tinyOptions(t)
			o.Device, o.NoPlot, o.Capacity, o.DType = d.String(), true, 0, dtype
			f32, _ := runOK(t, o)
			o.Out, o.Grads = t.TempDir(), "bf16"
			rep, out := runOK(t, o)
			if !strings.Contains(out, "bf16 expert gradients") {
				t.Errorf("-dtype %s: output does not say bf16 expert gradients:\n%s", dtype, out)
			}
			r := rep.Models[0]
			if !(r.Heldout < r.First-0.5) {
				t.Errorf("-dtype %s: held-out loss did not fall: %.3f", dtype, r.History.Eval)
			}
			if want := f32.Models[0].Heldout; math.Abs(r.Heldout-want) > 0.05*want {
				t.Errorf("-dtype %s: final held-out loss %.4f with bf16 expert gradients, %.4f with f32 ones", dtype, r.Heldout, want)
			}
		}
		cfg := tinyOptions(t).modelConfig(0)
		m := dt.Must(newModel(d, cfg, 1, modelOptions{DType: device.BF16, Grads: device.BF16}))
		defer m.Free()
		for _, p := range m.params {
			want := device.F32
			if p.expert {
				want = device.BF16
			}
			if p.g.DType() != want {
				t.Errorf("%s's gradient is %v, want %v", p.name, p.g, want)
			}
		}
	})
}

// TestMoments trains the tiny dropless model with -moments bf16 on each device and checks
// that its losses fall and end near those of f32 moments, that the checkpoint records
// bf16 moments holding bf16 values, that they load into f32 moments exactly and back into
// bf16 ones unchanged, and that -resume with the other -moments converts them, saying so.
func TestMoments(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		o := tinyOptions(t)
		o.Device, o.NoPlot, o.Capacity = d.String(), true, 0
		f32, _ := runOK(t, o)
		o.Out, o.Moments = t.TempDir(), "bf16"
		rep, out := runOK(t, o)
		if !strings.Contains(out, "bf16 AdamW moments") {
			t.Errorf("output does not say bf16 AdamW moments:\n%s", out)
		}
		r := rep.Models[0]
		if !(r.Heldout < r.First-0.5) {
			t.Errorf("held-out loss did not fall: %.3f", r.History.Eval)
		}
		if want := f32.Models[0].Heldout; math.Abs(r.Heldout-want) > 0.05*want {
			t.Errorf("final held-out loss %.4f with bf16 moments, %.4f with f32 ones", r.Heldout, want)
		}
		ck := dt.Must(readCheckpoint(r.Path))
		if ck.Moments != "bf16" {
			t.Fatalf("checkpoint's moments are %q, want bf16", ck.Moments)
		}
		for _, p := range ck.Params {
			for _, x := range [][]float32{p.M, p.V} {
				for i, y := range x {
					if y != roundBF16(y) {
						t.Fatalf("%s: moment %d is %v, not a bf16 value", p.Name, i, y)
					}
				}
			}
		}
		// bf16 → f32 is exact, and f32 → bf16 then gives the bf16 values back.
		for _, moments := range []device.DType{device.F32, device.BF16} {
			m := dt.Must(loadModel(d, ck, modelOptions{DType: device.F32, Moments: moments}))
			for i, p := range m.params {
				for _, c := range []struct {
					want []float32
					t    *device.Tensor
				}{{ck.Params[i].M, p.m}, {ck.Params[i].V, p.v}} {
					if c.t.DType() != moments {
						t.Fatalf("%s's moment is %v, want %v", p.name, c.t, moments)
					}
					if diff := cmp.Diff(c.want, down(t, m.s, c.t)); diff != "" {
						t.Errorf("%v moments: %s differs from the checkpoint (-saved +loaded):\n%s", moments, p.name, diff)
					}
				}
			}
			dt.NoErr(t, m.Free())
		}
		// A checkpoint from before -moments holds f32 ones; one of another dtype is refused.
		ck.Moments = ""
		if got, err := ck.momentType(); err != nil || got != device.F32 {
			t.Errorf("moments of a checkpoint without a dtype: %v, %v; want f32", got, err)
		}
		ck.Moments = "f16"
		bad := filepath.Join(t.TempDir(), "bad.ckpt")
		f := dt.Must(os.Create(bad))
		dt.NoErr(t, gob.NewEncoder(f).Encode(ck))
		dt.NoErr(t, f.Close())
		if _, err := readCheckpoint(bad); err == nil || !strings.Contains(err.Error(), `AdamW moments of dtype "f16"`) {
			t.Errorf("checkpoint with f16 moments: error %v", err)
		}
		// -resume with -moments f32 widens them, then with bf16 again rounds.
		o.Resume, o.Steps = true, 5
		for _, c := range []struct{ moments, note string }{
			{"f32", "the checkpoint's AdamW moments are bf16; converted to -moments f32 (exactly)"},
			{"bf16", "the checkpoint's AdamW moments are f32; converted to -moments bf16 (rounded to nearest even)"},
		} {
			o.Moments = c.moments
			_, out := runOK(t, o)
			if !strings.Contains(out, c.note) {
				t.Errorf("-resume -moments %s: output lacks %q:\n%s", c.moments, c.note, out)
			}
			if got := dt.Must(readCheckpoint(r.Path)).Moments; got != c.moments {
				t.Errorf("-resume -moments %s: checkpoint's moments are %q", c.moments, got)
			}
		}
	})
}

// TestFP8 trains the tiny dropless model with -dtype bf16 and each FP8 -precision on each
// device (-ffn 16: FP8 needs multiples of 16) and checks that its losses fall and stay
// near those of -precision bf16; that its final held-out loss is, bit for bit, that of
// its checkpoint reloaded into new layers, which quantize the weights afresh (layers that
// kept the copies of an earlier step would give another); that offloading, whose
// evaluation layers are other layers, changes no loss; that the checkpoint resumes in
// another precision; and that one whose shape FP8 cannot run is refused naming
// -precision.
func TestFP8(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		o := tinyOptions(t)
		o.Device, o.NoPlot, o.Capacity, o.DType, o.FFN = d.String(), true, 0, "bf16", 16
		base, _ := runOK(t, o)
		for _, c := range []struct{ prec, resume string }{{"fp8", "mxfp8"}, {"mxfp8", "bf16"}} {
			prec := c.prec
			t.Run(prec, func(t *testing.T) {
				o := o
				o.Out, o.Precision = t.TempDir(), prec
				rep, out := runOK(t, o)
				if !strings.Contains(out, "expert GEMMs in "+prec+" (E4M3") {
					t.Errorf("output does not name the precision:\n%s", out)
				}
				r, want := rep.Models[0], base.Models[0]
				if !(r.Heldout < r.First-0.5) || !(r.History.Train[2] < r.History.Train[0]) {
					t.Errorf("losses did not fall: train %.3f, held-out %.3f", r.History.Train, r.History.Eval)
				}
				closeHistories(t, "-precision "+prec, base, rep, fp8LossTol)
				t.Logf("held-out %.4f, bf16 %.4f; train %.4f, bf16 %.4f", r.History.Eval, want.History.Eval, r.History.Train, want.History.Train)

				ck := dt.Must(readCheckpoint(r.Path))
				p := dt.Must(o.precision())
				m := dt.Must(loadModel(d, ck, modelOptions{DType: device.BF16, Precision: p}))
				text := dt.Must(loadCorpus(o.Data, nil, o.MaxBytes))
				ev := dt.Must(m.evalLoss(evalBatches(text.Heldout, o.EvalTokens, o.Batch, o.Window)))
				dt.NoErr(t, m.Free())
				if ev != r.Heldout {
					t.Errorf("reloaded model's held-out loss %v, the trained one's %v: stale quantized weights", ev, r.Heldout)
				}

				oo := o
				oo.Offload, oo.Out = "*=offload", t.TempDir()
				off, offOut := runOK(t, oo)
				if diff := cmp.Diff(r.History, off.Models[0].History); diff != "" {
					t.Errorf("losses differ with offloading (-without +with):\n%s", diff)
				}
				if strings.Contains(offOut, "pool full") {
					t.Errorf("FP8 activations did not fit the pinned pool sized for them:\n%s", offOut)
				}

				o.Resume, o.Steps, o.Precision = true, 5, c.resume
				again, _ := runOK(t, o)
				if h := again.Models[0].History; h.EvalStep[len(h.EvalStep)-1] != 35 || !(h.Eval[len(h.Eval)-1] < r.First-0.5) {
					t.Errorf("-resume -precision %s: held-out %.3f at steps %d, want to step 35", c.resume, h.Eval, h.EvalStep)
				}
			})
		}
		o.Out, o.Steps, o.FFN = t.TempDir(), 0, 8
		runOK(t, o)
		o.Resume, o.Precision = true, "fp8"
		if _, err := run(o, io.Discard); err == nil || !strings.Contains(err.Error(), "-precision fp8 with -hidden 16 and -ffn 8") {
			t.Errorf("-resume -precision fp8 of a model with -ffn 8: error %v", err)
		}
	})
}

// fp8LossTol is how far an FP8 run's losses may be from the bf16 run's in TestFP8,
// relative to 1 + the loss: they were within 0.0011 on the CPU, and layers that kept the
// first step's quantized weights 0.06 to 0.15 off.
const fp8LossTol = 0.01

// TestOutputWeightGrad checks the output projection's weight gradient at batches that
// outSplit cuts into parts (and one that it does not) against float64 sums.
func TestOutputWeightGrad(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		cfg := ModelConfig{Vocab: 13, Window: 3, Hidden: 8, FFN: 4, Experts: 4, TopK: 2, Layers: 1}
		for _, B := range []int{1000, 2048, 5000 + 3} {
			t.Run(fmt.Sprintf("B=%d", B), func(t *testing.T) {
				m := dt.Must(newModel(d, cfg, 3, modelOptions{DType: device.F32}))
				defer m.Free()
				s, H, V := m.s, cfg.Hidden, cfg.Vocab
				ws := dt.Must(m.workspace(B))
				if got, want := ws.outParts != nil, outSplit(B, cfg.Hidden, cfg.Vocab) > 1; got != want {
					t.Fatalf("parts made %v, want %v", got, want)
				}
				r := dt.Rand(uint64(B))
				xv, gv := dt.Normal(r, B*H, 1), dt.Normal(r, B*V, 1)
				dt.NoErr(t, ws.xn[cfg.Layers].SetFloat32(s, xv))
				dt.NoErr(t, ws.dlogits.SetFloat32(s, gv))
				dt.Poison(t, s, m.out.g)
				dt.NoErr(t, m.outputWeightGrad(ws))
				want := make([]float64, H*V)
				for i := range H {
					for j := range V {
						var sum float64
						for b := range B {
							sum += float64(xv[b*H+i]) * float64(gv[b*V+j])
						}
						want[i*V+j] = sum
					}
				}
				near(t, "out.g", down(t, s, m.out.g), want, 1e-7*float64(B)) // f32 sums of B products of about 1
			})
		}
	})
}

// TestSideStream trains a few steps with the side stream's work there (the embedding
// gradient's grouping beside the forward, the experts' AdamW as each layer's backward
// ends) and with all of it on the model's stream (the grouping before the forward, every
// AdamW step at the end), in bf16 (the embedding's gradient reading the bf16 copy of the
// residual's): the parameters and moments agree bit for bit.
func TestSideStream(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		cfg := ModelConfig{Vocab: 13, Window: 3, Hidden: 16, FFN: 8, SharedFFN: 4, Experts: 4, TopK: 2, Layers: 2}
		h := adamHyper{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
		var ref [][]float32
		for _, serial := range []bool{true, false} {
			m := dt.Must(newModel(d, cfg, 3, modelOptions{DType: device.BF16, Moments: device.BF16}))
			m.serialSide = serial
			const B = 64
			for step := range 3 {
				tok := randTokens(uint64(20+step), B*(cfg.Window+1), cfg.Vocab, false)
				tt := dt.Must(device.FromSlice(m.s, device.I32, tok, B, cfg.Window+1))
				dt.NoErr(t, m.trainStep(tt, h, 1e-2))
				dt.NoErr(t, tt.Free())
			}
			var got [][]float32
			for _, p := range m.params {
				got = append(got, down(t, m.s, p.w), down(t, m.s, p.m), down(t, m.s, p.v))
			}
			dt.NoErr(t, m.Free())
			if ref == nil {
				ref = got
				continue
			}
			if diff := cmp.Diff(ref, got); diff != "" {
				t.Errorf("parameters and moments after the side stream's steps differ from one step at the end (-end +side):\n%s", diff)
			}
		}
	})
}
