package engine_test

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/wire"
)

// storeReplicas serves the engine real replica stores in the same process
// (one store per replica, as each server has its own), so a test sees the
// store's own rules (the dirty-region log, fencing, rebuild tracking),
// with gates to hold a kind of request to one replica.
type storeReplicas struct {
	t        *testing.T
	volumeID string
	size     uint64

	mu     sync.Mutex
	byID   map[string]*replica.Replica // guarded by mu
	gates  map[string]*gates           // guarded by mu
	mems   map[string]*errorfs.MemFS   // guarded by mu: the disks of the replicas a test may crash
	faults map[string]*errorfs.FS      // guarded by mu: the faults of those disks
}

func newStoreReplicas(t *testing.T, volumeID string, size uint64) *storeReplicas {
	return &storeReplicas{t: t, volumeID: volumeID, size: size, byID: map[string]*replica.Replica{}, gates: map[string]*gates{},
		mems: map[string]*errorfs.MemFS{}, faults: map[string]*errorfs.FS{}}
}

// onMemFS puts replica id's store, not yet made, on a disk in memory that
// crash can crash.
func (s *storeReplicas) onMemFS(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mems[id] = errorfs.NewMemFS()
}

// get returns replica id, creating its store on first use, and its gates.
func (s *storeReplicas) get(id string) (*replica.Replica, *gates) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.byID[id]; r != nil {
		return r, s.gates[id]
	}
	st := s.openStoreLocked(id)
	r, err := st.Create(replica.Spec{ID: id, VolumeID: s.volumeID, Size: s.size})
	if err != nil {
		s.t.Fatal(err)
	}
	s.byID[id], s.gates[id] = r, &gates{}
	return r, s.gates[id]
}

func (s *storeReplicas) openStoreLocked(id string) *replica.Store {
	cfg := replica.Config{Dir: filepath.Join(s.t.TempDir(), id), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if mem := s.mems[id]; mem != nil {
		s.faults[id] = errorfs.New(mem, 1)
		cfg.Dir, cfg.FS = "/"+id, s.faults[id]
	}
	st, err := replica.OpenStore(cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { st.Close() })
	return st
}

// fault adds a fault to the disk of replica id (on onMemFS's disk).
func (s *storeReplicas) fault(id string, rule errorfs.Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[id].Add(rule)
}

// crash crashes the machine of replica id (on onMemFS's disk): what it
// had not synced is lost, its connections are lost, and its server comes
// back with the replica as the disk kept it.
func (s *storeReplicas) crash(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	g := s.gates[id]
	g.mu.Lock()
	g.lost = true
	g.mu.Unlock()
	s.mems[id] = s.mems[id].CrashLoseAll()
	r, err := s.openStoreLocked(id).Get(id)
	if err != nil {
		s.t.Fatal(err)
	}
	s.byID[id], s.gates[id] = r, &gates{}
}

// read reads a replica directly, at an epoch that fences nobody.
func (s *storeReplicas) read(id string, epoch uint64, off, n int64) []byte {
	s.t.Helper()
	r, _ := s.get(id)
	p := make([]byte, n)
	if err := r.ReadAt(replica.Op{Epoch: epoch}, p, off); err != nil {
		s.t.Fatalf("read replica %s: %v", id, err)
	}
	return p
}

func (s *storeReplicas) connect(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
	r, g := s.get(open.Replica)
	if err := r.Fence(open.Epoch); err != nil {
		return nil, err
	}
	return storeConn{r, g}, nil
}

// storeConn is an engine's connection to a replica in the same process.
type storeConn struct {
	r *replica.Replica
	g *gates
}

func (c storeConn) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := c.g.pass(ctx, "ReadAt"); err != nil {
		return err
	}
	return c.r.ReadAt(o, p, off)
}

func (c storeConn) WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := c.g.pass(ctx, "WriteAt"); err != nil {
		return err
	}
	return c.r.WriteAt(o, p, off)
}

func (c storeConn) WriteZeroes(ctx context.Context, o replica.Op, off, n int64) error {
	return c.r.WriteZeroes(o, off, n)
}

func (c storeConn) Trim(ctx context.Context, o replica.Op, off, n int64) error {
	return c.r.Trim(o, off, n)
}

func (c storeConn) Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error) {
	p := make([]byte, n)
	if err := c.r.ReadAt(o, p, off); err != nil {
		return nil, err
	}
	return wire.BlockDigests(nil, p), nil
}

func (c storeConn) Flush(ctx context.Context, o replica.Op) error {
	if err := c.g.pass(ctx, "Flush"); err != nil {
		return err
	}
	return c.r.Flush(o)
}

func (c storeConn) Grow(ctx context.Context, o replica.Op, size uint64) error {
	return c.r.Grow(o, size)
}

func (c storeConn) DirtyRegions(ctx context.Context, o replica.Op) ([]replica.Extent, error) {
	return c.r.DirtyRegions(o)
}

func (c storeConn) Extents(ctx context.Context, o replica.Op, snapshotID string, from int64, limit int) ([]replica.Extent, error) {
	return c.r.Extents(o, snapshotID, from, limit)
}

func (c storeConn) WrittenSince(ctx context.Context, o replica.Op, generation uint64) ([]replica.Extent, error) {
	return c.r.WrittenSince(o, generation)
}

func (c storeConn) BeginRebuild(ctx context.Context, o replica.Op) error {
	if err := c.g.pass(ctx, "BeginRebuild"); err != nil {
		return err
	}
	return c.r.BeginRebuild(o)
}

func (c storeConn) RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error {
	return c.r.RebuildWrite(o, p, off)
}

func (c storeConn) EndRebuild(ctx context.Context, o replica.Op) error {
	return c.r.EndRebuild(o)
}

func (c storeConn) Close(ctx context.Context) error { return nil }
