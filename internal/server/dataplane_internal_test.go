package server

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/replicatest"
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
	v0, err := readClusterView(view, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Nothing applied yet (index 0): never taken for the same state.
	if v, err := readClusterView(view, v0); err != nil || v == v0 {
		t.Fatalf("a view at applied index 0 was reused (%v)", err)
	}
	apply(1)
	v1, err := readClusterView(view, v0)
	if err != nil {
		t.Fatal(err)
	}
	if v1 == v0 || v1.index != 1 {
		t.Fatalf("after an entry applied: view at index %d, reused %v", v1.index, v1 == v0)
	}
	for range 3 {
		if v, err := readClusterView(view, v1); err != nil || v != v1 {
			t.Fatalf("nothing applied since: a new view was read (%v)", err)
		}
	}
	apply(2)
	if v, err := readClusterView(view, v1); err != nil || v == v1 || v.index != 2 {
		t.Fatalf("after another entry: the view at index %d was reused (%v)", v1.index, err)
	}
	if reads != 7 {
		t.Errorf("%d transactions, want 7 (each read looks at the applied index in one)", reads)
	}
}

// TestReconcileActsOnNothingItCannotRead: a reconcile whose read of the
// cluster fails changes no local replica. It used to go on with what it
// had read (a volume listing stops at its first undecodable record), take
// every local replica missing from it for one no longer placed here, and
// delete it.
func TestReconcileActsOnNothingItCannotRead(t *testing.T) {
	store, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, err := store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := &Server{cfg: Config{ID: "s1"}, logger: replicatest.Logger(t), ctx: ctx}
	d := &dataPlane{s: s, store: store, rebuilding: map[string]bool{}, tasks: map[string]bool{},
		view: func(func(*raftstore.Reader) error) error { return errors.Join(raftstore.ErrCorrupt, errors.New("volume: undecodable")) }}
	d.reconcile()
	if _, err := store.Get("r1"); err != nil {
		t.Fatalf("replica r1 after a reconcile that could not read the cluster: %v", err)
	}
}
