// Package epmodel models the dispatch and combine of an expert-parallel MoE layer at
// scale: routing statistics measured by simulation on the CPU (how many distinct ranks
// and NVLink domains a token goes to), and a bandwidth model of the time the two ops
// take over NVLink inside a domain and InfiniBand between domains, set against the
// time of the expert GEMMs.
package epmodel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/dropless/dropless/internal/par"
)

// Routing describes the routing of one MoE layer over R ranks.
//
// Expert e lives on rank e/(E/R), as in package ep; rank r belongs to NVLink domain (node)
// r/NodeSize, and when NodeSize does not divide R the last domain holds the ranks left
// over. Each token picks TopK distinct experts: uniformly when Zipf is 0, else with
// popularity 1/i^Zipf for the expert at position i (from 1) of a seeded random order of
// the experts, drawn without replacement in proportion to popularity. When MaxNodes > 0
// the routing is node-limited as in DeepSeek-V3: the token's scores are the logarithm
// of each expert's popularity plus Gumbel noise (so that without the limit the choice is
// the one above), each domain scores the sum of its ⌈TopK/MaxNodes⌉ highest expert
// scores, and the token's experts are the TopK highest among the experts of its
// MaxNodes highest-scoring domains.
type Routing struct {
	Ranks, Experts, TopK int
	NodeSize             int
	Zipf                 float64
	MaxNodes             int
}

// Stats are routing statistics: means per token over the simulated tokens, the token's
// source rank being its index modulo R.
type Stats struct {
	Routing Routing
	Tokens  int

	// Ranks and Nodes count the distinct ranks and domains the token's experts live
	// on, the source's own included; RanksSD and NodesSD are their standard
	// deviations over the tokens.
	Ranks, Nodes, RanksSD, NodesSD float64

	// Local counts the distinct destination ranks in the source's domain other than
	// the source (rows sent over NVLink directly), OffNodeRanks those outside it (rows
	// sent over InfiniBand without deduplication per domain), OffNodes the distinct
	// domains other than the source's (rows sent over InfiniBand with it), and
	// Forwarded the off-domain destination ranks other than the rank of each
	// destination domain that receives the row over InfiniBand, the one with the
	// source's index in its domain (rows forwarded over NVLink there).
	Local, OffNodeRanks, OffNodes, Forwarded float64

	// RecvImbalance is the largest number of rows a rank receives from other ranks
	// over the mean; ExpertImbalance the same for the routing entries (expert rows) a
	// rank computes. Both are 1 for an even load, and read high by the sampling noise
	// of Tokens·Ranks/R rows per rank.
	RecvImbalance, ExpertImbalance float64
}

// check returns an error naming the field of r that is out of range, for the function
// fn.
func (r Routing) check(fn string) error {
	switch {
	case r.Ranks < 1:
		return fmt.Errorf("epmodel: %s Ranks is %d, want ≥ 1", fn, r.Ranks)
	case r.Experts < r.Ranks || r.Experts%r.Ranks != 0:
		return fmt.Errorf("epmodel: %s Experts is %d, want a positive multiple of Ranks (%d)", fn, r.Experts, r.Ranks)
	case r.TopK < 1 || r.TopK > r.Experts:
		return fmt.Errorf("epmodel: %s TopK is %d, want 1 to Experts (%d)", fn, r.TopK, r.Experts)
	case r.NodeSize < 1:
		return fmt.Errorf("epmodel: %s NodeSize is %d, want ≥ 1", fn, r.NodeSize)
	case r.Zipf < 0 || math.IsInf(r.Zipf, 0) || math.IsNaN(r.Zipf):
		return fmt.Errorf("epmodel: %s Zipf is %v, want a finite value ≥ 0", fn, r.Zipf)
	case r.MaxNodes < 0:
		return fmt.Errorf("epmodel: %s MaxNodes is %d, want ≥ 0", fn, r.MaxNodes)
	}
	if r.MaxNodes > 0 {
		sizes := r.nodeExperts()
		slices.Sort(sizes)
		held := 0
		for _, n := range sizes[:min(r.MaxNodes, len(sizes))] {
			held += n
		}
		if held < r.TopK {
			return fmt.Errorf("epmodel: %s MaxNodes is %d, want domains enough to hold TopK (%d) experts", fn, r.MaxNodes, r.TopK)
		}
	}
	return nil
}

// nodes returns the number of domains.
func (r Routing) nodes() int { return (r.Ranks + r.NodeSize - 1) / r.NodeSize }

// nodeExperts returns the number of experts of each domain.
func (r Routing) nodeExperts() []int {
	out := make([]int, r.nodes())
	for n := range out {
		out[n] = (min(r.Ranks, (n+1)*r.NodeSize) - n*r.NodeSize) * (r.Experts / r.Ranks)
	}
	return out
}

// rankExperts returns the number of experts of each rank.
func (r Routing) rankExperts() []int {
	out := make([]int, r.Ranks)
	for i := range out {
		out[i] = r.Experts / r.Ranks
	}
	return out
}

// Uniform returns the expected distinct ranks and domains per token under uniform
// routing (r.Zipf 0, no node limit), in closed form: over groups g of e_g experts,
// Σ_g (1 − C(E − e_g, K)/C(E, K)), which for R ranks of E/R experts each is
// R·(1 − C(E − E/R, K)/C(E, K)).
func Uniform(r Routing) (ranks, nodes float64, err error) {
	if err := r.check("Uniform"); err != nil {
		return 0, 0, err
	}
	if r.Zipf != 0 || r.MaxNodes != 0 {
		return 0, 0, fmt.Errorf("epmodel: Uniform routing has Zipf %v and MaxNodes %d, want 0 and 0", r.Zipf, r.MaxNodes)
	}
	return distinct(r.Experts, r.TopK, r.rankExperts()), distinct(r.Experts, r.TopK, r.nodeExperts()), nil
}

// distinct returns Σ_g (1 − C(E − e_g, K)/C(E, K)) over the group sizes e_g.
func distinct(e, k int, groups []int) float64 {
	sum := 0.0
	for _, g := range groups {
		miss := 1.0 // C(e−g, k)/C(e, k) = Π_{i<k} (e−g−i)/(e−i)
		for i := range k {
			miss *= math.Max(0, float64(e-g-i)) / float64(e-i)
		}
		sum += 1 - miss
	}
	return sum
}

// chunk is the number of tokens drawn from one random stream: the results depend on
// the seed and the number of tokens only, not on the number of goroutines.
const chunk = 4096

// Simulate draws tokens tokens routed as r says, from a random source seeded by seed,
// and returns their statistics.
func Simulate(r Routing, tokens int, seed uint64) (Stats, error) {
	if err := r.check("Simulate"); err != nil {
		return Stats{}, err
	}
	if tokens < 1 {
		return Stats{}, fmt.Errorf("epmodel: Simulate tokens is %d, want ≥ 1", tokens)
	}
	pop := popularity(r, rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)))
	parts := make([]tally, (tokens+chunk-1)/chunk)
	par.Each(len(parts), func(i int) {
		lo, hi := i*chunk, min((i+1)*chunk, tokens)
		parts[i] = newSampler(r, pop, rand.New(rand.NewPCG(seed, uint64(i)+1))).run(lo, hi)
	})
	total := newTally(r)
	for _, p := range parts {
		total.add(p)
	}
	return total.stats(r, tokens), nil
}

// popularity returns the experts' weights: all 1 for uniform routing, 1/i^s over a
// random order of the experts for Zipf(s).
func popularity(r Routing, rng *rand.Rand) []float64 {
	w := make([]float64, r.Experts)
	if r.Zipf == 0 {
		for e := range w {
			w[e] = 1
		}
		return w
	}
	for e, i := range rng.Perm(r.Experts) {
		w[e] = math.Pow(float64(i+1), -r.Zipf)
	}
	return w
}
