package engine_test

import (
	"bytes"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
)

// unclean leaves f's replicas as an engine that stopped uncleanly can:
// 2 MiB written and flushed everywhere, both regions still dirty on
// every replica, and the blocks at diff[i] changed on replica i only (a
// write that reached it alone). It returns each replica's bytes written
// so far.
func unclean(t *testing.T, f *fixture, diff map[int][]int64) [3]int64 {
	t.Helper()
	e := f.open(f.config("n1"))
	if err := e.WriteAt(ctx10(t), randomBytes(6, 2<<20), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	var written [3]int64
	for i := range 3 {
		r := f.replica(i)
		r.mu.Lock()
		r.dirty[0], r.dirty[1<<20] = true, true
		for _, off := range diff[i] {
			copy(r.data[off:], randomBytes(uint64(100+i), 4096))
		}
		written[i] = r.written
		r.mu.Unlock()
	}
	return written
}

// reopen opens the volume again at a new epoch, as a restarted node
// plugin does, and returns what each replica was written since before.
func reopen(t *testing.T, f *fixture, before [3]int64) (*engine.Engine, [3]int64) {
	t.Helper()
	cfg := f.config("n1")
	cfg.Takeover = true
	e := f.open(cfg)
	var copied [3]int64
	for i := range 3 {
		r := f.replica(i)
		r.mu.Lock()
		copied[i] = r.written - before[i]
		r.mu.Unlock()
	}
	return e, copied
}

func requireSame(t *testing.T, f *fixture, replicas ...int) {
	t.Helper()
	for _, i := range replicas[1:] {
		if !bytes.Equal(f.replica(replicas[0]).snapshot(), f.replica(i).snapshot()) {
			t.Fatalf("replicas %d and %d differ after the reconciling open", replicas[0], i)
		}
	}
}

// TestReconcileCopiesOnlyTheBlocksThatDiffer: of 2 MiB of dirty regions,
// in which one block differs on one replica and two adjacent blocks on
// another, the reconciling open copies those three blocks (one run of one
// block and one of two, to the two replicas that are not the source),
// and the replicas are the same after it.
func TestReconcileCopiesOnlyTheBlocksThatDiffer(t *testing.T) {
	f := newFixture(t)
	before := unclean(t, f, map[int][]int64{1: {1 << 20}, 2: {1<<20 + 40<<10, 1<<20 + 44<<10}})
	_, copied := reopen(t, f, before)
	requireSame(t, f, 0, 1, 2)
	var total int64
	for i := range 3 {
		total += copied[i]
		f.replica(i).mu.Lock()
		digests := f.replica(i).digests
		f.replica(i).mu.Unlock()
		if digests != 1 {
			t.Errorf("replica %d was asked for %d chunks of digests, want 1 (the 2 MiB of dirty regions are one chunk)", i, digests)
		}
	}
	if want := int64(2 * 3 * 4096); total != want {
		t.Fatalf("the reconcile wrote %v bytes in all (per replica %v), want %d: the differing blocks, to the two replicas that are not the source", total, copied, want)
	}
}

// TestReconcileCopiesWholeChunksFromAServerWithoutDigests: a replica
// whose server predates DIGEST (wire.ErrUnknownOp) is reconciled as
// before digests: every dirty chunk is copied to every replica but the
// source.
func TestReconcileCopiesWholeChunksFromAServerWithoutDigests(t *testing.T) {
	f := newFixture(t)
	before := unclean(t, f, map[int][]int64{1: {1 << 20}})
	r2 := f.replica(2)
	r2.mu.Lock()
	r2.noDigest = true
	r2.mu.Unlock()
	_, copied := reopen(t, f, before)
	requireSame(t, f, 0, 1, 2)
	var total int64
	for _, c := range copied {
		total += c
	}
	if want := int64(2 * 2 << 20); total != want {
		t.Fatalf("the reconcile wrote %v bytes in all (per replica %v), want %d: both regions, to the two replicas that are not the source", total, copied, want)
	}
	if v := f.volume(); v.Generation != 1 {
		t.Fatalf("generation %d: a server without DIGEST changed the replica set", v.Generation)
	}
}

// TestReconcileFaultsAReplicaThatCannotDigest: a replica that fails its
// DIGEST (an I/O error reading its data) is recorded faulty and left out;
// the others are reconciled, and the volume opens.
func TestReconcileFaultsAReplicaThatCannotDigest(t *testing.T) {
	f := newFixture(t)
	before := unclean(t, f, map[int][]int64{1: {1 << 20}, 2: {4096}})
	bad := f.replica(2)
	bad.mu.Lock()
	bad.failRead = true
	bad.mu.Unlock()
	_, copied := reopen(t, f, before)
	requireSame(t, f, 0, 1)
	for _, r := range f.volume().Replicas {
		// Recorded faulty: FAULTY, or REBUILDING once the engine's rebuild
		// of it started (only a FAULTY replica starts rebuilding).
		if want := r.Id == bad.id; want != (r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY) {
			t.Fatalf("replica %s is %v after the reconcile (the one that cannot digest is %s)", r.Id, r.State, bad.id)
		}
	}
	if copied[0]+copied[1] != 4096 || copied[2] != 0 {
		t.Fatalf("the reconcile wrote %v bytes per replica, want 4096 in all to replicas 0 and 1 (the block that differs between them), none to the faulty one", copied)
	}
}
