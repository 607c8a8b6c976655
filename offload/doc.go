// Package offload moves activations to pinned host memory during the forward pass and
// back before the backward pass, on streams of their own so the copies overlap compute.
//
// # Policy
//
// A Policy maps activation names to an Action: Device (keep it), Offload (copy it to the
// host and free the device copy) or Remat (drop it; the backward pass recomputes it), as
// MaxText's remat_policy: custom does. Its text form is
//
//	moe_mlpwi_0=offload,moe_mlpwi_1=offload,query_proj=remat,key_proj=remat,*=device
//
// where * sets the action of unnamed activations. Vocabulary lists MaxText's names;
// any other name works too.
//
// # Offloader
//
// An Offloader serves one device with a D2H stream, an H2D stream and one pinned pool
// allocated by New. A step runs
//
//	h, _ := o.Save(compute, "moe_mlpwi_0", x)  // forward: after the last use of x
//	...
//	o.Prefetch(h)                              // backward: a layer or two ahead
//	x, _ = o.Load(compute, h)                  // compute waits for the reload
//	... use x on compute ...
//	x.FreeOn(compute)
//
// The order of work is kept with events, never by blocking the host:
//
//   - Save records an event on compute; the D2H copy waits for it, so it reads what the
//     producer wrote. The device copy is freed on the D2H stream, after the copy.
//   - Prefetch enqueues the H2D copy after the D2H copy's event, into a tensor allocated
//     on the H2D stream; Load makes compute wait for the H2D copy's event.
//   - A slot is reused once its H2D copy has finished: Save returns slots whose reload
//     event is done (Event.Done) to the pool; when it needs one still being read, the
//     D2H stream waits for that reload on the device (Stats.Stalls).
//
// When the pool has no room for a tensor it stays on the device (Stats.Kept) and Load
// returns it. Nothing is pinned or allocated per call: the pool is carved first-fit in
// Align-byte slots, and records and events are reused from step to step.
//
// On the CPU the same API runs with Go memory as the pool and memcpy as the copies; ops
// run when enqueued, so every order is trivially kept.
package offload
