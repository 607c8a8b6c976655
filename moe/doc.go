// Package moe builds dropless Mixture-of-Experts layers from the primitives: the router,
// permute and unpermute, and the layer's forward and backward passes.
package moe
