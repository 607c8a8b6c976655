package baseline

import (
	"strings"
	"testing"
)

// TestCases checks that every case is well formed: a unique name ending in its skew,
// positive dimensions, group sizes that sum to M (with at least G/8 empty groups when
// skewed), and peer figures on every baseline case and none on the CPU case.
func TestCases(t *testing.T) {
	all := append(Cases(), CPUCase())
	if len(all) != 8 {
		t.Fatalf("%d cases, want 7 baseline cases and the CPU case", len(all))
	}
	seen := map[string]bool{}
	for i, c := range all {
		if seen[c.Name] {
			t.Errorf("%s: name used twice", c.Name)
		}
		seen[c.Name] = true
		if c.Skew != "uniform" && c.Skew != "skewed" {
			t.Errorf("%s: skew %q, want uniform or skewed", c.Name, c.Skew)
		}
		if !strings.HasSuffix(c.Name, "_"+c.Skew) {
			t.Errorf("%s: name does not end in _%s", c.Name, c.Skew)
		}
		if c.G < 1 || c.M < 1 || c.K < 1 || c.N < 1 {
			t.Errorf("%s: G=%d M=%d K=%d N=%d, want all ≥ 1", c.Name, c.G, c.M, c.K, c.N)
		}
		sizes := c.Sizes()
		if len(sizes) != c.G {
			t.Fatalf("%s: %d group sizes, want %d", c.Name, len(sizes), c.G)
		}
		sum, empty := 0, 0
		for _, v := range sizes {
			if v < 0 {
				t.Fatalf("%s: negative group size %d", c.Name, v)
			}
			sum += int(v)
			if v == 0 {
				empty++
			}
		}
		if sum != c.M || (c.Skew == "skewed" && empty < c.G/8) {
			t.Errorf("%s: sizes sum to %d with %d empty groups, want %d and ≥ %d", c.Name, sum, empty, c.M, c.G/8)
		}
		p := c.Peer
		if cpu := i == len(all)-1; cpu && p != (Peer{}) {
			t.Errorf("%s: peer figures %+v, want none on the CPU case", c.Name, p)
		} else if !cpu && (p.Forward <= 0 || p.DX <= 0 || p.DW <= 0) {
			t.Errorf("%s: peer figures %+v, want all three positive", c.Name, p)
		}
	}
}

// TestCasesCopy checks that Cases returns a copy that the caller may change.
func TestCasesCopy(t *testing.T) {
	c := Cases()
	c[0].Name, c[0].Peer.Forward = "changed", 0
	if d := Cases()[0]; d.Name != "dsv3_wi_ep8_uniform" || d.Peer.Forward != 653 {
		t.Errorf("Cases()[0] is %s with forward %g after the caller changed its copy", d.Name, d.Peer.Forward)
	}
}
