package server

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
	"github.com/stor-io/stor/replica/wire"
)

// TestClusterViewReadOncePerAppliedIndex: the reconcile's read of the
// cluster is reused while the state machine applies nothing, and read
// again after it applies an entry.
func TestClusterViewReadOncePerAppliedIndex(t *testing.T) {
	f, err := raftstore.OpenFSM(filepath.Join(t.TempDir(), "meta.db"), replicatest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	reads := 0
	view := func(fn func(*raftstore.Reader) error) error {
		reads++
		return f.View(fn)
	}
	apply := func(index uint64) {
		t.Helper()
		f.ApplyBatch([]*raft.Log{{Index: index, Term: 1, Type: raft.LogNoop}})
	}
	v0, err := readClusterView(view, nil, "s1")
	if err != nil {
		t.Fatal(err)
	}
	// Nothing applied yet (index 0): never taken for the same state.
	if v, err := readClusterView(view, v0, "s1"); err != nil || v == v0 {
		t.Fatalf("a view at applied index 0 was reused (%v)", err)
	}
	apply(1)
	v1, err := readClusterView(view, v0, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if v1 == v0 || v1.index != 1 {
		t.Fatalf("after an entry applied: view at index %d, reused %v", v1.index, v1 == v0)
	}
	for range 3 {
		if v, err := readClusterView(view, v1, "s1"); err != nil || v != v1 {
			t.Fatalf("nothing applied since: a new view was read (%v)", err)
		}
	}
	apply(2)
	if v, err := readClusterView(view, v1, "s1"); err != nil || v == v1 || v.index != 2 {
		t.Fatalf("after another entry: the view at index %d was reused (%v)", v1.index, err)
	}
	if reads != 7 {
		t.Errorf("%d transactions, want 7 (each read looks at the applied index in one)", reads)
	}
}

// stateAndStore opens the state machine of the file at path and an empty
// replica store, both closed when the test ends.
func stateAndStore(t *testing.T, path string) (*raftstore.FSM, *replica.Store) {
	t.Helper()
	f, err := raftstore.OpenFSM(path, replicatest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	store, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	return f, store
}

// stateFile writes a state machine's file holding vols and snaps (raw
// encoded records: a test may give one that does not decode), one
// server s1, at applied index 5.
func stateFile(t *testing.T, vols, snaps map[string][]byte) string {
	t.Helper()
	return stateFileFor(t, &storpb.Server{Id: "s1", State: storpb.ServerState_SERVER_STATE_UP}, vols, snaps)
}

// stateFileFor is stateFile with srv for s1's record.
func stateFileFor(t *testing.T, s1 *storpb.Server, vols, snaps map[string][]byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "meta.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := proto.Marshal(s1)
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range []string{"meta", "servers", "volumes", "volume_names", "snapshots", "snapshot_names", "nodes", "events", "volume_snapshots"} {
			if _, err := tx.CreateBucket([]byte(b)); err != nil {
				return err
			}
		}
		tx.Bucket([]byte("meta")).Put([]byte("applied_index"), binary.BigEndian.AppendUint64(nil, 5))
		tx.Bucket([]byte("servers")).Put([]byte("s1"), srv)
		for id, v := range vols {
			tx.Bucket([]byte("volumes")).Put([]byte(id), v)
			tx.Bucket([]byte("volume_names")).Put([]byte("name-"+id), []byte(id))
		}
		for id, v := range snaps {
			tx.Bucket([]byte("snapshots")).Put([]byte(id), v)
			k := append(binary.AppendUvarint(nil, 2), "v1"+id...)
			tx.Bucket([]byte("volume_snapshots")).Put(k, nil)
		}
		return nil
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// TestReconcileOfAPartialReadDeletesNothing: a reconcile whose read of
// the cluster stops at an undecodable record creates and fences the
// replicas of the volumes it read (moving forward is safe) and deletes
// none: it used to ignore the failure, take every local replica of a
// volume after the bad record for one no longer placed here, and delete
// it. A bad snapshot record stops no fencing either.
func TestReconcileOfAPartialReadDeletesNothing(t *testing.T) {
	vol := func(id, rep string) []byte {
		b, err := proto.Marshal(&storpb.Volume{Id: id, Name: "name-" + id, SizeBytes: 1 << 20, Epoch: 3,
			State:    storpb.VolumeState_VOLUME_STATE_AVAILABLE,
			Replicas: []*storpb.Replica{{Id: rep, ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY}}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	bad := []byte{0xff}
	for _, tc := range []struct {
		name        string
		vols, snaps map[string][]byte
	}{
		{"an undecodable volume", map[string][]byte{"v1": vol("v1", "r1"), "v2": bad, "v3": vol("v3", "r3")}, nil},
		{"an undecodable snapshot", map[string][]byte{"v1": vol("v1", "r1"), "v3": vol("v3", "r3")}, map[string][]byte{"s1": bad}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, store := stateAndStore(t, stateFile(t, tc.vols, tc.snaps))
			r1, err := store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := store.Create(replica.Spec{ID: "r3", VolumeID: "v3", Size: 1 << 20}); err != nil {
				t.Fatal(err)
			}
			d := testDataPlane(t, store, f)
			d.reconcile()
			if _, err := store.Get("r3"); err != nil {
				t.Errorf("replica r3, of a volume the read did not reach: %v", err)
			}
			if got := r1.Epoch(); got != 3 {
				t.Errorf("replica r1 of a volume read (epoch 3) is at epoch %d after the reconcile", got)
			}
			if d.last != nil {
				t.Errorf("a partial read was kept for reuse")
			}
		})
	}
}

// TestADeletedReplicaIsForgottenByTheDataPort: the data port keeps, per
// replica, the order of its attach handles (wire's "Incarnations"); a
// replica the reconcile deletes must take its order with it, or a server
// keeps one for every replica ever attached to it for as long as it runs.
// So must one whose delete failed after it left the store (its directory
// renamed, the directory's sync failing): no later reconcile lists it.
func TestADeletedReplicaIsForgottenByTheDataPort(t *testing.T) {
	for _, syncFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("sync-fails=%v", syncFails), func(t *testing.T) {
			testDeletedReplicaForgotten(t, syncFails)
		})
	}
}

// testDataPlane is server s1's data plane over store, reading the cluster
// from f, always caught up; its context ends with the test.
func testDataPlane(t *testing.T, store *replica.Store, f *raftstore.FSM) *dataPlane {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := &Server{cfg: Config{ID: "s1"}, logger: replicatest.Logger(t), ctx: ctx}
	return &dataPlane{s: s, store: store, wire: storeWire(t, store), rebuilding: map[string]bool{}, tasks: map[string]bool{},
		view: f.View, catchUp: func(context.Context) error { return nil }}
}

// storeWire is a data port serving store's replicas, closed when the test
// ends.
func storeWire(t *testing.T, store *replica.Store) *wire.Server {
	t.Helper()
	ws, err := wire.NewServer(wire.BackendFunc(func(id string) (wire.Replica, error) {
		r, err := store.Get(id)
		if err != nil {
			return nil, err
		}
		return r, nil
	}), wire.ServerConfig{Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	return ws
}

func testDeletedReplicaForgotten(t *testing.T, syncFails bool) {
	f, err := raftstore.OpenFSM(stateFile(t, nil, nil), replicatest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	efs := errorfs.New(replica.OS(), 1)
	store, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), FS: efs, Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, err := store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	ws := storeWire(t, store)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go ws.Serve(ln)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	conn, err := wire.Dial(ctx, "tcp", ln.Addr().String(), wire.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.OpenFor(ctx, wire.OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 2,
		Purpose: wire.PurposeAttach, Incarnation: 1}); err != nil {
		t.Fatal(err)
	}
	if n := ws.Stats().AttachOrders; n != 1 {
		t.Fatalf("after an attach OPEN the data port orders %d replicas' handles; want 1", n)
	}

	s := &Server{cfg: Config{ID: "s1"}, logger: replicatest.Logger(t), ctx: ctx}
	d := &dataPlane{s: s, store: store, wire: ws, rebuilding: map[string]bool{}, tasks: map[string]bool{},
		view: f.View, catchUp: func(context.Context) error { return nil }}
	if syncFails {
		efs.Add(errorfs.Rule{Ops: errorfs.OpSyncDir, Times: 1})
	}
	d.reconcile() // the cluster places no replica here
	if _, err := store.Get("r1"); !errors.Is(err, replica.ErrNotFound) {
		t.Fatalf("replica r1, placed nowhere, after the reconcile: %v; want it deleted", err)
	}
	if n := ws.Stats().AttachOrders; n != 0 {
		t.Errorf("after the reconcile deleted r1 the data port still orders %d replicas' attach handles; want 0", n)
	}
}

// TestAReplicaThatCannotGrowIsFenced: a reconcile grows a local replica to
// its volume's size, then fences it at the volume's epoch. A grow that
// failed (it writes a new meta.json: a full disk, a quota, a permission)
// skipped the fence, which only rewrites a slot of an existing file and
// would have worked: a volume expanded and then detached (force, from a
// node cut off from the control plane) kept its replica at the old epoch,
// and the old node's engine went on writing to it, acknowledged.
func TestAReplicaThatCannotGrowIsFenced(t *testing.T) {
	b, err := proto.Marshal(&storpb.Volume{Id: "v1", Name: "name-v1", SizeBytes: 2 << 20, Epoch: 6,
		State:    storpb.VolumeState_VOLUME_STATE_AVAILABLE,
		Replicas: []*storpb.Replica{{Id: "r1", ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY}}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := raftstore.OpenFSM(stateFile(t, map[string][]byte{"v1": b}, nil), replicatest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	efs := errorfs.New(replica.OS(), 1)
	store, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), FS: efs, Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	r1, err := store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := r1.Fence(5); err != nil { // attached at epoch 5 before the expansion and the detach
		t.Fatal(err)
	}
	efs.Add(errorfs.Rule{Path: "meta.json.tmp", Err: syscall.EACCES})
	d := testDataPlane(t, store, f)
	d.reconcile()
	if got := r1.Size(); got != 1<<20 {
		t.Fatalf("replica r1 grew to %d although meta.json could not be written", got)
	}
	if got := r1.Epoch(); got != 6 {
		t.Errorf("replica r1, whose grow failed, is at epoch %d after the reconcile; want the volume's 6", got)
	}
	if err := r1.WriteAt(replica.Op{Epoch: 5}, make([]byte, 4096), 0); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Errorf("a write at the old epoch 5: %v, want ErrStaleEpoch", err)
	}
}

// TestNothingIsMadeUnlessTheRecordNamesThisDataDir: a server whose data
// dir was wiped gets the cluster's records back, which still place its
// old replicas here, healthy. Its reconcile made them again, empty, to
// be read from. Now a reconcile makes, fences and deletes nothing unless
// the record of its server names its data dir, or names none (a record of
// an older version) while the dir holds replicas (a dir in use before).
func TestNothingIsMadeUnlessTheRecordNamesThisDataDir(t *testing.T) {
	b, err := proto.Marshal(&storpb.Volume{Id: "v1", Name: "name-v1", SizeBytes: 1 << 20, Epoch: 3,
		State:      storpb.VolumeState_VOLUME_STATE_AVAILABLE,
		Attachment: &storpb.Attachment{NodeId: "n1", Mode: storpb.AccessMode_ACCESS_MODE_READ_WRITE},
		Replicas:   []*storpb.Replica{{Id: "r1", ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		recorded string // the record's data dir
		inUse    bool   // the store holds a replica (r9, placed nowhere)
		owns     bool
	}{
		{"the record names another dir", "d-old", false, false},
		{"the record names another dir, this one in use", "d-old", true, false},
		{"the record names this dir", "d-new", false, true},
		{"the record names none, this dir is empty", "", false, false},
		{"the record names none, this dir is in use", "", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, store := stateAndStore(t, stateFileFor(t, &storpb.Server{Id: "s1", State: storpb.ServerState_SERVER_STATE_UP, DataDirId: tc.recorded},
				map[string][]byte{"v1": b}, nil))
			if tc.inUse {
				if _, err := store.Create(replica.Spec{ID: "r9", VolumeID: "v9", Size: 1 << 20}); err != nil {
					t.Fatal(err)
				}
			}
			d := testDataPlane(t, store, f)
			d.dataDirID = "d-new"
			d.reconcile()
			_, err = store.Get("r1")
			if made := err == nil; made != tc.owns {
				t.Errorf("replica r1, placed here, after the reconcile: %v; want made: %v", err, tc.owns)
			}
			if tc.inUse {
				_, err := store.Get("r9")
				if deleted := errors.Is(err, replica.ErrNotFound); deleted != tc.owns {
					t.Errorf("replica r9, placed nowhere, after the reconcile: %v; want deleted: %v", err, tc.owns)
				}
			}
		})
	}
}

// TestADetachedRebuildWaitsForAPendingCut: a server rebuilds its
// REBUILDING replica of a detached volume from a healthy one, but not
// while a snapshot of the volume is pending. The detached cut then opens
// every replica at its own epoch and writes the target too (reconciling
// dirty regions); a rebuild started at that epoch copied with no write
// ordering against those writes, and could leave the target holding an
// unacknowledged write the cut had just taken off the others.
func TestADetachedRebuildWaitsForAPendingCut(t *testing.T) {
	rebuilding := &storpb.Replica{Id: "r1", ServerId: "s1", State: storpb.ReplicaState_REPLICA_STATE_REBUILDING}
	healthy := &storpb.Replica{Id: "r2", ServerId: "s2", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY}
	vol := func(edit func(v *storpb.Volume)) *storpb.Volume {
		v := &storpb.Volume{Id: "v1", State: storpb.VolumeState_VOLUME_STATE_AVAILABLE, Epoch: 4,
			Replicas: []*storpb.Replica{rebuilding, healthy}}
		edit(v)
		return v
	}
	for _, tc := range []struct {
		name string
		v    *storpb.Volume
		due  bool
	}{
		{"detached, a healthy source", vol(func(*storpb.Volume) {}), true},
		{"a snapshot pending", vol(func(v *storpb.Volume) { v.PendingSnapshotIds = []string{"snap"} }), false},
		{"attached: its engine rebuilds", vol(func(v *storpb.Volume) { v.Attachment = &storpb.Attachment{NodeId: "n1"} }), false},
		{"no healthy source", vol(func(v *storpb.Volume) {
			v.Replicas = []*storpb.Replica{rebuilding, {Id: "r2", ServerId: "s2", State: storpb.ReplicaState_REPLICA_STATE_FAULTY}}
		}), false},
	} {
		if got := detachedRebuildDue(tc.v, rebuilding); got != tc.due {
			t.Errorf("%s: a detached rebuild of r1 due %v, want %v", tc.name, got, tc.due)
		}
	}
}
