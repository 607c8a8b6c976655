package ep

import (
	"time"

	"github.com/dropless/dropless/device"
)

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

// SetTrace sets the group's trace hook, called at points of Dispatch and Combine with
// the stream that reaches them.
func SetTrace(g *Group, f func(at string, s *device.Stream)) { g.trace = f }

// Phases runs each phase of Dispatch and Combine of x ([T, H]) alone on s, n times, and
// returns the mean time of each on the device: the packing of the rows for other ranks,
// their transfer in one piece and in Config.Chunks pieces, the replication of this
// rank's own rows and of the received ones, the weighted sums and the final sum. Every
// rank of the group must call it at once (the transfers pair up). "host NAME" is the
// host's time to enqueue a phase.
func (l *Layout) Phases(s *device.Stream, x *device.Tensor, n int) (map[string]time.Duration, error) {
	g := l.g
	R, r, H, C := g.r, g.rank, x.Dim(1), g.chunks()
	tmp := &temps{s: s}
	defer tmp.free()
	nS, nR := l.sendOff[R]-l.tokTo[r], l.recvOff[R]-l.tokFrom[r]
	sendX, recvX := tmp.alloc(x.DType(), nS, H), tmp.alloc(x.DType(), nR, H)
	X := tmp.alloc(x.DType(), l.capacity, H)
	back, zsend := tmp.alloc(x.DType(), l.sendOff[R], H), tmp.alloc(x.DType(), nR, H)
	w := tmp.alloc(device.F32, l.capacity)
	if tmp.err != nil {
		return nil, tmp.err
	}
	if err := device.Fill(s, X, 0.25); err != nil {
		return nil, err
	}
	if err := device.Fill(s, w, 0.5); err != nil {
		return nil, err
	}
	cso, cro := compact(l.sendOff, r), compact(l.recvOff, r)
	exchange := func(s *device.Stream, c, C int) error {
		return g.tr.AllToAllV(s, chunkExchange([]*device.Tensor{sendX}, []*device.Tensor{recvX}, cso, l.tokTo, cro, l.tokFrom, r, c, C))
	}
	repOwn := func() error {
		n := l.tokTo[r]
		if n == 0 {
			return nil
		}
		m := rows(l.sendTok, l.sendOff[r], l.sendOff[r]+n)
		return g.be.replicate(s, X, nil, x, nil, m, rows(l.slot, l.recvOff[r], l.recvOff[r]+n))
	}
	phases := []struct {
		name string
		run  func() error
	}{
		{"gather", func() error {
			for p := range R {
				if p != r && l.tokTo[p] > 0 {
					m := rows(l.sendTok, l.sendOff[p], l.sendOff[p+1])
					if err := g.be.gather(s, rows(sendX, cso[p], cso[p]+l.tokTo[p]), x, m); err != nil {
						return err
					}
				}
			}
			return nil
		}},
		{"a2a-1", func() error { return exchange(s, 0, 1) }},
		{"a2a-C", func() error {
			for c := range C {
				if err := exchange(s, c, C); err != nil {
					return err
				}
			}
			return nil
		}},
		{"replicate-own", repOwn},
		{"a2a-C+replicate-own", func() error {
			// The chunked transfer on the group's transfer stream beside the replication.
			e, err := s.Record()
			if err != nil {
				return err
			}
			defer e.Close()
			if err := g.cs.Wait(e); err != nil {
				return err
			}
			for c := range C {
				if err := exchange(g.cs, c, C); err != nil {
					return err
				}
			}
			if err := repOwn(); err != nil {
				return err
			}
			done, err := g.cs.Record()
			if err != nil {
				return err
			}
			defer done.Close()
			return s.Wait(done)
		}},
		{"replicate-recv", func() error {
			for p := range R {
				if p != r && l.tokFrom[p] > 0 {
					err := g.be.replicate(s, X, nil, rows(recvX, cro[p], cro[p]+l.tokFrom[p]), nil, nil,
						rows(l.slot, l.recvOff[p], l.recvOff[p+1]))
					if err != nil {
						return err
					}
				}
			}
			return nil
		}},
		{"wsum-recv", func() error {
			for p := range R {
				if p != r && l.tokFrom[p] > 0 {
					if err := g.be.wsum(s, rows(zsend, cro[p], cro[p]+l.tokFrom[p]), X, w, rows(l.slot, l.recvOff[p], l.recvOff[p+1])); err != nil {
						return err
					}
				}
			}
			return nil
		}},
		{"wsum-own", func() error {
			n := l.tokTo[r]
			if n == 0 {
				return nil
			}
			return g.be.wsum(s, rows(back, l.sendOff[r], l.sendOff[r]+n), X, w, rows(l.slot, l.recvOff[r], l.recvOff[r]+n))
		}},
		{"final-sum", func() error { return g.be.finalSum(s, tmp.alloc(x.DType(), l.t, H), back, l.sendRow, nil) }},
	}
	out := map[string]time.Duration{}
	for _, ph := range phases {
		if err := ph.run(); err != nil { // warm up
			return nil, err
		}
		a, err := s.Record()
		if err != nil {
			return nil, err
		}
		t0 := time.Now()
		for range n {
			if err := ph.run(); err != nil {
				return nil, err
			}
		}
		out["host "+ph.name] = time.Since(t0) / time.Duration(n)
		b, err := s.Record()
		if err != nil {
			return nil, err
		}
		if err := g.tr.Sync(s); err != nil {
			return nil, err
		}
		d, err := b.Since(a)
		a.Close()
		b.Close()
		if err != nil {
			return nil, err
		}
		out[ph.name] = d / time.Duration(n)
	}
	return out, tmp.err
}
