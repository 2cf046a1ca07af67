package server

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
	"google.golang.org/protobuf/proto"
)

// fakeMeta is applied metadata: volumes, snapshots and servers by id.
type fakeMeta struct {
	vols    map[string]*storpb.Volume
	snaps   map[string]*storpb.Snapshot
	servers map[string]bool
	addrs   map[string]string // data addresses of servers (optional)
}

func (m *fakeMeta) Volume(id string) (*storpb.Volume, error) {
	if v, ok := m.vols[id]; ok {
		return proto.Clone(v).(*storpb.Volume), nil
	}
	return nil, fmt.Errorf("volume %q: %w", id, raftstore.ErrNotFound)
}

func (m *fakeMeta) Volumes(string, int) ([]*storpb.Volume, string, error) {
	var out []*storpb.Volume
	for _, v := range m.vols {
		out = append(out, proto.Clone(v).(*storpb.Volume))
	}
	return out, "", nil
}

func (m *fakeMeta) Snapshot(id string) (*storpb.Snapshot, error) {
	if s, ok := m.snaps[id]; ok {
		return proto.Clone(s).(*storpb.Snapshot), nil
	}
	return nil, fmt.Errorf("snapshot %q: %w", id, raftstore.ErrNotFound)
}

func (m *fakeMeta) Server(id string) (*storpb.Server, error) {
	if m.servers[id] {
		return &storpb.Server{Id: id, DataAddress: m.addrs[id]}, nil
	}
	return nil, fmt.Errorf("server %q: %w", id, raftstore.ErrNotFound)
}

// laggingAccess is a dataAccess on this server ("s1") whose applied state
// is applied, and whose catchUp applies leader (if set) after delay, or
// fails with catchUpErr.
type laggingAccess struct {
	mu         sync.Mutex
	applied    *fakeMeta
	leader     *fakeMeta
	delay      time.Duration
	catchUpErr error
	catchUps   int
}

func (l *laggingAccess) access() *dataAccess {
	return &dataAccess{
		me: "s1",
		view: func(fn func(metaView) error) error {
			l.mu.Lock()
			defer l.mu.Unlock()
			return fn(l.applied)
		},
		catchUp: func(ctx context.Context) error {
			l.mu.Lock()
			l.catchUps++
			l.mu.Unlock()
			if l.catchUpErr != nil {
				return l.catchUpErr
			}
			select {
			case <-time.After(l.delay):
			case <-ctx.Done():
				return ctx.Err()
			}
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.leader != nil {
				l.applied = l.leader
			}
			return nil
		},
		wait: 2 * time.Second,
	}
}

const testVol = "v1"

// testMeta: volume v1 (16 MiB, epoch 4, generation 7, attached to node-a, snapshot
// snap-1 ready and cut on r1 at epoch 3, snap-2 pending) with replicas r1
// on this server s1 and r2 on s2; clone c1 of snap-1 being filled, with a
// replica on s2.
func testMeta() *fakeMeta {
	v := &storpb.Volume{
		Id: testVol, Name: "vol", SizeBytes: 16 << 20, Epoch: 4, Generation: 7,
		Attachment:         &storpb.Attachment{NodeId: "node-a"},
		PendingSnapshotIds: []string{"snap-2"},
		Replicas: []*storpb.Replica{
			{Id: "r1", ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY},
			{Id: "r2", ServerId: "s2", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY},
		},
	}
	clone := &storpb.Volume{
		Id: "c1", Name: "clone", SizeBytes: 16 << 20, Epoch: 1, State: storpb.VolumeState_VOLUME_STATE_CREATING,
		CloneSnapshotId: "snap-1",
		Replicas:        []*storpb.Replica{{Id: "c1.r0", ServerId: "s2"}},
	}
	cut := []*storpb.SnapshotReplica{{ReplicaId: "r1", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT}}
	return &fakeMeta{
		vols: map[string]*storpb.Volume{testVol: v, "c1": clone},
		snaps: map[string]*storpb.Snapshot{
			"snap-1": {Id: "snap-1", Name: "one", VolumeId: testVol, ReadyToUse: true, CutEpoch: 3, Replicas: cut},
			"snap-2": {Id: "snap-2", Name: "two", VolumeId: testVol},
		},
		servers: map[string]bool{"s1": true, "s2": true},
	}
}

func attachOpen(epoch uint64, node string) wire.OpenRequest {
	return wire.OpenRequest{Replica: "r1", Volume: testVol, Node: node, Epoch: epoch, Purpose: wire.PurposeAttach}
}

// TestDataAccessOpenRules: the OPEN rules of dataauth.go, one case each,
// on a server whose view is current (catching up changes nothing).
func TestDataAccessOpenRules(t *testing.T) {
	detached := testMeta()
	detached.vols[testVol].Attachment = nil
	rebuilding := testMeta()
	rebuilding.vols[testVol].Attachment = nil
	rebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	attachedRebuilding := testMeta() // r2 on s2 rebuilds; r1 here is its source
	attachedRebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	sourceRebuilding := testMeta() // r1 here is not healthy: no one's source
	sourceRebuilding.vols[testVol].Replicas[0].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	sourceRebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	cloneFilling := testMeta() // testVol a clone being filled: r1 not yet
	cloneFilling.vols[testVol].Attachment = nil
	cloneFilling.vols[testVol].State = storpb.VolumeState_VOLUME_STATE_CREATING
	cloneFilling.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	faultySource := testMeta() // r2 on s2 rebuilds; r1 here is faulty
	faultySource.vols[testVol].Attachment = nil
	faultySource.vols[testVol].Replicas[0].State = storpb.ReplicaState_REPLICA_STATE_FAULTY
	faultySource.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	cloneFilled := testMeta()
	cloneFilled.vols[testVol] = proto.Clone(cloneFilling.vols[testVol]).(*storpb.Volume)
	cloneFilled.vols[testVol].CloneDoneReplicaIds = []string{"r1"}
	cloneLost := testMeta() // the clone's replica on s2 was lost with its server's data
	cloneLost.vols["c1"].Replicas[0].ServerRemoved = true
	copySource := func(node string) wire.OpenRequest {
		return wire.OpenRequest{Replica: "r1", Volume: testVol, Node: node, Epoch: 4, Purpose: wire.PurposeRebuildSource}
	}
	for _, tc := range []struct {
		name string
		meta *fakeMeta
		open wire.OpenRequest
		want error // nil: granted
	}{
		{"attach", testMeta(), attachOpen(4, "node-a"), nil},
		{"attach at epoch 2^64-1", testMeta(), attachOpen(1<<64-1, "node-a"), wire.ErrDenied},
		{"attach at the next epoch", testMeta(), attachOpen(5, "node-a"), wire.ErrDenied},
		{"attach at an old epoch", testMeta(), attachOpen(3, "node-a"), replica.ErrStaleEpoch},
		{"attach by another node", testMeta(), attachOpen(4, "node-b"), wire.ErrDenied},
		{"attach of a detached volume", detached, attachOpen(4, "node-a"), wire.ErrDenied},
		{"no purpose", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "node-a", Epoch: 4}, wire.ErrDenied},
		{"no volume", testMeta(), wire.OpenRequest{Replica: "r1", Node: "node-a", Epoch: 4, Purpose: wire.PurposeAttach}, wire.ErrDenied},
		{"unknown volume", testMeta(), wire.OpenRequest{Replica: "r1", Volume: "v9", Node: "node-a", Epoch: 4, Purpose: wire.PurposeAttach}, replica.ErrNotFound},
		{"replica of another volume", testMeta(), wire.OpenRequest{Replica: "c1.r0", Volume: testVol, Node: "node-a", Epoch: 4, Purpose: wire.PurposeAttach}, replica.ErrNotFound},
		{"replica on another server", testMeta(), wire.OpenRequest{Replica: "r2", Volume: testVol, Node: "node-a", Epoch: 4, Purpose: wire.PurposeAttach}, wire.ErrDenied},
		{"rebuild", rebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild}, nil},
		{"rebuild by a server with no rebuilding replica", rebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s1", Epoch: 4, Purpose: wire.PurposeRebuild}, wire.ErrDenied},
		{"rebuild of an attached volume", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild}, wire.ErrDenied},
		{"snapshot cut", detached, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeSnapshotCut}, nil},
		{"snapshot cut by a non-server", detached, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "evil", Epoch: 4, Purpose: wire.PurposeSnapshotCut}, wire.ErrDenied},
		{"snapshot cut of an attached volume", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeSnapshotCut}, wire.ErrDenied},
		{"clone copy", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Snapshot: "snap-1", Epoch: 4, Purpose: wire.PurposeCloneCopy}, nil},
		{"clone copy for a server with no clone", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s1", Snapshot: "snap-1", Epoch: 4, Purpose: wire.PurposeCloneCopy}, wire.ErrDenied},
		{"clone copy for a server whose clone replica was lost", cloneLost, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Snapshot: "snap-1", Epoch: 4, Purpose: wire.PurposeCloneCopy}, wire.ErrDenied},
		{"clone copy of a snapshot not ready", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Snapshot: "snap-2", Epoch: 4, Purpose: wire.PurposeCloneCopy}, wire.ErrDenied},
		{"inspect, unverified", testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Epoch: 4, Purpose: wire.PurposeInspect}, wire.ErrDenied},
		{"rebuild source, attached", attachedRebuilding, copySource("s2"), nil},
		{"rebuild source, attached, the engine's handle not on this server process", attachedRebuilding, copySource("s2"), wire.ErrDenied},
		{"rebuild source, detached", rebuilding, copySource("s2"), nil},
		{"rebuild source for a server with no rebuilding replica", attachedRebuilding, copySource("s3"), wire.ErrDenied},
		{"rebuild source with nothing rebuilding", testMeta(), copySource("s2"), wire.ErrDenied},
		{"rebuild source not healthy", sourceRebuilding, copySource("s2"), wire.ErrDenied},
		{"rebuild reading a clone's replica, filled", cloneFilled, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild}, nil},
		{"rebuild reading a clone's replica, not yet filled", cloneFilling, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild}, wire.ErrDenied},
		{"rebuild reading a faulty replica", faultySource, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild}, wire.ErrDenied},
		{"rebuild source of a clone, filled", cloneFilled, copySource("s2"), nil},
		{"rebuild source of a clone, not yet filled", cloneFilling, copySource("s2"), wire.ErrDenied},
		{"rebuild source at the next epoch", attachedRebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 5, Purpose: wire.PurposeRebuildSource}, wire.ErrDenied},
		{"rebuild source at an old epoch", attachedRebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 3, Purpose: wire.PurposeRebuildSource}, replica.ErrStaleEpoch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &laggingAccess{applied: tc.meta}
			a := l.access()
			// This server process holds the attached engine's handle
			// of r1 at epoch 4, except where the case says not.
			holds := !strings.Contains(tc.name, "not on this server process")
			a.engineHolds = func(id string, epoch uint64) bool { return holds && id == "r1" && epoch == 4 }
			g, err := a.Open(context.Background(), wire.Peer{}, tc.open)
			if tc.want == nil {
				if err != nil || g == nil {
					t.Fatalf("Open = %v, %v; want a grant", g, err)
				}
				return
			}
			if !errors.Is(err, tc.want) || g != nil {
				t.Fatalf("Open = %v, %v; want %v", g, err, tc.want)
			}
		})
	}
}

// TestDataAccessIdentities: a verified identity must match the open.
func TestDataAccessIdentities(t *testing.T) {
	detached := testMeta()
	detached.vols[testVol].Attachment = nil
	cut := wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeSnapshotCut}
	inspect := wire.OpenRequest{Replica: "r1", Volume: testVol, Epoch: 4, Purpose: wire.PurposeInspect}
	rebuilding := testMeta()
	rebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	source := wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuildSource}
	for _, tc := range []struct {
		name string
		meta *fakeMeta
		id   wire.Identity
		open wire.OpenRequest
		ok   bool
	}{
		{"node's own attachment", testMeta(), wire.Identity{Verified: true, Role: "csi-node", Name: "node-a"}, attachOpen(4, "node-a"), true},
		{"node naming another node", testMeta(), wire.Identity{Verified: true, Role: "csi-node", Name: "node-b"}, attachOpen(4, "node-a"), false},
		{"operator attach", testMeta(), wire.Identity{Verified: true, Role: "operator", Name: "ops"}, attachOpen(4, "node-a"), true},
		{"controller attach", testMeta(), wire.Identity{Verified: true, Role: "csi-controller"}, attachOpen(4, "node-a"), false},
		{"server cut as itself", detached, wire.Identity{Verified: true, Role: "server", Name: "s2"}, cut, true},
		{"server cut as another", detached, wire.Identity{Verified: true, Role: "server", Name: "s1"}, cut, false},
		{"node cut", detached, wire.Identity{Verified: true, Role: "csi-node", Name: "s2"}, cut, false},
		{"operator inspects", testMeta(), wire.Identity{Verified: true, Role: "operator"}, inspect, true},
		{"node inspects", testMeta(), wire.Identity{Verified: true, Role: "csi-node", Name: "node-a"}, inspect, false},
		{"server reads a source as itself", rebuilding, wire.Identity{Verified: true, Role: "server", Name: "s2"}, source, true},
		{"server reads a source as another", rebuilding, wire.Identity{Verified: true, Role: "server", Name: "s1"}, source, false},
		{"node reads a source", rebuilding, wire.Identity{Verified: true, Role: "csi-node", Name: "s2"}, source, false},
		{"operator reads a source", rebuilding, wire.Identity{Verified: true, Role: "operator", Name: "s2"}, source, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &laggingAccess{applied: tc.meta}
			_, err := l.access().Open(context.Background(), wire.Peer{Identity: tc.id}, tc.open)
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, wire.ErrDenied)) {
				t.Fatalf("Open by %+v = %v, want ok=%v", tc.id, err, tc.ok)
			}
		})
	}
}

// TestDataAccessWaitsForALaggingFollower: an engine opens its replicas as
// soon as the leader has applied its attach (here a takeover to node-b at
// epoch 5); this server applies it a little later. The open is granted
// once this server has caught up — neither refused for good nor accepted
// before the attach is applied. An epoch the leader has not committed
// either is refused after catching up; and when this server cannot catch
// up, an open above its applied epoch is refused, never accepted blindly.
func TestDataAccessWaitsForALaggingFollower(t *testing.T) {
	leader := testMeta()
	leader.vols[testVol].Epoch = 5
	leader.vols[testVol].Attachment = &storpb.Attachment{NodeId: "node-b"}
	l := &laggingAccess{applied: testMeta(), leader: leader, delay: 100 * time.Millisecond}
	a := l.access()
	start := time.Now()
	if _, err := a.Open(context.Background(), wire.Peer{}, attachOpen(5, "node-b")); err != nil {
		t.Fatalf("open after the takeover, on a follower that applies it late: %v", err)
	}
	if d := time.Since(start); d < l.delay {
		t.Fatalf("granted after %v, before the follower applied the attach", d)
	}
	if _, err := a.Open(context.Background(), wire.Peer{}, attachOpen(4, "node-a")); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("open by the old engine after the takeover: %v, want ErrStaleEpoch", err)
	}
	if _, err := a.Open(context.Background(), wire.Peer{}, attachOpen(6, "node-b")); !errors.Is(err, wire.ErrDenied) {
		t.Fatalf("open above the leader's epoch: %v, want ErrDenied", err)
	}

	cut := &laggingAccess{applied: testMeta(), leader: leader, catchUpErr: raftstore.ErrNoLeader}
	a = cut.access()
	a.wait = 300 * time.Millisecond
	if _, err := a.Open(context.Background(), wire.Peer{}, attachOpen(5, "node-b")); !errors.Is(err, wire.ErrDenied) {
		t.Fatalf("open above the applied epoch on a server that cannot catch up: %v, want ErrDenied", err)
	}
	if cut.catchUps < 2 {
		t.Fatalf("%d catch-ups, want it retried within the wait", cut.catchUps)
	}

	stuck := &laggingAccess{applied: testMeta(), delay: time.Hour}
	a = stuck.access()
	a.wait = 200 * time.Millisecond
	start = time.Now()
	if _, err := a.Open(context.Background(), wire.Peer{}, attachOpen(1<<64-1, "node-a")); !errors.Is(err, wire.ErrDenied) {
		t.Fatalf("open at epoch 2^64-1 with a stuck catch-up: %v, want ErrDenied", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the refusal took %v: the wait is not bounded", d)
	}
}

// TestDataGrantRules: what a granted handle may do.
func TestDataGrantRules(t *testing.T) {
	ctx := context.Background()
	grant := func(meta *fakeMeta, open wire.OpenRequest) *dataGrant {
		t.Helper()
		l := &laggingAccess{applied: meta}
		g, err := l.access().Open(ctx, wire.Peer{}, open)
		if err != nil {
			t.Fatal(err)
		}
		return g.(*dataGrant)
	}
	eng := grant(testMeta(), attachOpen(4, "node-a"))
	clone := grant(testMeta(), wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Snapshot: "snap-1", Epoch: 4, Purpose: wire.PurposeCloneCopy})
	l := &laggingAccess{applied: testMeta()}
	a := l.access()
	a.insecureInspect = true
	ig, err := a.Open(ctx, wire.Peer{}, wire.OpenRequest{Replica: "r1", Volume: testVol, Epoch: 4, Purpose: wire.PurposeInspect})
	if err != nil {
		t.Fatal(err)
	}
	inspect := ig.(*dataGrant)
	rebuilding := testMeta()
	rebuilding.vols[testVol].Attachment = nil
	rebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	source := grant(rebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuild})
	target := testMeta()
	target.vols[testVol].Attachment = nil
	target.vols[testVol].Replicas[0].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	rebuild := grant(target, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s1", Epoch: 4, Purpose: wire.PurposeRebuild})
	attachedRebuilding := testMeta()
	attachedRebuilding.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	copySource := grant(attachedRebuilding, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuildSource})
	for _, tc := range []struct {
		name string
		g    *dataGrant
		r    wire.Request
		ok   bool
	}{
		{"write", eng, wire.Request{Op: wire.OpWrite, Epoch: 4}, true},
		{"write above the handle's epoch", eng, wire.Request{Op: wire.OpWrite, Epoch: 1<<64 - 1}, false},
		{"write at the volume's generation", eng, wire.Request{Op: wire.OpWrite, Epoch: 4, Generation: 7}, true},
		{"write above the volume's generation", eng, wire.Request{Op: wire.OpWrite, Epoch: 4, Generation: 8}, false},
		{"write at generation 2^64-1", eng, wire.Request{Op: wire.OpWrite, Epoch: 4, Generation: 1<<64 - 1}, false},
		{"grow to the volume's size", eng, wire.Request{Op: wire.OpGrow, Epoch: 4, Len: 16 << 20}, true},
		{"grow to 1 PiB", eng, wire.Request{Op: wire.OpGrow, Epoch: 4, Len: 1 << 50}, false},
		{"cut a pending snapshot", eng, wire.Request{Op: wire.OpSnapshotCreate, Epoch: 4, ID: replica.LayerName("snap-2", 4)}, true},
		{"cut at another epoch", eng, wire.Request{Op: wire.OpSnapshotCreate, Epoch: 4, ID: replica.LayerName("snap-2", 9)}, false},
		{"cut a snapshot not pending", eng, wire.Request{Op: wire.OpSnapshotCreate, Epoch: 4, ID: replica.LayerName("snap-9", 4)}, false},
		{"delete a ready layer", eng, wire.Request{Op: wire.OpSnapshotDelete, Epoch: 4, ID: replica.LayerName("snap-1", 3)}, false},
		{"delete a stray layer", eng, wire.Request{Op: wire.OpSnapshotDelete, Epoch: 4, ID: replica.LayerName("snap-1", 2)}, true},
		{"delete a deleted snapshot's layer", eng, wire.Request{Op: wire.OpSnapshotDelete, Epoch: 4, ID: replica.LayerName("snap-7", 2)}, true},
		{"read a listed snapshot", eng, wire.Request{Op: wire.OpSnapshotRead, Epoch: 4, ID: replica.LayerName("snap-1", 3)}, true},
		{"read an unlisted snapshot", eng, wire.Request{Op: wire.OpSnapshotRead, Epoch: 4, ID: replica.LayerName("snap-7", 3)}, false},
		{"read a non-layer", eng, wire.Request{Op: wire.OpExtents, Epoch: 4, ID: "junk"}, false},
		{"extents of the head", eng, wire.Request{Op: wire.OpExtents, Epoch: 4}, true},
		{"clone reads its snapshot", clone, wire.Request{Op: wire.OpSnapshotRead, Epoch: 4, ID: replica.LayerName("snap-1", 3)}, true},
		{"clone lists its snapshot", clone, wire.Request{Op: wire.OpExtents, Epoch: 4, ID: replica.LayerName("snap-1", 3)}, true},
		{"clone reads the head", clone, wire.Request{Op: wire.OpRead, Epoch: 4}, false},
		{"clone lists the head", clone, wire.Request{Op: wire.OpExtents, Epoch: 4}, false},
		{"clone writes", clone, wire.Request{Op: wire.OpWrite, Epoch: 4}, false},
		{"inspection reads an unlisted layer", inspect, wire.Request{Op: wire.OpSnapshotRead, Epoch: 4, ID: replica.LayerName("snap-7", 3)}, true},
		{"inspection writes", inspect, wire.Request{Op: wire.OpWrite, Epoch: 4}, false},
		{"inspection lists dirty regions", inspect, wire.Request{Op: wire.OpDirtyRegions, Epoch: 4}, false},
		{"rebuild writes its target", rebuild, wire.Request{Op: wire.OpRebuildWrite, Epoch: 4}, true},
		{"rebuild flushes its target", rebuild, wire.Request{Op: wire.OpFlush, Epoch: 4}, true},
		{"rebuild plain-writes its target", rebuild, wire.Request{Op: wire.OpWrite, Epoch: 4}, false},
		{"rebuild zeroes its target", rebuild, wire.Request{Op: wire.OpWriteZeroes, Epoch: 4}, false},
		{"rebuild reads a source", source, wire.Request{Op: wire.OpRead, Epoch: 4}, true},
		{"rebuild lists a source's history", source, wire.Request{Op: wire.OpWrittenSince, Epoch: 4}, true},
		{"rebuild writes a source", source, wire.Request{Op: wire.OpRebuildWrite, Epoch: 4}, false},
		{"rebuild begins on a source", source, wire.Request{Op: wire.OpRebuildBegin, Epoch: 4}, false},
		{"rebuild grows", rebuild, wire.Request{Op: wire.OpGrow, Epoch: 4, Len: 1 << 20}, false},
		{"rebuild deletes a snapshot", rebuild, wire.Request{Op: wire.OpSnapshotDelete, Epoch: 4, ID: replica.LayerName("snap-7", 2)}, false},
		{"rebuild has its target copy", rebuild, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, true},
		{"rebuild has a source copy", source, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, false},
		{"engine has its rebuild target copy", eng, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, true},
		{"clone copy has its replica copy", clone, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, false},
		{"inspection has its replica copy", inspect, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, false},
		{"a copy's source is read", copySource, wire.Request{Op: wire.OpRead, Epoch: 4}, true},
		{"a copy's source read above its epoch", copySource, wire.Request{Op: wire.OpRead, Epoch: 5}, false},
		{"a copy's source is written", copySource, wire.Request{Op: wire.OpWrite, Epoch: 4}, false},
		{"a copy's source is rebuild-written", copySource, wire.Request{Op: wire.OpRebuildWrite, Epoch: 4}, false},
		{"a copy's source lists its extents", copySource, wire.Request{Op: wire.OpExtents, Epoch: 4}, false},
		{"a copy's source has its snapshot read", copySource, wire.Request{Op: wire.OpSnapshotRead, Epoch: 4, ID: replica.LayerName("snap-1", 3)}, false},
		{"a copy's source is flushed", copySource, wire.Request{Op: wire.OpFlush, Epoch: 4}, false},
		{"a copy's source copies", copySource, wire.Request{Op: wire.OpRebuildCopy, Epoch: 4, ID: "r2"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.g.Allow(ctx, tc.r)
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, wire.ErrDenied)) {
				t.Fatalf("Allow(%+v) = %v, want ok=%v", tc.r, err, tc.ok)
			}
		})
	}
}
