package server

import (
	"bytes"
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/replicatest"
	"github.com/stor-io/stor/replica/wire"
)

// fencedMidCopy is a source replica whose volume is fenced at a newer
// epoch (an attach, a detach, a cut of a snapshot while detached) once
// the clone copy has made after reads of the snapshot's layer.
type fencedMidCopy struct {
	wire.Replica
	after int64
	reads atomic.Int64
	epoch uint64
}

func (f *fencedMidCopy) ReadSnapshotAt(o replica.Op, id string, p []byte, off int64) error {
	err := f.Replica.ReadSnapshotAt(o, id, p, off)
	if f.reads.Add(1) == f.after {
		if ferr := f.Fence(f.epoch); ferr != nil {
			return ferr
		}
	}
	return err
}

// TestACloneCopyGoesOnAtTheSourcesNewEpoch: a clone copy reads the
// snapshot's layer from a source replica at the source volume's epoch.
// When the volume was fenced at a newer epoch during the copy, the
// replica refused the copy's next request and the attempt failed, to
// start over from the first byte: a clone of a volume snapshotted (while
// detached) or attached more often than its copy took never finished.
// The layer does not change: the copy now opens the source again at the
// new epoch and goes on where it was.
func TestACloneCopyGoesOnAtTheSourcesNewEpoch(t *testing.T) {
	const (
		size     = 4 << 20
		oldEpoch = 2
		newEpoch = 3
		snapID   = "snap-1"
	)
	// The source: every other 4 KiB block written, then the snapshot cut
	// at the old epoch, its volume since fenced at the new one.
	srcStore, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer srcStore.Close()
	src, err := srcStore.Create(replica.Spec{ID: "src-r1", VolumeID: "src", Size: size})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Fence(oldEpoch); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, size)
	so := replica.Op{Epoch: oldEpoch, Generation: 1}
	for off := 0; off < size; off += 8192 {
		block := bytes.Repeat([]byte{byte(off>>13) | 1}, 4096)
		copy(want[off:], block)
		if err := src.WriteAt(so, block, int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	layer := replica.LayerName(snapID, oldEpoch)
	if err := src.CreateSnapshot(so, layer); err != nil {
		t.Fatal(err)
	}
	fenced := &fencedMidCopy{Replica: src, after: 100, epoch: newEpoch}
	ws, err := wire.NewServer(wire.BackendFunc(func(id string) (wire.Replica, error) {
		if id != src.ID() {
			return nil, replica.ErrNotFound
		}
		return fenced, nil
	}), wire.ServerConfig{Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go ws.Serve(ln)

	// The cluster's record of the source volume, at the new epoch.
	srcVol := &storpb.Volume{Id: "src", Name: "name-src", SizeBytes: size, Epoch: newEpoch, State: storpb.VolumeState_VOLUME_STATE_AVAILABLE,
		Replicas: []*storpb.Replica{{Id: src.ID(), ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY}}}
	b, err := proto.Marshal(srcVol)
	if err != nil {
		t.Fatal(err)
	}
	f, err := raftstore.OpenFSM(stateFile(t, map[string][]byte{"src": b}, nil), replicatest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	dstStore, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer dstStore.Close()
	dst, err := dstStore.Create(replica.Spec{ID: "clone-r1", VolumeID: "clone", Size: size})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := &Server{cfg: Config{ID: "s1", TaskIOTimeout: 10 * time.Second}, logger: replicatest.Logger(t), ctx: ctx}
	d := &dataPlane{s: s, store: dstStore, view: f.View, catchUp: func(context.Context) error { return nil },
		rebuilding: map[string]bool{}, tasks: map[string]bool{}}

	// The copy starts at the epoch it last saw (the old one).
	atOld := proto.Clone(srcVol).(*storpb.Volume)
	atOld.Epoch = oldEpoch
	snap := &storpb.Snapshot{Id: snapID, Name: "snap", VolumeId: "src", CutEpoch: oldEpoch}
	copied, err := d.copyFrom(ctx, ln.Addr().String(), src.ID(), atOld, snap, dst, replica.Op{Epoch: 1, Generation: 1})
	if err != nil {
		t.Fatalf("clone copy across the source's fence: %v", err)
	}
	// Each extent once, and the read the fenced replica refused.
	if n, extents := fenced.reads.Load(), int64(size/8192); n > extents+1 {
		t.Fatalf("the copy read the layer %d times (fenced after %d of its %d extents): it went back", n, fenced.after, extents)
	}
	got := make([]byte, size)
	if err := dst.ReadAt(replica.Op{Epoch: 1}, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the clone replica does not read as the snapshot")
	}
	t.Logf("copied %d bytes in %d reads of the layer", copied, fenced.reads.Load())
}
