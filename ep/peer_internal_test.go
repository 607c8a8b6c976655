package ep

import (
	"testing"

	dt "github.com/dropless/dropless/device/devicetest"
)

// TestGeom: with direct transfers a sender writes its rows where the receiver's own
// layout expects them. For every receiver q and sender r, the geometry r computes for q
// (q's receive rows, and where r's rows start) must match q's receive tensors: a
// dispatch's hold the other ranks' tokens at q's compacted receive offsets, a combine's
// hold q's send order (sendOff), and r's segment must fit.
func TestGeom(t *testing.T) {
	rnd := dt.Rand(7)
	for R := 1; R <= 8; R++ {
		pair := make([]int, R*R)
		for i := range pair {
			pair[i] = rnd.IntN(50)
		}
		layout := func(me int) *Layout {
			l := &Layout{g: &Group{r: R, rank: me}, pair: pair, recvOff: make([]int, R+1), sendOff: make([]int, R+1)}
			for p := range R {
				l.recvOff[p+1] = l.recvOff[p] + pair[p*R+me]
				l.sendOff[p+1] = l.sendOff[p] + pair[me*R+p]
			}
			return l
		}
		for q := range R {
			lq := layout(q)
			cro := compact(lq.recvOff, q)
			for r := range R {
				if r == q {
					continue
				}
				lr := layout(r)
				rows, at := lr.dispatchGeom(q)
				if want := lq.recvOff[R] - pair[q*R+q]; rows != want || at != cro[r] || at+pair[r*R+q] > rows {
					t.Fatalf("R=%d: dispatch from %d to %d: rows %d at %d, want %d at %d", R, r, q, rows, at, want, cro[r])
				}
				rows, at = lr.combineGeom(q)
				if rows != lq.sendOff[R] || at != lq.sendOff[r] || at+pair[q*R+r] > rows {
					t.Fatalf("R=%d: combine from %d to %d: rows %d at %d, want %d at %d", R, r, q, rows, at, lq.sendOff[R], lq.sendOff[r])
				}
			}
		}
	}
}
