package quant

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
)

// The argument checks that MXFP8 and the blockwise recipe share.

// checkShapeArgs returns an error of fn unless m and k, the shape of an allocation, are
// not negative.
func checkShapeArgs(fn string, m, k int) error {
	if m < 0 || k < 0 {
		return fmt.Errorf("quant: %s: shape m×k = %d×%d: want m, k ≥ 0", fn, m, k)
	}
	return nil
}

// freeAllOn frees each tensor that is not nil in stream order on s.
func freeAllOn(s *device.Stream, ts ...*device.Tensor) error {
	var errs []error
	for _, t := range ts {
		if t != nil {
			errs = append(errs, t.FreeOn(s))
		}
	}
	return errors.Join(errs...)
}

// groupCount returns the number of groups of gs (0 for nil gs), checked to be
// positive when there are rows to group (m > 0).
func groupCount(fn string, gs *device.Tensor, m int) (int, error) {
	if gs == nil {
		return 0, nil
	}
	groups := gs.Len()
	if groups == 0 && m > 0 {
		return 0, fmt.Errorf("quant: %s: opt.GroupSizes is %v: no groups for %d rows", fn, gs, m)
	}
	return groups, nil
}

// part is one of the tensors of a quantized layout as its allocation made it: used
// says whether the call checking it reads or writes it.
type part struct {
	name  string
	t     *device.Tensor
	used  bool
	dt    device.DType
	shape []int
}

// checkParts returns an error of fn unless each used part is there, live on s's device
// and of its dtype and shape; dir is the layout's direction, named when a part is
// missing, and sep separates a tensor from the dtype and shape wanted in the message.
func checkParts(fn string, s *device.Stream, dir Direction, sep string, parts ...part) error {
	for _, c := range parts {
		if !c.used {
			continue
		}
		if c.t == nil {
			return fmt.Errorf("quant: %s: %s is nil, q.Dir is %v", fn, c.name, dir)
		}
		if err := c.t.Check(s, c.name); err != nil {
			return fmt.Errorf("quant: %s: %w", fn, err)
		}
		if !c.t.HasShape(c.dt, c.shape...) {
			return fmt.Errorf("quant: %s: %s is %v%swant %s", fn, c.name, c.t, sep, device.ShapeString(c.dt, c.shape...))
		}
	}
	return nil
}

// checkTables returns an error of fn unless a grouped layout (grouped) has its
// descriptor table tables[0], named what, and every table there is live on s's device;
// made names the function that allocates the layout.
func checkTables(fn string, s *device.Stream, grouped bool, what, made string, tables ...*device.Tensor) error {
	if grouped && tables[0] == nil {
		return fmt.Errorf("quant: %s: q has a grouped layout without its %s: want q as %s made it", fn, what, made)
	}
	for _, t := range tables {
		if t != nil {
			if err := t.Check(s, "q's "+what); err != nil {
				return fmt.Errorf("quant: %s: %w", fn, err)
			}
		}
	}
	return nil
}

// checkIntoSource returns an error of fn unless x is a live BF16 or F32 matrix on s's
// device of the shape m×k that q was allocated for.
func checkIntoSource(fn string, s *device.Stream, x *device.Tensor, m, k int) error {
	if err := checkSource(fn, s, x); err != nil {
		return err
	}
	if x.Dim(0) != m || x.Dim(1) != k {
		return fmt.Errorf("quant: %s: x is %v: want [%d %d], the shape q was allocated for", fn, x, m, k)
	}
	return nil
}

// checkHolds returns an error of fn unless the options' format f and direction dir
// are those that q holds, qf and qdir.
func checkHolds(fn string, f, qf Format, dir, qdir Direction) error {
	switch {
	case f != qf:
		return fmt.Errorf("quant: %s: opt.Format is %v, q holds %v", fn, f, qf)
	case dir != qdir:
		return fmt.Errorf("quant: %s: opt.Dir is %v, q holds %v", fn, dir, qdir)
	}
	return nil
}

// intoStatus returns the Status that a quantization of fn into q records invalid
// group sizes in: opt, the options' Status, when not nil, else own, q's Status, checked
// usable on s, when q's layout is grouped (nil otherwise). gs, the options' group
// sizes, must fit q's layout: grouped or not as q is, with at most groups groups and
// at least one for m > 0 rows.
func intoStatus(fn string, s *device.Stream, gs *device.Tensor, opt, own *device.Status, grouped bool, groups, m int) (*device.Status, error) {
	switch {
	case gs == nil && grouped:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is nil, q has a grouped layout", fn)
	case gs != nil && !grouped:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is %v, q has an ungrouped layout", fn, gs)
	case gs != nil && gs.Len() > groups:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is %v, q has room for %d groups", fn, gs, groups)
	case gs != nil && gs.Len() == 0 && m > 0:
		return nil, fmt.Errorf("quant: %s: opt.GroupSizes is %v: no groups for %d rows", fn, gs, m)
	}
	if opt != nil || !grouped {
		return opt, nil
	}
	if err := own.Usable(s, "q.Status"); err != nil {
		return nil, fmt.Errorf("quant: %s: %w", fn, err)
	}
	return own, nil
}

// checkDst returns an error of fn unless dst is a live BF16 or F32 tensor on s's
// device of the given shape.
func checkDst(fn string, s *device.Stream, dst *device.Tensor, shape ...int) error {
	if err := dst.Check(s, "dst"); err != nil {
		return fmt.Errorf("quant: %s: %w", fn, err)
	}
	if dt := dst.DType(); (dt != device.BF16 && dt != device.F32) || !dst.HasShape(device.Invalid, shape...) {
		return fmt.Errorf("quant: %s: dst is %v: want bf16 or f32 %s", fn, dst, device.ShapeString(device.Invalid, shape...))
	}
	return nil
}
