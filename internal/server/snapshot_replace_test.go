package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// snapshotEntry is replica id's entry in s, or nil.
func snapshotEntry(s *storpb.Snapshot, id string) *storpb.SnapshotReplica {
	for _, r := range s.Replicas {
		if r.ReplicaId == id {
			return r
		}
	}
	return nil
}

// callRefused makes a control call that must be refused, retrying while
// the cluster is electing, and returns its status.
func callRefused(t *testing.T, what string, call func(ctx context.Context) error) *status.Status {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := call(ctx)
		cancel()
		st := status.Convert(err)
		switch {
		case err == nil:
			t.Fatalf("%s: accepted, want refused", what)
		case (st.Code() == codes.Unavailable || st.Code() == codes.DeadlineExceeded) && time.Now().Before(deadline):
			time.Sleep(50 * time.Millisecond)
			continue
		}
		return st
	}
}

// TestReplaceReplicaKeepsSnapshotRecordsHonest: replacing the replicas of
// a snapshotted volume one by one takes their copies of the snapshot with
// them, and the snapshot's record says so (LOST entries; still ready
// while a copy is CUT); the removal of the replica that holds the last
// copy is refused while its server is up; when that server dies and the
// leader replaces its replica, the snapshot is failed as lost, and a
// clone from it is refused at once rather than failing inside the copy.
func TestReplaceReplicaKeepsSnapshotRecordsHonest(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = 500 * time.Millisecond
		cfg.Raft.ReplaceAfter = 2 * time.Second
	}})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v := createVolume(t, c.Client(leader), "snap-replace", size, 3)
	ctx := ctxT(t, 3*time.Minute)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, blockData(1, 1), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}
	s := createSnapshot(t, c, leader, v.Id, "before-replace")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if !s.ReadyToUse || cutCount(s) != 3 {
		t.Fatalf("snapshot of a healthy volume: %v", s)
	}

	// The last copy stays on a server that is not the leader (it is
	// killed at the end); the other two replicas are replaced.
	leaderID := c.Nodes[leader].ID
	var keep *storpb.Replica
	var replace []*storpb.Replica
	for _, r := range getVolume(t, c, leader, v.Id).Replicas {
		if keep == nil && r.ServerId != leaderID {
			keep = r
		} else {
			replace = append(replace, r)
		}
	}
	for i, old := range replace {
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
			return c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{
				Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: old.Id})
		})
		s = getSnapshot(t, c, leader, s.Id)
		got := snapshotEntry(s, old.Id)
		if got.GetState() != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST || !strings.Contains(got.GetReason(), "the copy went with it") {
			t.Fatalf("replacement %d: the removed replica's entry is %v, want LOST with its reason", i+1, got)
		}
		if !s.ReadyToUse || s.Failed || cutCount(s) != 2-i {
			t.Fatalf("replacement %d: snapshot %v, want ready with %d copies", i+1, s, 2-i)
		}
		waitVolume(t, c, leader, v.Id, 60*time.Second, "the new replica healthy", func(v *storpb.Volume) bool {
			return len(v.Replicas) == 3 && healthyReplicas(v) == 3
		})
	}

	// The last copy: an operator's removal is refused, naming the snapshot.
	for _, removeOnly := range []bool{false, true} {
		st := callRefused(t, "removing the last copy", func(ctx context.Context) error {
			_, err := c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{
				Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: keep.Id, RemoveOnly: removeOnly})
			return err
		})
		if st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), `snapshot "before-replace"`) {
			t.Fatalf("removing the last copy (remove only %v): %v, want FailedPrecondition naming the snapshot", removeOnly, st)
		}
	}
	if s = getSnapshot(t, c, leader, s.Id); !s.ReadyToUse || snapshotEntry(s, keep.Id).GetState() != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
		t.Fatalf("snapshot after the refused removal: %v", s)
	}

	// Its server dies; the leader replaces the replica after ReplaceAfter
	// (repairing the head comes first) and records the loss.
	for i, n := range c.Nodes {
		if n.ID == keep.ServerId {
			c.Kill(i)
		}
	}
	s = waitSnapshot(t, c, leader, s.Id, 60*time.Second, "snapshot failed once its last copy is gone", func(s *storpb.Snapshot) bool { return s.Failed })
	if s.ReadyToUse || !strings.Contains(s.StatusMessage, "every copy of the snapshot is lost") ||
		snapshotEntry(s, keep.Id).GetState() != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST {
		t.Fatalf("snapshot whose copies are gone: %v", s)
	}
	st := callRefused(t, "clone of a lost snapshot", func(ctx context.Context) error {
		_, err := c.Client(leader).Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{
			Name: "clone-of-lost", SizeBytes: size, ReplicaCount: 3, ContentSource: fromSnapshot(s.Id)})
		return err
	})
	if st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "lost") {
		t.Fatalf("clone of a lost snapshot: %v, want FailedPrecondition saying the copies are lost", st)
	}
}

func healthyReplicas(v *storpb.Volume) int {
	n := 0
	for _, r := range v.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			n++
		}
	}
	return n
}
