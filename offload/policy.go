package offload

import (
	"fmt"
	"strings"
)

// Action says what Save does with an activation.
type Action uint8

const (
	// Device keeps the activation on the device: Save holds the tensor, Load returns it.
	Device Action = iota
	// Offload copies the activation to the pinned host pool and frees the device copy;
	// Load copies it back.
	Offload
	// Remat drops the activation: Save frees it and Load returns ErrRecompute, telling
	// the caller to recompute it.
	Remat
)

var actionNames = [...]string{Device: "device", Offload: "offload", Remat: "remat"}

// String returns "device", "offload" or "remat".
func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("Action(%d)", a)
}

// ParseAction parses "device", "offload" or "remat".
func ParseAction(s string) (Action, error) {
	for a, n := range actionNames {
		if s == n {
			return Action(a), nil
		}
	}
	return 0, fmt.Errorf("offload: unknown action %q: want device, offload or remat", s)
}

// Wildcard is the policy name that sets the action of activations the policy does not name.
const Wildcard = "*"

// Vocabulary returns MaxText's activation names (the checkpoint names of its
// remat_policy: custom), a default vocabulary for naming activations:
//
//	decoder_layer_input          input of a decoder layer (the remat start point)
//	context                      attention output before the output projection
//	query_proj key_proj value_proj qkv_proj   attention input projections
//	out_proj                     attention output projection
//	mla_q mla_kv                 multi-head latent attention low-rank projections
//	mlpwi mlpwi_0 mlpwi_1 mlpwo  dense MLP: fused input, gate, up and output projections
//	moe_mlpwi moe_mlpwi_0 moe_mlpwi_1 moe_mlpwo   the same for the experts of an MoE layer
//
// Policies may name any other activation too.
func Vocabulary() []string {
	return []string{
		"decoder_layer_input", "context",
		"query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj",
		"mla_q", "mla_kv",
		"mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
		"moe_mlpwi", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo",
	}
}

// Policy maps activation names to Actions. Its text form lists name=action entries
// separated by commas, in order, such as
//
//	moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat,*=device
//
// where the name * sets the action of every activation not named (Device when absent).
// The zero Policy keeps every activation on the device. A Policy is a value: With
// returns a new one and never changes p.
type Policy struct {
	entries []entry
}

type entry struct {
	name string
	act  Action
}

// ParsePolicy parses the text form of a Policy. Spaces around names and actions are
// ignored; names may not contain ',', '=' or spaces, nor appear twice. The empty string
// is the zero Policy. For every s without spaces, ParsePolicy(s).String() == s.
func ParsePolicy(s string) (Policy, error) {
	var p Policy
	if strings.TrimSpace(s) == "" {
		return p, nil
	}
	for i, tok := range strings.Split(s, ",") {
		name, act, ok := strings.Cut(tok, "=")
		if !ok {
			return Policy{}, fmt.Errorf("offload: policy entry %d %q: want name=action", i+1, tok)
		}
		name, act = strings.TrimSpace(name), strings.TrimSpace(act)
		if err := checkName(name); err != nil {
			return Policy{}, fmt.Errorf("offload: policy entry %d %q: %v", i+1, tok, err)
		}
		a, err := ParseAction(act)
		if err != nil {
			return Policy{}, fmt.Errorf("offload: policy entry %d %q: unknown action %q: want device, offload or remat", i+1, tok, act)
		}
		if p.index(name) >= 0 {
			return Policy{}, fmt.Errorf("offload: policy entry %d %q: %q is listed twice", i+1, tok, name)
		}
		p.entries = append(p.entries, entry{name, a})
	}
	return p, nil
}

// MustParsePolicy is ParsePolicy that panics on error, for constant policies.
func MustParsePolicy(s string) Policy {
	p, err := ParsePolicy(s)
	if err != nil {
		panic(err)
	}
	return p
}

func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("empty name")
	}
	if i := strings.IndexFunc(name, func(r rune) bool { return r == ',' || r == '=' || r <= ' ' || r == 0x7f }); i >= 0 {
		return fmt.Errorf("name %q holds %q", name, name[i])
	}
	return nil
}

func (p Policy) index(name string) int {
	for i, e := range p.entries {
		if e.name == name {
			return i
		}
	}
	return -1
}

// Action returns the action for the activation called name: its entry's, else the
// wildcard's, else Device.
func (p Policy) Action(name string) Action {
	if i := p.index(name); i >= 0 && name != Wildcard {
		return p.entries[i].act
	}
	return p.Default()
}

// Default returns the action of activations p does not name.
func (p Policy) Default() Action {
	if i := p.index(Wildcard); i >= 0 {
		return p.entries[i].act
	}
	return Device
}

// With returns p with name mapped to a: the entry is replaced where p has one, else
// appended. Name Wildcard sets the default. A name ParsePolicy refuses and an action
// that is not one of Device, Offload and Remat are errors.
func (p Policy) With(name string, a Action) (Policy, error) {
	if err := checkName(name); err != nil {
		return Policy{}, fmt.Errorf("offload: Policy.With: %v", err)
	}
	if int(a) >= len(actionNames) {
		return Policy{}, fmt.Errorf("offload: Policy.With(%q): invalid %v: want device, offload or remat", name, a)
	}
	q := Policy{entries: append(make([]entry, 0, len(p.entries)+1), p.entries...)}
	if i := q.index(name); i >= 0 {
		q.entries[i].act = a
	} else {
		q.entries = append(q.entries, entry{name, a})
	}
	return q, nil
}

// Names returns the names p lists, in order, Wildcard included.
func (p Policy) Names() []string {
	out := make([]string, len(p.entries))
	for i, e := range p.entries {
		out[i] = e.name
	}
	return out
}

// String returns p's text form (see ParsePolicy).
func (p Policy) String() string {
	var b strings.Builder
	for i, e := range p.entries {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(e.name)
		b.WriteByte('=')
		b.WriteString(e.act.String())
	}
	return b.String()
}

// MarshalText returns p's text form.
func (p Policy) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText sets p from its text form, so a Policy works with flag.TextVar and
// encoding/json.
func (p *Policy) UnmarshalText(b []byte) error {
	q, err := ParsePolicy(string(b))
	if err != nil {
		return err
	}
	*p = q
	return nil
}
