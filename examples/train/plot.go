package main

import (
	"fmt"
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// curve is one model's history for the plot.
type curve struct {
	name string
	h    History
}

// plotLosses draws the training and held-out losses of the curves against the step,
// with the unigram entropy of the held-out text as a reference, into a PNG at path.
func plotLosses(path string, curves []curve, unigram float64) error {
	p := plot.New()
	p.Title.Text = "Loss per byte, dropless vs capacity-factor MoE"
	p.X.Label.Text = "step"
	p.Y.Label.Text = "cross-entropy (nats/byte)"
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	colors := []color.Color{
		color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
		color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
		color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	}
	xmax := 1.0
	for i, c := range curves {
		col := colors[i%len(colors)]
		tr := make(plotter.XYs, len(c.h.Train))
		for j := range tr {
			tr[j] = plotter.XY{X: float64(c.h.TrainStep[j]), Y: c.h.Train[j]}
			xmax = max(xmax, tr[j].X)
		}
		ev := make(plotter.XYs, len(c.h.Eval))
		for j := range ev {
			ev[j] = plotter.XY{X: float64(c.h.EvalStep[j]), Y: c.h.Eval[j]}
			xmax = max(xmax, ev[j].X)
		}
		if len(tr) > 0 {
			l, err := plotter.NewLine(tr)
			if err != nil {
				return err
			}
			l.Color = col
			l.Width = vg.Points(1)
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			p.Add(l)
			p.Legend.Add(c.name+" train", l)
		}
		if len(ev) > 0 {
			l, s, err := plotter.NewLinePoints(ev)
			if err != nil {
				return err
			}
			l.Color = col
			l.Width = vg.Points(2)
			s.Color = col
			s.Shape = draw.CircleGlyph{}
			s.Radius = vg.Points(2)
			p.Add(l, s)
			p.Legend.Add(c.name+" held-out", l, s)
		}
	}
	uni, err := plotter.NewLine(plotter.XYs{{X: 0, Y: unigram}, {X: xmax, Y: unigram}})
	if err != nil {
		return err
	}
	uni.Color = color.Gray{Y: 0x70}
	uni.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
	p.Add(uni)
	p.Legend.Add(fmt.Sprintf("unigram entropy %.3f", unigram), uni)
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}
