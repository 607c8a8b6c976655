package quant

import "fmt"

// Block and tile sizes shared with the kernels.
const (
	blockSize = 32  // elements per scale
	tileCols  = 256 // source columns per kernel block
)

// geom is the shape of one MXFP8 layout.
//
// The rows are cut into tiles of 32 rows: tile t owns rowwise scale rows [32t, 32t+32)
// and columnwise scale row t. Without groups tile t holds source rows [32t, 32t+32).
// With groups each group g owns 4·ceil(M_g/128) consecutive tiles, starting at tile
// 4·P_g with P_g = Σ_{h<g} ceil(M_h/128); its first ceil(M_g/32) tiles hold its rows
// (the last may be short), the rest are padding. Tiles after the last group are padding
// too: their number is fixed by the bound 4·(floor(M/128) + min(G, M)) on the tiles the
// groups can need, so that shapes do not depend on the group sizes.
type geom struct {
	m, k   int
	nbk    int // blocks per row: ceil(k/32)
	cp     int // rowwise scale columns: roundup(nbk, 4)
	kp     int // columnwise scale columns: roundup(k, 128)
	ntiles int // 32-row tiles; rowwise scale rows = 32·ntiles, columnwise = ntiles
	ncolt  int // 256-column tiles covering kp
	groups int // G (0 without groups)
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

func newGeom(m, k, groups int, grouped bool) geom {
	g := geom{m: m, k: k, groups: groups}
	g.nbk = ceilDiv(k, blockSize)
	g.cp = 4 * ceilDiv(g.nbk, 4)
	g.kp = 128 * ceilDiv(k, 128)
	if grouped {
		g.ntiles = 4 * (m/128 + min(groups, m))
	} else {
		g.ntiles = 4 * ceilDiv(m, 128)
	}
	g.ncolt = ceilDiv(g.kp, tileCols)
	return g
}

// check returns an error if the layout is too large for the kernels' 32-bit indices.
func (g geom) check() error {
	const lim = 1<<31 - 1
	switch {
	case g.m > lim-256:
		return fmt.Errorf("m = %d rows: want at most %d", g.m, lim-256)
	case g.kp > lim:
		return fmt.Errorf("k = %d columns: want at most %d", g.k, lim-127)
	case g.ntiles > lim/32:
		return fmt.Errorf("%d rows in %d groups: more than 2^31 scale rows", g.m, g.groups)
	case g.ncolt > 0 && g.ntiles > lim/g.ncolt:
		return fmt.Errorf("%d×%d: more than 2^31 kernel blocks", g.m, g.k)
	}
	return nil
}

func (g geom) rowScaleShape() []int { return []int{32 * g.ntiles, g.cp} }
func (g geom) colScaleShape() []int { return []int{g.ntiles, g.kp} }
func (g geom) colTShape() []int     { return []int{g.k, blockSize * g.ntiles} }

// rowScaleOff returns the byte offset of rowwise scale (row, block).
func (g geom) rowScaleOff(swz bool, row, blk int) int {
	if swz {
		return swizzle(row, blk, g.cp)
	}
	return row*g.cp + blk
}

// colScaleOff returns the byte offset of the columnwise scale of column j in tile t,
// where the tile's group (or the trailing padding) starts at tile p4 and spans cg tiles.
// Swizzled, a group's columnwise scales are the swizzled layout of its own scale matrix
// transposed (rows: the K columns; columns: its 32-row blocks), as for a [K, M_g] operand.
func (g geom) colScaleOff(swz bool, t, j, p4, cg int) int {
	if swz {
		return p4*g.kp + swizzle(j, t-p4, cg)
	}
	return t*g.kp + j
}

// tile describes one 32-row tile: source rows [row0, row0+nrows); nrows 0 marks padding
// and −1 invalid group sizes. The tile's group starts at tile p4 and spans cg tiles.
type tile struct{ row0, nrows, p4, cg int32 }

// Status codes of group-size validation, the codes of its device.Status records (see
// status.go).
const (
	statusOK       = 0
	statusNegative = 1 // a size is negative
	statusSum      = 2 // the sizes do not sum to M
)

// tiles returns the tile descriptors for the given group sizes (nil: no groups) and
// the validation status. With invalid sizes every tile is {32t, −1, 0, ntiles}.
func (g geom) tiles(sizes []int32) ([]tile, int32) {
	ts := make([]tile, g.ntiles)
	if sizes == nil {
		for t := range ts {
			ts[t] = tile{int32(32 * t), int32(min(max(g.m-32*t, 0), 32)), 0, int32(g.ntiles)}
		}
		return ts, statusOK
	}
	status := int32(statusOK)
	var sum int64
	for _, s := range sizes {
		if s < 0 {
			status = statusNegative
			break
		}
		sum += int64(s)
	}
	if status == statusOK && sum != int64(g.m) {
		status = statusSum
	}
	if status != statusOK {
		for t := range ts {
			ts[t] = tile{int32(32 * t), -1, 0, int32(g.ntiles)}
		}
		return ts, status
	}
	t, off := 0, 0
	for _, s := range sizes {
		n := int(s)
		cg := 4 * ceilDiv(n, 128)
		p4 := t
		for b := range cg {
			ts[t] = tile{int32(min(off+32*b, g.m)), int32(min(max(n-32*b, 0), 32)), int32(p4), int32(cg)}
			t++
		}
		off += n
	}
	for p4 := t; t < g.ntiles; t++ {
		ts[t] = tile{int32(g.m), 0, int32(p4), int32(g.ntiles - p4)}
	}
	return ts, statusOK
}
