package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// corpus is the text the model learns: bytes, each a token of a vocabulary of 256.
type corpus struct {
	Train, Heldout []byte
	Files          int    // files read
	HeldoutFiles   int    // of which held out
	Source         string // where the text came from
}

// heldoutEvery is the stride of held-out files: every 20th file (5%) is held out whole,
// so that no held-out line has a near copy in the training text of the same file.
const heldoutEvery = 20

// goroot returns the root of the Go tree whose sources the default corpus reads: $GOROOT,
// else what the go command on the PATH says.
func goroot() string {
	if r := os.Getenv("GOROOT"); r != "" {
		if _, err := os.Stat(filepath.Join(r, "src", "fmt")); err == nil {
			return r
		}
	}
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		return strings.TrimSpace(string(out))
	}
	return ""
}

// loadCorpus reads the corpus: the .go files of the packages pkgs of the Go standard
// library (GOROOT/src/<pkg>, not recursive) when data is empty, else the file data or
// the files under the directory data (hidden files and directories left out). Files
// are taken in order of path until maxBytes, leaving out binary files (a NUL byte in
// their first 8000); every heldoutEvery-th file is held out.
func loadCorpus(data string, pkgs []string, maxBytes int) (*corpus, error) {
	var files []string
	var source string
	if data == "" {
		root := goroot()
		src := filepath.Join(root, "src")
		if root == "" {
			return nil, errors.New("corpus: GOROOT is unknown; pass -data FILE_OR_DIR to train on other text")
		}
		for _, p := range pkgs {
			dir := filepath.Join(src, filepath.FromSlash(p))
			ents, err := os.ReadDir(dir)
			if err != nil {
				return nil, fmt.Errorf("corpus: the Go source of package %q is not under %s (%v); pass -data FILE_OR_DIR to train on other text", p, src, err)
			}
			for _, e := range ents {
				if e.Type().IsRegular() && strings.HasSuffix(e.Name(), ".go") {
					files = append(files, filepath.Join(dir, e.Name()))
				}
			}
		}
		source = fmt.Sprintf("Go source of %s under %s", strings.Join(pkgs, ", "), src)
	} else {
		fi, err := os.Stat(data)
		if err != nil {
			return nil, fmt.Errorf("corpus: -data: %v", err)
		}
		if fi.IsDir() {
			err = filepath.WalkDir(data, func(path string, d fs.DirEntry, err error) error {
				if err != nil {
					return err
				}
				if path != data && strings.HasPrefix(d.Name(), ".") {
					if d.IsDir() {
						return filepath.SkipDir
					}
					return nil
				}
				if d.Type().IsRegular() {
					files = append(files, path)
				}
				return nil
			})
			if err != nil {
				return nil, fmt.Errorf("corpus: -data: %v", err)
			}
			sort.Strings(files)
		} else {
			files = []string{data}
		}
		source = data
	}
	c := &corpus{Source: source}
	var train, held bytes.Buffer
	for _, f := range files {
		if train.Len()+held.Len() >= maxBytes {
			break
		}
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("corpus: %v", err)
		}
		if bytes.IndexByte(b[:min(len(b), 8000)], 0) >= 0 {
			continue // binary, not text
		}
		b = b[:min(len(b), maxBytes-train.Len()-held.Len())]
		c.Files++
		if c.Files%heldoutEvery == 0 {
			held.Write(b)
			c.HeldoutFiles++
		} else {
			train.Write(b)
		}
	}
	c.Train, c.Heldout = train.Bytes(), held.Bytes()
	if c.HeldoutFiles == 0 && len(c.Train) > 0 {
		// Fewer than heldoutEvery files: hold out the last 5% of the text.
		n := len(c.Train) - len(c.Train)/heldoutEvery
		c.Train, c.Heldout = c.Train[:n], c.Train[n:]
	}
	return c, nil
}

// unigramEntropy returns the entropy, in nats, of the byte distribution of text.
func unigramEntropy(text []byte) float64 {
	var n [256]int
	for _, b := range text {
		n[b]++
	}
	h := 0.0
	for _, c := range n {
		if c > 0 {
			p := float64(c) / float64(len(text))
			h -= p * math.Log(p)
		}
	}
	return h
}

// window writes the W+1 ids of position p of text into dst: the W bytes before it, then
// the byte at p (the target). p ≥ W.
func window(dst []int32, text []byte, p, W int) {
	for i, b := range text[p-W : p+1] {
		dst[i] = int32(b)
	}
}

// trainBatch returns batch number step (0, 1, ...) of B windows of W tokens at uniform
// positions of text: a function of seed and step only, so the data order is the same
// for every model trained with the seed, and resumes where it stopped.
func trainBatch(text []byte, seed uint64, step, B, W int) []int32 {
	r := rand.New(rand.NewPCG(seed^0x7a11, uint64(step)))
	tok := make([]int32, B*(W+1))
	for b := range B {
		window(tok[b*(W+1):], text, W+r.IntN(len(text)-W), W)
	}
	return tok
}

// evalBatches returns n windows (n a multiple of B) evenly spaced over text, in batches
// of B: the fixed held-out set every evaluation uses.
func evalBatches(text []byte, n, B, W int) [][]int32 {
	var out [][]int32
	span := len(text) - W
	for i := 0; i < n; i += B {
		tok := make([]int32, B*(W+1))
		for b := range B {
			window(tok[b*(W+1):], text, W+int(int64(i+b)*int64(span)/int64(n)), W)
		}
		out = append(out, tok)
	}
	return out
}
