package ep

// overlap calls the caller's functions of x's op once, in order, and forgets them.
func (x *xfer) overlap() error {
	fs := x.during
	x.during = nil
	for _, f := range fs {
		if f == nil {
			continue
		}
		if err := f(); err != nil {
			return err
		}
	}
	return nil
}
