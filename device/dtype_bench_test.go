package device

import (
	"math/rand/v2"
	"testing"
)

const benchLen = 1 << 16

func benchInput() []float32 {
	rng := rand.New(rand.NewPCG(7, 8))
	x := make([]float32, benchLen)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * 10)
	}
	return x
}

// The byte counts are the bytes read plus the bytes written.

func BenchmarkEncodeFloat32(b *testing.B) {
	src := benchInput()
	for _, t := range []DType{BF16, E4M3} {
		b.Run(t.String(), func(b *testing.B) {
			dst := make([]byte, len(src)*t.Size())
			b.SetBytes(int64(len(src) * (4 + t.Size())))
			for b.Loop() {
				EncodeFloat32(t, dst, src)
			}
		})
	}
}

func BenchmarkDecodeFloat32(b *testing.B) {
	x := benchInput()
	for _, t := range []DType{BF16, E4M3} {
		b.Run(t.String(), func(b *testing.B) {
			src := make([]byte, len(x)*t.Size())
			EncodeFloat32(t, src, x)
			dst := make([]float32, len(x))
			b.SetBytes(int64(len(x) * (4 + t.Size())))
			for b.Loop() {
				DecodeFloat32(t, dst, src)
			}
		})
	}
}
