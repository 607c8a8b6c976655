// Package ep moves tokens between the ranks of an expert-parallel MoE layer: dispatch
// sends each token once to every rank that holds one of its experts, combine brings the
// weighted expert outputs back, over NCCL between GPUs or an in-process transport.
package ep
