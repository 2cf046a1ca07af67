package server_test

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
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
// (or heals them).
type hungDisks struct {
	mu       sync.Mutex
	replicas map[string]bool // ids of the replicas whose reads hang
	release  chan struct{}   // closed by heal
	slowDir  string          // syncs of files under it take slowSync
	slowSync time.Duration
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

// heal lets every hung read, and every later one, through.
func (h *hungDisks) heal() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.replicas)
	select {
	case <-h.release:
	default:
		close(h.release)
	}
}

// hangs reports whether a read of the file at name (in a replica's
// directory, named by its id) hangs now.
func (h *hungDisks) hangs(name string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for id := range h.replicas {
		if strings.Contains(name, string(filepath.Separator)+id+string(filepath.Separator)) {
			return true
		}
	}
	return false
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
	return f.File.Sync()
}

func (f hungFile) ReadAt(p []byte, off int64) (int, error) {
	if f.h.hangs(f.name) {
		<-f.h.release
	}
	return f.File.ReadAt(p, off)
}

// hungCluster is a 4-server cluster whose replicas' reads hang at the
// test's word, and whose servers' own tasks give up on a request after
// taskIO.
func hungCluster(t *testing.T, taskIO time.Duration) (*servertest.Cluster, *hungDisks) {
	h := &hungDisks{replicas: map[string]bool{}, release: make(chan struct{})}
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
		cfg.TaskIOTimeout = taskIO
		cfg.ReplicaFS = hungFS{FS: replica.OS(), h: h}
	}})
	t.Cleanup(h.heal) // before the cluster's own cleanup, which closes its servers
	return c, h
}

// writtenVolume creates a detached volume of size bytes with 3 replicas,
// written whole with randomData(seed).
func writtenVolume(t *testing.T, c *servertest.Cluster, leader int, name string, size int, seed uint64) (*storpb.Volume, []byte) {
	t.Helper()
	v := createVolume(t, c.Client(leader), name, uint64(size), 3)
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
	v, data := writtenVolume(t, c, leader, "hung-source", size, 17)
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
	v, data := writtenVolume(t, c, leader, "hung-clone-src", size, 18)
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
	v, data := writtenVolume(t, c, leader, "slow-target", size, 19)
	spare := spareServer(c, v)
	h.slow(spare.Dir, time.Second) // each sync over the TaskIOTimeout
	moveFirstReplica(t, c, leader, v, spare, "the replacement on the slow disk rebuilt")
	h.slow("", 0)
	requireChecksums(t, c, v.Id, data, "volume rebuilt onto a slow disk")
}
