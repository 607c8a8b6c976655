package quant

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

// FuzzQuantize quantizes fuzzed bf16 or f32 bits on the CPU and checks: the result
// equals the independent reference; negating the input flips element signs and keeps
// the scales; dequantizing, quantizing again and dequantizing reproduces the values
// bit for bit (finite inputs are kept below 2^126), and the codes too, but in RCEIL blocks whose largest element is Max/2
// and in blocks of scale 254. flags: bit 0 E5M2, bit 1 FLOOR, bit 2 swizzle, bit 3 two
// groups, bit 4 f32 source, bit 5 the transposed form (ColT) against the reference too.
func FuzzQuantize(f *testing.F) {
	bf := func(v ...float32) []byte {
		b := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(b[2*i:], device.BF16FromFloat32(x))
		}
		return b
	}
	f32 := func(v ...float32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b
	}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	negZero := float32(math.Copysign(0, -1)) // the literal -0.0 is +0 in Go
	f.Add(bf(1, -0.5, 448, 3.5, 1e-3, 224.5, -7), uint8(3), uint8(40), uint8(0))
	f.Add(bf(480, 449, 150, -0.25, 0), uint8(33), uint8(31), uint8(2))
	f.Add(f32(1.0625, 1.1875, 1.0/1024, 3.0/1024, 3.5/512, 448), uint8(7), uint8(64), uint8(16|4))
	f.Add(f32(57344, -1e-30, 1e30, 2.5e-5), uint8(40), uint8(33), uint8(16|1|8))
	f.Add(bf(nan, 1, -inf, 2, negZero), uint8(35), uint8(3), uint8(8|4|1))
	f.Add(f32(inf, 2, -3, nan, 1e-45), uint8(9), uint8(70), uint8(16|2|8))
	f.Add(bf(225, 1, 2, 3, 226, -225), uint8(64), uint8(32), uint8(0))
	f.Add(bf(3, -0.5, 448, nan, 1e-3), uint8(40), uint8(64), uint8(32|8))
	f.Add(f32(1, -2, inf, 7e-3, negZero), uint8(70), uint8(17), uint8(32|16|8|4))
	f.Fuzz(func(t *testing.T, data []byte, mb, kb, flags uint8) {
		m, k := 1+int(mb%72), 1+int(kb%80)
		in := device.BF16
		if flags&16 != 0 {
			in = device.F32
		}
		es := in.Size()
		if len(data) < es {
			return
		}
		s := device.CPU().Stream()
		x := dt.Must(s.Alloc(in, m, k))
		raw := x.HostBytes()
		for i := range raw { // the fuzzed bytes, cycled, each pass shifted by one element
			pass := i / len(data)
			raw[i] = data[(i+pass*es)%len(data)]
		}
		// Keep finite magnitudes below 2^126: above, a block's largest element may round
		// up past float32's range and dequantize to ±Inf, which the round trip cannot keep.
		for i := 0; i < len(raw); i += es {
			if es == 2 {
				if v := binary.LittleEndian.Uint16(raw[i:]); v>>7&0xff >= 253 && v>>7&0xff != 255 {
					binary.LittleEndian.PutUint16(raw[i:], v&^(0xff<<7)|252<<7)
				}
			} else if v := binary.LittleEndian.Uint32(raw[i:]); v>>23&0xff >= 253 && v>>23&0xff != 255 {
				binary.LittleEndian.PutUint32(raw[i:], v&^(0xff<<23)|252<<23)
			}
		}
		vals := dt.Must(x.Float32s(s))
		opt := Options{Format: Format(flags & 1), Mode: ScaleMode(flags >> 1 & 1), Dir: Both, Swizzle: flags&4 != 0}
		var sizes []int32
		if flags&8 != 0 {
			cut := int(data[0]) % (m + 1)
			sizes = []int32{int32(cut), int32(m - cut)}
			opt.GroupSizes = dt.Must(device.FromSlice(s, device.I32, sizes, 2))
		}
		got, q := quantBytes(t, s, x, opt)
		if diff := diffOut(got, refQuantize(vals, m, k, sizes, opt, q.Tiles())); diff != "" {
			t.Fatalf("%d×%d %v %+v: differs from the reference: %s", m, k, in, opt, diff)
		}
		if flags&32 != 0 {
			topt := opt
			topt.Transpose = true
			tg, tq := quantBytes(t, s, x, topt)
			if diff := diffOut(tg, refQuantize(vals, m, k, sizes, topt, tq.Tiles())); diff != "" {
				t.Fatalf("%d×%d %v %+v: differs from the reference: %s", m, k, in, topt, diff)
			}
			tq.Free()
		}

		neg := dt.Must(s.Alloc(in, m, k))
		nb := neg.HostBytes()
		copy(nb, raw)
		for i := es - 1; i < len(nb); i += es {
			nb[i] ^= 0x80
		}
		ng, _ := quantBytes(t, s, neg, opt)
		want := got
		want.row, want.col = flipSigns(got.row), flipSigns(got.col)
		if diff := diffOut(ng, want); diff != "" {
			t.Fatalf("%d×%d %+v: negated input: %s", m, k, opt, diff)
		}

		for _, dir := range []Direction{Rowwise, Columnwise} {
			y := dt.Must(s.Alloc(device.F32, m, k))
			dt.NoErr(t, Dequantize(s, y, q, dir))
			o2 := opt
			o2.Dir = dir
			q2 := dt.Must(Quantize(s, y, o2))
			y2 := dt.Must(s.Alloc(device.F32, m, k))
			dt.NoErr(t, Dequantize(s, y2, q2, dir))
			v1, v2 := device.Slice[uint32](y), device.Slice[uint32](y2)
			for i := range v1 {
				if v1[i] != v2[i] {
					t.Fatalf("%d×%d %+v %v: element %d: dq(q(dq(q))) %#08x, dq(q) %#08x", m, k, opt, dir, i, v2[i], v1[i])
				}
			}
			checkRequantCodes(t, q, q2, dir)
		}
	})
}

// checkRequantCodes checks that q2 = Quantize(Dequantize(q)), of the same layout as
// q, has q's codes, but in RCEIL blocks whose largest element is Max/2 and in blocks of
// scale 254.
func checkRequantCodes(t *testing.T, q, q2 *MXFP8, dir Direction) {
	t.Helper()
	g := q.g
	e1, e2, s1, s2 := bytesOf(q.Row), bytesOf(q2.Row), bytesOf(q.RowScale), bytesOf(q2.RowScale)
	if dir == Columnwise {
		e1, e2, s1, s2 = bytesOf(q.Col), bytesOf(q2.Col), bytesOf(q.ColScale), bytesOf(q2.ColScale)
	}
	for t0, tl := range storedTiles(q) {
		for r := range int(tl.nrows) {
			row := int(tl.row0) + r
			for j := range g.k {
				var off int
				var blk []int // element indices of the block
				if dir == Rowwise {
					off = g.rowScaleOff(q.Swizzled, 32*t0+r, j/32)
					for i := j &^ 31; i < min(j|31+1, g.k); i++ {
						blk = append(blk, row*g.k+i)
					}
				} else {
					off = g.colScaleOff(q.Swizzled, t0, j, int(tl.p4), int(tl.cg))
					for i := range int(tl.nrows) {
						blk = append(blk, (int(tl.row0)+i)*g.k+j)
					}
				}
				mx := uint8(0)
				for _, i := range blk {
					if c := e1[i] & 0x7f; c != 0x7f && c > mx {
						mx = c
					}
				}
				if s1[off] == 254 || (q.Mode == RCEIL && mx == halfMax(q.Format)) {
					continue
				}
				if i := row*g.k + j; s1[off] != s2[off] || e1[i] != e2[i] {
					t.Fatalf("%v %v: row %d col %d: q(dq(q)) has scale %d element %#02x, q scale %d element %#02x",
						q.Format, dir, row, j, s2[off], e2[i], s1[off], e1[i])
				}
			}
		}
	}
}
