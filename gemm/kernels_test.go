package gemm

import (
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, program) }

// TestGemmArgsMirrorsC checks that gemmArgs has the fields of struct GemmArgs of
// kernels/gemm.cu, in order, with the same sizes, so that Kernel.Launch lays it out as
// the kernels read it.
func TestGemmArgsMirrorsC(t *testing.T) {
	type field struct {
		Name string
		Size int
	}
	body := regexp.MustCompile(`(?s)struct GemmArgs \{(.*?)\};`).FindStringSubmatch(gemmSrc)
	if body == nil {
		t.Fatal("kernels/gemm.cu has no struct GemmArgs")
	}
	comment := regexp.MustCompile(`//[^\n]*`)
	var want []field
	for _, decl := range strings.Split(comment.ReplaceAllString(body[1], ""), ";") {
		// "[const] type [*]name, [*]name ..."
		words := strings.Fields(strings.TrimPrefix(strings.TrimSpace(decl), "const "))
		if len(words) == 0 {
			continue
		}
		typ := words[0]
		for _, n := range strings.Split(strings.Join(words[1:], ""), ",") {
			size := 0
			switch {
			case strings.HasPrefix(n, "*"), typ == "i64":
				size = 8
			case typ == "int":
				size = 4
			default:
				t.Fatalf("GemmArgs: field %q of type %s", n, typ)
			}
			want = append(want, field{strings.ToLower(strings.TrimLeft(n, "*")), size})
		}
	}
	var got []field
	rt := reflect.TypeOf(gemmArgs{})
	for i := range rt.NumField() {
		f := rt.Field(i)
		size := int(f.Type.Size())
		if f.Type != reflect.TypeOf((*device.Tensor)(nil)) && f.Type.Kind() != reflect.Int64 {
			t.Errorf("gemmArgs.%s is %v, want *device.Tensor or int64", f.Name, f.Type)
		}
		got = append(got, field{strings.ToLower(f.Name), size})
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("gemmArgs differs from struct GemmArgs (-C +Go):\n%s", d)
	}
}
