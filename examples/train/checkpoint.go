package main

import (
	"bufio"
	"encoding/gob"
	"fmt"
	"os"
	"slices"

	"github.com/dropless/dropless/device"
)

// checkpointVersion is the version of the checkpoint format.
const checkpointVersion = 1

// Checkpoint is the file format of a saved model: one gob-encoded Checkpoint
// (encoding/gob). It holds everything needed to resume training: the model's shape,
// the optimizer step, every parameter with its AdamW moments (the experts of every
// rank, so a model trained over R ranks resumes over any number that divides E), and
// the loss history. It does not record -precision: the parameters are the f32 weights
// whatever the expert GEMMs' arithmetic, so a model resumes in any precision.
type Checkpoint struct {
	Version int // checkpointVersion
	Config  ModelConfig
	Step    int    // optimizer steps taken
	Seed    uint64 // the seed of the data order
	// Moments is the dtype the AdamW moments were trained in, "f32" or "bf16" (-moments;
	// empty in checkpoints written before the flag: f32). The saved moments hold its
	// values exactly.
	Moments string
	Params  []SavedTensor
	History History
}

// SavedTensor is a parameter in a Checkpoint: row-major float32 values and moments.
type SavedTensor struct {
	Name  string
	Shape []int
	Value []float32
	M, V  []float32 // AdamW's first and second moments, of the checkpoint's Moments dtype
}

// momentType returns the dtype of the checkpoint's AdamW moments.
func (ck *Checkpoint) momentType() (device.DType, error) {
	if ck.Moments == "" {
		return device.F32, nil
	}
	return floatType("AdamW moments of dtype", ck.Moments)
}

// History is the record of a training run: the mean training loss of each window of
// steps ending at TrainStep[i], and the held-out loss at EvalStep[i], in nats per token;
// Dropped[i] is the fraction of assignments dropped for capacity in window i.
type History struct {
	TrainStep []int
	Train     []float64
	Dropped   []float64
	EvalStep  []int
	Eval      []float64
}

// save writes the model and its history to path, atomically (a temporary file renamed).
// Over several ranks every rank calls it: the experts of every rank are gathered, and
// rank 0 writes the file.
func (m *Model) save(path string, seed uint64, h History) error {
	ck := Checkpoint{Version: checkpointVersion, Config: m.Config, Step: m.Step, Seed: seed, Moments: m.moments.String(), History: h}
	for _, p := range m.params {
		st := SavedTensor{Name: p.name, Shape: slices.Clone(p.full)}
		var err error
		for _, c := range []struct {
			dst *[]float32
			t   *device.Tensor
		}{{&st.Value, p.w}, {&st.M, p.m}, {&st.V, p.v}} {
			if p.expert {
				*c.dst, err = m.dist.gatherFloat32(m.s, c.t)
			} else {
				*c.dst, err = c.t.Float32s(m.s)
			}
			if err != nil {
				return err
			}
		}
		ck.Params = append(ck.Params, st)
	}
	if m.dist.Rank() != 0 {
		return nil
	}
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	err = gob.NewEncoder(w).Encode(&ck)
	if err == nil {
		err = w.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("checkpoint %s: %v", path, err)
	}
	return os.Rename(tmp, path)
}

// readCheckpoint reads the checkpoint at path.
func readCheckpoint(path string) (*Checkpoint, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var ck Checkpoint
	if err := gob.NewDecoder(bufio.NewReader(f)).Decode(&ck); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %v", path, err)
	}
	if ck.Version != checkpointVersion {
		return nil, fmt.Errorf("checkpoint %s: version %d, want %d", path, ck.Version, checkpointVersion)
	}
	if _, err := ck.momentType(); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %v", path, err)
	}
	return &ck, nil
}

// loadModel returns the model of a checkpoint on d, trained as o says: over R ranks,
// each takes its experts. Moments of another dtype than o.Moments are converted: f32 ones
// rounded to bf16 (nearest even), bf16 ones widened exactly. The checkpoint does not
// depend on o.Precision: the FP8 layers quantize the loaded weights.
func loadModel(d *device.Device, ck *Checkpoint, o modelOptions) (*Model, error) {
	m, err := newModel(d, ck.Config, 0, o)
	if err != nil {
		return nil, err
	}
	if len(ck.Params) != len(m.params) {
		return nil, m.freeAfter(fmt.Errorf("checkpoint: %d parameters, want %d", len(ck.Params), len(m.params)))
	}
	R, rank := m.dist.Size(), m.dist.Rank()
	for i, p := range m.params {
		st := ck.Params[i]
		if st.Name != p.name || !slices.Equal(st.Shape, p.full) {
			return nil, m.freeAfter(fmt.Errorf("checkpoint: parameter %d is %s %v, want %s %v", i, st.Name, st.Shape, p.name, p.full))
		}
		for _, c := range []struct {
			src []float32
			t   *device.Tensor
		}{{st.Value, p.w}, {st.M, p.m}, {st.V, p.v}} {
			n := c.t.Len()
			if p.expert {
				n *= R
			}
			if len(c.src) != n {
				return nil, m.freeAfter(fmt.Errorf("checkpoint: %s holds %d values, want %d", p.name, len(c.src), n))
			}
			src := c.src
			if p.expert {
				src = src[rank*c.t.Len() : (rank+1)*c.t.Len()]
			}
			if err := c.t.SetFloat32(m.s, src); err != nil {
				return nil, m.freeAfter(err)
			}
		}
	}
	// The model's layers are new: they quantize the loaded W1 and W2 at their first Forward.
	if err := m.syncCompute(); err != nil {
		return nil, m.freeAfter(err)
	}
	m.Step = ck.Step
	return m, nil
}
