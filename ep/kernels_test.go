package ep

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/dropless/dropless/device"
	dt "github.com/dropless/dropless/device/devicetest"
)

func TestKernelsCompile(t *testing.T) { dt.CheckCompiles(t, kernels) }

// TestArithKernels: checkArith accepts f32, bf16 and f16, exactly the dtypes that ep.cu
// has arithmetic kernels for, named by the dtype's String.
func TestArithKernels(t *testing.T) {
	var got []string
	for _, typ := range device.DTypes {
		ok := checkArith(typ) == nil
		has := strings.Contains(kernelSrc, "EP_ARITH("+typ.String()+",")
		if ok != has {
			t.Errorf("%v: checkArith accepts it: %v; ep.cu has its kernels: %v", typ, ok, has)
		}
		if ok {
			got = append(got, typ.String())
		}
	}
	if diff := cmp.Diff([]string{"f32", "f16", "bf16"}, got); diff != "" {
		t.Errorf("dtypes with GPU arithmetic (-want +got):\n%s", diff)
	}
}
