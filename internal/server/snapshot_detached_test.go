package server_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// writeOneReplica writes p at off to replica replicaID of v only, over the
// data protocol at epoch, opened as the engine of v's attachment (as an
// engine's write that reached one replica before the engine died).
func writeOneReplica(t *testing.T, c *servertest.Cluster, v *storpb.Volume, replicaID string, epoch uint64, p []byte, off int64) {
	t.Helper()
	ctx := ctxT(t, 20*time.Second)
	servers := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(0).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	var addr string
	var inc uint64
	for _, r := range v.Replicas {
		for _, s := range servers.Servers {
			if r.Id == replicaID && s.Id == r.ServerId {
				addr, inc = s.DataAddress, r.Generation
			}
		}
	}
	conn, err := wire.Dial(ctx, "tcp", addr, wire.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h, err := conn.OpenFor(ctx, wire.OpenRequest{
		Replica: replicaID, Volume: v.Id, Node: v.GetAttachment().GetNodeId(), Epoch: epoch, Purpose: wire.PurposeAttach,
		Incarnation: inc, // the engine's own (wire's doc, "Incarnations")
	})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if err := h.WriteAt(ctx, replica.Op{Epoch: epoch, Generation: v.Generation}, p, off); err != nil {
		t.Fatalf("write to replica %s alone: %v", replicaID, err)
	}
}

func detach(t *testing.T, c *servertest.Cluster, from int, volumeID, node string) *storpb.Volume {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
		return c.Client(from).Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}, NodeId: node})
	}).Volume
}

// requireOneCutPoint reads snapshot s's layer from every replica that
// cut it and fails unless they all hold the same bytes; it returns them.
func requireOneCutPoint(t *testing.T, c *servertest.Cluster, v *storpb.Volume, s *storpb.Snapshot) []byte {
	t.Helper()
	var first []byte
	var firstID string
	for _, r := range s.Replicas {
		if r.State != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
			continue
		}
		data, err := c.ReadSnapshot(v.Id, replica.LayerName(s.Id, s.CutEpoch), r.ReplicaId, s.SizeBytes)
		if err != nil {
			t.Fatalf("read snapshot layer of %s: %v", r.ReplicaId, err)
		}
		if first == nil {
			first, firstID = data, r.ReplicaId
			continue
		}
		if !bytes.Equal(data, first) {
			for off := 0; off < len(data); off += snapBlock {
				if !bytes.Equal(data[off:off+snapBlock], first[off:off+snapBlock]) {
					t.Fatalf("replica %s's snapshot differs from %s's at %d: the replicas were cut at different points", r.ReplicaId, firstID, off)
				}
			}
		}
	}
	if first == nil {
		t.Fatalf("no replica cut the snapshot: %v", s)
	}
	return first
}

// TestSnapshotDetachedAfterUncleanStopCutsOnePoint: an engine died with a
// write applied on one replica only (a dirty region the others lack), and
// the volume was then detached. A snapshot of it is cut only after the
// replicas were fenced and that region reconciled: every replica's layer
// holds the same bytes, and so do their heads.
func TestSnapshotDetachedAfterUncleanStopCutsOnePoint(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v := createVolume(t, c.Client(leader), "unclean", size, 3)
	ctx := ctxT(t, 2*time.Minute)
	base := make([]byte, size)
	for b := uint64(0); b < size/snapBlock; b++ {
		copy(base[b*snapBlock:], blockData(b, 1))
	}
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, base, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// The engine's last write reached one replica, then its node died; the
	// orchestrator detaches the volume from the lost node.
	v = getVolume(t, c, leader, v.Id)
	writeOneReplica(t, c, v, v.Replicas[0].Id, e.Epoch(), blockData(7, 2), 7*snapBlock)
	detached := detach(t, c, leader, v.Id, "node-1")
	if detached.Epoch <= e.Epoch() {
		t.Fatalf("detach left the epoch at %d; the engine holds %d", detached.Epoch, e.Epoch())
	}

	s := createSnapshot(t, c, leader, v.Id, "after-unclean-stop")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if cutCount(s) != 3 {
		t.Fatalf("snapshot cut on %d replicas, want 3: %v", cutCount(s), s)
	}
	data := requireOneCutPoint(t, c, v, s)
	if g, ok := decodeBlock(data[7*snapBlock:8*snapBlock], 7); !ok || (g != 1 && g != 2) {
		t.Fatalf("block 7 in the snapshot is neither the acknowledged write nor the unacknowledged one (generation %d, whole %v)", g, ok)
	}
	want := bytes.Clone(base)
	copy(want[7*snapBlock:], data[7*snapBlock:8*snapBlock])
	if !bytes.Equal(data, want) {
		t.Fatal("the snapshot lacks acknowledged writes")
	}
	requireChecksums(t, c, v.Id, want, "heads after the detached cut")
}

// blindWatch hides the volume's changes from an engine, as for an engine
// on a node cut off from the control plane.
type blindWatch struct{ storpb.VolumeServiceClient }

func (blindWatch) WatchVolume(ctx context.Context, _ *storpb.WatchVolumeRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[storpb.VolumeEvent], error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestSnapshotDetachedFencesAZombieEngine: an engine that never learns of
// its detach (a zombie) keeps writing. The detach raises the epoch, every
// server fences its replica at it, and the zombie's writes are refused
// soon after; a snapshot of the detached volume then holds one point on
// every replica: every write the zombie had acknowledged, and of the write
// that was refused at most that one, on every replica alike.
func TestSnapshotDetachedFencesAZombieEngine(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	const blocks = 16
	v := createVolume(t, c.Client(leader), "zombie", size, 3)
	cfg := c.EngineConfig(v.Name, "node-1")
	cfg.Control.Volumes = blindWatch{cfg.Control.Volumes}
	z := c.OpenEngine(cfg)
	ctx := ctxT(t, 2*time.Minute)
	acked := map[uint64]uint64{} // block -> generation acknowledged last
	for b := uint64(0); b < blocks; b++ {
		if err := z.WriteAt(ctx, blockData(b, 1), int64(b*snapBlock), false); err != nil {
			t.Fatal(err)
		}
		acked[b] = 1
	}
	detach(t, c, leader, v.Id, "node-1")

	// The zombie writes on; within a few seconds every write is refused.
	refusedBlock, refusedGen := uint64(0), uint64(0)
	deadline := time.Now().Add(10 * time.Second)
	for k := uint64(2); ; k++ {
		b := k % blocks
		err := z.WriteAt(ctx, blockData(b, k), int64(b*snapBlock), false)
		if err == nil {
			acked[b] = k
			if time.Now().After(deadline) {
				t.Fatalf("the zombie's writes are still acknowledged %v after the detach (write %d)", 10*time.Second, k)
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if !errors.Is(err, engine.ErrFenced) {
			t.Fatalf("zombie write %d: %v, want ErrFenced", k, err)
		}
		refusedBlock, refusedGen = b, k
		break
	}
	if err := z.WriteAt(ctx, blockData(0, 999), 0, false); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("zombie write after it was fenced: %v", err)
	}

	s := createSnapshot(t, c, leader, v.Id, "zombie")
	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if cutCount(s) != 3 {
		t.Fatalf("snapshot cut on %d replicas, want 3: %v", cutCount(s), s)
	}
	data := requireOneCutPoint(t, c, v, s)
	for b := uint64(0); b < blocks; b++ {
		g, ok := decodeBlock(data[b*snapBlock:(b+1)*snapBlock], b)
		switch {
		case !ok:
			t.Errorf("block %d in the snapshot is not one whole write", b)
		case g == acked[b]:
		case b == refusedBlock && g == refusedGen:
			t.Logf("the refused write to block %d reached a replica before its fence and was reconciled onto all", b)
		default:
			t.Errorf("block %d in the snapshot holds write %d; the zombie's last acknowledged write there was %d", b, g, acked[b])
		}
	}
}

// TestSnapshotDetachedRacingAnAttach: snapshots of a detached volume are
// requested just before the volume is attached and written. Whichever
// wins (the detached cut, refused by the attach's epoch, or the attached
// engine's cut), the attach and the writes succeed, and each snapshot
// becomes ready at one point on every replica that cut it.
func TestSnapshotDetachedRacingAnAttach(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v := createVolume(t, c.Client(leader), "race", size, 3)
	ctx := ctxT(t, 3*time.Minute)
	for round := uint64(1); round <= 3; round++ {
		s := createSnapshot(t, c, leader, v.Id, "race-"+string(rune('0'+round)))
		if round > 1 {
			time.Sleep(time.Duration(round-2) * 20 * time.Millisecond) // vary who wins
		}
		e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
		for b := uint64(0); b < 8; b++ {
			if err := e.WriteAt(ctx, blockData(b, round), int64(b*snapBlock), false); err != nil {
				t.Fatalf("round %d: write: %v", round, err)
			}
		}
		s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
		if !s.ReadyToUse || cutCount(s) == 0 {
			t.Fatalf("round %d: snapshot %v", round, s)
		}
		data := requireOneCutPoint(t, c, v, s)
		for b := uint64(0); b < 8; b++ {
			if g, ok := decodeBlock(data[b*snapBlock:(b+1)*snapBlock], b); ok && g != round && g != round-1 {
				t.Fatalf("round %d: block %d in the snapshot holds round %d's write", round, b, g)
			}
		}
		if err := e.Close(ctx, true); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
	}
}

// crashingCut makes a detached cut die half-way, as its server would if
// killed: it cuts only replica survivor, and its control plane answers
// nothing (so no fault and no cut is ever recorded).
type crashingCut struct {
	survivor string
}

type cutter interface {
	CreateSnapshot(ctx context.Context, o replica.Op, id string) error
}

type crashingConn struct {
	engine.ReplicaConn
	id       string
	survivor string
}

func (c crashingConn) CreateSnapshot(ctx context.Context, o replica.Op, id string) error {
	if c.id != c.survivor {
		return errors.New("injected: the cutting server died")
	}
	return c.ReplicaConn.(cutter).CreateSnapshot(ctx, o, id)
}

func (cc crashingCut) connect(next engine.Connector) engine.Connector {
	return func(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
		c, err := next(ctx, addr, open)
		if err != nil {
			return nil, err
		}
		return crashingConn{c, open.Replica, cc.survivor}, nil
	}
}

type deadVolumes struct{ storpb.VolumeServiceClient }

func (deadVolumes) SetReplicaState(ctx context.Context, _ *storpb.SetReplicaStateRequest, _ ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	return nil, status.Error(codes.Unavailable, "injected: the cutting server died")
}

type deadSnapshots struct{ storpb.SnapshotServiceClient }

func (deadSnapshots) RecordSnapshotCut(ctx context.Context, _ *storpb.RecordSnapshotCutRequest, _ ...grpc.CallOption) (*storpb.RecordSnapshotCutResponse, error) {
	return nil, status.Error(codes.Unavailable, "injected: the cutting server died")
}

// TestSnapshotDetachedCutDyingHalfWay: a detached cut fences the volume,
// cuts one replica and dies before recording anything (its server was
// killed). The servers' own cut then fences anew and cuts every replica at
// one point; the dead cut's layer, at an epoch the volume has left, is
// merged away. (The servers' cut may also start first or meanwhile: it
// then fences the dying one. Either way the end state is the same.)
func TestSnapshotDetachedCutDyingHalfWay(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	const size = 1 << 20
	v := createVolume(t, c.Client(leader), "dying-cut", size, 3)
	ctx := ctxT(t, 2*time.Minute)
	base := make([]byte, size)
	for b := uint64(0); b < size/snapBlock; b++ {
		copy(base[b*snapBlock:], blockData(b, 1))
	}
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	if err := e.WriteAt(ctx, base, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	v = getVolume(t, c, leader, v.Id)
	survivor := v.Replicas[2].Id
	// The engine dies with a write on one replica only, so cuts at
	// different points would differ.
	writeOneReplica(t, c, v, survivor, e.Epoch(), blockData(3, 2), 3*snapBlock)
	s := createSnapshot(t, c, leader, v.Id, "dying-cut") // cut by no one: the volume is attached
	detach(t, c, leader, v.Id, "node-1")

	cfg := c.EngineConfig(v.Id, "a-server")
	cfg.VolumeIsID = true
	cfg.Connect = crashingCut{survivor}.connect(cfg.Connect)
	cfg.Control.Volumes = deadVolumes{cfg.Control.Volumes}
	cfg.Control.Snapshots = deadSnapshots{cfg.Control.Snapshots}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	start := time.Now()
	err := engine.CutDetached(dctx, cfg)
	cancel()
	t.Logf("the dying cut: %v (after %v)", err, time.Since(start).Round(time.Millisecond))
	// The cut's context bounds it: a dying server must not wait out the
	// engine's FaultTimeout (2 minutes) to report replicas it cannot reach.
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("the dying cut returned %v after its 5 s context ended, want it to give up with its context", took)
	}
	if err == nil {
		t.Log("the servers' cut got in first; the dying cut found nothing to do")
	}

	s = waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if cutCount(s) != 3 {
		t.Fatalf("snapshot cut on %d replicas, want 3: %v", cutCount(s), s)
	}
	requireOneCutPoint(t, c, v, s)
	// Every layer of this snapshot but the recorded one is merged away.
	deadline := time.Now().Add(30 * time.Second)
	for epoch := uint64(1); epoch < s.CutEpoch; epoch++ {
		for _, r := range v.Replicas {
			for {
				_, err := c.ReadSnapshot(v.Id, replica.LayerName(s.Id, epoch), r.Id, s.SizeBytes)
				if errors.Is(err, replica.ErrNotFound) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("replica %s still has an unrecorded layer of the snapshot cut at epoch %d (read: %v)", r.Id, epoch, err)
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
}
