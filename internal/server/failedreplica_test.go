package server_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// TestADetachedRebuildOntoAFailingDiskIsReplaced: a server rebuilds its
// replica of a detached volume, and its disk fails the replica's syncs
// (its epoch's first: the replica is never fenced) or the rebuild's
// writes of its data. Every attempt failed, and the replica stayed
// REBUILDING for ever: only an attached engine recorded a failed target
// FAULTY, so the leader never replaced it and the volume stayed a replica
// short. Now the server records its failed replica FAULTY, from its
// fence's failure or from the rebuild's, and the leader replaces it.
func TestADetachedRebuildOntoAFailingDiskIsReplaced(t *testing.T) {
	for _, writes := range []bool{false, true} {
		t.Run(map[bool]string{false: "syncs", true: "writes"}[writes], func(t *testing.T) {
			c, h := hungClusterReplacing(t, 30*time.Second, 3*time.Second)
			leader := c.Leader(10 * time.Second)
			const size = 1 << 20
			v, data := writtenVolume(t, c, leader, "failing-target", size, 3, 21)
			spare := spareServer(c, v)
			if writes {
				h.failDataWrites(spare.Dir)
			} else {
				h.failSyncs(spare.Dir)
			}
			start := time.Now()
			moved := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
				return c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id, ServerId: spare.ID})
			})
			if replicaOn(moved.Volume, spare.ID) == nil {
				t.Fatalf("no replica on %s after the move: %v", spare.ID, moved.Volume.Replicas)
			}
			waitVolume(t, c, leader, v.Id, 2*time.Minute, "the replica on the failing disk replaced", func(v *storpb.Volume) bool {
				return len(v.Replicas) == 3 && replicaOn(v, spare.ID) == nil && allHealthy(v)
			})
			t.Logf("replaced and rebuilt in %v", time.Since(start).Round(time.Millisecond))
			requireChecksums(t, c, v.Id, data, "volume rebuilt past a failing disk")
		})
	}
}

// TestADetachedRebuildDoesNotFaultItsTargetForASourcesError: the
// source's disk fails the rebuild's reads (EIO). That is the source's
// failure, not the target's: the target is not recorded faulty (and so
// not replaced), and the next attempt reads another source.
func TestADetachedRebuildDoesNotFaultItsTargetForASourcesError(t *testing.T) {
	c, h := hungClusterReplacing(t, 30*time.Second, 3*time.Second)
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v, data := writtenVolume(t, c, leader, "failing-source", size, 3, 23)
	h.failReads(v.Replicas[0].Id, v.Replicas[1].Id) // the rebuild's first source, whichever is read first
	spare := spareServer(c, v)
	moveFirstReplica(t, c, leader, v, spare, "the replacement rebuilt from the source that reads")
	target := replicaOn(waitVolume(t, c, leader, v.Id, time.Second, "read", func(*storpb.Volume) bool { return true }), spare.ID)
	evs := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListEventsResponse, error) {
		return c.Client(leader).Cluster.ListEvents(ctx, &storpb.ListEventsRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	})
	for _, ev := range evs.Events {
		if ev.Reason == "ReplicaFaulty" && ev.ReplicaId == target.Id {
			t.Errorf("the target was recorded faulty for a source's error: %s", ev.Message)
		}
	}
	if h.failedReads() == 0 {
		t.Fatal("no read of a source failed: the test tested nothing")
	}
	h.heal()
	requireChecksums(t, c, v.Id, data, "volume rebuilt past a failing source")
}

func allHealthy(v *storpb.Volume) bool {
	return !slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool { return r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY })
}

// TestADamagedReplicaOfADetachedVolumeIsReplaced: a server restarts and
// finds a HEALTHY replica of a detached volume damaged (its metadata
// unreadable); its store keeps it aside, unserved. It stayed HEALTHY in
// the metadata: the volume had a copy fewer than `stor-ctl volume get`
// said until an engine attached it. Now its server records it FAULTY and
// the leader replaces it.
func TestADamagedReplicaOfADetachedVolumeIsReplaced(t *testing.T) {
	c, _ := hungClusterReplacing(t, 30*time.Second, 3*time.Second)
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v, data := writtenVolume(t, c, leader, "damaged-healthy", size, 3, 22)
	var rep *storpb.Replica
	var i int
	for _, r := range v.Replicas {
		if j := slices.IndexFunc(c.Nodes, func(n *servertest.Node) bool { return n.ID == r.ServerId }); j != leader {
			rep, i = r, j
			break
		}
	}
	c.Kill(i)
	if err := os.WriteFile(filepath.Join(c.Nodes[i].Dir, "replicas", rep.Id, "meta.json"), []byte("{garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.Start(i)
	waitVolume(t, c, leader, v.Id, time.Minute, "the damaged replica replaced", func(v *storpb.Volume) bool {
		return len(v.Replicas) == 3 && slices.IndexFunc(v.Replicas, func(r *storpb.Replica) bool { return r.Id == rep.Id }) < 0 && allHealthy(v)
	})
	t.Logf("replaced and rebuilt in %v", time.Since(start).Round(time.Millisecond))
	requireChecksums(t, c, v.Id, data, "volume rebuilt past a damaged replica")
}
