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

// cutHarness is a driver on a cluster of three, with a volume's life
// around its engine on node 0: made through CreateVolume, published and
// opened, closed and unpublished (the tests of the cuts' ends).
type cutHarness struct {
	t    *testing.T
	ctx  context.Context
	ctrl csipb.ControllerClient
	cl   *client.Client
	node string
}

// cutSize is the size of the volumes a cutHarness makes.
const cutSize = 1 << 20

func newCutHarness(t *testing.T) *cutHarness {
	t.Helper()
	u := newDriverUnderTest(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return &cutHarness{t: t, ctx: ctx, ctrl: u.ctrl, cl: clusterClient(t, u.c), node: u.c.Nodes[0].ID}
}

func (h *cutHarness) create(name string, src *csipb.VolumeContentSource) string {
	h.t.Helper()
	vol, err := h.ctrl.CreateVolume(h.ctx, &csipb.CreateVolumeRequest{
		Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: cutSize},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, VolumeContentSource: src,
	})
	if err != nil {
		h.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return vol.GetVolume().GetVolumeId()
}

func (h *cutHarness) open(id string, volumes storpb.VolumeServiceClient) *engine.Engine {
	h.t.Helper()
	if _, err := h.ctrl.ControllerPublishVolume(h.ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: h.node, VolumeCapability: rwoCap()}); err != nil {
		h.t.Fatalf("publish %s: %v", id, err)
	}
	e, err := engine.Open(h.ctx, engine.Config{
		Volume: id, VolumeIsID: true, NodeID: h.node,
		Control: engine.ControlPlane{Volumes: volumes, Cluster: h.cl.Cluster, Snapshots: h.cl.Snapshots},
		Connect: engine.WireConnector(wire.ClientConfig{}), Logger: testLogger(h.t),
	})
	if err != nil {
		h.t.Fatalf("engine open %s: %v", id, err)
	}
	return e
}

// readFilled waits until volume id (a clone) is filled, and reads it
// whole through an engine.
func (h *cutHarness) readFilled(id string) []byte {
	h.t.Helper()
	waitFilled(h.t, h.ctx, h.cl, id)
	r := h.open(id, h.cl.Volumes)
	got := make([]byte, cutSize)
	if err := r.ReadAt(h.ctx, got, 0); err != nil {
		h.t.Fatal(err)
	}
	h.closeEngine(id, r)
	return got
}

func (h *cutHarness) closeEngine(id string, e *engine.Engine) {
	h.t.Helper()
	if err := e.Close(h.ctx, false); err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.ctrl.ControllerUnpublishVolume(h.ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: h.node}); err != nil {
		h.t.Fatal(err)
	}
}

// CreateSnapshot returns only once the snapshot is cut: the CO thaws the
// application when it returns, and a write acknowledged after that must
// not be in the snapshot. It used to return as soon as the cluster had
// recorded the snapshot, before the engine, which learns of it through
// its watch, had cut it; a write acknowledged in between was in the
// snapshot.
func TestCreateSnapshotReturnsOnceCut(t *testing.T) {
	h := newCutHarness(t)
	ctx, ctrl, cl := h.ctx, h.ctrl, h.cl
	const size = cutSize
	create, open, closeEngine := h.create, h.open, h.closeEngine

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
	got := h.readFilled(restored)
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

// CreateVolume of a clone from a volume returns only once the snapshot
// the cluster takes of its source is cut: the CO (and the application)
// take the clone for a copy of the source as of the call, and a write
// acknowledged after it returned must not be in the clone. It used to
// return as soon as the cluster had recorded the clone, before the
// engine, which learns of the snapshot through its watch, had cut it.
func TestCreateVolumeFromAVolumeReturnsOnceCut(t *testing.T) {
	h := newCutHarness(t)
	ctx, cl := h.ctx, h.cl
	const size = cutSize
	create, open, closeEngine := h.create, h.open, h.closeEngine

	src := create("pvc-source", nil)
	e := open(src, slowWatch{cl.Volumes, time.Second})
	before, after := bytes.Repeat([]byte{0xa1}, size), bytes.Repeat([]byte{0xb2}, size)
	if err := e.WriteAt(ctx, before, 0, true); err != nil {
		t.Fatal(err)
	}
	clone := create("pvc-clone", &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{
		Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: src}}})
	// The clone is made: the application's next write is acknowledged.
	if err := e.WriteAt(ctx, after, 0, true); err != nil {
		t.Fatal(err)
	}
	closeEngine(src, e)
	got := h.readFilled(clone)
	switch {
	case bytes.Equal(got, after):
		t.Fatal("the clone holds a write acknowledged after CreateVolume returned")
	case !bytes.Equal(got, before):
		t.Fatal("the clone holds neither the data written before it nor after")
	}
}

// A clone whose source's snapshot failed can never be filled: CreateVolume
// deletes it and is INTERNAL (a final error), so no CREATING volume is
// left that no PersistentVolume names.
func TestCreateVolumeFromAVolumeWhoseSnapshotFailed(t *testing.T) {
	u := newDriverUnderTest(t)
	cl := clusterClient(t, u.c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, err := u.ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-src", CapacityRange: &csipb.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{Mode: ModeController, Logger: testLogger(t),
		Cluster: Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: failedSnapshots{cl.Snapshots}}})
	if err != nil {
		t.Fatal(err)
	}
	failing := &controllerServer{d: d}
	_, err = failing.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "pvc-clone", CapacityRange: &csipb.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
		VolumeContentSource: &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{
			Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: vol.GetVolume().GetVolumeId()}}}})
	if code := status.Code(toStatus(err)); code != codes.Internal {
		t.Fatalf("CreateVolume of a clone whose source's snapshot failed: %v (%v), want INTERNAL", err, code)
	}
	if _, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "pvc-clone"}}); status.Code(err) != codes.NotFound {
		t.Fatalf("the clone after CreateVolume failed: %v, want it deleted (NotFound)", err)
	}
}
