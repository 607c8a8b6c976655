package ep

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/dropless/dropless/device"
)

// The ranks' groups must agree on their settings: ranks that do not would exchange
// buffers of different sizes, and fail on a count of bytes (or, over NCCL, hang or
// misread rows). The first Layout of a group compares them, in one small all-gather.

// setting is one entry of the record the ranks compare: its name, its words in the
// record and how to show their value.
type setting struct {
	name  string
	words int
	show  func(v []int64) string
}

func showInt(v []int64) string { return strconv.FormatInt(v[0], 10) }

// settings lists the entries of record, in order.
var settings = []setting{
	{"Config.Experts", 1, showInt},
	{"Config.TopK", 1, showInt},
	{"Config.Capacity", 3, func(v []int64) string {
		return Capacity{kind: capKind(v[0]), factor: math.Float64frombits(uint64(v[1])), rows: int(v[2])}.String()
	}},
	{"Config.Overflow", 1, func(v []int64) string { return Overflow(v[0]).String() }},
	{"Config.CheckEvery", 1, showInt},
	{"Config.Chunks", 2, func(v []int64) string {
		if v[0] == 0 {
			return fmt.Sprintf("0 (%d on the rank's device)", v[1])
		}
		return showInt(v)
	}},
}

// record returns the group's settings as settings lists them. CheckEvery counts as 1
// where it checks every Layout (0, or under DropOverflow, which never checks).
func (g *Group) record() []int64 {
	c := g.cfg
	every := max(c.CheckEvery, 1)
	if c.Overflow == DropOverflow {
		every = 1
	}
	return []int64{int64(c.Experts), int64(c.TopK),
		int64(c.Capacity.kind), int64(math.Float64bits(c.Capacity.factor)), int64(c.Capacity.rows),
		int64(c.Overflow), int64(every), int64(c.Chunks), int64(g.chunks())}
}

// agree gathers every rank's settings on s and fails, on every rank alike, when they
// differ, naming the first setting that does and the ranks of each value.
func (g *Group) agree(s *device.Stream) error {
	if g.r == 1 {
		return nil
	}
	rec := g.record()
	all, err := g.allGather64(s, rec)
	if err != nil {
		return err
	}
	n, at := len(rec), 0
	for _, st := range settings {
		var vals []string
		ranks := map[string][]int{}
		for q := range g.r {
			v := st.show(all[q*n+at : q*n+at+st.words])
			if ranks[v] == nil {
				vals = append(vals, v)
			}
			ranks[v] = append(ranks[v], q)
		}
		if len(vals) > 1 {
			parts := make([]string, len(vals))
			for i, v := range vals {
				parts[i] = v + " on " + rankList(ranks[v])
			}
			return fmt.Errorf("ep: Layout: the ranks' groups disagree on %s: %s", st.name, strings.Join(parts, ", "))
		}
		at += st.words
	}
	return nil
}

// rankList names the ranks rs: "rank 3", "ranks [0 2]", "ranks [0 1 2 3 4 5 6 7 ...] (12)".
func rankList(rs []int) string {
	switch {
	case len(rs) == 1:
		return fmt.Sprintf("rank %d", rs[0])
	case len(rs) > 8:
		return fmt.Sprintf("ranks %v (%d)", strings.TrimSuffix(fmt.Sprint(rs[:8]), "]")+" ...]", len(rs))
	}
	return fmt.Sprintf("ranks %v", rs)
}
