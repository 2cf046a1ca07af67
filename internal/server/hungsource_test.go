package server_test

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
)

// hungDisks makes the reads of chosen replicas hang, as a disk that takes
// requests and never completes them does: their servers stay up and the
// replicas HEALTHY, and a read of one never returns until the test ends
// (or heals them). It also makes a server's disk slow, or fail its
// syncs.
type hungDisks struct {
	mu       sync.Mutex
	replicas map[string]bool // ids of the replicas whose reads hang
	failing  map[string]bool // ids of the replicas whose reads fail (EIO)
	failed   int             // reads failed so far
	release  chan struct{}   // closed by heal
	slowDir  string          // syncs of files under it take slowSync
	slowSync time.Duration
	// failDir: the replicas' files under it fail (EIO): their syncs, or
	// (failWrites) the writes of their data.
	failDir    string
	failWrites bool
}

// slow makes every sync of a file under dir (a server's data directory)
// take d, as a slow disk's do.
func (h *hungDisks) slow(dir string, d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.slowDir, h.slowSync = dir, d
}

// syncTime is how long a sync of the file at name takes.
func (h *hungDisks) syncTime(name string) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.slowDir != "" && strings.HasPrefix(name, h.slowDir+string(filepath.Separator)) {
		return h.slowSync
	}
	return 0
}

// hang makes the reads of replicas ids hang.
func (h *hungDisks) hang(ids ...string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, id := range ids {
		h.replicas[id] = true
	}
}

// heal lets every hung read, and every later one, through, and fails no
// more reads.
func (h *hungDisks) heal() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.replicas)
	clear(h.failing)
	select {
	case <-h.release:
	default:
		close(h.release)
	}
}

// failReads makes the reads of replicas ids fail with EIO.
func (h *hungDisks) failReads(ids ...string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failing == nil {
		h.failing = map[string]bool{}
	}
	for _, id := range ids {
		h.failing[id] = true
	}
}

// readFails reports whether a read of the file at name fails now.
func (h *hungDisks) readFails(name string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if inReplica(name, h.failing) {
		h.failed++
		return true
	}
	return false
}

// failedReads is how many reads failed so far.
func (h *hungDisks) failedReads() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.failed
}

// inReplica reports whether the file at name is in the directory of one
// of the replicas ids (a replica's directory is named by its id).
func inReplica(name string, ids map[string]bool) bool {
	for id := range ids {
		if strings.Contains(name, string(filepath.Separator)+id+string(filepath.Separator)) {
			return true
		}
	}
	return false
}

// hangs reports whether a read of the file at name (in a replica's
// directory, named by its id) hangs now.
func (h *hungDisks) hangs(name string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return inReplica(name, h.replicas)
}

// failSyncs makes every sync of a replica's file under dir (a server's
// data directory) fail with EIO, as a failing disk's do, which fails the
// replica until its server restarts. A replica being created is spared,
// so that it is created and then fails.
func (h *hungDisks) failSyncs(dir string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failDir, h.failWrites = dir, false
}

// failDataWrites makes every write of a replica's data under dir fail with
// EIO, as a failing disk's do; the replica's other files (its epoch, its
// logs) are spared.
func (h *hungDisks) failDataWrites(dir string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failDir, h.failWrites = dir, true
}

// fails reports whether a sync (write false) or a write of the file at
// name fails now.
func (h *hungDisks) fails(name string, write bool) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failDir == "" || write != h.failWrites || !strings.HasPrefix(name, h.failDir+string(filepath.Separator)) ||
		strings.Contains(name, string(filepath.Separator)+".creating-") {
		return false
	}
	return !write || strings.HasSuffix(name, ".data")
}

type hungFS struct {
	replica.FS
	h *hungDisks
}

func (f hungFS) OpenFile(name string, flag int, perm os.FileMode) (replica.File, error) {
	file, err := f.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return hungFile{File: file, h: f.h, name: name}, nil
}

type hungFile struct {
	replica.File
	h    *hungDisks
	name string
}

func (f hungFile) Sync() error {
	time.Sleep(f.h.syncTime(f.name))
	if f.h.fails(f.name, false) {
		return &os.PathError{Op: "sync", Path: f.name, Err: syscall.EIO}
	}
	return f.File.Sync()
}

func (f hungFile) WriteAt(p []byte, off int64) (int, error) {
	if f.h.fails(f.name, true) {
		return 0, &os.PathError{Op: "write", Path: f.name, Err: syscall.EIO}
	}
	return f.File.WriteAt(p, off)
}

func (f hungFile) ReadAt(p []byte, off int64) (int, error) {
	if f.h.hangs(f.name) {
		<-f.h.release
	}
	if f.h.readFails(f.name) {
		return 0, &os.PathError{Op: "read", Path: f.name, Err: syscall.EIO}
	}
	return f.File.ReadAt(p, off)
}

// hungCluster is a 4-server cluster whose replicas' reads hang at the
// test's word, and whose servers' own tasks give up on a request after
// taskIO. Only the test moves replicas.
func hungCluster(t *testing.T, taskIO time.Duration) (*servertest.Cluster, *hungDisks) {
	return hungClusterReplacing(t, taskIO, time.Hour)
}

// hungClusterReplacing is hungCluster whose leader replaces a replica
// FAULTY for replaceAfter.
func hungClusterReplacing(t *testing.T, taskIO, replaceAfter time.Duration) (*servertest.Cluster, *hungDisks) {
	h := &hungDisks{replicas: map[string]bool{}, release: make(chan struct{})}
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = replaceAfter
		cfg.TaskIOTimeout = taskIO
		cfg.ReplicaFS = hungFS{FS: replica.OS(), h: h}
	}})
	t.Cleanup(h.heal) // before the cluster's own cleanup, which closes its servers
	return c, h
}

// writtenVolume creates a detached volume of size bytes with that many
// replicas, written whole with randomData(seed).
func writtenVolume(t *testing.T, c *servertest.Cluster, leader int, name string, size int, replicas uint32, seed uint64) (*storpb.Volume, []byte) {
	t.Helper()
	v := createVolume(t, c.Client(leader), name, uint64(size), replicas)
	data := randomData(seed, size)
	ctx := ctxT(t, 2*time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}
	return v, data
}

// spareServer is a server holding no replica of v.
func spareServer(c *servertest.Cluster, v *storpb.Volume) *servertest.Node {
	for _, n := range c.Nodes {
		if replicaOn(v, n.ID) == nil {
			return n
		}
	}
	panic("no spare server")
}

// moveFirstReplica moves v's first replica to server to and waits until
// the replacement there is HEALTHY (what: the wait's failure).
func moveFirstReplica(t *testing.T, c *servertest.Cluster, leader int, v *storpb.Volume, to *servertest.Node, what string) {
	t.Helper()
	start := time.Now()
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
		return c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id, ServerId: to.ID})
	})
	waitVolume(t, c, leader, v.Id, time.Minute, what, func(v *storpb.Volume) bool {
		return replicaOn(v, to.ID).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	t.Logf("rebuilt in %v", time.Since(start).Round(time.Millisecond))
}

func randomData(seed uint64, n int) []byte {
	data := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, seed))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	return data
}

// TestADetachedRebuildReadsAnotherSourceWhenOneHangs: a server rebuilds a
// detached volume's replica from a HEALTHY one; when that one's disk
// hung, a read of it never returned, and the rebuild, and every later
// attempt (its entry in d.rebuilding), waited with it: the volume stayed
// degraded until the server restarted. Now each request of the rebuild
// gives up after TaskIOTimeout, and the next attempt reads the next
// source.
func TestADetachedRebuildReadsAnotherSourceWhenOneHangs(t *testing.T) {
	c, h := hungCluster(t, 2*time.Second)
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v, data := writtenVolume(t, c, leader, "hung-source", size, 3, 17)
	// Every source but the last hangs (the replaced one too, in case it
	// is still read).
	h.hang(v.Replicas[0].Id, v.Replicas[1].Id)
	moveFirstReplica(t, c, leader, v, spareServer(c, v), "the replacement rebuilt from the source that answers")
	h.heal()
	requireChecksums(t, c, v.Id, data, "volume rebuilt past a hung source")
}

// TestACloneCopyReadsAnotherSourceWhenOneHangs: a server fills its
// replica of a clone from a replica of the snapshot's volume (its own
// first); when that one's disk hung, the copy waited for ever, and the
// clone stayed CREATING (its PVC unbound) until the server restarted.
// Now each request gives up after TaskIOTimeout and the copy reads the
// next source.
func TestACloneCopyReadsAnotherSourceWhenOneHangs(t *testing.T) {
	c, h := hungCluster(t, 2*time.Second)
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v, data := writtenVolume(t, c, leader, "hung-clone-src", size, 3, 18)
	s := createSnapshot(t, c, leader, v.Id, "hung-clone-src-snap")
	waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse })
	h.hang(v.Replicas[0].Id, v.Replicas[1].Id)
	start := time.Now()
	clone := createClone(t, c, leader, "hung-clone", size, fromSnapshot(s.Id))
	waitVolume(t, c, leader, clone.Id, time.Minute, "the clone filled from the source that answers", func(v *storpb.Volume) bool {
		return available(v)
	})
	t.Logf("filled in %v", time.Since(start).Round(time.Millisecond))
	h.heal()
	requireChecksums(t, c, clone.Id, data, "clone filled past a hung source")
}

// TestADetachedRebuildWaitsForASlowTarget: the bound on a detached
// rebuild's requests is for its sources, which another attempt can
// avoid. A target (the server's own replica) whose disk is slow is
// waited for: bounding its flushes too failed every attempt of a slow
// disk's rebuild, and the replica never became HEALTHY.
func TestADetachedRebuildWaitsForASlowTarget(t *testing.T) {
	c, h := hungCluster(t, 300*time.Millisecond)
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v, data := writtenVolume(t, c, leader, "slow-target", size, 3, 19)
	spare := spareServer(c, v)
	h.slow(spare.Dir, time.Second) // each sync over the TaskIOTimeout
	moveFirstReplica(t, c, leader, v, spare, "the replacement on the slow disk rebuilt")
	h.slow("", 0)
	requireChecksums(t, c, v.Id, data, "volume rebuilt onto a slow disk")
}
