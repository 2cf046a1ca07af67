package csi

import (
	"bytes"
	"context"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// slowWatch delays every event of its volume watches: an engine whose
// watch lags (a re-watch after a broken stream, a busy leader).
type slowWatch struct {
	storpb.VolumeServiceClient
	delay time.Duration
}

func (w slowWatch) WatchVolume(ctx context.Context, in *storpb.WatchVolumeRequest, opts ...grpc.CallOption) (storpb.VolumeService_WatchVolumeClient, error) {
	st, err := w.VolumeServiceClient.WatchVolume(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	return slowStream{st, w.delay}, nil
}

type slowStream struct {
	storpb.VolumeService_WatchVolumeClient
	delay time.Duration
}

func (s slowStream) Recv() (*storpb.VolumeEvent, error) {
	ev, err := s.VolumeService_WatchVolumeClient.Recv()
	time.Sleep(s.delay)
	return ev, err
}

// CreateSnapshot returns only once the snapshot is cut: the CO thaws the
// application when it returns, and a write acknowledged after that must
// not be in the snapshot. It used to return as soon as the cluster had
// recorded the snapshot, before the engine, which learns of it through
// its watch, had cut it; a write acknowledged in between was in the
// snapshot.
func TestCreateSnapshotReturnsOnceCut(t *testing.T) {
	u := newDriverUnderTest(t)
	ctrl, c := u.ctrl, u.c
	cl := clusterClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	node := c.Nodes[0].ID
	const size = 1 << 20
	create := func(name string, src *csipb.VolumeContentSource) string {
		t.Helper()
		vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, VolumeContentSource: src,
		})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		return vol.GetVolume().GetVolumeId()
	}
	open := func(id string, volumes storpb.VolumeServiceClient) *engine.Engine {
		t.Helper()
		if _, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: rwoCap()}); err != nil {
			t.Fatalf("publish %s: %v", id, err)
		}
		e, err := engine.Open(ctx, engine.Config{
			Volume: id, VolumeIsID: true, NodeID: node,
			Control: engine.ControlPlane{Volumes: volumes, Cluster: cl.Cluster, Snapshots: cl.Snapshots},
			Connect: engine.WireConnector(wire.ClientConfig{}), Logger: testLogger(t),
		})
		if err != nil {
			t.Fatalf("engine open %s: %v", id, err)
		}
		return e
	}
	closeEngine := func(id string, e *engine.Engine) {
		t.Helper()
		if err := e.Close(ctx, false); err != nil {
			t.Fatal(err)
		}
		if _, err := ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node}); err != nil {
			t.Fatal(err)
		}
	}

	id := create("pvc-frozen", nil)
	e := open(id, slowWatch{cl.Volumes, time.Second})
	before, after := bytes.Repeat([]byte{0xa1}, size), bytes.Repeat([]byte{0xb2}, size)
	if err := e.WriteAt(ctx, before, 0, true); err != nil {
		t.Fatal(err)
	}
	snap, err := ctrl.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: id, Name: "snap-frozen"})
	if err != nil {
		t.Fatal(err)
	}
	// The application is thawed: its next write is acknowledged.
	if err := e.WriteAt(ctx, after, 0, true); err != nil {
		t.Fatal(err)
	}
	if !snap.GetSnapshot().GetReadyToUse() {
		t.Error("CreateSnapshot returned before the snapshot was cut (not ready to use)")
	}
	snapID := snap.GetSnapshot().GetSnapshotId()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		got, err := cl.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: snapID}})
		if err != nil {
			t.Fatal(err)
		}
		if got.GetSnapshot().GetReadyToUse() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the snapshot is not ready after 30 s: %v", got.GetSnapshot())
		}
	}
	closeEngine(id, e)

	restored := create("pvc-thawed", &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
		Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}})
	waitFilled(t, ctx, cl, restored)
	r := open(restored, cl.Volumes)
	got := make([]byte, size)
	if err := r.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	closeEngine(restored, r)
	switch {
	case bytes.Equal(got, after):
		t.Fatal("the snapshot holds a write acknowledged after CreateSnapshot returned")
	case !bytes.Equal(got, before):
		t.Fatal("the snapshot holds neither the data written before it nor after")
	}
}

// failedSnapshots reports every snapshot failed once the cluster has
// recorded it (as if no replica could cut it).
type failedSnapshots struct{ storpb.SnapshotServiceClient }

func (f failedSnapshots) GetSnapshot(ctx context.Context, in *storpb.GetSnapshotRequest, opts ...grpc.CallOption) (*storpb.GetSnapshotResponse, error) {
	r, err := f.SnapshotServiceClient.GetSnapshot(ctx, in, opts...)
	if err == nil {
		r.Snapshot.ReadyToUse, r.Snapshot.Failed, r.Snapshot.StatusMessage = false, true, "test: no replica could cut it"
	}
	return r, err
}

// The two ends of CreateSnapshot's wait that are not a cut: a snapshot
// that failed is deleted and the call is INTERNAL (a final error), so no
// record is left that no VolumeSnapshotContent names (the first version
// of the wait left it); a snapshot not cut by the time the call's time is
// nearly up (an attached volume whose engine is gone) is answered not
// ready to use, not with an error, which would keep csi-snapshotter from
// ever deleting its VolumeSnapshot.
func TestCreateSnapshotThatIsNotCut(t *testing.T) {
	u := newDriverUnderTest(t)
	cl := clusterClient(t, u.c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, err := u.ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-uncut", CapacityRange: &csipb.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()

	d, err := New(Config{Mode: ModeController, Logger: testLogger(t),
		Cluster: Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: failedSnapshots{cl.Snapshots}}})
	if err != nil {
		t.Fatal(err)
	}
	failing := &controllerServer{d: d}
	_, err = failing.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: id, Name: "snap-failed"})
	if code := status.Code(toStatus(err)); code != codes.Internal {
		t.Fatalf("CreateSnapshot of a snapshot that failed: %v (%v), want INTERNAL", err, code)
	}
	if _, err := cl.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Name: "snap-failed"}}); status.Code(err) != codes.NotFound {
		t.Fatalf("the failed snapshot after CreateSnapshot answered: %v, want it deleted (NotFound)", err)
	}

	// Attached, its engine gone: nothing cuts it.
	if _, err := u.ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: u.c.Nodes[0].ID, VolumeCapability: rwoCap()}); err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, snapshotCutMargin+time.Second)
	defer cancelShort()
	snap, err := u.ctrl.CreateSnapshot(short, &csipb.CreateSnapshotRequest{SourceVolumeId: id, Name: "snap-uncut"})
	if err != nil {
		t.Fatalf("CreateSnapshot of a snapshot nothing cuts: %v, want it answered not ready to use", err)
	}
	if snap.GetSnapshot().GetReadyToUse() || snap.GetSnapshot().GetSnapshotId() == "" {
		t.Fatalf("CreateSnapshot of a snapshot nothing cuts: %v, want a snapshot id, not ready to use", snap.GetSnapshot())
	}
}

// waitFilled waits up to 30 s for volume id, restored from a snapshot or
// cloned, to be filled (AVAILABLE).
func waitFilled(t *testing.T, ctx context.Context, cl *client.Client, id string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		v, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
		if err != nil {
			t.Fatal(err)
		}
		if v.GetVolume().GetState() == storpb.VolumeState_VOLUME_STATE_AVAILABLE {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("volume %s is not filled after 30 s: %v", id, v.GetVolume())
		}
	}
}
