// Package baseline holds the cases of the peer baselines (PyTorch, JAX) that the
// benchmarks are compared with, with the peers' figures, and reproduces their inputs, so
// that both run the very same cases.
package baseline

import (
	"math"
	"math/rand/v2"
)

// mt19937 is the 32-bit Mersenne Twister, as PyTorch's CPU generator.
type mt19937 struct {
	s [624]uint32
	i int
}

func newMT19937(seed uint32) *mt19937 {
	m := &mt19937{i: 624}
	m.s[0] = seed
	for i := 1; i < 624; i++ {
		m.s[i] = 1812433253*(m.s[i-1]^(m.s[i-1]>>30)) + uint32(i)
	}
	return m
}

func (m *mt19937) next() uint32 {
	if m.i >= 624 {
		for k := 0; k < 624; k++ {
			y := m.s[k]&0x80000000 | m.s[(k+1)%624]&0x7fffffff
			v := m.s[(k+397)%624] ^ y>>1
			if y&1 != 0 {
				v ^= 0x9908b0df
			}
			m.s[k] = v
		}
		m.i = 0
	}
	y := m.s[m.i]
	m.i++
	y ^= y >> 11
	y ^= y << 7 & 0x9d2c5680
	y ^= y << 15 & 0xefc60000
	y ^= y >> 18
	return y
}

// randperm is torch.randperm(n, generator) on the CPU for small n.
func (m *mt19937) randperm(n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = i
	}
	for i := 0; i < n-1; i++ {
		z := int(m.next() % uint32(n-i))
		p[i], p[i+z] = p[i+z], p[i]
	}
	return p
}

// GroupSizes reproduces group_sizes of the peer-baseline script (seed 1):
// uniform gives M/G each (the remainder to the last group); skewed gives Zipf(1.1)
// weights over a random permutation with G/8 groups emptied, floored shares of M, and
// the remainder to the heaviest group. Sums are in float32 as there; a sum rounded
// differently may move a row between groups.
func GroupSizes(G, M int, dist string) []int32 {
	s := make([]int32, G)
	if dist == "uniform" {
		for g := range s {
			s[g] = int32(M / G)
		}
		s[G-1] += int32(M - G*(M/G))
		return s
	}
	gen := newMT19937(1)
	base := make([]float32, G)
	for i := range base {
		base[i] = float32(1 / math.Pow(float64(i+1), 1.1))
	}
	perm := gen.randperm(G)
	w := make([]float32, G)
	for i, p := range perm {
		w[i] = base[p]
	}
	for _, p := range gen.randperm(G)[:G/8] {
		w[p] = 0
	}
	var sum64 float64
	for _, v := range w {
		sum64 += float64(v)
	}
	sum := float32(sum64)
	total, arg := 0, 0
	for g, v := range w {
		s[g] = int32(math.Floor(float64(v / sum * float32(M))))
		total += int(s[g])
		if v > w[arg] {
			arg = g
		}
	}
	s[arg] += int32(M - total)
	return s
}

// ZipfSizes returns g group sizes summing to m from a seeded generator: Zipf(1.1) weights
// over a random order of the groups, g/8 of them emptied, floored shares of m and the
// remainder to the heaviest group (the skew of quant's grouped benchmark and tests).
func ZipfSizes(g, m int, seed uint64) []int32 {
	r := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	w := make([]float64, g)
	for i, p := range r.Perm(g) {
		w[p] = 1 / math.Pow(float64(i+1), 1.1)
	}
	for _, p := range r.Perm(g)[:g/8] {
		w[p] = 0
	}
	sum, big := 0.0, 0
	for i, x := range w {
		sum += x
		if x > w[big] {
			big = i
		}
	}
	sizes := make([]int32, g)
	tot := 0
	for i, x := range w {
		sizes[i] = int32(math.Floor(x / sum * float64(m)))
		tot += int(sizes[i])
	}
	sizes[big] += int32(m - tot)
	return sizes
}
