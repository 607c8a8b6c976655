package device

import "errors"

// Temps is a set of tensors allocated on one stream that are freed together: an op's
// temporaries, or the parts of a result that must all be allocated or none. It keeps the
// first allocation error, so that a run of Allocs needs one check:
//
//	ts := device.NewTemps(s)
//	defer ts.Free()
//	a, b := ts.Alloc(device.F32, m, k), ts.Alloc(device.I32, m)
//	if err := ts.Err(); err != nil {
//		return err
//	}
//
// A Temps is used by one goroutine at a time.
type Temps struct {
	s   *Stream
	all []*Tensor
	err error
}

// NewTemps returns an empty set whose tensors are allocated and freed on s.
func NewTemps(s *Stream) *Temps { return &Temps{s: s} }

// Alloc allocates a tensor of dtype dt and shape on the set's stream and adds it to the
// set. After a failed allocation it returns nil and allocates nothing more; Err says why.
func (ts *Temps) Alloc(dt DType, shape ...int) *Tensor {
	if ts.err != nil {
		return nil
	}
	if ts.s == nil {
		ts.err = errors.New("device: Temps.Alloc: nil stream")
		return nil
	}
	t, err := ts.s.Alloc(dt, shape...)
	if err != nil {
		ts.err = err
		return nil
	}
	ts.all = append(ts.all, t)
	return t
}

// Add adds tensors allocated elsewhere to the set, to be freed with it; nil ones are
// skipped.
func (ts *Temps) Add(t ...*Tensor) {
	for _, x := range t {
		if x != nil {
			ts.all = append(ts.all, x)
		}
	}
}

// Err returns the first allocation error, or nil.
func (ts *Temps) Err() error { return ts.err }

// Keep empties the set without freeing its tensors: they now belong to the caller. Call
// it once a result built from the set is complete, before a deferred Free runs.
func (ts *Temps) Keep() { ts.all = nil }

// Free frees every tensor of the set, each in stream order on its allocating stream, and
// empties the set. It returns the errors of the frees, joined.
func (ts *Temps) Free() error {
	err := FreeAll(ts.all...)
	ts.all = nil
	return err
}

// FreeAll frees the tensors (nil ones are skipped) and returns their errors, joined.
func FreeAll(t ...*Tensor) error {
	var errs []error
	for _, x := range t {
		if x != nil {
			if err := x.Free(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
