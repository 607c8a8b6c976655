// Package quant quantizes tensors to MXFP8 (OCP microscaling: 32-element blocks sharing
// an E8M0 scale, E4M3 or E5M2 elements), rowwise and columnwise in one pass, aware of
// expert groups, and dequantizes them back, on the CPU and on CUDA GPUs.
package quant
