package server_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// TestAServerBackOnAnEmptyDataDirIsRefusedUntilRemoved: a server whose
// data dir is wiped or replaced without being removed first (its claim
// deleted by mistake, a disk that did not mount) starts with no state,
// joins again and gets the cluster's records back, which still place its
// replicas there, healthy. Its reconcile made them again, empty, and they
// stayed healthy: replicas holding nothing, read from and copied from.
// Now the cluster knows each server's data dir: one back on another is
// refused (not a member, nothing made) until it is removed, and then
// joins afresh; its replicas are replaced (here on it, the only server
// without one) and rebuilt whole, and its snapshot copies are lost.
func TestAServerBackOnAnEmptyDataDirIsRefusedUntilRemoved(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // nothing but the removal replaces a replica
	}})
	leader := c.Leader(10 * time.Second)
	const size = 4 << 20
	const blocks = 64
	v := createVolume(t, c.Client(leader), "v", size, 3)
	ctx := ctxT(t, 3*time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	want := make([]byte, size)
	for i := range uint64(blocks) {
		p := blockData(i, 1)
		if err := e.WriteAt(ctx, p, int64(i)*snapBlock, false); err != nil {
			t.Fatal(err)
		}
		copy(want[i*snapBlock:], p)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}
	digest := servertest.Digest(want)
	snap := createSnapshot(t, c, leader, v.Id, "before")
	waitSnapshot(t, c, leader, snap.Id, 30*time.Second, "snapshot cut by every replica", func(s *storpb.Snapshot) bool { return cutCount(s) == 3 })

	// Ordinal 0 refuses to start without state while it is a member
	// (TestOrdinalZeroWithoutStateNeverMakesASecondCluster); the others
	// ask to join again.
	victim := 1
	if victim == leader {
		victim = 2
	}
	id := c.Nodes[victim].ID
	lost := replicaOn(v, id)
	c.Kill(victim)
	if err := os.RemoveAll(c.Nodes[victim].Dir); err != nil {
		t.Fatal(err)
	}
	c.Start(victim)
	lostDir := filepath.Join(c.Nodes[victim].Dir, "replicas", lost.Id)
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if _, err := os.Stat(lostDir); err == nil {
			t.Fatalf("replica %s was made again on %s's empty data dir", lost.Id, id)
		}
		for _, d := range c.Checksums(v.Id) {
			if d.Err == nil && d.SHA256 != digest {
				t.Fatalf("replica %s on %s (%v) reads as other bytes than were written", d.Replica.Id, d.Replica.ServerId, d.Replica.State)
			}
		}
	}
	if c.Nodes[victim].Server().Store().Member() {
		t.Fatalf("%s, back on an empty data dir, was admitted as a member", id)
	}

	if _, err := c.Client(leader).Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: id}); err != nil {
		t.Fatal(err)
	}
	// Wait for three healthy replicas that all answer a read in full.
	var digests []servertest.ReplicaDigest
	deadline := time.Now().Add(90 * time.Second)
	for digests == nil {
		vol := getVolume(t, c, leader, v.Id)
		healthy := 0
		for _, r := range vol.Replicas {
			if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				healthy++
			}
		}
		if healthy == 3 && len(vol.Replicas) == 3 {
			ds := c.Checksums(v.Id)
			digests = ds
			for _, d := range ds {
				if d.Err != nil {
					digests = nil
				}
			}
		}
		if digests == nil && time.Now().After(deadline) {
			t.Fatalf("the volume has not three healthy, readable replicas within 90 s of %s's removal: %v", id, vol.Replicas)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, d := range digests {
		if d.SHA256 != digest {
			t.Errorf("healthy replica %s on %s holds other bytes than were written (%s, want %s)", d.Replica.Id, d.Replica.ServerId, d.SHA256, digest)
		}
		if d.Replica.Id == lost.Id {
			t.Errorf("replica %s, whose data dir was wiped, is healthy again: %v", lost.Id, d.Replica)
		}
	}
	for _, r := range getSnapshot(t, c, leader, snap.Id).Replicas {
		if r.ReplicaId == lost.Id && r.State != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST {
			t.Errorf("the snapshot's copy on the wiped replica %s: %v, want LOST", lost.Id, r.State)
		}
	}
	if !c.Nodes[victim].Server().Store().Member() {
		t.Errorf("%s did not join afresh once removed", id)
	}
}

// TestAServerBackOnItsOldDiskAfterItWasReplacedIsRefusedUntilRemoved: the
// other way round. A server's disk did not mount; it was refused on the
// empty dir, removed, and joined afresh there (its replicas rebuilt on
// it). Then its old disk comes back, with Raft state and membership of
// its own, naming a dir the cluster no longer knows it on. Its reports
// are refused: it is not ready and makes nothing. Removed again, it
// joins afresh by itself, on the old disk, and is ready.
func TestAServerBackOnItsOldDiskAfterItWasReplacedIsRefusedUntilRemoved(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	victim := 1
	if victim == leader {
		victim = 2
	}
	n := c.Nodes[victim]
	h := healthClient(t, n.Addr)
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 10*time.Second)
	ctx := ctxT(t, 2*time.Minute)

	// The old disk, set aside; the server on an empty dir, refused, is
	// removed and joins afresh.
	c.Stop(victim)
	oldDisk := n.Dir + ".old"
	if err := os.Rename(n.Dir, oldDisk); err != nil {
		t.Fatal(err)
	}
	c.Start(victim)
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_NOT_SERVING, 10*time.Second)
	leave := func() {
		t.Helper()
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.LeaveResponse, error) {
			return c.Client(leader).Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: n.ID})
		})
	}
	leave()
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 20*time.Second)

	// The old disk back.
	c.Stop(victim)
	if err := os.RemoveAll(n.Dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(oldDisk, n.Dir); err != nil {
		t.Fatal(err)
	}
	c.Start(victim)
	// (Ready until its first report is refused: a member that knows its
	// leader.)
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_NOT_SERVING, 5*time.Second)
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if check(t, h, server.HealthReadiness) == healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%s, back on a disk the cluster no longer knows it on, is ready", n.ID)
		}
	}
	srvs, err := c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range srvs.Servers {
		if s.Id == n.ID && s.State == storpb.ServerState_SERVER_STATE_UP && time.Since(time.Unix(0, s.LastSeenUnixNano)) < time.Second {
			t.Errorf("%s, back on a disk the cluster no longer knows it on, reports and is seen: %v", n.ID, s)
		}
	}
	leave()
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 20*time.Second)
	waitServerUp := time.Now().Add(10 * time.Second)
	for {
		srvs, err := c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
		if err != nil {
			t.Fatal(err)
		}
		up := false
		for _, s := range srvs.Servers {
			up = up || (s.Id == n.ID && s.State == storpb.ServerState_SERVER_STATE_UP)
		}
		if up {
			break
		}
		if time.Now().After(waitServerUp) {
			t.Fatalf("%s did not join afresh on its old disk once removed: %v", n.ID, srvs.Servers)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
