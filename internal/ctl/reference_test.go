package ctl

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/spf13/cobra/doc"
)

// updateReference regenerates docs/stor-ctl (make docs).
var updateReference = flag.Bool("update-reference", false, "write the stor-ctl reference to docs/stor-ctl")

// referenceDir is the generated command reference, relative to this
// package.
const referenceDir = "../../docs/stor-ctl"

// TestReferenceIsGenerated: docs/stor-ctl is exactly what cobra's doc
// generator makes of the command tree, one Markdown page per command, so
// the reference cannot drift from the flags and help texts. make docs
// regenerates it.
func TestReferenceIsGenerated(t *testing.T) {
	root := NewRootCommand(io.Discard, io.Discard)
	root.DisableAutoGenTag = true // no generation date: the pages are reproducible
	dir := t.TempDir()
	if *updateReference {
		dir = referenceDir
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := doc.GenMarkdownTree(root, dir); err != nil {
		t.Fatal(err)
	}
	if *updateReference {
		return
	}
	want := pages(t, dir)
	got := pages(t, referenceDir)
	for name, w := range want {
		g, ok := got[name]
		switch {
		case !ok:
			t.Errorf("docs/stor-ctl/%s is missing: run make docs", name)
		case !bytes.Equal(g, w):
			t.Errorf("docs/stor-ctl/%s is stale (the command's flags or help changed): run make docs", name)
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("docs/stor-ctl/%s documents no command: run make docs", name)
		}
	}
}

func pages(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	out := map[string][]byte{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(f)] = b
	}
	return out
}
