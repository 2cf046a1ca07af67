package server_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

func getVolume(t *testing.T, c *servertest.Cluster, from int, id string) *storpb.Volume {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.GetVolumeResponse, error) {
		return c.Client(from).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	}).Volume
}

// waitVolume polls the volume until cond holds.
func waitVolume(t *testing.T, c *servertest.Cluster, from int, id string, within time.Duration, what string, cond func(v *storpb.Volume) bool) *storpb.Volume {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v := getVolume(t, c, from, id)
		if cond(v) {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached within %v; volume %v", what, within, v)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func replicaOn(v *storpb.Volume, serverID string) *storpb.Replica {
	for _, r := range v.Replicas {
		if r.ServerId == serverID {
			return r
		}
	}
	return nil
}

func TestServerReturningInTimeGetsDeltaRebuild(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = 500 * time.Millisecond
		cfg.Raft.ReplaceAfter = time.Minute
	}})
	leader := c.Leader(10 * time.Second)
	victim := (leader + 1) % 3
	id := c.Nodes[victim].ID
	v := createVolume(t, c.Client(leader), "v", gib, 3)
	c.Kill(victim)
	faulty := waitVolume(t, c, leader, v.Id, 10*time.Second, "replica faulty after its server went down", func(v *storpb.Volume) bool {
		return replicaOn(v, id).GetState() == storpb.ReplicaState_REPLICA_STATE_FAULTY
	})
	faultGen := replicaOn(faulty, id).Generation
	c.Start(victim)
	rebuilding := waitVolume(t, c, leader, v.Id, 10*time.Second, "delta rebuild after the server returned", func(v *storpb.Volume) bool {
		return replicaOn(v, id).GetState() == storpb.ReplicaState_REPLICA_STATE_REBUILDING
	})
	r := replicaOn(rebuilding, id)
	if r.RebuildFromGeneration != faultGen || r.UnhealthySinceUnixNano == 0 {
		t.Fatalf("rebuilding replica %v: want a delta from generation %d", r, faultGen)
	}
	if len(rebuilding.Replicas) != 3 {
		t.Fatalf("replica set changed size: %v", rebuilding.Replicas)
	}
}

func TestReplicaUnhealthyTooLongIsReplaced(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = 200 * time.Millisecond
		cfg.Raft.ReplaceAfter = time.Second
	}})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "v", gib, 3)
	var victim int
	for i, n := range c.Nodes {
		if i != leader && replicaOn(v, n.ID) != nil {
			victim = i
			break
		}
	}
	gone := c.Nodes[victim].ID
	c.Kill(victim)
	replaced := waitVolume(t, c, leader, v.Id, 15*time.Second, "replacement placed", func(v *storpb.Volume) bool {
		return replicaOn(v, gone) == nil && len(v.Replicas) == 3
	})
	// The new replica is the one on a server the volume did not use. Its
	// rebuild is full (from generation 0) until it completes; an empty
	// volume's full rebuild can complete between two polls, so a HEALTHY
	// replacement is fine too.
	var fresh *storpb.Replica
	for _, r := range replaced.Replicas {
		if replicaOn(v, r.ServerId) == nil {
			fresh = r
		}
	}
	if fresh == nil || (fresh.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY && fresh.RebuildFromGeneration != 0) {
		t.Fatalf("replacement %v: want a full rebuild (from generation 0); replicas %v", fresh, replaced.Replicas)
	}
	servers := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	}).Servers
	for _, s := range servers {
		want := uint64(0)
		if replicaOn(replaced, s.Id) != nil {
			want = gib
		}
		if s.AllocatedBytes != want {
			t.Fatalf("server %s allocates %d bytes, want %d", s.Id, s.AllocatedBytes, want)
		}
	}
}

func TestReplaceReplicaByOperator(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4})
	cl := c.Client(0)
	v := createVolume(t, cl, "v", gib, 3)
	var spare string
	for _, n := range c.Nodes {
		if replicaOn(v, n.ID) == nil {
			spare = n.ID
		}
	}
	moved := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
		return cl.Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id, ServerId: spare})
	}).Volume
	if r := replicaOn(moved, spare); r == nil || r.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || len(moved.Replicas) != 3 {
		t.Fatalf("after moving a replica to %s: %v", spare, moved.Replicas)
	}
	// Adding to a full volume, or onto a server that already holds one, is refused.
	_, err := cl.Volumes.ReplaceReplica(ctxT(t, 5*time.Second), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("add to a full volume: %v", err)
	}
	// Remove the two healthy ones: the second is the last healthy copy.
	var healthy []string
	for _, r := range moved.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			healthy = append(healthy, r.Id)
		}
	}
	if _, err := cl.Volumes.ReplaceReplica(ctxT(t, 5*time.Second), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: healthy[0], RemoveOnly: true}); err != nil {
		t.Fatal(err)
	}
	_, err = cl.Volumes.ReplaceReplica(ctxT(t, 5*time.Second), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: healthy[1], RemoveOnly: true})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("removing the last healthy replica: %v", err)
	}
}

// TestDeletedVolumeKeptForSnapshotIsRepaired: a volume deleted while it
// has a snapshot is kept for it, and its replicas are repaired like any
// volume's: a server that goes down has its replica marked faulty by the
// leader, and rebuilt when it returns; every replica still holds the
// snapshot's layer with the snapshot's bytes. A new leader holds the same
// deleted volume. Deleting the snapshot then removes the volume and frees
// its servers' space.
func TestDeletedVolumeKeptForSnapshotIsRepaired(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = 500 * time.Millisecond
		cfg.Raft.ReplaceAfter = time.Minute
	}})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v := createVolume(t, c.Client(leader), "kept", size, 3)
	ctx := ctxT(t, 2*time.Minute)
	data := make([]byte, size)
	for b := uint64(0); b < size/snapBlock; b++ {
		copy(data[b*snapBlock:], blockData(b, 1))
	}
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}
	s := createSnapshot(t, c, leader, v.Id, "kept-snap")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if cutCount(s) != 3 {
		t.Fatalf("snapshot cut on %d replicas, want 3: %v", cutCount(s), s)
	}
	del := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DeleteVolumeResponse, error) {
		return c.Client(leader).Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	})
	if del.GetRetained().GetState() != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("delete of a volume with a snapshot: %v, want it retained", del)
	}

	victim := (leader + 1) % 3
	id := c.Nodes[victim].ID
	c.Kill(victim)
	waitVolume(t, c, leader, v.Id, 10*time.Second, "replica of the deleted volume faulty after its server went down", func(v *storpb.Volume) bool {
		return replicaOn(v, id).GetState() == storpb.ReplicaState_REPLICA_STATE_FAULTY
	})
	c.Start(victim)
	healed := waitVolume(t, c, leader, v.Id, 30*time.Second, "replica of the deleted volume rebuilt after its server returned", func(v *storpb.Volume) bool {
		return replicaOn(v, id).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	if healed.State != storpb.VolumeState_VOLUME_STATE_DELETED || len(healed.Replicas) != 3 {
		t.Fatalf("deleted volume after the repair: %v", healed)
	}
	s = getSnapshot(t, c, leader, s.Id)
	if cutCount(s) != 3 || !s.ReadyToUse {
		t.Fatalf("snapshot after the repair: %v, want ready with 3 copies", s)
	}
	if got := requireOneCutPoint(t, c, healed, s); !bytes.Equal(got, data) {
		t.Fatal("the snapshot's layers do not hold the bytes written before it")
	}

	// A new leader (the old one killed and restarted, replaying its log)
	// holds the same deleted volume: its name still free.
	old := leader
	c.Restart(old)
	leader = c.Leader(10 * time.Second)
	if kept := getVolume(t, c, leader, v.Id); kept.State != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("the deleted volume after the leader was restarted: %v", kept)
	}
	requireNotFound(t, "the deleted volume's name after the leader was restarted", func(ctx context.Context) error {
		_, err := c.Client(old).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "kept"}})
		return err
	})

	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DeleteSnapshotResponse, error) {
		return c.Client(leader).Snapshots.DeleteSnapshot(ctx, &storpb.DeleteSnapshotRequest{Snapshot: snapRef(s.Id)})
	})
	requireNotFound(t, "the deleted volume after its last snapshot was deleted", func(ctx context.Context) error {
		_, err := c.Client(leader).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		return err
	})
	servers := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	}).Servers
	for _, srv := range servers {
		if srv.AllocatedBytes != 0 {
			t.Errorf("server %s allocates %d bytes with no volume left", srv.Id, srv.AllocatedBytes)
		}
	}
}

// requireNotFound calls fn until it answers something other than
// Unavailable (an election) within 10s, and fails unless that is NotFound.
func requireNotFound(t *testing.T, what string, fn func(ctx context.Context) error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := fn(ctx)
		cancel()
		switch code := status.Code(err); {
		case code == codes.NotFound:
			return
		case (code != codes.Unavailable && code != codes.DeadlineExceeded) || time.Now().After(deadline):
			t.Fatalf("%s: %v, want NotFound", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
