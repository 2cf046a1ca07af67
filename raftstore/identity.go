package raftstore

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/google/uuid"

	"github.com/stor-io/stor/internal/durable"
)

// identity is what a data directory says about its owner. It is written
// before any Raft state exists and updated once the server is a member of a
// cluster, so a directory can never be silently re-bootstrapped or used by
// another server.
type identity struct {
	ServerID  string `json:"server_id"`
	ClusterID string `json:"cluster_id,omitempty"`
	// Member is set once the server has bootstrapped or joined a cluster.
	Member bool `json:"member"`
	// DataDirID names this directory, made when it is first used (or
	// when a directory of an older version is first accepted): the server
	// registers with it (storpb.Server.data_dir_id), so that a server
	// whose directory was wiped or replaced, which comes back under the
	// same id with a new one, is refused (until removed) rather than
	// making the replicas its record places here again, empty.
	DataDirID string `json:"data_dir_id,omitempty"`

	unsaved bool // DataDirID was made for an identity of an older version
}

const (
	identityFile = "identity.json"
	raftDBFile   = "raft.db"
	metaDBFile   = "meta.db"
	snapshotsDir = "snapshots"
)

// ourEntries are the names a stor data directory holds: Store's files, the
// replica store's directory, and lost+found (a fresh ext4 filesystem's).
var ourEntries = map[string]bool{identityFile: true, raftDBFile: true, metaDBFile: true, snapshotsDir: true, "lost+found": true, "replicas": true}

// Initialized reports whether dir has been used as a stor data directory
// (it holds an identity), without changing it.
func Initialized(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, identityFile))
	return err == nil
}

// loadIdentity checks that dir is either new (created, or empty) or belongs
// to server id, and returns its identity.
func loadIdentity(dir, id string) (identity, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return identity{}, fmt.Errorf("raftstore: data dir: %w", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, identityFile))
	if errors.Is(err, fs.ErrNotExist) {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return identity{}, fmt.Errorf("raftstore: data dir: %w", err)
		}
		for _, e := range entries {
			if e.Name() == raftDBFile || e.Name() == metaDBFile {
				return identity{}, fmt.Errorf("%w: %s holds %s but no %s; refusing to guess whose state it is",
					ErrCorrupt, dir, e.Name(), identityFile)
			}
			if !ourEntries[e.Name()] {
				return identity{}, fmt.Errorf("%w: %s is not empty (it holds %q) and is not a stor data directory (no %s)",
					ErrForeignDataDir, dir, e.Name(), identityFile)
			}
		}
		ident := identity{ServerID: id, DataDirID: uuid.NewString()}
		return ident, saveIdentity(dir, ident)
	}
	if err != nil {
		return identity{}, fmt.Errorf("raftstore: data dir: %w", err)
	}
	var ident identity
	if err := json.Unmarshal(b, &ident); err != nil || ident.ServerID == "" {
		return identity{}, fmt.Errorf("%w: %s: unreadable identity (%v)", ErrCorrupt, filepath.Join(dir, identityFile), err)
	}
	if ident.ServerID != id {
		return identity{}, fmt.Errorf("%w: %s belongs to server %q, not %q", ErrForeignDataDir, dir, ident.ServerID, id)
	}
	if ident.DataDirID == "" {
		// Written by a version before data dir ids: the directory is
		// the one the cluster knows (its record has no id yet). Named
		// here, saved by Open once the directory is accepted.
		ident.DataDirID, ident.unsaved = uuid.NewString(), true
	}
	return ident, nil
}

// saveIdentity writes the identity durably (write, fsync, rename, fsync dir).
func saveIdentity(dir string, ident identity) error {
	b, err := json.MarshalIndent(ident, "", "  ")
	if err != nil {
		return err
	}
	if err := durable.WriteFile(filepath.Join(dir, identityFile), append(b, '\n')); err != nil {
		return fmt.Errorf("raftstore: write identity: %w", err)
	}
	return nil
}
