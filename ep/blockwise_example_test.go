package ep_test

import (
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/ep"
	"github.com/dropless/dropless/gemm"
	"github.com/dropless/dropless/quant"
)

// ExampleLayout_DispatchBlockwise quantizes each rank's tokens once, dispatches the FP8
// rows with their scales, and runs the local experts' FP8 product on them, on two
// in-process ranks. The experts are identities and the values fit E4M3 exactly under
// power-of-two scales, so each token comes back as it was.
func ExampleLayout_DispatchBlockwise() {
	const H = 128
	w, _ := ep.NewWorld(2)
	outs := make([]string, 2)
	err := w.Run(func(tr ep.Transport) error {
		s := device.CPU().Stream()
		g, err := ep.NewGroup(tr, ep.Config{Experts: 4, TopK: 2})
		if err != nil {
			return err
		}
		defer g.Close()
		// Three tokens per rank, token t of rank r all 2r+t+1; experts 0, 1 live on rank 0
		// and 2, 3 on rank 1.
		idx, _ := device.FromSlice(s, device.I32, []int32{0, 1, 0, 2, 3, -1}, 3, 2)
		wts, _ := device.FromFloat32(s, device.F32, []float32{0.5, 0.5, 0.75, 0.25, 1, 0}, 3, 2)
		xv := make([]float32, 3*H)
		for i := range xv {
			xv[i] = float32(2*tr.Rank() + i/H + 1)
		}
		x, _ := device.FromFloat32(s, device.BF16, xv, 3, H)
		l, err := g.Layout(s, idx)
		if err != nil {
			return err
		}
		defer l.Free()
		opt := quant.BlockOptions{Scale: quant.ScalePow2}
		q, err := quant.QuantizeBlockwise(s, x, opt)
		if err != nil {
			return err
		}
		defer q.Free()
		d, err := l.DispatchBlockwise(s, q, wts)
		if err != nil {
			return err
		}
		defer d.Free()
		// The two local experts' weights, identities, quantized in 128×128 blocks.
		eye := make([]float32, 2*H*H)
		for i := range 2 * H {
			eye[i*H+i%H] = 1
		}
		we, _ := device.FromFloat32(s, device.BF16, eye, 2, H, H)
		wq, err := quant.QuantizeWeights(s, we, opt)
		if err != nil {
			return err
		}
		defer wq.Free()
		y, _ := s.Alloc(device.F32, l.Capacity(), H)
		defer y.Free()
		if err := gemm.RaggedDotBlockwise(s, y, d.X, wq, d.Counts, nil); err != nil {
			return err
		}
		out, err := l.Combine(s, y, d.Weights)
		if err != nil {
			return err
		}
		v, _ := out.Float32s(s)
		outs[tr.Rank()] = fmt.Sprintf("rank %d: expert rows %v, tokens %v %v %v", tr.Rank(), l.Counts(), v[0], v[H], v[2*H])
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	for _, o := range outs {
		fmt.Println(o)
	}
	// Output:
	// rank 0: expert rows [4 2], tokens 1 2 3
	// rank 1: expert rows [2 2], tokens 3 4 5
}
