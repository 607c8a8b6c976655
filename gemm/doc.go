// Package gemm computes ragged_dot, the grouped matrix product of dropless MoE layers:
// rows of x sorted by group (expert) are multiplied by their group's weight matrix, with
// group sizes held in a tensor on the device. Forward, input-gradient and weight-gradient
// forms run on the CPU and on CUDA GPUs.
package gemm
