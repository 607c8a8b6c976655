package ep

import (
	"fmt"
	"math"
	"strconv"
)

// Limits of a Group.
const (
	MaxTopK    = 64   // routing entries per token
	MaxRanks   = 1024 // ranks of a transport
	MaxExperts = 8192 // experts over all ranks
	maxChunks  = 64
)

// Capacity sizes the expert-major buffers a rank receives into (Dispatched.X and the
// gradients of the same shape), in rows. The zero Capacity is Dropless.
type Capacity struct {
	kind   capKind
	factor float64
	rows   int
}

type capKind int

const (
	capWorst capKind = iota
	capExact
	capFactor
	capRows
)

// Dropless sizes the buffers for the worst case: every token of every rank routed to
// this rank, min(K, local experts) rows each. It never overflows and the shape is the
// same at every step while the ranks' token counts stay the same.
var Dropless = Capacity{}

// Exact sizes the buffers to the rows routed to the rank at this step: it never
// overflows, and the shape changes from step to step.
var Exact = Capacity{kind: capExact}

// Factor sizes the buffers at f times the balanced load, K·(tokens of all ranks)/R rows,
// rounded up (MaxText's ragged_buffer_factor). f must be positive.
func Factor(f float64) Capacity { return Capacity{kind: capFactor, factor: f} }

// Rows sizes the buffers at n rows.
func Rows(n int) Capacity { return Capacity{kind: capRows, rows: n} }

func (c Capacity) String() string {
	switch c.kind {
	case capExact:
		return "Exact"
	case capFactor:
		return "Factor(" + strconv.FormatFloat(c.factor, 'g', -1, 64) + ")"
	case capRows:
		return fmt.Sprintf("Rows(%d)", c.rows)
	}
	return "Dropless"
}

func (c Capacity) check() error {
	switch c.kind {
	case capWorst, capExact:
	case capFactor:
		if !(c.factor > 0) || math.IsInf(c.factor, 0) {
			return fmt.Errorf("ep: capacity %v: the factor must be positive and finite", c)
		}
	case capRows:
		if c.rows < 0 || c.rows > math.MaxInt32 {
			return fmt.Errorf("ep: capacity %v: want 0 to 2^31-1 rows", c)
		}
	default:
		return fmt.Errorf("ep: invalid capacity %v", c)
	}
	return nil
}

// rowsFor returns the capacity of a rank that is asked for demand rows, when the ranks
// hold tokens tokens in all.
func (c Capacity) rowsFor(demand, tokens, k, local, ranks int) int {
	var n float64
	switch c.kind {
	case capExact:
		return demand
	case capFactor:
		n = math.Ceil(c.factor * float64(k) * float64(tokens) / float64(ranks))
	case capRows:
		return c.rows
	default:
		n = float64(tokens) * float64(min(k, local))
	}
	return int(min(n, math.MaxInt32))
}

// balanced is the balanced load of rowsFor's Factor, for error messages.
func balanced(tokens, k, ranks int) float64 { return float64(k) * float64(tokens) / float64(ranks) }

// Overflow says what happens when a rank is routed more rows than its capacity.
type Overflow int

const (
	// FailOnOverflow fails Layout on every rank, with a *CapacityError that says how
	// many rows are needed. It is the default. See Config.CheckEvery.
	FailOnOverflow Overflow = iota
	// DropOverflow keeps the rows that fit, in expert-major order, and drops the rest:
	// they are counted (Layout.Dropped), not sent to an expert, and contribute zero to
	// Combine and to the gradients.
	DropOverflow
)

func (o Overflow) String() string {
	switch o {
	case FailOnOverflow:
		return "FailOnOverflow"
	case DropOverflow:
		return "DropOverflow"
	}
	return fmt.Sprintf("Overflow(%d)", int(o))
}

// CapacityError is the error of Layout when a rank's demand exceeds its capacity under
// the FailOnOverflow policy. Every rank returns the same one.
type CapacityError struct {
	Rank     int      // the rank that needs the most rows beyond its capacity
	Need     int      // expert rows that rank needs: a capacity of Rows(Need) would do
	Capacity int      // rows its capacity gave
	Policy   Capacity // the capacity policy
	Factor   float64  // Need over the balanced load: Factor(Factor) would do
	Steps    int      // layouts checked together (Config.CheckEvery), 1 when checked at once
}

func (e *CapacityError) Error() string {
	s := fmt.Sprintf("ep: capacity exceeded: rank %d needs %d expert rows, %v gives %d", e.Rank, e.Need, e.Policy, e.Capacity)
	if e.Steps > 1 {
		s += fmt.Sprintf(" (largest need of the last %d steps)", e.Steps)
	}
	return s + fmt.Sprintf("; use Rows(%d) or Factor(%g) or more, Dropless, or DropOverflow", e.Need, e.Factor)
}

// Config describes an expert-parallel layer to NewGroup.
type Config struct {
	// Experts is the number of experts over all ranks, a multiple of the ranks: rank r
	// holds experts [r·E/R, (r+1)·E/R).
	Experts int
	// TopK is the number of routing entries per token, 1 to MaxTopK.
	TopK int
	// Capacity sizes the expert-major buffers; the zero value is Dropless.
	Capacity Capacity
	// Overflow is the policy when a rank is routed more rows than its capacity; the zero
	// value is FailOnOverflow.
	Overflow Overflow
	// CheckEvery, under FailOnOverflow, is how often the capacity is checked: 0 or 1
	// checks every Layout, before any payload moves (the demand is known on the host
	// after Layout's count exchange, so this costs nothing). N > 1 checks every N-th
	// Layout: in between, rows past the capacity are dropped as under DropOverflow, and
	// the N-th Layout fails if any overflow happened since the last check, with the
	// largest need.
	CheckEvery int
	// Chunks is the number of pieces each transfer of Dispatch and Combine is split
	// into, so that packing, transfer and replication overlap. 0 means 1 on the CPU, 4 on
	// GPUs through the transport and 2 with direct transfers (see TransportOnly).
	Chunks int
	// TransportOnly moves all payload through the transport's AllToAllV. Otherwise, with
	// NCCL transports, when every rank's GPU can address every other's memory (distinct
	// GPUs of one host, with the ranks in one process or several), ranks write their
	// rows straight into buffers of the receiving ranks (a window of about the largest receive buffer of an op per
	// rank, kept by the group): faster, as no transport kernels or host calls stand
	// between packing and placing. $DROPLESS_EP_PEER=0 has the same effect. The choice
	// does not change any result.
	TransportOnly bool
}

func (c *Config) check(ranks int) error {
	switch {
	case ranks < 1 || ranks > MaxRanks:
		return fmt.Errorf("ep: %d ranks: want 1 to %d", ranks, MaxRanks)
	case c.Experts < 1 || c.Experts > MaxExperts:
		return fmt.Errorf("ep: Config.Experts = %d: want 1 to %d", c.Experts, MaxExperts)
	case c.Experts%ranks != 0:
		return fmt.Errorf("ep: Config.Experts = %d is not a multiple of the %d ranks", c.Experts, ranks)
	case c.TopK < 1 || c.TopK > MaxTopK:
		return fmt.Errorf("ep: Config.TopK = %d: want 1 to %d", c.TopK, MaxTopK)
	case c.Overflow != FailOnOverflow && c.Overflow != DropOverflow:
		return fmt.Errorf("ep: Config.Overflow = %v: want FailOnOverflow or DropOverflow", c.Overflow)
	case c.CheckEvery < 0:
		return fmt.Errorf("ep: Config.CheckEvery = %d: want 0 or more", c.CheckEvery)
	case c.Chunks < 0 || c.Chunks > maxChunks:
		return fmt.Errorf("ep: Config.Chunks = %d: want 0 to %d", c.Chunks, maxChunks)
	}
	return c.Capacity.check()
}
