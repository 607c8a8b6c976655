package main

import (
	"bytes"
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

// TestOps checks the dense ops of the model on each device against float64 references,
// at sizes that are not multiples of the block size, outputs poisoned first.
func TestOps(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		r := dt.Rand(7)
		for _, c := range []struct{ B, W, V, H int }{{1, 1, 2, 1}, {37, 5, 11, 19}, {300, 3, 7, 300}} {
			t.Run(fmt.Sprintf("B=%d,W=%d,V=%d,H=%d", c.B, c.W, c.V, c.H), func(t *testing.T) {
				B, W, V, H := c.B, c.W, c.V, c.H
				ld := W + 2
				tokv := randTokens(uint64(B), B*ld, V, true)
				tok := dt.Must(device.FromSlice(s, device.I32, tokv, B, ld))
				embv := dt.Normal(r, W*V*H, 1)
				emb := up(t, s, embv, W*V, H)
				h := dt.Must(s.Alloc(device.F32, B, H))
				dt.Poison(t, s, h)
				dt.NoErr(t, embedForward(s, h, emb, tok, W, V))
				want := make([]float64, B*H)
				for b := range B {
					for w := range W {
						if v := int(tokv[b*ld+w]); v < V {
							for j := range H {
								want[b*H+j] += float64(embv[(w*V+v)*H+j])
							}
						}
					}
				}
				near(t, "embedForward", down(t, s, h), want, 1e-5)

				dhv := dt.Normal(r, B*H, 1)
				dh := up(t, s, dhv, B, H)
				demb := dt.Must(s.Alloc(device.F32, W*V, H))
				dt.Poison(t, s, demb)
				dt.NoErr(t, embedBackward(s, demb, dh, tok, W, V))
				want = make([]float64, W*V*H)
				for b := range B {
					for w := range W {
						if v := int(tokv[b*ld+w]); v < V {
							for j := range H {
								want[(w*V+v)*H+j] += float64(dhv[b*H+j])
							}
						}
					}
				}
				near(t, "embedBackward", down(t, s, demb), want, 1e-4)

				xv := dt.Normal(r, B*H, 2)
				x := up(t, s, xv, B, H)
				xn := dt.Must(s.Alloc(device.F32, B, H))
				rstd := dt.Must(s.Alloc(device.F32, B))
				dt.Poison(t, s, xn, rstd)
				dt.NoErr(t, rmsForward(s, xn, rstd, x))
				wantXn, wantR := make([]float64, B*H), make([]float64, B)
				for b := range B {
					ss := 0.0
					for j := range H {
						ss += float64(xv[b*H+j]) * float64(xv[b*H+j])
					}
					wantR[b] = 1 / math.Sqrt(ss/float64(H)+rmsEps)
					for j := range H {
						wantXn[b*H+j] = float64(xv[b*H+j]) * wantR[b]
					}
				}
				near(t, "rmsForward xn", down(t, s, xn), wantXn, 1e-5)
				near(t, "rmsForward rstd", down(t, s, rstd), wantR, 1e-5)
				for _, acc := range []bool{false, true} {
					prev := dt.Normal(r, B*H, 1)
					dx := up(t, s, prev, B, H)
					if !acc {
						dt.Poison(t, s, dx)
					}
					dt.NoErr(t, rmsBackward(s, dx, dh, xn, rstd, acc))
					xnv := down(t, s, xn)
					want := make([]float64, B*H)
					for b := range B {
						dot := 0.0
						for j := range H {
							dot += float64(dhv[b*H+j]) * float64(xnv[b*H+j])
						}
						for j := range H {
							want[b*H+j] = wantR[b] * (float64(dhv[b*H+j]) - float64(xnv[b*H+j])*dot/float64(H))
							if acc {
								want[b*H+j] += float64(prev[b*H+j])
							}
						}
					}
					near(t, fmt.Sprintf("rmsBackward(accumulate=%v)", acc), down(t, s, dx), want, 1e-4)
				}

				sum := dt.Must(s.Alloc(device.F32, B, H))
				dt.Poison(t, s, sum)
				dt.NoErr(t, add(s, sum, x, dh))
				want = make([]float64, B*H)
				for i := range want {
					want[i] = float64(xv[i]) + float64(dhv[i])
				}
				near(t, "add", down(t, s, sum), want, 1e-6)

				zv := dt.Normal(r, B*H, 3) // logits [B, H]: H plays the vocabulary here
				z := up(t, s, zv, B, H)
				const col = 1
				for _, grad := range []bool{false, true} {
					lossInit := dt.Normal(r, B, 1)
					loss := up(t, s, lossInit, B)
					var dz *device.Tensor
					if grad {
						dz = dt.Must(s.Alloc(device.F32, B, H))
						dt.Poison(t, s, dz)
					}
					tokH := randTokens(uint64(B+H), B*ld, H, true)
					tt := dt.Must(device.FromSlice(s, device.I32, tokH, B, ld))
					dt.NoErr(t, softmaxCE(s, loss, dz, z, tt, col, 0.5))
					wantL, wantD := make([]float64, B), make([]float64, B*H)
					for b := range B {
						m := math.Inf(-1)
						for j := range H {
							m = math.Max(m, float64(zv[b*H+j]))
						}
						se := 0.0
						for j := range H {
							se += math.Exp(float64(zv[b*H+j]) - m)
						}
						tg := int(tokH[b*ld+col])
						wantL[b] = float64(lossInit[b])
						if tg < H {
							wantL[b] += math.Log(se) + m - float64(zv[b*H+tg])
						}
						for j := range H {
							p := 0.0
							if tg < H {
								p = math.Exp(float64(zv[b*H+j])-m) / se
							}
							if j == tg {
								p--
							}
							wantD[b*H+j] = 0.5 * p
						}
					}
					near(t, fmt.Sprintf("softmaxCE(grad=%v) loss", grad), down(t, s, loss), wantL, 1e-5)
					if grad {
						near(t, "softmaxCE dlogits", down(t, s, dz), wantD, 1e-5)
					}
				}

				n := B * H
				pv, gv, mv, vv := dt.Normal(r, n, 1), dt.Normal(r, n, 1), dt.Normal(r, n, 0.1), dt.Normal(r, n, 0.1)
				for i := range vv {
					vv[i] *= vv[i]
				}
				p, g, m, v := up(t, s, pv, n), up(t, s, gv, n), up(t, s, mv, n), up(t, s, vv, n)
				hyp := adamHyper{LR: 0.01, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8}
				const step, wd = 3, 0.1
				dt.NoErr(t, adamw(s, p, g, m, v, hyp, wd, step))
				wantP, wantM, wantV := make([]float64, n), make([]float64, n), make([]float64, n)
				c1, c2 := 1/(1-math.Pow(0.9, step)), 1/(1-math.Pow(0.99, step))
				for i := range n {
					g := float64(gv[i])
					wantM[i] = 0.9*float64(mv[i]) + 0.1*g
					wantV[i] = 0.99*float64(vv[i]) + 0.01*g*g
					wantP[i] = float64(pv[i])*(1-0.01*wd) - 0.01*wantM[i]*c1/(math.Sqrt(wantV[i]*c2)+1e-8)
				}
				near(t, "adamw p", down(t, s, p), wantP, 1e-5)
				near(t, "adamw m", down(t, s, m), wantM, 1e-5)
				near(t, "adamw v", down(t, s, v), wantV, 1e-5)
				for _, x := range []*device.Tensor{tok, emb, h, dh, demb, x, xn, rstd, sum, z, p, g, m, v} {
					x.Free()
				}
			})
		}
	})
}

// TestGradients compares the model's gradients with central differences of its loss,
// on a few entries of every parameter.
func TestGradients(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		for _, shared := range []int{0, 6} {
			t.Run(fmt.Sprintf("shared=%d", shared), func(t *testing.T) {
				cfg := ModelConfig{Vocab: 13, Window: 3, Hidden: 8, FFN: 4, SharedFFN: shared, Experts: 4, TopK: 2, Layers: 2}
				m := dt.Must(newModel(d, cfg, 3))
				defer m.Free()
				s := m.s
				// A random output layer, so that every parameter gets a gradient.
				dt.NoErr(t, m.out.w.SetFloat32(s, dt.Normal(dt.Rand(5), m.out.w.Len(), 0.5)))
				const B = 16
				tok := randTokens(11, B*(cfg.Window+1), cfg.Vocab, false)
				ws := dt.Must(m.workspace(B))
				dt.NoErr(t, device.Upload(s, ws.tok, tok))
				acts := dt.Must(m.forward(ws, ws.trainLoss, true))
				dt.NoErr(t, m.backward(ws, acts))
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
		m := dt.Must(loadModel(d, ck))
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
	} {
		o := tinyOptions(t)
		c.mod(&o)
		_, err := run(o, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("error %v, want one naming %s", err, c.want)
		}
	}
}
