package device_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// rectCase is a CopyRects call on views of two allocations: the source's elements
// random, the destination's poisoned (0xFF).
type rectCase struct {
	name              string
	typ               device.DType
	batch, rows, cols int
	src, dst          device.Strides
	srcOff, dstOff    int // elements before the views in their allocations
	srcLen, dstLen    int // the views' elements, at least the rectangles' spans
}

// span returns the elements from the first of a rectangle to past its last.
func span(st device.Strides, batch, rows, cols int) int {
	if batch == 0 || rows == 0 || cols == 0 {
		return 0
	}
	return (batch-1)*st.Batch + (rows-1)*st.Row + cols
}

// want returns the destination's bytes after the copy: dst with the rectangle of src.
func (c rectCase) want(dst, src []byte) []byte {
	out := append([]byte(nil), dst...)
	es := c.typ.Size()
	for b := 0; b < c.batch; b++ {
		for i := 0; i < c.rows; i++ {
			d := (c.dstOff + b*c.dst.Batch + i*c.dst.Row) * es
			s := (c.srcOff + b*c.src.Batch + i*c.src.Row) * es
			copy(out[d:d+c.cols*es], src[s:s+c.cols*es])
		}
	}
	return out
}

// TestCopyRect copies rectangles between layouts of other row strides (padded copies of
// matrices and back, batches of them, views at odd offsets, every access width of the
// GPU kernel, rows longer than a block's pass) and checks every byte of the destination
// against a copy made on the host: the rectangle copied, the rest left poisoned.
func TestCopyRect(t *testing.T) {
	bf, f32 := device.BF16, device.F32
	cases := []rectCase{
		{name: "pad 17 to 24", typ: bf, batch: 1, rows: 5, cols: 17, src: device.Strides{Row: 17}, dst: device.Strides{Row: 24}},
		{name: "unpad 24 to 17", typ: bf, batch: 1, rows: 5, cols: 17, src: device.Strides{Row: 24}, dst: device.Strides{Row: 17}},
		{name: "odd offsets", typ: bf, batch: 1, rows: 7, cols: 23, src: device.Strides{Row: 23}, dst: device.Strides{Row: 24}, srcOff: 1, dstOff: 3},
		{name: "4-byte rows", typ: bf, batch: 1, rows: 9, cols: 4100, src: device.Strides{Row: 4100}, dst: device.Strides{Row: 4104}},
		{name: "odd long rows", typ: bf, batch: 1, rows: 4, cols: 4099, src: device.Strides{Row: 4099}, dst: device.Strides{Row: 4104}},
		{name: "f32 16-byte rows", typ: f32, batch: 1, rows: 3, cols: 4100, src: device.Strides{Row: 4100}, dst: device.Strides{Row: 4104}},
		{name: "8-byte rows", typ: f32, batch: 1, rows: 6, cols: 10, src: device.Strides{Row: 10}, dst: device.Strides{Row: 12}, srcOff: 2},
		{name: "bytes", typ: device.E4M3, batch: 1, rows: 11, cols: 33, src: device.Strides{Row: 33}, dst: device.Strides{Row: 40}},
		{name: "i64 narrower", typ: device.I64, batch: 1, rows: 5, cols: 3, src: device.Strides{Row: 5}, dst: device.Strides{Row: 3}},
		{name: "dense", typ: bf, batch: 1, rows: 8, cols: 64, src: device.Strides{Row: 64}, dst: device.Strides{Row: 64}, srcOff: 1},
		{name: "one row", typ: f32, batch: 1, rows: 1, cols: 37, src: device.Strides{Row: 37}, dst: device.Strides{Row: 37}, dstOff: 1},
		{name: "many rows", typ: bf, batch: 1, rows: 70001, cols: 3, src: device.Strides{Row: 3}, dst: device.Strides{Row: 8}},
		{name: "sub-rectangle", typ: f32, batch: 1, rows: 4, cols: 5, src: device.Strides{Row: 9}, dst: device.Strides{Row: 6}, srcOff: 2, dstOff: 1},
		{name: "batch pad", typ: bf, batch: 3, rows: 5, cols: 7, src: device.Strides{Row: 7, Batch: 35}, dst: device.Strides{Row: 8, Batch: 64}},
		{name: "batch unpad", typ: bf, batch: 3, rows: 5, cols: 7, src: device.Strides{Row: 8, Batch: 64}, dst: device.Strides{Row: 7, Batch: 35}},
		{name: "batch of rows", typ: f32, batch: 4, rows: 1, cols: 6, src: device.Strides{Row: 6, Batch: 6}, dst: device.Strides{Row: 6, Batch: 9}, srcOff: 1},
		{name: "batch of one", typ: bf, batch: 1, rows: 3, cols: 3, src: device.Strides{Row: 3, Batch: 1}, dst: device.Strides{Row: 4}},
		{name: "empty rows", typ: bf, batch: 2, rows: 0, cols: 5, src: device.Strides{Row: 5}, dst: device.Strides{Row: 5}, srcLen: 4, dstLen: 4},
		{name: "empty cols", typ: bf, batch: 1, rows: 3, cols: 0, src: device.Strides{Row: 0}, dst: device.Strides{Row: 2}, srcLen: 4, dstLen: 4},
		{name: "empty batch", typ: bf, batch: 0, rows: 3, cols: 3, src: device.Strides{Row: 3}, dst: device.Strides{Row: 3}, srcLen: 4, dstLen: 4},
	}
	r := dt.Rand(5)
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		for _, c := range cases {
			es := c.typ.Size()
			sn := max(c.srcLen, span(c.src, c.batch, c.rows, c.cols))
			dn := max(c.dstLen, span(c.dst, c.batch, c.rows, c.cols))
			srcBytes := dt.Bytes(r, (c.srcOff+sn+3)*es) // 3 elements past the view
			sa := upload(t, s, c.typ, srcBytes, c.srcOff+sn+3)
			da := dt.Must(s.Alloc(c.typ, c.dstOff+dn+3))
			dt.Poison(t, s, da)
			sv := dt.Must(sa.View(c.srcOff, sn))
			dv := dt.Must(da.View(c.dstOff, dn))
			var err error
			if c.batch == 1 && c.src.Batch == 0 && c.dst.Batch == 0 {
				err = device.CopyRect(s, dv, c.dst.Row, sv, c.src.Row, c.rows, c.cols)
			} else {
				err = device.CopyRects(s, dv, c.dst, sv, c.src, c.batch, c.rows, c.cols)
			}
			if err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			// cmp.Diff only on a difference: it is slow on large slices.
			got := download(t, s, da)
			if want := c.want(bytes.Repeat([]byte{0xFF}, len(got)), srcBytes); !bytes.Equal(want, got) {
				t.Errorf("%v: %s: destination bytes (-want +got):\n%s", d, c.name, cmp.Diff(want, got))
			}
			if got := download(t, s, sa); !bytes.Equal(srcBytes, got) {
				t.Errorf("%v: %s: the source changed (-want +got):\n%s", d, c.name, cmp.Diff(srcBytes, got))
			}
			dt.NoErr(t, sa.Free())
			dt.NoErr(t, da.Free())
		}
	})
}

// TestCopyRectSameStorage copies between disjoint rectangles of one allocation, and a
// rectangle onto itself, which leaves it as it is; a capturing CPU stream records the
// copy for the graph to replay.
func TestCopyRectSameStorage(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		v := make([]float32, 40)
		for i := range v {
			v[i] = float32(i)
		}
		x := dt.Must(device.FromFloat32(s, device.F32, v, 40))
		defer x.Free()
		lo, hi := dt.Must(x.View(0, 20)), dt.Must(x.View(20, 20))
		dt.NoErr(t, device.CopyRect(s, hi, 5, lo, 4, 4, 3)) // rows of 3 of lo[4×4] to hi[4×5]
		dt.NoErr(t, device.CopyRect(s, lo, 4, lo, 4, 5, 4)) // itself
		want := append([]float32(nil), v...)
		for i := range 4 {
			for j := range 3 {
				want[20+i*5+j] = v[i*4+j]
			}
		}
		if diff := cmp.Diff(want, dt.Must(x.Float32s(s))); diff != "" {
			t.Errorf("x after the copies (-want +got):\n%s", diff)
		}

		cs := dt.Must(d.NewStream())
		defer cs.Close()
		dt.NoErr(t, cs.BeginCapture())
		dt.NoErr(t, device.CopyRect(cs, lo, 4, hi, 5, 4, 4)) // back
		g := dt.Must(cs.EndCapture())
		defer g.Close()
		dt.NoErr(t, g.Launch(cs))
		for i := range 4 {
			for j := range 4 {
				want[i*4+j] = want[20+i*5+j]
			}
		}
		if diff := cmp.Diff(want, dt.Must(x.Float32s(cs))); diff != "" {
			t.Errorf("x after the replayed copy (-want +got):\n%s", diff)
		}
	})
}

// TestCopyRectOtherDevice checks that CopyRect refuses a tensor of another device than
// its stream's.
func TestCopyRectOtherDevice(t *testing.T) {
	g := dt.GPU(t)
	c := device.CPU()
	a := dt.Must(c.Alloc(device.F32, 8))
	b := dt.Must(g.Alloc(device.F32, 8))
	defer b.Free()
	runBad(t, []badCase{
		{"CPU source on a GPU stream", func() error { return device.CopyRect(g.Stream(), b, 4, a, 4, 2, 4) }, "CopyRect source is on cpu, the stream on cuda:0"},
		{"CPU destination on a GPU stream", func() error { return device.CopyRect(g.Stream(), a, 4, b, 4, 2, 4) }, "CopyRect destination is on cpu"},
		{"GPU source on the CPU stream", func() error { return device.CopyRect(c.Stream(), a, 4, b, 4, 2, 4) }, "CopyRect source is on cuda:0, the stream on cpu"},
		{"GPU source on the CPU stream, batched", func() error {
			return device.CopyRects(c.Stream(), a, device.Strides{Row: 4, Batch: 4}, b, device.Strides{Row: 4, Batch: 4}, 2, 1, 4)
		}, "CopyRects source is on cuda:0"},
	})
}

// TestIsOutOfMemory checks IsOutOfMemory on the errors of allocations too large for the
// device and on others.
func TestIsOutOfMemory(t *testing.T) {
	dt.Run(t, func(t *testing.T, d *device.Device) {
		s := d.Stream()
		_, err := s.Alloc(device.F32, 1<<50) // 4 PiB
		if err == nil || !device.IsOutOfMemory(err) {
			t.Errorf("Alloc of 4 PiB on %v: IsOutOfMemory(%v) = false", d, err)
		}
		if w := fmt.Errorf("op: %w", err); !device.IsOutOfMemory(w) {
			t.Errorf("IsOutOfMemory(%v) = false for a wrapped out-of-memory error", w)
		}
		_, err = s.Alloc(device.F32, -1)
		for _, e := range []error{nil, errors.New("out of memory"), err} {
			if device.IsOutOfMemory(e) {
				t.Errorf("IsOutOfMemory(%v) = true", e)
			}
		}
	})
	if _, err := device.CPU().AllocPinned(1 << 50); !device.IsOutOfMemory(err) {
		t.Errorf("AllocPinned of 1 PiB on the CPU: IsOutOfMemory(%v) = false", err)
	}
}
