package device

import (
	"encoding/binary"
	"fmt"
	"math"
	"reflect"
	"sync"
)

// A structField is one scalar of a struct argument's C layout.
type structField struct {
	index []int // reflect field path, array elements included as a last index
	kind  reflect.Kind
	ptr   bool // a *Tensor: its device address
	off   int
	size  int
}

// structLayout is the C layout of a Go struct type used as a kernel argument.
type structLayout struct {
	fields []structField
	size   int
	err    error
}

var layouts sync.Map // reflect.Type → *structLayout

var tensorPtrType = reflect.TypeOf((*Tensor)(nil))

// layoutOf returns the C layout of struct type t: each field at the next multiple of its
// size (the natural alignment of C's scalars), the struct padded to its widest field.
func layoutOf(t reflect.Type) *structLayout {
	if v, ok := layouts.Load(t); ok {
		return v.(*structLayout)
	}
	l := &structLayout{}
	align := 1
	walk := func(t reflect.Type, path []int) {
		for i := 0; i < t.NumField() && l.err == nil; i++ {
			f := t.Field(i)
			if !f.IsExported() {
				l.err = fmt.Errorf("struct %v: unexported field %s", t, f.Name)
				return
			}
			p := append(append([]int(nil), path...), i)
			add := func(ft reflect.Type, p []int) {
				size, ptr := 0, false
				switch {
				case ft == tensorPtrType:
					size, ptr = 8, true
				case ft.Kind() == reflect.Bool:
					size = 4
				case ft.Kind() == reflect.Int32 || ft.Kind() == reflect.Uint32 || ft.Kind() == reflect.Float32:
					size = 4
				case ft.Kind() == reflect.Int64 || ft.Kind() == reflect.Uint64 || ft.Kind() == reflect.Uintptr || ft.Kind() == reflect.Float64:
					size = 8
				default:
					l.err = fmt.Errorf("struct %v: field %s of type %v (want a sized scalar, bool, *Tensor or an array of them)", t, f.Name, ft)
					return
				}
				off := (l.size + size - 1) / size * size
				l.fields = append(l.fields, structField{index: p, kind: ft.Kind(), ptr: ptr, off: off, size: size})
				l.size = off + size
				align = max(align, size)
			}
			if f.Type.Kind() == reflect.Array {
				for j := 0; j < f.Type.Len() && l.err == nil; j++ {
					add(f.Type.Elem(), append(append([]int(nil), p...), -1-j))
				}
				continue
			}
			add(f.Type, p)
		}
	}
	walk(t, nil)
	l.size = (l.size + align - 1) / align * align
	v, _ := layouts.LoadOrStore(t, l)
	return v.(*structLayout)
}

// packStruct writes struct value a into dst in its C layout and returns its size. Tensor
// fields must be usable on s (nil ones are null pointers).
func packStruct(s *Stream, dst []byte, a any) (int, error) {
	v := reflect.ValueOf(a)
	if v.Kind() != reflect.Struct {
		return 0, fmt.Errorf("unsupported type %T", a)
	}
	l := layoutOf(v.Type())
	if l.err != nil {
		return 0, l.err
	}
	if l.size == 0 || l.size > len(dst) {
		return 0, fmt.Errorf("struct %T of %d bytes (at most %d in all)", a, l.size, len(dst))
	}
	for _, f := range l.fields {
		fv := v
		for _, i := range f.index {
			if i < 0 {
				fv = fv.Index(-1 - i)
			} else {
				fv = fv.Field(i)
			}
		}
		var u uint64
		switch {
		case f.ptr:
			if t := fv.Interface().(*Tensor); t != nil {
				if err := t.usable(s, "struct field"); err != nil {
					return 0, err
				}
				u = uint64(t.dptr())
			}
		case f.kind == reflect.Bool:
			if fv.Bool() {
				u = 1
			}
		case f.kind == reflect.Int32 || f.kind == reflect.Int64:
			u = uint64(fv.Int())
		case f.kind == reflect.Float32:
			u = uint64(math.Float32bits(float32(fv.Float())))
		case f.kind == reflect.Float64:
			u = math.Float64bits(fv.Float())
		default:
			u = fv.Uint()
		}
		if f.size == 4 {
			binary.LittleEndian.PutUint32(dst[f.off:], uint32(u))
		} else {
			binary.LittleEndian.PutUint64(dst[f.off:], u)
		}
	}
	return l.size, nil
}
