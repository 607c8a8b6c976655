// Package ep moves tokens between the ranks of an expert-parallel MoE layer: dispatch
// sends each token once to every rank that holds one of its experts, combine brings the
// weighted expert outputs back, over NCCL between GPUs or an in-process transport.
//
// R ranks hold E experts, E/R each: rank r holds experts [r·E/R, (r+1)·E/R). Each rank
// has T tokens (T may differ between ranks, and be 0) routed by topk_idx (I32 [T, K],
// expert ids, -1 for none) with weights (F32 [T, K]).
//
// # Steps
//
// Group.Layout reads the routing on the device: which ranks each token goes to (a token
// counts once per rank that holds any of its experts: the deduplication), how many
// entries each expert gets. One small all-gather of these counts tells every rank what
// every rank receives, so each knows its demand before any payload moves, and all make
// the same capacity decision. Layout then tells each rank the routing of the rows it
// will receive (one all-to-all-v of K+1 ints per row) and places them in expert-major
// order. The same exchange gives every rank the experts' loads over all ranks' tokens
// (Layout.GroupEntries, and Layout.GroupLoad on the device), which a load-balancing loss
// over the group's batch needs.
//
// Layout.Dispatch sends each (token, rank) pair once and, on arrival, replicates the
// token into the expert-major buffer Dispatched.X ([Capacity, H]: rows of local expert
// 0, then 1, ...; within an expert by source rank, token, k), ready for a ragged matrix
// product with the group sizes Layout.Counts. The routing weights travel with it.
//
// Layout.DispatchMXFP8 does the same for rows quantized to MXFP8 (quant.Quantize without
// groups, rowwise, plain scales): each row's FP8 elements and its scale row move in the
// one exchange, beside the weights, and arrive as a quant.MXFP8 of Capacity rows in
// quant's ungrouped rowwise layout, for an MXFP8 ragged matrix product with the same
// group sizes. A rowwise block lies within a row, so this is bit-identical to
// dispatching the bf16 rows and quantizing after, and moves about half the bytes.
// Layout.DispatchBlockwise does the same for blockwise FP8 rows (quant.QuantizeBlockwise
// without groups, rowwise: 1×128 blocks, float32 or power-of-two scales), the recipe of
// Hopper's FP8 GEMMs; their scales travel as one row per token, transposed out of and
// back into quant's layout (scale blocks outer) around the exchange, and arrive as a
// quant.Blockwise of Capacity rows ready for gemm.RaggedDotBlockwise.
//
// Layout.Combine multiplies each expert output by its weight and sums them per token on
// the expert's rank, sends each (token, rank) partial sum back once, and adds the
// partial sums on the token's rank in rank order, in float32. Every sum has a fixed
// order, with no atomics and no fused multiply-adds: results are bit-identical across
// runs, schedules and devices.
//
// The backward passes reuse the layout: CombineBackward is a dispatch of the output
// gradient (scaled by the weights, with the weight gradients ⟨y, dout⟩ per row), and
// DispatchBackward is a combine of the row gradients (plus the weight gradients sent
// back to their tokens).
//
// Every rank's group has the same Config, and every rank passes each op rows of the
// same width and dtype. The first Layout checks the Config (one small all-gather, once
// per group); an in-process World also checks the rows of each op. Either fails every
// rank with an error that names the setting and the ranks of each value. Every op's
// outputs are new tensors that alias none of its inputs.
//
// # Capacity
//
// The expert-major buffers have Capacity rows: Dropless (the worst case, the default),
// Exact (this step's demand), Factor(f) over the balanced load, or Rows(n). When a rank
// is routed more rows than that, Config.Overflow decides: FailOnOverflow (the default)
// fails Layout on every rank with a *CapacityError that names the size needed, at once
// or every Config.CheckEvery steps; DropOverflow keeps the rows that fit in expert-major
// order and counts the others, which contribute zero. Nothing traps on the device and
// nothing is cut silently.
//
// # Transports
//
// A Transport moves tensors among the ranks. NewWorld makes R ranks in one process
// (goroutines): the embedded default and the test bed, which counts the bytes between
// each pair of ranks. Ranks on one GPU, or on GPUs that address each other's memory,
// move rows device to device in stream order: each rank copies what it receives on its
// own stream, straight from the sender's tensors on its GPU (from a staging copy in the
// sender's peer memory on another), after events of the ranks' streams on one GPU (the
// host, across GPUs) say the rows are ready; ranks on the CPU, or on GPUs that cannot
// address each other's memory, move them through host memory. BenchmarkWorld times
// Dispatch and Combine between two ranks on one GPU at the size of the NCCL benchmark.
// NewNCCL, NewNCCLWorld and InitFromEnv use NCCL (libnccl.so.2 or $DROPLESS_NCCL, 2.23
// or later, loaded at run time): one process per GPU with the id published over TCP from
// rank 0 as torchrun's variables say, or one process driving several GPUs. All-to-all-v
// is a group of ncclSend and ncclRecv on the op's stream. A rank that dies or never
// arrives makes the others fail within the timeout ($DROPLESS_EP_TIMEOUT, a duration
// such as 90s), not hang: the rendezvous has deadlines, communicators are non-blocking,
// and host waits poll with a deadline, then abort the communicator. Dispatch, Combine
// and the backward passes do not wait: wait for their results with Transport.Sync, which
// has that deadline, rather than with Stream.Synchronize or a copy to the host, which
// wait as long as the transfers do.
//
// Between NCCL ranks on distinct GPUs that can address each other's memory (GPUs of one
// host over NVLink or PCIe, in one process or several), Dispatch, Combine and the
// backward passes move their payload without NCCL: each rank packs its rows straight
// into a window of the receiving rank (peer memory the group keeps, about the size of
// the largest receive buffer of an op) and sets a flag there that the receiver's stream
// waits on, on the device. The ranks decide this together at their first op;
// Group.Direct reports it and Config.TransportOnly (or DROPLESS_EP_PEER=0) turns it off.
// It changes no result. Layout's exchanges always go through the transport.
//
// # Streams
//
// Each op is enqueued on the caller's stream and on a second stream of the Group for
// transfers (of the highest priority), with events between them; only Layout waits for
// the device (for the counts). A transfer moves in Config.Chunks pieces: the caller's
// stream packs the pieces (the transfer stream, with direct transfers), does the op's
// local work (this rank's own rows) while they move, and places or sums each piece as it
// arrives. On the CPU every op runs when called.
//
// # Overlap
//
// Every op of a Layout (Dispatch, DispatchMXFP8, DispatchBlockwise, Combine,
// CombineBackward, DispatchBackward) takes, last, functions of the caller's to run
// while its transfers move. The op calls them in order, on the calling goroutine, once
// it has enqueued on its stream s the packing of what it sends, the transfers on the
// group's transfer stream and its work that needs no transfer (this rank's own rows),
// and before it enqueues on s its waits for the pieces. What they enqueue on s runs on
// the device beside the transfers, ahead of the op's placing or summing of what
// arrives: a weight gradient, a shared expert, a quantization of weights. They must
// not start another op of the group, nor touch the op's inputs or outputs.
//
// Nil functions are skipped. An op that returns nil has called each once; one that
// fails has called some of them or none (none when it fails before its transfers
// start). The first error one of them returns fails the op (its outputs freed), which
// returns it as it is. Where the transport moves rows when called (in-process ranks on
// the CPU or through host memory), they run after the rows have moved: the results are
// the same, only nothing overlaps.
package ep
