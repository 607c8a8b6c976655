package baseline

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestMT19937(t *testing.T) {
	// The first outputs of MT19937 seeded with its default seed.
	m := newMT19937(5489)
	if d := cmp.Diff([]uint32{3499211612, 581869302, 3890346734}, []uint32{m.next(), m.next(), m.next()}); d != "" {
		t.Errorf("mt19937 (-want +got):\n%s", d)
	}
}

func TestGroupSizes(t *testing.T) {
	if d := cmp.Diff([]int32{2, 2, 2, 4}, GroupSizes(4, 10, "uniform")); d != "" {
		t.Errorf("uniform sizes (-want +got):\n%s", d)
	}
	for _, c := range []struct{ G, M int }{{32, 65536}, {128, 32768}, {128, 2048}} {
		sum, empty := 0, 0
		for _, v := range GroupSizes(c.G, c.M, "skewed") {
			if v < 0 {
				t.Fatalf("G=%d M=%d: negative size", c.G, c.M)
			}
			sum += int(v)
			if v == 0 {
				empty++
			}
		}
		if sum != c.M || empty < c.G/8 {
			t.Errorf("G=%d M=%d: sum %d with %d empty groups", c.G, c.M, sum, empty)
		}
	}
}

func TestZipfSizes(t *testing.T) {
	for _, m := range []int{64, 2048, 65536} {
		sum := 0
		for _, v := range ZipfSizes(128, m, 1) {
			if v < 0 {
				t.Fatalf("ZipfSizes(128, %d): negative size", m)
			}
			sum += int(v)
		}
		if sum != m {
			t.Errorf("ZipfSizes(128, %d) sums to %d", m, sum)
		}
	}
}
