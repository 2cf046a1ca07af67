package raftstore

import (
	"os"
	"path/filepath"
	"testing"
)

// A data dir is named when it is first used, keeps its name across
// opens, and a dir written by a version before names gets one once.
func TestADataDirKeepsTheNameItWasGiven(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	first, err := loadIdentity(dir, "s1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := loadIdentity(dir, "s1")
	if err != nil {
		t.Fatal(err)
	}
	elsewhere, err := loadIdentity(other, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if first.DataDirID == "" || again.DataDirID != first.DataDirID || elsewhere.DataDirID == first.DataDirID {
		t.Errorf("data dir ids: first open %q, second %q, another dir of the same server %q; want one name per dir, kept", first.DataDirID, again.DataDirID, elsewhere.DataDirID)
	}

	// An identity of an older version: named, but saved only once the
	// directory is accepted (Open's saveDataDirID), so a start refused
	// for another reason leaves the directory as it was.
	old := t.TempDir()
	oldIdent := []byte(`{"server_id":"s1","cluster_id":"c","member":true}`)
	if err := os.WriteFile(filepath.Join(old, identityFile), oldIdent, 0o600); err != nil {
		t.Fatal(err)
	}
	named, err := loadIdentity(old, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(old, identityFile)); err != nil || string(b) != string(oldIdent) {
		t.Errorf("an older version's identity after it was loaded: %q (%v); want it unchanged until the directory is accepted", b, err)
	}
	s := &Store{cfg: Config{Dir: old}, ident: named}
	if err := s.saveDataDirID(); err != nil {
		t.Fatal(err)
	}
	kept, err := loadIdentity(old, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if named.DataDirID == "" || kept.DataDirID != named.DataDirID || kept.unsaved || !kept.Member || kept.ClusterID != "c" {
		t.Errorf("an older version's identity, named %+v, saved and loaded again: %+v; want its name kept, and its membership", named, kept)
	}
}
