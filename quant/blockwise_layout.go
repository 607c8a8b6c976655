package quant

import (
	"fmt"
	"math"

	"github.com/dropless/dropless/device"
)

// The block rule of the blockwise recipe, in float32 with IEEE divisions rounded to
// nearest even; kernels/blockwise.cu computes the same bits.

// blockScale returns the scale of a block of format f whose largest magnitude is amax
// (≥ 0, NaN left out): 1 for amax 0, +Inf for amax +Inf; else f = amax/Max, and f
// itself (1 where it underflows to 0), or with ScalePow2 the smallest power of two ≥ f
// (f's bits with the mantissa cleared, the exponent raised by one when the mantissa was
// not zero), clamped to [2^-126, 2^127].
func blockScale(amax float32, f Format, k ScaleKind) float32 {
	switch {
	case amax == 0:
		return 1
	case math.IsInf(float64(amax), 1):
		return amax
	}
	v := amax / f.Max()
	if k == ScaleF32 {
		if v == 0 {
			return 1
		}
		return v
	}
	b := math.Float32bits(v)
	e := b >> 23
	if b&0x7fffff != 0 {
		e++
	}
	return math.Float32frombits(min(max(e, 1), 254) << 23)
}

// blockEncode returns the code of v in a block of scale s: v/s rounded to nearest even
// in float32, then encoded (saturating; NaN to the NaN code).
func blockEncode(f Format, v, s float32) uint8 { return f.encode(v / s) }

// blockDecode returns decode(c)·s in float32, NaN as the quiet NaN 0x7FC00000; tab is
// the format's decodeTable.
func blockDecode(tab *[256]float32, c uint8, s float32) float32 {
	v := tab[c] * s
	if v != v {
		return nanF32
	}
	return v
}

// bwGeom is the shape of a blockwise activation layout (see Blockwise).
type bwGeom struct {
	m, k    int
	nb      int // blocks per row, ceil(k/128): RowScale rows and kernel column tiles
	mr      int // roundup(m, 4): RowScale columns
	ntiles  int // token blocks: Mp/128, ColTScale rows
	groups  int // G (0 without groups)
	grouped bool
}

func newBwGeom(m, k, groups int, grouped bool) bwGeom {
	g := bwGeom{m: m, k: k, groups: groups, grouped: grouped}
	g.nb = ceilDiv(k, BlockSize)
	g.mr = 4 * ceilDiv(m, 4)
	if grouped {
		g.ntiles = m/BlockSize + min(groups, m)
	} else {
		g.ntiles = ceilDiv(m, BlockSize)
	}
	return g
}

// mp returns Mp, the token columns of ColT.
func (g bwGeom) mp() int { return BlockSize * g.ntiles }

// check returns an error if the layout is too large for the kernels' 32-bit indices.
func (g bwGeom) check() error {
	const lim = math.MaxInt32
	switch {
	case g.m > lim-2*BlockSize:
		return fmt.Errorf("m = %d rows: want at most %d", g.m, lim-2*BlockSize)
	case g.k > lim-BlockSize:
		return fmt.Errorf("k = %d columns: want at most %d", g.k, lim-BlockSize)
	case g.ntiles > lim/BlockSize:
		return fmt.Errorf("%d rows in %d groups: more than 2^31 ColT columns", g.m, g.groups)
	case g.nb > 0 && g.ntiles > lim/g.nb:
		return fmt.Errorf("%d×%d: more than 2^31 kernel blocks", g.m, g.k)
	}
	return nil
}

func (g bwGeom) rowScaleShape() []int  { return []int{g.nb, g.mr} }
func (g bwGeom) colTShape() []int      { return []int{g.k, g.mp()} }
func (g bwGeom) colTScaleShape() []int { return []int{g.ntiles, g.k} }

// bwTile is a token block of ColT: source rows [row0, row0+n), n ≤ 128, n = 0 for a
// padding block.
type bwTile struct{ row0, n int32 }

// bwSizesCheck is the validation of group sizes: code statusOK, statusNegative (a, b:
// the first negative size's index and value) or statusSum (a, b: the sum and M).
type bwSizesCheck struct {
	code int
	a, b int64
}

// tiles returns the token blocks for the group sizes (nil: no groups) and their
// validation. Invalid sizes give the ungrouped blocks: Row does not depend on the
// groups, and ColT stays within its bounds.
func (g bwGeom) tiles(sizes []int32) ([]bwTile, bwSizesCheck) {
	ts := make([]bwTile, g.ntiles)
	ungrouped := func() {
		for t := range ts {
			n := min(max(g.m-BlockSize*t, 0), BlockSize)
			ts[t] = bwTile{int32(g.m), 0}
			if n > 0 {
				ts[t] = bwTile{int32(BlockSize * t), int32(n)}
			}
		}
	}
	if sizes == nil {
		ungrouped()
		return ts, bwSizesCheck{}
	}
	var sum int64
	for i, s := range sizes {
		if s < 0 {
			ungrouped()
			return ts, bwSizesCheck{statusNegative, int64(i), int64(s)}
		}
		sum += int64(s)
	}
	if sum != int64(g.m) {
		ungrouped()
		return ts, bwSizesCheck{statusSum, sum, int64(g.m)}
	}
	t, row := 0, 0
	for _, s := range sizes {
		for b := 0; b < int(s); b += BlockSize {
			ts[t] = bwTile{int32(row + b), int32(min(int(s)-b, BlockSize))}
			t++
		}
		row += int(s)
	}
	for ; t < len(ts); t++ {
		ts[t] = bwTile{int32(g.m), 0}
	}
	return ts, bwSizesCheck{}
}

// The ops of the blockwise records of group-size validation in a device.Status (domain
// statusDomain, codes statusNegative and statusSum; op opQuantize is MXFP8's).
// kernels/blockwise.cu records them with the op it is given.
const (
	opQuantizeBlockwise       = 2
	opQuantizeBlockwiseInto   = 3
	opQuantizeBlockwiseSource = 6 // after the gathers' 4 and 5
)

// record records c, the validation of the group sizes of a CPU op, in st.
func (c bwSizesCheck) record(st *device.Status, op int) {
	if c.code != statusOK {
		// st was checked to be a CPU Status by the op: Record cannot fail.
		_ = st.Record(device.StatusCode(statusDomain, op, c.code), c.a, c.b, 0)
	}
}

// blockwiseStatusError returns the error of a record of a blockwise op (statusError
// dispatches them here), and nil for the records of other ops.
func blockwiseStatusError(op, code int, v [3]int64) error {
	var fn string
	switch op {
	case opQuantizeBlockwise:
		fn = "QuantizeBlockwise"
	case opQuantizeBlockwiseInto:
		fn = "QuantizeBlockwiseInto"
	case opQuantizeBlockwiseSource:
		fn = "QuantizeBlockwiseSource"
	default:
		return nil
	}
	switch code {
	case statusNegative:
		return fmt.Errorf("quant: %s: sizes[%d] = %d < 0", fn, v[0], v[1])
	case statusSum:
		rel := ">"
		if v[0] < v[1] {
			rel = "<"
		}
		return fmt.Errorf("quant: %s: sizes sum to %d %s M=%d", fn, v[0], rel, v[1])
	}
	return fmt.Errorf("quant: %s: invalid group sizes (code %d)", fn, code)
}
