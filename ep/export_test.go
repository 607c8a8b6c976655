package ep

import "github.com/dropless/dropless/device"

// Tune sets the row kernels' grid (threads per block, blocks per multiprocessor on the
// op's stream, and on the transfer stream for direct transfers; zeros leave them as
// they are) for a benchmark, and returns a function that restores
// it. Call it while no group works.
func Tune(threads int, perSM, pack float64) (restore func()) {
	t, ps, ds, pk := rowThreads, rowPerSM, directPerSM, packPerSM
	if threads > 0 {
		rowThreads = threads
	}
	if perSM > 0 {
		rowPerSM, directPerSM = perSM, perSM
	}
	if pack > 0 {
		packPerSM = pack
	}
	return func() { rowThreads, rowPerSM, directPerSM, packPerSM = t, ps, ds, pk }
}

// TuneWindow sets the step in which windows of direct transfers grow and the ops after
// which a window is set up anew, so that tests see both, and returns a function that
// restores them. Call it while no group works.
func TuneWindow(grain int, epochs uint32) (restore func()) {
	g, e := winGrain, maxEpoch
	winGrain, maxEpoch = grain, epochs
	return func() { winGrain, maxEpoch = g, e }
}

// SetTrace sets the group's trace hook (nil: none), called at the marks of Dispatch,
// Combine and their backward passes with the stream that reaches them. A mark is a name,
// followed by the piece c for those reached once per piece of a transfer. On the op's
// stream: "pack c" after packing piece c for the other ranks (through the transport),
// "place own" (dispatches) or "sums own" and "final local" (combines) after the rank's
// own rows, "wait c" once piece c has arrived, "place c" or "final c" after placing or
// summing it. On the transfer stream: "transfer start c" and "transfer c" around the
// transfer of piece c through the transport, or "sent c" after writing it into the
// peers' memory (direct transfers).
func SetTrace(g *Group, f func(at string, s *device.Stream)) { g.trace = f }
