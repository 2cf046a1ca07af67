package server_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// An attached volume's engine rebuilds a new replica in full, records a
// checkpoint, sends two writes that reach only the new replica (one below
// the checkpoint, one above) and dies before it acknowledges them; the
// volume is then detached, and the new replica's server finishes the
// rebuild. It resumed at the checkpoint: the write below it was never
// copied over, the one above was kept by the target's rebuild tracking,
// and the rebuild's flushes cleared both writes' dirty regions, so the
// replica was recorded HEALTHY holding two blocks the others do not (the
// next engine's reads differ by the replica they reach). Now a rebuild
// resumed with no engine's write order resets the target's tracking and
// copies its dirty regions below the checkpoint too. The test is the dead
// engine: it speaks the replica protocol to the new replica as the
// engine's rebuild and writes do.
func TestADetachedRebuildDoesNotResumeADeadEnginesCheckpoint(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
	}})
	leader := c.Leader(10 * time.Second)
	const (
		size       = 4 << 20
		checkpoint = 2 << 20
	)
	v, data := writtenVolume(t, c, leader, "resumed", size, 3, 31)
	vols := c.Client(leader).Volumes
	ref := &storpb.VolumeRef{Id: v.Id}
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
		return vols.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: ref, NodeId: "n1"})
	})
	spare := spareServer(c, v)
	moved := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
		return vols.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: ref, ReplicaId: v.Replicas[0].Id, ServerId: spare.ID})
	}).Volume
	target := replicaOn(moved, spare.ID)
	if target == nil || target.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || moved.Attachment.GetNodeId() != "n1" {
		t.Fatalf("after the move: %v", moved)
	}

	// The engine of n1: its full rebuild copies and flushes everything
	// below the checkpoint, and records it.
	ctx := ctxT(t, 2*time.Minute)
	var conn *wire.Conn
	var h *wire.Handle
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if conn, err = wire.Dial(ctx, "tcp", spare.DataAddr, wire.ClientConfig{}); err == nil {
			h, err = conn.OpenFor(ctx, wire.OpenRequest{Replica: target.Id, Volume: v.Id, Node: "n1", Epoch: moved.Epoch, Purpose: wire.PurposeAttach})
			if err == nil {
				break
			}
			conn.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("open the new replica as n1's engine: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	op := replica.Op{Epoch: moved.Epoch, Generation: moved.Generation}
	if err := h.BeginRebuild(ctx, op); err != nil {
		t.Fatal(err)
	}
	for off := 0; off < checkpoint; off += replica.MaxIO {
		if err := h.RebuildWrite(ctx, op, data[off:min(checkpoint, off+replica.MaxIO)], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Flush(ctx, op); err != nil {
		t.Fatal(err)
	}
	if _, err := vols.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
		VolumeId: v.Id, ReplicaId: target.Id, State: storpb.ReplicaState_REPLICA_STATE_REBUILDING, Epoch: moved.Epoch, Generation: target.Generation,
		RebuildDoneBytes: checkpoint, RebuildTotalBytes: size, RebuildResumeOffset: checkpoint,
	}); err != nil {
		t.Fatal(err)
	}
	// Two writes that reach the new replica only, and the engine dies.
	unacked := bytes.Repeat([]byte{0xd1}, 4096)
	for _, off := range []int64{checkpoint / 4, checkpoint + checkpoint/2} {
		if err := h.WriteAt(ctx, op, unacked, off); err != nil {
			t.Fatal(err)
		}
	}
	conn.Close()

	// Detached, the new replica's server rebuilds it.
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
		return vols.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: ref, NodeId: "n1"})
	})
	waitVolume(t, c, leader, v.Id, time.Minute, "the new replica rebuilt", func(v *storpb.Volume) bool {
		return replicaOn(v, spare.ID).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	requireChecksums(t, c, v.Id, data, "after a detached rebuild of a replica a dead engine had written alone")
}
