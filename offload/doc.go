// Package offload moves activations to pinned host memory during the forward pass and
// back before the backward pass, on streams of their own so the copies overlap compute.
package offload
