package epmodel

import (
	"flag"
	"fmt"
	"strings"
	"testing"
)

var tables = flag.Bool("tables", false, "print the tables of docs/scaling.md")

// The two-GPU run the model is calibrated by (2 × H200 over NVLink): dispatch + combine
// of T = 16384 tokens, H = 7168 bf16, E = 64, K = 8 moved 235 MB each way per op in
// 0.93 + 0.96 ms; a plain GPU-to-GPU copy reached 386 GB/s of the 450 of the datasheet.
const (
	twoGPUBytes   = 2 * 235e6 // each way, dispatch and combine
	twoGPUSeconds = 1.89e-3
	nvlink4       = 450.0 // GB/s each way per GPU, datasheet
	copyGBps      = 386.0
)

// dsv3 returns DeepSeek-V3's layer shape per rank with dispatch in bf16 or FP8 (one
// float32 scale per 128 elements) and the expert GEMMs at the measured H200 rates.
func dsv3(fp8 bool) Layer {
	if fp8 {
		return Layer{Tokens: 16384, Hidden: 7168, FFN: 2048, TopK: 8, DispatchBytes: 1 + 4.0/128, CombineBytes: 2, TFLOPs: 970}
	}
	return Layer{Tokens: 16384, Hidden: 7168, FFN: 2048, TopK: 8, DispatchBytes: 2, CombineBytes: 2, TFLOPs: 650}
}

// experts returns DeepSeek-V3's 256 experts, or one per rank past 256 ranks.
func experts(r int) int { return max(256, r) }

// TestTables prints the tables of docs/scaling.md with -tables:
//
//	go test ./internal/epmodel -run Tables -tables -v
func TestTables(t *testing.T) {
	if !*tables {
		t.Skip("without -tables")
	}
	const tokens = 1 << 17
	memo := map[Routing]Stats{}
	sim := func(r Routing) Stats {
		if st, ok := memo[r]; ok {
			return st
		}
		st, err := Simulate(r, tokens, 1)
		if err != nil {
			t.Fatal(err)
		}
		memo[r] = st
		return st
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nRouting, %d tokens each, K = 8: distinct ranks (ranks/K), distinct domains of 8 and 72\n", tokens)
	fmt.Fprintln(&b, "| R | E | closed form | uniform | node 8 | node 72 | Zipf | node 8 | node 72 | Zipf max/mean rows | M=4 of 8: uniform | Zipf |")
	fmt.Fprintln(&b, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, R := range []int{8, 16, 32, 64, 128, 256, 512, 1024} {
		r := Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 8}
		cf, _, err := Uniform(r)
		if err != nil {
			t.Fatal(err)
		}
		u8, z8 := sim(r), sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 8, Zipf: 1.1})
		u72, z72 := sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 72}), sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 72, Zipf: 1.1})
		lu, lz := "—", "—"
		if R > 32 {
			lu = cell(sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 8, MaxNodes: 4}))
			lz = cell(sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: 8, Zipf: 1.1, MaxNodes: 4}))
		}
		fmt.Fprintf(&b, "| %d | %d | %.3f | %.3f (%.3f) | %.2f | %.2f | %.3f (%.3f) | %.2f | %.2f | %.1f | %s | %s |\n",
			R, experts(R), cf, u8.Ranks, u8.Ranks/8, u8.Nodes, u72.Nodes, z8.Ranks, z8.Ranks/8, z8.Nodes, z72.Nodes, z8.ExpertImbalance, lu, lz)
	}

	eff, err := Calibrate(twoGPUBytes, twoGPUSeconds, nvlink4)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "\nCalibration: %.1f GB/s each way, Eff %.4f of %v GB/s; copy %.4f\n", twoGPUBytes/twoGPUSeconds/1e9, eff, nvlink4, copyGBps/nvlink4)
	r2 := sim(Routing{Ranks: 2, Experts: 64, TopK: 8, NodeSize: 8})
	t2, err := Predict(System{NodeSize: 8, NVLink: Link{nvlink4, eff}, IB: Link{50, eff}}, r2, dsv3(false))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "Two GPUs back: rows/token %.4f, %.3f ms\n", r2.Local, t2.Comm()*1e3)

	systems := []struct {
		sys      System
		maxNodes int
	}{
		{System{Name: "H200, domains of 8", NodeSize: 8, NVLink: Link{nvlink4, eff}, IB: Link{50, eff}}, 0},
		{System{Name: "H200, domains of 8, M=4", NodeSize: 8, NVLink: Link{nvlink4, eff}, IB: Link{50, eff}}, 4},
		{System{Name: "H800, domains of 8, M=4", NodeSize: 8, NVLink: Link{160, eff}, IB: Link{50, eff}}, 4},
		{System{Name: "GB200 NVL72", NodeSize: 72, NVLink: Link{900, eff}, IB: Link{50, eff}}, 0},
		{System{Name: "GB200 NVL72, M=2", NodeSize: 72, NVLink: Link{900, eff}, IB: Link{50, eff}}, 2},
	}
	fmt.Fprintln(&b, "\nOne layer per rank, uniform routing: rows per token, forward ms, efficiency without / with overlap, forward+backward with overlap")
	fmt.Fprintln(&b, "| system | R | NVLink rows | IB rows | bf16 comm | eff | overlap | FP8 comm | eff | overlap | fwd+bwd overlap bf16 / FP8 |")
	fmt.Fprintln(&b, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, s := range systems {
		for _, R := range []int{8, 16, 64, 256, 1024} {
			st := sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: s.sys.NodeSize, MaxNodes: limit(s.maxNodes, R, s.sys.NodeSize)})
			fmt.Fprintf(&b, "| %s | %d | %.2f | %.2f |", s.sys.Name, R, st.Local+st.Forwarded, st.OffNodes)
			var fb []string
			for _, fp8 := range []bool{false, true} {
				tm, err := Predict(s.sys, st, dsv3(fp8))
				if err != nil {
					t.Fatal(err)
				}
				fmt.Fprintf(&b, " %.2f | %s | %s |", tm.Comm()*1e3, pct(tm.Efficiency(false)), pct(tm.Efficiency(true)))
				fb = append(fb, pct(tm.WithBackward().Efficiency(true)))
			}
			fmt.Fprintf(&b, " %s |\n", strings.Join(fb, " / "))
		}
	}
	for _, fp8 := range []bool{false, true} {
		tm, err := Predict(systems[0].sys, r2, dsv3(fp8))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "compute fp8=%v: %.2f ms\n", fp8, tm.Compute*1e3)
	}

	// With overlap the efficiency is compute/comm once comm exceeds compute, so 97%
	// needs every link to reach 0.97·rows·(dispatch + combine bytes per
	// element)·flop rate/(6·K·F) bytes per second: the cost of one row per token.
	fmt.Fprintln(&b, "\nAchieved GB/s each way per GPU that one row per token needs for 97% with overlap")
	for _, fp8 := range []bool{false, true} {
		l := dsv3(fp8)
		u := 0.97 * (l.DispatchBytes + l.CombineBytes) * l.TFLOPs * 1e12 / (6 * float64(l.TopK) * float64(l.FFN)) / 1e9
		fmt.Fprintf(&b, "fp8=%v: forward %.2f, forward+backward %.2f; without overlap x%.1f\n", fp8, u, u*2/3, 0.97/0.03)
	}
	fmt.Fprintln(&b, "\nR = 1024 (E = 1024), forward+backward with overlap")
	fmt.Fprintln(&b, "| system | routing | NVLink rows | IB rows | IB GB/s for 97%, bf16 / FP8 | bf16 at Eff 0.553 / 0.858 / 1 | FP8 at 0.553 / 0.858 / 1 |")
	fmt.Fprintln(&b, "| --- | --- | --- | --- | --- | --- | --- |")
	for _, c := range []struct {
		name string
		node int
		nvl  float64
	}{{"H200", 8, nvlink4}, {"H800", 8, 160}, {"GB200 NVL72", 72, 900}} {
		for _, m := range []int{0, 4, 2, 1} {
			st := sim(Routing{Ranks: 1024, Experts: 1024, TopK: 8, NodeSize: c.node, MaxNodes: m})
			fmt.Fprintf(&b, "| %s | M=%d | %.2f | %.2f |", c.name, m, st.Local+st.Forwarded, st.OffNodes)
			var need, effs []string
			for _, fp8 := range []bool{false, true} {
				l := dsv3(fp8)
				need = append(need, fmt.Sprintf("%.1f", 0.97*st.OffNodes*(l.DispatchBytes+l.CombineBytes)*l.TFLOPs*1e12/(6*float64(l.TopK)*float64(l.FFN))*2/3/1e9))
				var e []string
				for _, f := range []float64{eff, copyGBps / nvlink4, 1} {
					tm, err := Predict(System{NodeSize: c.node, NVLink: Link{c.nvl, f}, IB: Link{50, f}}, st, l)
					if err != nil {
						t.Fatal(err)
					}
					e = append(e, pct(tm.WithBackward().Efficiency(true)))
				}
				effs = append(effs, strings.Join(e, " / "))
			}
			fmt.Fprintf(&b, " %s | %s |\n", strings.Join(need, " / "), strings.Join(effs, " | "))
		}
	}
	fmt.Fprintln(&b, "\nRows per token, IB without deduplication per domain (OffNodeRanks)")
	for _, R := range []int{64, 256, 1024} {
		for _, ns := range []int{8, 72} {
			st := sim(Routing{Ranks: R, Experts: experts(R), TopK: 8, NodeSize: ns})
			fmt.Fprintf(&b, "R=%d node %d: IB %.2f, without %.2f\n", R, ns, st.OffNodes, st.OffNodeRanks)
		}
	}
	fmt.Fprintf(&b, "two GPUs measured: forward %.1f%%, forward+backward %.1f%% without overlap; 97%% needs %.3f ms\n",
		100*t2.Efficiency(false), 100*t2.WithBackward().Efficiency(false), t2.Compute*0.03/0.97*1e3)
	t.Log(b.String())
}

// limit returns m where the routing has more than m domains, else 0 (no limit).
func limit(m, ranks, nodeSize int) int {
	if m == 0 || (ranks+nodeSize-1)/nodeSize <= m {
		return 0
	}
	return m
}

// pct formats a fraction as a percentage.
func pct(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }

// cell formats the distinct ranks and domains of st.
func cell(st Stats) string { return fmt.Sprintf("%.2f / %.2f", st.Ranks, st.Nodes) }
