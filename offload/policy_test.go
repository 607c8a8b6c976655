package offload

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParsePolicy(t *testing.T) {
	for _, tc := range []struct {
		in, out string            // out: String(), when it differs from in
		acts    map[string]Action // Action of these names
	}{
		{in: "", acts: map[string]Action{"x": Device, "query_proj": Device}},
		{in: "moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat",
			acts: map[string]Action{"moe_mlpwi_0": Offload, "moe_mlpwi_1": Offload, "query_proj": Remat, "key_proj": Device}},
		{in: "*=remat,mlpwo=device", acts: map[string]Action{"mlpwo": Device, "other": Remat, "": Remat}},
		{in: "a=offload,*=offload,b=device", acts: map[string]Action{"a": Offload, "b": Device, "c": Offload}},
		{in: " a = offload ,b=remat ", out: "a=offload,b=remat", acts: map[string]Action{"a": Offload, "b": Remat}},
		{in: "layers.3/ffn:in=offload,ünïcode=remat", acts: map[string]Action{"layers.3/ffn:in": Offload, "ünïcode": Remat}},
		{in: "*=device", acts: map[string]Action{"*": Device, "z": Device}},
	} {
		p, err := ParsePolicy(tc.in)
		if err != nil {
			t.Fatalf("ParsePolicy(%q): %v", tc.in, err)
		}
		want := tc.out
		if want == "" {
			want = tc.in
		}
		if got := p.String(); got != want {
			t.Errorf("ParsePolicy(%q).String() = %q, want %q", tc.in, got, want)
		}
		got := map[string]Action{}
		for name := range tc.acts {
			got[name] = p.Action(name)
		}
		if d := cmp.Diff(tc.acts, got); d != "" {
			t.Errorf("ParsePolicy(%q) actions (-want +got):\n%s", tc.in, d)
		}
		q, err := ParsePolicy(p.String())
		if err != nil || q.String() != p.String() || !cmp.Equal(q.Names(), p.Names()) {
			t.Errorf("ParsePolicy(%q) does not round-trip: %q, %v", p.String(), q.String(), err)
		}
	}
}

func TestParsePolicyErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"a=offload,b=fly", `"b=fly"`},
		{"a=offload,b=fly", `unknown action "fly"`},
		{"a=Offload", `"Offload"`},
		{"a=offload,b", `entry 2 "b": want name=action`},
		{"a=offload,,b=remat", `entry 2 "": want name=action`},
		{"a=offload,", `entry 2 ""`},
		{"=remat", `empty name`},
		{"a b=remat", `"a b"`},
		{"a=b=remat", `unknown action "b=remat"`},
		{"q=remat,q=offload", `"q" is listed twice`},
		{"*=remat,*=device", `"*" is listed twice`},
	} {
		_, err := ParsePolicy(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParsePolicy(%q) = %v, want an error containing %s", tc.in, err, tc.want)
		}
	}
}

func TestPolicyWith(t *testing.T) {
	p := MustParsePolicy("a=offload")
	q := p
	for _, e := range []entry{{"b", Remat}, {"a", Device}, {Wildcard, Offload}} {
		var err error
		if q, err = q.With(e.name, e.act); err != nil {
			t.Fatalf("With(%q, %v): %v", e.name, e.act, err)
		}
	}
	if got, want := q.String(), "a=device,b=remat,*=offload"; got != want {
		t.Errorf("With: %q, want %q", got, want)
	}
	if p.String() != "a=offload" {
		t.Errorf("With changed its receiver: %q", p.String())
	}
	if q.Default() != Offload || p.Default() != Device {
		t.Errorf("Default: %v, %v", q.Default(), p.Default())
	}
	for _, bad := range []string{"", "a,b", "x=y", "a b"} {
		if _, err := p.With(bad, Remat); err == nil || !strings.Contains(err.Error(), "Policy.With") {
			t.Errorf("With(%q): %v, want an error", bad, err)
		}
	}
}

func TestPolicyText(t *testing.T) {
	var cfg struct{ Policy Policy }
	if err := json.Unmarshal([]byte(`{"Policy":"mlpwi_0=offload,*=remat"}`), &cfg); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(cfg)
	if err != nil || string(b) != `{"Policy":"mlpwi_0=offload,*=remat"}` {
		t.Errorf("json round trip: %s, %v", b, err)
	}
	if err := json.Unmarshal([]byte(`{"Policy":"mlpwi_0=gpu"}`), &cfg); err == nil || !strings.Contains(err.Error(), `"gpu"`) {
		t.Errorf("json of a bad policy: %v", err)
	}
}

func TestVocabulary(t *testing.T) {
	var b strings.Builder
	seen := map[string]bool{}
	for i, name := range Vocabulary() {
		if seen[name] {
			t.Errorf("%q twice", name)
		}
		seen[name] = true
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(name + "=" + Action(i%3).String())
	}
	p, err := ParsePolicy(b.String())
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range Vocabulary() {
		if p.Action(name) != Action(i%3) {
			t.Errorf("%s: %v", name, p.Action(name))
		}
	}
	for _, name := range []string{"moe_mlpwi_0", "moe_mlpwi_1", "query_proj", "key_proj", "value_proj", "decoder_layer_input"} {
		if !seen[name] {
			t.Errorf("vocabulary lacks %s", name)
		}
	}
}

func TestAction(t *testing.T) {
	for _, a := range []Action{Device, Offload, Remat} {
		b, err := ParseAction(a.String())
		if err != nil || b != a {
			t.Errorf("ParseAction(%q) = %v, %v", a.String(), b, err)
		}
	}
	if s := Action(7).String(); s != "Action(7)" {
		t.Errorf("Action(7).String() = %q", s)
	}
}

func FuzzParsePolicy(f *testing.F) {
	for _, s := range []string{"", "a=offload", "moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat", "*=remat,x=device", " a = remat", "a=b=c", ",", "a=offload,a=remat"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePolicy(s)
		if err != nil {
			return
		}
		q, err := ParsePolicy(p.String())
		if err != nil {
			t.Fatalf("ParsePolicy(%q).String() = %q does not parse: %v", s, p.String(), err)
		}
		if q.String() != p.String() || !cmp.Equal(q.Names(), p.Names()) {
			t.Fatalf("round trip of %q: %q then %q", s, p.String(), q.String())
		}
		for _, n := range p.Names() {
			if q.Action(n) != p.Action(n) {
				t.Fatalf("%q: action of %q changed", s, n)
			}
		}
	})
}
