package epmodel

import (
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// near reports whether the simulated mean got is within 5 standard errors of want.
func near(got, sd float64, tokens int, want float64) bool {
	return math.Abs(got-want) <= 5*math.Max(sd, 0.05)/math.Sqrt(float64(tokens))+1e-12
}

func TestUniformClosedForm(t *testing.T) {
	for _, c := range []struct {
		name         string
		r            Routing
		ranks, nodes float64 // by hand, 0: not checked
	}{
		// 2·(1 − C(32,8)/C(64,8)), C(32,8) = 10518300, C(64,8) = 4426165368.
		{"R2/E64", Routing{Ranks: 2, Experts: 64, TopK: 8, NodeSize: 8}, 2 * (1 - 10518300.0/4426165368), 1},
		{"R1", Routing{Ranks: 1, Experts: 16, TopK: 4, NodeSize: 8}, 1, 1},
		{"R8/E256", Routing{Ranks: 8, Experts: 256, TopK: 8, NodeSize: 8}, 0, 1},
		{"R64/E256/node8", Routing{Ranks: 64, Experts: 256, TopK: 8, NodeSize: 8}, 0, 0},
		{"R256/E256/node72", Routing{Ranks: 256, Experts: 256, TopK: 8, NodeSize: 72}, 8, 0},
		{"R1024/E1024/node72", Routing{Ranks: 1024, Experts: 1024, TopK: 8, NodeSize: 72}, 8, 0},
		{"R16/E32/K8", Routing{Ranks: 16, Experts: 32, TopK: 8, NodeSize: 4}, 0, 0},
		{"R4/E8/K8", Routing{Ranks: 4, Experts: 8, TopK: 8, NodeSize: 3}, 4, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			ranks, nodes, err := Uniform(c.r)
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range []struct{ got, want float64 }{{ranks, c.ranks}, {nodes, c.nodes}} {
				if h.want != 0 && math.Abs(h.got-h.want) > 1e-12 {
					t.Errorf("Uniform = %v, %v, want %v, %v", ranks, nodes, c.ranks, c.nodes)
				}
			}
			const tokens = 30000
			st, err := Simulate(c.r, tokens, 1)
			if err != nil {
				t.Fatal(err)
			}
			if !near(st.Ranks, st.RanksSD, tokens, ranks) || !near(st.Nodes, st.NodesSD, tokens, nodes) {
				t.Errorf("Simulate: %v ranks (sd %v), %v nodes (sd %v), want %v, %v", st.Ranks, st.RanksSD, st.Nodes, st.NodesSD, ranks, nodes)
			}
			// Every destination but the source is local or off-domain, and the
			// source is one with probability Ranks/R.
			if got, want := st.Local+st.OffNodeRanks, ranks*(1-1/float64(c.r.Ranks)); !near(got, st.RanksSD, tokens, want) {
				t.Errorf("Local + OffNodeRanks = %v, want %v", got, want)
			}
			if st.Forwarded > st.OffNodeRanks || st.OffNodes > st.OffNodeRanks || c.r.nodes() == 1 && st.OffNodeRanks != 0 {
				t.Errorf("Forwarded %v, OffNodes %v, OffNodeRanks %v out of order", st.Forwarded, st.OffNodes, st.OffNodeRanks)
			}
			if c.r.Ranks%c.r.NodeSize != 0 && c.r.nodes() > 1 {
				return
			}
			// Equal domains of m ranks: each rank is a destination with probability
			// p = ranks/R, each domain with nodes/N.
			p, m, n := ranks/float64(c.r.Ranks), float64(min(c.r.NodeSize, c.r.Ranks)), float64(c.r.nodes())
			for _, h := range []struct {
				name      string
				got, want float64
			}{
				{"Local", st.Local, (m - 1) * p},
				{"OffNodes", st.OffNodes, nodes * (1 - 1/n)},
				{"Forwarded", st.Forwarded, st.OffNodeRanks - (n-1)*p},
			} {
				if !near(h.got, st.RanksSD, tokens, h.want) {
					t.Errorf("%s = %v, want %v", h.name, h.got, h.want)
				}
			}
		})
	}
}

// TestLimitedWithoutLimit checks the node-limited draw (Gumbel scores) against the
// plain one when the limit binds nowhere: both sample without replacement in proportion
// to popularity, uniform and Zipf.
func TestLimitedWithoutLimit(t *testing.T) {
	const tokens = 30000
	for _, zipf := range []float64{0, 1.1} {
		r := Routing{Ranks: 32, Experts: 128, TopK: 8, NodeSize: 8, Zipf: zipf}
		plain, err := Simulate(r, tokens, 2)
		if err != nil {
			t.Fatal(err)
		}
		r.MaxNodes = 4 // all the domains
		lim, err := Simulate(r, tokens, 2)
		if err != nil {
			t.Fatal(err)
		}
		sd := math.Hypot(plain.RanksSD, lim.RanksSD)
		if !near(lim.Ranks, sd, tokens, plain.Ranks) || !near(lim.Nodes, sd, tokens, plain.Nodes) {
			t.Errorf("Zipf %v: limited %v ranks %v nodes, plain %v ranks %v nodes", zipf, lim.Ranks, lim.Nodes, plain.Ranks, plain.Nodes)
		}
		if zipf == 0 {
			if want, _, _ := Uniform(Routing{Ranks: 32, Experts: 128, TopK: 8, NodeSize: 8}); !near(lim.Ranks, lim.RanksSD, tokens, want) {
				t.Errorf("limited uniform: %v ranks, want %v", lim.Ranks, want)
			}
		}
	}
}

// TestDraws checks each token's experts: TopK distinct ones, on at most MaxNodes
// domains when limited.
func TestDraws(t *testing.T) {
	for _, r := range []Routing{
		{Ranks: 64, Experts: 256, TopK: 8, NodeSize: 8},
		{Ranks: 64, Experts: 256, TopK: 8, NodeSize: 8, Zipf: 1.1},
		{Ranks: 64, Experts: 256, TopK: 8, NodeSize: 8, MaxNodes: 4},
		{Ranks: 64, Experts: 256, TopK: 8, NodeSize: 8, Zipf: 1.1, MaxNodes: 3},
		{Ranks: 100, Experts: 100, TopK: 8, NodeSize: 72, MaxNodes: 1},
	} {
		s := newSampler(r, popularity(r, rand.New(rand.NewPCG(1, 2))), rand.New(rand.NewPCG(3, 4)))
		for range 2000 {
			if r.MaxNodes > 0 {
				s.drawLimited()
			} else {
				s.draw()
			}
			seen, nodes := map[int]bool{}, map[int]bool{}
			for _, e := range s.experts {
				if e < 0 || e >= r.Experts || seen[e] {
					t.Fatalf("%+v: experts %v", r, s.experts)
				}
				seen[e] = true
				nodes[e/(r.Experts/r.Ranks)/r.NodeSize] = true
			}
			if len(s.experts) != r.TopK || r.MaxNodes > 0 && len(nodes) > r.MaxNodes {
				t.Fatalf("%+v: experts %v on %d domains", r, s.experts, len(nodes))
			}
		}
	}
}

func TestDeterministic(t *testing.T) {
	r := Routing{Ranks: 16, Experts: 64, TopK: 8, NodeSize: 8, Zipf: 1.1, MaxNodes: 2}
	var got []Stats
	for _, procs := range []int{1, 2, 3} {
		old := runtime.GOMAXPROCS(procs)
		st, err := Simulate(r, 10000, 7)
		runtime.GOMAXPROCS(old)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, st)
	}
	if d := cmp.Diff(got[0], got[1]) + cmp.Diff(got[0], got[2]); d != "" {
		t.Errorf("stats differ with GOMAXPROCS (-1 +2, -1 +3):\n%s", d)
	}
}

// TestZipfImbalance checks that Zipf(1.1) loads the rank of the most popular expert
// above the mean and that uniform routing does not, beyond sampling noise.
func TestZipfImbalance(t *testing.T) {
	u, err := Simulate(Routing{Ranks: 8, Experts: 64, TopK: 4, NodeSize: 8}, 40000, 3)
	if err != nil {
		t.Fatal(err)
	}
	z, err := Simulate(Routing{Ranks: 8, Experts: 64, TopK: 4, NodeSize: 8, Zipf: 1.1}, 40000, 3)
	if err != nil {
		t.Fatal(err)
	}
	if u.ExpertImbalance > 1.02 || u.RecvImbalance > 1.02 || z.ExpertImbalance < 1.3 {
		t.Errorf("uniform: imbalance %v, %v, %v ranks; Zipf: imbalance %v, %v ranks", u.ExpertImbalance, u.RecvImbalance, u.Ranks, z.ExpertImbalance, z.Ranks)
	}
}

func TestRoutingErrors(t *testing.T) {
	ok := Routing{Ranks: 8, Experts: 64, TopK: 8, NodeSize: 8}
	for _, c := range []struct {
		mod  func(*Routing)
		want string
	}{
		{func(r *Routing) { r.Ranks = 0 }, "Ranks is 0"},
		{func(r *Routing) { r.Experts = 60 }, "Experts is 60"},
		{func(r *Routing) { r.Experts = 4 }, "Experts is 4"},
		{func(r *Routing) { r.TopK = 0 }, "TopK is 0"},
		{func(r *Routing) { r.TopK = 65 }, "TopK is 65"},
		{func(r *Routing) { r.NodeSize = 0 }, "NodeSize is 0"},
		{func(r *Routing) { r.Zipf = -1 }, "Zipf is -1"},
		{func(r *Routing) { r.Zipf = math.NaN() }, "Zipf is NaN"},
		{func(r *Routing) { r.MaxNodes = -1 }, "MaxNodes is -1"},
		{func(r *Routing) { r.NodeSize, r.TopK, r.MaxNodes = 1, 17, 2 }, "MaxNodes is 2"},
	} {
		r := ok
		c.mod(&r)
		if _, err := Simulate(r, 10, 1); err == nil || !strings.Contains(err.Error(), "Simulate "+c.want) {
			t.Errorf("Simulate(%+v) error %v, want %q", r, err, c.want)
		}
		if _, _, err := Uniform(r); err == nil || !strings.Contains(err.Error(), "Uniform "+c.want) {
			t.Errorf("Uniform(%+v) error %v, want %q", r, err, c.want)
		}
	}
	if _, err := Simulate(ok, 0, 1); err == nil || !strings.Contains(err.Error(), "tokens is 0") {
		t.Errorf("Simulate of 0 tokens: error %v", err)
	}
	for _, r := range []Routing{{Ranks: 8, Experts: 64, TopK: 8, NodeSize: 8, Zipf: 1.1}, {Ranks: 8, Experts: 64, TopK: 8, NodeSize: 8, MaxNodes: 1}} {
		if _, _, err := Uniform(r); err == nil || !strings.Contains(err.Error(), "want 0 and 0") {
			t.Errorf("Uniform(%+v) error %v", r, err)
		}
	}
}

func TestLanding(t *testing.T) {
	r := Routing{Ranks: 20, Experts: 20, TopK: 1, NodeSize: 8} // domains 0–7, 8–15, 16–19
	var got []int
	for _, c := range [][2]int{{0, 13}, {1, 3}, {1, 8}, {2, 13}, {2, 7}, {2, 19}} {
		got = append(got, landing(r, c[0], c[1]))
	}
	if d := cmp.Diff([]int{5, 11, 8, 17, 19, 19}, got); d != "" {
		t.Errorf("landing (-want +got):\n%s", d)
	}
}
