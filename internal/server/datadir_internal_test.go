package server

import (
	"os"
	"path/filepath"
	"testing"
)

// The data dir holds every replica and the Raft log: a server makes it
// private even when it exists already with wider modes (a
// PersistentVolume's root is often 0755 or 0777).
func TestDataDirMadePrivate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil { // past the umask
		t.Fatal(err)
	}
	if err := privateDir(dir); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m := st.Mode().Perm(); m != 0o700 {
		t.Fatalf("data dir mode %o after start, want 700", m)
	}
}
