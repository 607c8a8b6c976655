module github.com/dropless/dropless/interop/cu

go 1.26

require (
	github.com/dropless/dropless v0.0.0-00010101000000-000000000000
	github.com/google/go-cmp v0.7.0
	gorgonia.org/cu v0.9.6
)

require (
	github.com/ebitengine/purego v0.11.3 // indirect
	github.com/google/uuid v1.1.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	gonum.org/v1/gonum v0.17.0 // indirect
)

replace github.com/dropless/dropless => ../..
