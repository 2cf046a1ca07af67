package durable_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stor-io/stor/internal/durable"
)

func TestWriteFileReplacesAndRemoveForgets(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "v.json")
	for _, want := range []string{"first\n", "second\n"} {
		if err := durable.WriteFile(path, []byte(want)); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(path)
		if err != nil || string(got) != want {
			t.Fatalf("after WriteFile(%q): %q, %v", want, got, err)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("the directory holds %d entries, want the file alone (no temporary left)", len(entries))
	}
	if err := durable.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("after Remove: %v, want not exist", err)
	}
	if err := durable.Remove(path); err != nil {
		t.Fatalf("Remove of a missing file: %v, want nil", err)
	}
	if err := durable.WriteFile(filepath.Join(dir, "no-such-dir", "x"), nil); err == nil {
		t.Fatal("WriteFile into a missing directory succeeded")
	}
}

func TestReadJSON(t *testing.T) {
	type rec struct{ A int }
	path := filepath.Join(t.TempDir(), "r.json")
	if r, err := durable.ReadJSON[rec](path); r != nil || err != nil {
		t.Fatalf("no file: %v, %v; want nil, nil", r, err)
	}
	if err := durable.WriteFile(path, []byte(`{"A": 7}`)); err != nil {
		t.Fatal(err)
	}
	if r, err := durable.ReadJSON[rec](path); err != nil || r == nil || r.A != 7 {
		t.Fatalf("ReadJSON = %v, %v; want {7}", r, err)
	}
	if err := durable.WriteFile(path, []byte(`{"A": `)); err != nil {
		t.Fatal(err)
	}
	if r, err := durable.ReadJSON[rec](path); err == nil {
		t.Fatalf("a truncated file read as %v, want an error", r)
	}
}
