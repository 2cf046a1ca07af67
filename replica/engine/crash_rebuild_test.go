package engine_test

import (
	"bytes"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/errorfs"
)

// onMemFSFixture is a fixture whose replicas are stores, the i-th on a
// MemFS (to crash it or fault its disk), and an engine config on node n1
// that connects to them, with a 5 s I/O timeout.
func onMemFSFixture(t *testing.T, i int) (*fixture, *storeReplicas, string, engine.Config) {
	t.Helper()
	f := newFixture(t)
	stores := newStoreReplicas(t, f.vol.Id, volSize)
	id := f.vol.Replicas[i].Id
	stores.onMemFS(id)
	cfg := f.config("n1")
	cfg.Connect = stores.connect
	cfg.IOTimeout = 5 * time.Second
	return f, stores, id, cfg
}

// A replica whose machine crashes loses the writes it acknowledged and had
// not flushed; only its dirty-region log remembers where. Its engine finds
// its connection gone and records it faulty, the leader has it rebuilt,
// and it rejoins the write set before its rebuild begins: the engine's
// flushes reach it from then on. Two of them used to clear the regions its
// server found dirty at the restart, so the delta rebuild, which copies
// what the other replicas wrote since the replica left plus the target's
// own dirty regions, left out the lost write, and the replica was recorded
// healthy without a write every other replica had and a flush had made
// durable.
func TestARebuildRestoresWritesItsTargetLostInACrash(t *testing.T) {
	f, stores, _, cfg := onMemFSFixture(t, 2)
	var ids [3]string
	for i := range 3 {
		ids[i] = f.vol.Replicas[i].Id
	}
	e := f.open(cfg)
	for range 2 {
		if err := e.Flush(ctx10(t)); err != nil {
			t.Fatal(err)
		}
	}
	const off = 3 << 20
	w := randomBytes(7, 4096)
	if err := e.WriteAt(ctx10(t), w, off, false); err != nil { // acknowledged by all three, not flushed
		t.Fatal(err)
	}
	stores.crash(ids[2])
	if got := stores.read(ids[2], e.Epoch(), off, 4096); bytes.Equal(got, w) {
		t.Fatal("the crash kept the unflushed write: this test needs it lost")
	}
	// The next write finds replica 2 gone: it leaves the set, and the
	// flush after it makes w durable on the other two.
	if err := e.WriteAt(ctx10(t), randomBytes(8, 4096), 6<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	// Replica 2 comes back and rejoins; hold its rebuild until two
	// flushes have reached it.
	_, g := stores.get(ids[2])
	begin := g.shut("BeginRebuild")
	if begin.count(1, 20*time.Second) != 1 {
		t.Fatal("replica 2 was not rebuilt within 20 s of its crash")
	}
	for range 2 {
		if err := e.Flush(ctx10(t)); err != nil {
			t.Fatal(err)
		}
	}
	g.open("BeginRebuild")
	waitFor(t, "replica 2 healthy again", func() bool {
		for _, r := range f.volume().Replicas {
			if r.Id == ids[2] {
				return r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
			}
		}
		return false
	})
	if got := stores.read(ids[2], e.Epoch(), off, 4096); !bytes.Equal(got, w) {
		t.Fatal("replica 2 is healthy again without the write its crash lost")
	}
	// The completed rebuild settled what replica 2 owed: its regions are
	// cleared by the usual rule again, not reconciled at every open.
	for range 2 {
		if err := e.Flush(ctx10(t)); err != nil {
			t.Fatal(err)
		}
	}
	r2, _ := stores.get(ids[2])
	if d, err := r2.DirtyRegions(replica.Op{Epoch: e.Epoch()}); err != nil || len(d) != 0 {
		t.Fatalf("replica 2's dirty regions two flushes after its rebuild: %v, %v; want none", d, err)
	}
}

// A healthy replica whose machine crashed while no engine noticed (the
// volume idle, say) owes its dirty regions until a reconcile has copied
// them: the next engine's open reconciles them and settles them, and the
// usual rule clears them after. Without the settle they stayed dirty, to
// be digested again at every open.
func TestAnOpenSettlesTheRegionsItReconciled(t *testing.T) {
	f, stores, id, cfg := onMemFSFixture(t, 0)
	e := f.open(cfg)
	if err := e.WriteAt(ctx10(t), randomBytes(9, 4096), 2<<20, false); err != nil {
		t.Fatal(err)
	}
	stores.crash(id)
	cfg.Takeover = true
	e2 := f.open(cfg) // reconciles, from replica 1 or 2
	for range 2 {
		if err := e2.Flush(ctx10(t)); err != nil {
			t.Fatal(err)
		}
	}
	r, _ := stores.get(id)
	if d, err := r.DirtyRegions(replica.Op{Epoch: e2.Epoch()}); err != nil || len(d) != 0 {
		t.Fatalf("the crashed replica's dirty regions after an open reconciled them and two flushes: %v, %v; want none", d, err)
	}
	for _, x := range f.volume().Replicas {
		if x.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			t.Fatalf("replica %s is %v after the open", x.Id, x.State)
		}
	}
}

// A replica whose disk failed (a failed fsync: it refuses every request
// until its server reopens it) is recorded faulty; its server is up, so
// the leader sets it rebuilding again, and the engine's open of it for
// its rebuild fails the same way. The engine only logged "will retry":
// the replica stayed rebuilding for good, and a rebuilding replica is
// never replaced, so the volume stayed a copy short. The engine now
// records it faulty again (paced), and it is replaced once it has been
// unhealthy for the cluster's replacement wait.
func TestARebuildingReplicaWhoseDiskFailedIsRecordedFaulty(t *testing.T) {
	f, stores, id, cfg := onMemFSFixture(t, 2)
	e := f.open(cfg)
	if err := e.WriteAt(ctx10(t), randomBytes(10, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	stores.fault(id, errorfs.Rule{Path: ".data", Ops: errorfs.OpSync})
	if err := e.Flush(ctx10(t)); err != nil { // fails replica 2; the others acknowledge
		t.Fatal(err)
	}
	state := func() storpb.ReplicaState {
		for _, r := range f.volume().Replicas {
			if r.Id == id {
				return r.State
			}
		}
		return storpb.ReplicaState_REPLICA_STATE_UNSPECIFIED
	}
	waitFor(t, "the failed replica set rebuilding by the leader", func() bool {
		return state() == storpb.ReplicaState_REPLICA_STATE_REBUILDING
	})
	waitFor(t, "the rebuilding replica that cannot be opened recorded faulty again", func() bool {
		return state() == storpb.ReplicaState_REPLICA_STATE_FAULTY
	})
}
