package offload_test

import (
	"errors"
	"fmt"

	"github.com/dropless/dropless/device"
	"github.com/dropless/dropless/offload"
)

// A step saves activations by name in the forward pass and loads them in the backward
// pass; the policy decides which go to the host, which stay and which are recomputed.
func Example() {
	d := device.CPU() // or device.Open("")
	s := d.Stream()
	policy := offload.MustParsePolicy("moe_mlpwi_0=offload,query_proj=remat,*=device")
	o, err := offload.New(d, offload.Config{PoolBytes: 64 << 20, Policy: policy})
	if err != nil {
		panic(err)
	}
	defer o.Close()

	// Forward.
	wi, _ := device.FromFloat32(s, device.BF16, []float32{1, 2, 3, 4}, 2, 2)
	q, _ := device.FromFloat32(s, device.BF16, []float32{5, 6}, 2)
	hwi, _ := o.Save(s, "moe_mlpwi_0", wi) // copied to the host, wi freed after the copy
	hq, _ := o.Save(s, "query_proj", q)    // dropped

	// Backward.
	o.Prefetch(hwi)
	wi, _ = o.Load(s, hwi)
	v, _ := wi.Float32s(s)
	wi.FreeOn(s)
	fmt.Println(hwi.Action(), v)
	if _, err := o.Load(s, hq); errors.Is(err, offload.ErrRecompute) {
		fmt.Println(hq.Action(), "→ recompute query_proj")
	}
	st := o.Stats()
	fmt.Println(st.Offloaded, "bytes out,", st.Reloaded, "back")
	// Output:
	// offload [1 2 3 4]
	// remat → recompute query_proj
	// 8 bytes out, 8 back
}

func ExampleParsePolicy() {
	p, err := offload.ParsePolicy("moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat,*=device")
	if err != nil {
		panic(err)
	}
	fmt.Println(p.Action("moe_mlpwi_1"), p.Action("query_proj"), p.Action("mlpwo"))
	q, err := p.With("key_proj", offload.Remat)
	if err != nil {
		panic(err)
	}
	fmt.Println(q)
	_, err = offload.ParsePolicy("query_proj=recompute")
	fmt.Println(err)
	// Output:
	// offload remat device
	// moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat,*=device,key_proj=remat
	// offload: policy entry 1 "query_proj=recompute": unknown action "recompute": want device, offload or remat
}
