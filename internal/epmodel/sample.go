package epmodel

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
)

// sampler routes tokens and tallies what they send. It is used by one goroutine.
type sampler struct {
	r        Routing
	rng      *rand.Rand
	cum      []float64 // cumulative popularity, for draws without the node limit
	logw     []float64 // log popularity, for the node-limited draws
	perRank  int       // experts per rank
	experts  []int     // the token's experts
	score    []float64 // the token's expert scores (node-limited)
	nodeTop  []float64 // the highest scores of one domain (node-limited)
	nodes    []int     // domain order by score (node-limited)
	nodeVal  []float64 // domain scores (node-limited)
	rankMark []int     // token stamp per rank: the rank is a destination
	nodeMark []int     // token stamp per domain
	stamp    int
	t        tally
}

// tally sums the statistics of a run of tokens.
type tally struct {
	ranks, ranks2, nodes, nodes2             float64
	local, offNodeRanks, offNodes, forwarded float64
	recv, rows                               []float64 // per rank
}

func newTally(r Routing) tally {
	return tally{recv: make([]float64, r.Ranks), rows: make([]float64, r.Ranks)}
}

func (t *tally) add(u tally) {
	t.ranks += u.ranks
	t.ranks2 += u.ranks2
	t.nodes += u.nodes
	t.nodes2 += u.nodes2
	t.local += u.local
	t.offNodeRanks += u.offNodeRanks
	t.offNodes += u.offNodes
	t.forwarded += u.forwarded
	for i := range t.recv {
		t.recv[i] += u.recv[i]
		t.rows[i] += u.rows[i]
	}
}

func (t tally) stats(r Routing, tokens int) Stats {
	n := float64(tokens)
	sd := func(sum, sum2 float64) float64 { return math.Sqrt(math.Max(0, sum2/n-(sum/n)*(sum/n))) }
	return Stats{
		Routing:         r,
		Tokens:          tokens,
		Ranks:           t.ranks / n,
		Nodes:           t.nodes / n,
		RanksSD:         sd(t.ranks, t.ranks2),
		NodesSD:         sd(t.nodes, t.nodes2),
		Local:           t.local / n,
		OffNodeRanks:    t.offNodeRanks / n,
		OffNodes:        t.offNodes / n,
		Forwarded:       t.forwarded / n,
		RecvImbalance:   maxOverMean(t.recv),
		ExpertImbalance: maxOverMean(t.rows),
	}
}

// maxOverMean returns max(v)/mean(v), or 1 when v sums to 0.
func maxOverMean(v []float64) float64 {
	sum := 0.0
	for _, x := range v {
		sum += x
	}
	if sum == 0 {
		return 1
	}
	return slices.Max(v) * float64(len(v)) / sum
}

func newSampler(r Routing, pop []float64, rng *rand.Rand) *sampler {
	s := &sampler{
		r: r, rng: rng, perRank: r.Experts / r.Ranks,
		experts:  make([]int, 0, r.TopK),
		rankMark: make([]int, r.Ranks), nodeMark: make([]int, r.nodes()),
		t: newTally(r),
	}
	if r.MaxNodes > 0 {
		s.logw = make([]float64, len(pop))
		for e, w := range pop {
			s.logw[e] = math.Log(w)
		}
		s.score = make([]float64, r.Experts)
		s.nodeTop = make([]float64, 0, r.TopK)
		s.nodes = make([]int, r.nodes())
		s.nodeVal = make([]float64, r.nodes())
		return s
	}
	if r.Zipf != 0 {
		s.cum = make([]float64, len(pop))
		acc := 0.0
		for e, w := range pop {
			acc += w
			s.cum[e] = acc
		}
	}
	return s
}

// run routes the tokens [lo, hi) and returns their tally.
func (s *sampler) run(lo, hi int) tally {
	for tok := lo; tok < hi; tok++ {
		if s.r.MaxNodes > 0 {
			s.drawLimited()
		} else {
			s.draw()
		}
		s.count(tok % s.r.Ranks)
	}
	return s.t
}

// draw picks TopK distinct experts in proportion to popularity, by rejection.
func (s *sampler) draw() {
	s.experts = s.experts[:0]
	for len(s.experts) < s.r.TopK {
		var e int
		if s.cum == nil {
			e = s.rng.IntN(s.r.Experts)
		} else {
			e = sort.SearchFloat64s(s.cum, s.rng.Float64()*s.cum[len(s.cum)-1])
			e = min(e, len(s.cum)-1)
		}
		if !slices.Contains(s.experts, e) {
			s.experts = append(s.experts, e)
		}
	}
}

// drawLimited picks the TopK highest-scoring experts of the MaxNodes domains whose
// ⌈TopK/MaxNodes⌉ highest expert scores sum highest.
func (s *sampler) drawLimited() {
	r := s.r
	for e := range s.score {
		s.score[e] = s.logw[e] - math.Log(s.rng.ExpFloat64()) // log w + Gumbel
	}
	per := (r.TopK + r.MaxNodes - 1) / r.MaxNodes
	span := r.NodeSize * s.perRank
	for n := range s.nodes {
		s.nodes[n] = n
		s.nodeTop = s.nodeTop[:0]
		for e := n * span; e < min(r.Experts, (n+1)*span); e++ {
			s.nodeTop = insertTop(s.nodeTop, per, s.score[e])
		}
		s.nodeVal[n] = 0
		for _, v := range s.nodeTop {
			s.nodeVal[n] += v
		}
	}
	slices.SortFunc(s.nodes, func(a, b int) int {
		if c := -cmpFloat(s.nodeVal[a], s.nodeVal[b]); c != 0 {
			return c
		}
		return a - b
	})
	s.experts = s.experts[:0]
	for _, n := range s.nodes[:min(r.MaxNodes, len(s.nodes))] {
		for e := n * span; e < min(r.Experts, (n+1)*span); e++ {
			if len(s.experts) < r.TopK || s.score[e] > s.score[s.experts[len(s.experts)-1]] {
				s.experts = s.insertExpert(e)
			}
		}
	}
}

// insertTop inserts v into top, kept in decreasing order and at most n long.
func insertTop(top []float64, n int, v float64) []float64 {
	if len(top) == n && v <= top[n-1] {
		return top
	}
	if len(top) < n {
		top = append(top, v)
	} else {
		top[n-1] = v
	}
	for i := len(top) - 1; i > 0 && top[i] > top[i-1]; i-- {
		top[i], top[i-1] = top[i-1], top[i]
	}
	return top
}

// insertExpert inserts e into s.experts, kept in decreasing order of score and at most
// TopK long.
func (s *sampler) insertExpert(e int) []int {
	ex := s.experts
	if len(ex) < s.r.TopK {
		ex = append(ex, e)
	} else {
		ex[len(ex)-1] = e
	}
	for i := len(ex) - 1; i > 0 && s.score[ex[i]] > s.score[ex[i-1]]; i-- {
		ex[i], ex[i-1] = ex[i-1], ex[i]
	}
	return ex
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// count tallies the destinations of s.experts for a token of rank src.
func (s *sampler) count(src int) {
	r, t := s.r, &s.t
	s.stamp++
	home := src / r.NodeSize
	ranks, nodes, local, offRanks, offNodes, landed := 0, 0, 0, 0, 0, 0
	for _, e := range s.experts {
		d := e / s.perRank
		t.rows[d]++
		if s.rankMark[d] == s.stamp {
			continue
		}
		s.rankMark[d] = s.stamp
		ranks++
		n := d / r.NodeSize
		if s.nodeMark[n] != s.stamp {
			s.nodeMark[n] = s.stamp
			nodes++
			if n != home {
				offNodes++
			}
		}
		switch {
		case d == src:
			continue
		case n == home:
			local++
		default:
			offRanks++
			if d == landing(r, n, src) {
				landed++
			}
		}
		t.recv[d]++
	}
	t.ranks += float64(ranks)
	t.ranks2 += float64(ranks * ranks)
	t.nodes += float64(nodes)
	t.nodes2 += float64(nodes * nodes)
	t.local += float64(local)
	t.offNodeRanks += float64(offRanks)
	t.offNodes += float64(offNodes)
	t.forwarded += float64(offRanks - landed)
}

// landing returns the rank of domain n that receives the rows of rank src over
// InfiniBand: the one with src's index in its domain (modulo the size of a short last
// domain).
func landing(r Routing, n, src int) int {
	first := n * r.NodeSize
	size := min(r.Ranks, first+r.NodeSize) - first
	return first + src%r.NodeSize%size
}
