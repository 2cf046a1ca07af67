package server_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
)

const snapBlock = 4096

// blockData is block i's contents at generation g: 16-byte units of (i, g).
func blockData(i, g uint64) []byte {
	p := make([]byte, snapBlock)
	for o := 0; o < snapBlock; o += 16 {
		binary.BigEndian.PutUint64(p[o:], i)
		binary.BigEndian.PutUint64(p[o+8:], g)
	}
	return p
}

// decodeBlock returns the generation block i holds, or ok=false if the
// block is not entirely one (i, g) (torn, or another block's data).
func decodeBlock(p []byte, i uint64) (g uint64, ok bool) {
	g = binary.BigEndian.Uint64(p[8:])
	return g, bytes.Equal(p, blockData(i, g))
}

func snapRef(id string) *storpb.SnapshotRef { return &storpb.SnapshotRef{Id: id} }

func getSnapshot(t *testing.T, c *servertest.Cluster, from int, id string) *storpb.Snapshot {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.GetSnapshotResponse, error) {
		return c.Client(from).Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: snapRef(id)})
	}).Snapshot
}

func waitSnapshot(t *testing.T, c *servertest.Cluster, from int, id string, within time.Duration, what string, cond func(s *storpb.Snapshot) bool) *storpb.Snapshot {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		s := getSnapshot(t, c, from, id)
		if cond(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached within %v; snapshot %v", what, within, s)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func createSnapshot(t *testing.T, c *servertest.Cluster, from int, volumeID, name string) *storpb.Snapshot {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.CreateSnapshotResponse, error) {
		return c.Client(from).Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: volumeID, Name: name})
	}).Snapshot
}

func createClone(t *testing.T, c *servertest.Cluster, from int, name string, size uint64, src *storpb.ContentSource) *storpb.Volume {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.CreateVolumeResponse, error) {
		return c.Client(from).Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{
			Name: name, SizeBytes: size, ReplicaCount: 3, ContentSource: src,
		})
	}).Volume
}

func fromSnapshot(id string) *storpb.ContentSource {
	return &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: id}}
}

func fromVolume(id string) *storpb.ContentSource {
	return &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: id}}
}

func cutCount(s *storpb.Snapshot) int {
	n := 0
	for _, r := range s.Replicas {
		if r.State == storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
			n++
		}
	}
	return n
}

// requireChecksums fails unless every replica of the volume reads as want.
func requireChecksums(t *testing.T, c *servertest.Cluster, volumeID string, want []byte, what string) {
	t.Helper()
	digest := servertest.Digest(want)
	for _, d := range c.Checksums(volumeID) {
		if d.Err != nil || d.SHA256 != digest {
			t.Errorf("%s: replica %s: %s, %v; want %s", what, d.Replica.Id, d.SHA256, d.Err, digest)
		}
	}
}

func available(v *storpb.Volume) bool { return v.State == storpb.VolumeState_VOLUME_STATE_AVAILABLE }

// snapWriter writes blocks of its own range one at a time, each block a
// new generation, and logs every write in order.
type snapWriter struct {
	first, n uint64
	mu       sync.Mutex
	log      []uint64 // blocks in issue order; write k wrote generation k+1
	acked    int      // writes acknowledged (a prefix of log)
	stopped  bool     // the writer's goroutine returned
}

// waitCounts waits until the writer has issued at least issuedAtLeast
// writes and had ackedAtLeast acknowledged. It fails the test when the
// writer stopped short (an error, or its bound of writes) or when within
// passes: a writer that stalls must not hang the test binary until go
// test's own timeout.
func (w *snapWriter) waitCounts(t *testing.T, issuedAtLeast, ackedAtLeast int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		w.mu.Lock()
		issued, acked, stopped := len(w.log), w.acked, w.stopped
		w.mu.Unlock()
		switch {
		case issued >= issuedAtLeast && acked >= ackedAtLeast:
			return
		case stopped:
			t.Fatalf("writer of blocks %d..%d stopped after %d writes (%d acknowledged), want %d (%d acknowledged)",
				w.first, w.first+w.n-1, issued, acked, issuedAtLeast, ackedAtLeast)
		case time.Now().After(deadline):
			t.Fatalf("writer of blocks %d..%d issued %d writes (%d acknowledged) in %v, want %d (%d acknowledged)",
				w.first, w.first+w.n-1, issued, acked, within, issuedAtLeast, ackedAtLeast)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (w *snapWriter) counts() (issued, acked int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.log), w.acked
}

// matchPrefix checks that the writer's blocks in data (the whole volume)
// hold exactly the state after its first k writes for some k in
// [lo, hi], with every block entirely of one generation.
func (w *snapWriter) matchPrefix(t *testing.T, data []byte, lo, hi int, what string) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	got := map[uint64]uint64{}
	for b := w.first; b < w.first+w.n; b++ {
		g, ok := decodeBlock(data[b*snapBlock:(b+1)*snapBlock], b)
		if !ok {
			t.Fatalf("%s: block %d is not entirely one write (torn or misplaced)", what, b)
		}
		got[b] = g
	}
	cur := map[uint64]uint64{} // block -> generation after k writes (0: the initial data)
	mismatches := 0
	for b := w.first; b < w.first+w.n; b++ {
		if got[b] != 0 {
			mismatches++
		}
	}
	for k := 0; ; k++ {
		if k >= lo && mismatches == 0 {
			return
		}
		if k == hi || k == len(w.log) {
			break
		}
		b, g := w.log[k], uint64(k+1)
		if cur[b] == got[b] {
			mismatches++
		}
		cur[b] = g
		if cur[b] == got[b] {
			mismatches--
		}
	}
	t.Fatalf("%s: blocks %d..%d match no prefix of the writes between %d (acknowledged before the snapshot was requested) and %d (issued before it was ready)",
		what, w.first, w.first+w.n-1, lo, hi)
}

// TestSnapshotOfAttachedVolumeIsCrashConsistent: writers run while a
// snapshot is taken through the control plane; the attached engine holds
// writes and cuts every replica at one point. Every replica's snapshot
// reads exactly the same bytes, and for every writer a prefix of its
// writes, never less than what was acknowledged before the request. A
// clone of the snapshot holds the same bytes; a replica that is rebuilt
// (delta) after the snapshot still serves it; the head keeps every write.
func TestSnapshotOfAttachedVolumeIsCrashConsistent(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = time.Minute // the engine reports faults; keep the leader out of it
	}})
	leader := c.Leader(10 * time.Second)
	const blocks = 1024 // 4 MiB
	v := createVolume(t, c.Client(leader), "snap-src", blocks*snapBlock, 3)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	ctx := ctxT(t, 2*time.Minute)
	initial := make([]byte, blocks*snapBlock)
	for b := uint64(0); b < blocks; b++ {
		copy(initial[b*snapBlock:], blockData(b, 0))
	}
	if err := e.WriteAt(ctx, initial, 0, false); err != nil {
		t.Fatal(err)
	}

	const nWriters = 4
	writers := make([]*snapWriter, nWriters)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for i := range writers {
		w := &snapWriter{first: uint64(i) * blocks / nWriters, n: blocks / nWriters}
		writers[i] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				w.mu.Lock()
				w.stopped = true
				w.mu.Unlock()
			}()
			rng := rand.New(rand.NewPCG(seed, uint64(i)))
			for k := 0; k < 5000; k++ { // bounded; normally stopped far earlier
				select {
				case <-stop:
					return
				default:
				}
				b := w.first + rng.Uint64N(w.n)
				w.mu.Lock()
				w.log = append(w.log, b)
				g := uint64(len(w.log))
				w.mu.Unlock()
				if err := e.WriteAt(ctx, blockData(b, g), int64(b*snapBlock), false); err != nil {
					t.Errorf("writer %d: write %d: %v", i, g, err)
					return
				}
				w.mu.Lock()
				w.acked++
				w.mu.Unlock()
			}
		}()
	}
	stopWriters := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}
	defer stopWriters()

	// Let the writers get going, then snapshot.
	writers[0].waitCounts(t, 0, 20, 30*time.Second)
	lo := make([]int, nWriters)
	for i, w := range writers {
		_, lo[i] = w.counts()
	}
	s := createSnapshot(t, c, leader, v.Id, "under-load")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse })
	hi := make([]int, nWriters)
	for i, w := range writers {
		hi[i], _ = w.counts()
	}
	if cutCount(s) != 3 {
		t.Fatalf("snapshot cut on %d replicas, want 3: %v", cutCount(s), s)
	}
	// Keep writing after the cut.
	writers[0].waitCounts(t, hi[0]+20, 0, 30*time.Second)

	var snapData []byte
	for _, r := range v.Replicas {
		data, err := c.ReadSnapshot(v.Id, replica.LayerName(s.Id, s.CutEpoch), r.Id, s.SizeBytes)
		if err != nil {
			t.Fatalf("read snapshot from %s: %v", r.Id, err)
		}
		if snapData == nil {
			snapData = data
			for i, w := range writers {
				w.matchPrefix(t, data, lo[i], hi[i], "snapshot from "+r.Id)
			}
		} else if !bytes.Equal(data, snapData) {
			t.Fatalf("replica %s's snapshot differs from %s's: the replicas did not cut at one point", r.Id, v.Replicas[0].Id)
		}
	}

	// A replica whose server dies is faulted by the writes, comes back by a
	// delta rebuild and still serves the snapshot (its layer survived).
	victim := (leader + 1) % 3
	vid := c.Nodes[victim].ID
	c.Kill(victim)
	waitVolume(t, c, leader, v.Id, 30*time.Second, "replica faulty while its server is down", func(v *storpb.Volume) bool {
		return replicaOn(v, vid).GetState() == storpb.ReplicaState_REPLICA_STATE_FAULTY
	})
	c.Start(victim)
	waitVolume(t, c, leader, v.Id, 60*time.Second, "replica healthy again after a rebuild", func(v *storpb.Volume) bool {
		return replicaOn(v, vid).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	stopWriters()
	if t.Failed() {
		return
	}
	data, err := c.ReadSnapshot(v.Id, replica.LayerName(s.Id, s.CutEpoch), replicaOn(v, vid).Id, s.SizeBytes)
	if err != nil || !bytes.Equal(data, snapData) {
		t.Fatalf("rebuilt replica %s's snapshot: equal %v, err %v", replicaOn(v, vid).Id, bytes.Equal(data, snapData), err)
	}

	// The head holds every acknowledged write.
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	head := bytes.Clone(initial)
	for _, w := range writers {
		for k, b := range w.log[:w.acked] {
			copy(head[b*snapBlock:], blockData(b, uint64(k+1)))
		}
	}
	requireChecksums(t, c, v.Id, head, "head after the snapshot")

	// A clone of the snapshot holds the snapshot's bytes (the source stays
	// attached: the copy reads the snapshot layers, not the head).
	clone := createClone(t, c, leader, "snap-clone", v.SizeBytes, fromSnapshot(s.Id))
	waitVolume(t, c, leader, clone.Id, 60*time.Second, "clone copied", available)
	requireChecksums(t, c, clone.Id, snapData, "clone of the snapshot")
}

// TestSnapshotDetachedCloneAndDelete: a detached volume is snapshotted by
// one server, which fences the volume at a new epoch, reconciles and cuts
// the replicas it can open; a replica whose server is down is recorded
// faulty and as having missed the snapshot (it was neither fenced nor
// reconciled, so it cannot cut at that point later), and the snapshot is
// ready on the others. The down replica comes back by a rebuild. Clones
// from the snapshot and from the volume read byte-for-byte as the source;
// deleting merges the layer on every replica and keeps the head.
func TestSnapshotDetachedCloneAndDelete(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = time.Minute // the leader does not fault the down server's replica itself
	}})
	leader := c.Leader(10 * time.Second)
	const size = 2 << 20
	v := createVolume(t, c.Client(leader), "detached-src", size, 3)
	ctx := ctxT(t, 2*time.Minute)
	data := make([]byte, size)
	rng := rand.New(rand.NewPCG(7, 7))
	for i := 0; i < size; i += 8192 { // every other block random, the rest left unwritten (sparse)
		for j := i; j < i+snapBlock; j++ {
			data[j] = byte(rng.Uint32())
		}
	}
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	victim := (leader + 1) % 3
	vid := c.Nodes[victim].ID
	c.Kill(victim)
	s := createSnapshot(t, c, leader, v.Id, "detached")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready without the down server", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if !s.ReadyToUse || cutCount(s) != 2 {
		t.Fatalf("snapshot with a replica down: %v", s)
	}
	for _, r := range s.Replicas {
		if missed := r.State == storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED; missed != (r.ServerId == vid) || (missed && r.Reason == "") {
			t.Fatalf("snapshot entry %v; want only the down server's replica missed, with a reason", r)
		}
	}
	requireOneCutPoint(t, c, v, s)

	// The down server returns; its replica, recorded faulty by the cut, is
	// rebuilt (the volume is detached: by its server).
	c.Start(victim)
	waitVolume(t, c, leader, v.Id, 60*time.Second, "the down server's replica healthy again", func(v *storpb.Volume) bool {
		return replicaOn(v, vid).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	clone := createClone(t, c, leader, "detached-clone", 2*size, fromSnapshot(s.Id))
	waitVolume(t, c, leader, clone.Id, 60*time.Second, "clone copied", available)
	want := append(bytes.Clone(data), make([]byte, size)...) // the clone is larger: the rest reads as zeroes
	requireChecksums(t, c, clone.Id, want, "clone of the detached snapshot")

	// The clone is an ordinary volume now: attach it and write.
	ce := c.OpenEngine(c.EngineConfig(clone.Name, "node-2"))
	if err := ce.WriteAt(ctx, blockData(1, 1), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := ce.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	// Write the source's head after the snapshot.
	e = c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	newHead := bytes.Clone(data)
	copy(newHead[snapBlock:], blockData(99, 99)) // a block the snapshot lacks
	copy(newHead[0:], blockData(98, 98))         // a block the snapshot has
	if err := e.WriteAt(ctx, newHead[:2*snapBlock], 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	// Clone from the volume: an implicit snapshot of the current head.
	vclone := createClone(t, c, leader, "volume-clone", size, fromVolume(v.Id))
	waitVolume(t, c, leader, vclone.Id, 60*time.Second, "volume clone copied", available)
	requireChecksums(t, c, vclone.Id, newHead, "clone of the volume")
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListSnapshotsResponse, error) {
		return c.Client(leader).Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{VolumeId: v.Id})
	})
	// The implicit snapshot was cut while the source was detached, at the
	// epoch its cut fenced the volume at (the volume's last); the copy
	// done, its layers are merged away.
	src := getVolume(t, c, leader, v.Id)
	waitLayersGone(t, c, v, replica.LayerName(raftstore.ImplicitSnapshotID(vclone.Id), src.Epoch))

	// Delete merges the snapshot on every replica; the head is unchanged.
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DeleteSnapshotResponse, error) {
		return c.Client(leader).Snapshots.DeleteSnapshot(ctx, &storpb.DeleteSnapshotRequest{Snapshot: snapRef(s.Id)})
	})
	waitLayersGone(t, c, v, replica.LayerName(s.Id, s.CutEpoch))
	requireChecksums(t, c, v.Id, newHead, "head after the snapshot's layer was merged")
}

// waitLayersGone waits until no replica of v has layer id.
func waitLayersGone(t *testing.T, c *servertest.Cluster, v *storpb.Volume, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, r := range v.Replicas {
		for {
			_, err := c.ReadSnapshot(v.Id, id, r.Id, v.SizeBytes)
			if errors.Is(err, replica.ErrNotFound) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("replica %s still has snapshot %s's layer (read: %v)", r.Id, id, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}
