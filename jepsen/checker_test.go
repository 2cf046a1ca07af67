package jepsen

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

func TestValueRoundTripAndDamage(t *testing.T) {
	const seed = 99
	v := encodeValue(1234, 5, seed)
	if id, bad := decodeValue(v, 5, seed); id != 1234 || bad != "" {
		t.Fatalf("decode = %d %q, want 1234", id, bad)
	}
	if id, bad := decodeValue(make([]byte, BlockSize), 5, seed); id != 0 || bad != "" {
		t.Fatalf("zeroes decode = %d %q, want the initial value 0", id, bad)
	}
	// A torn block: the first half of one write, the second of another.
	torn := append(append([]byte(nil), v[:BlockSize/2]...), encodeValue(1235, 5, seed)[BlockSize/2:]...)
	if _, bad := decodeValue(torn, 5, seed); !strings.HasPrefix(bad, "torn") {
		t.Fatalf("torn block decoded as %q", bad)
	}
	if _, bad := decodeValue(v, 6, seed); !strings.HasPrefix(bad, "foreign") {
		t.Fatalf("another block's value decoded as %q", bad)
	}
	if _, bad := decodeValue(v, 5, seed+1); !strings.HasPrefix(bad, "foreign") {
		t.Fatalf("another run's value decoded as %q", bad)
	}
}

func ms(n int) int64 { return int64(n) * int64(time.Millisecond) }

func write(client, block int, value uint64, call, ret int, ok bool) Op {
	return Op{Client: client, Kind: "write", Block: block, Value: value, Call: ms(call), Return: ms(ret), OK: ok}
}

func read(client, block int, value uint64, call, ret int) Op {
	return Op{Client: client, Kind: "read", Block: block, Value: value, Call: ms(call), Return: ms(ret), OK: true}
}

func TestLinearizabilityChecker(t *testing.T) {
	cases := []struct {
		name string
		ops  []Op
		bad  int
	}{
		{"sequential", []Op{write(0, 0, 1, 0, 10, true), read(1, 0, 1, 20, 30), write(0, 0, 2, 40, 50, true), read(1, 0, 2, 60, 70)}, 0},
		{"stale read", []Op{write(0, 0, 1, 0, 10, true), write(0, 0, 2, 20, 30, true), read(1, 0, 1, 40, 50)}, 1},
		{"lost acknowledged write", []Op{write(0, 0, 1, 0, 10, true), read(1, 0, 0, 20, 30)}, 1},
		{"concurrent writes either order", []Op{write(0, 0, 1, 0, 10, true), write(1, 0, 2, 0, 10, true), read(2, 0, 1, 20, 30), read(2, 0, 1, 40, 50)}, 0},
		// The anomaly of jepsen seed 42: the block flips back.
		{"flip between concurrent writes", []Op{write(0, 0, 1, 0, 10, true), write(1, 0, 2, 0, 10, true), read(2, 0, 2, 20, 30), read(2, 0, 1, 40, 50)}, 1},
		// A failed write may take effect at any later time, or never.
		{"failed write seen later", []Op{write(0, 0, 1, 0, 10, false), read(1, 0, 0, 20, 30), read(1, 0, 1, 40, 50)}, 0},
		{"failed write never seen", []Op{write(0, 0, 1, 0, 10, false), read(1, 0, 0, 20, 30)}, 0},
		{"failed write seen, then gone", []Op{write(0, 0, 1, 0, 10, false), read(1, 0, 1, 20, 30), read(1, 0, 0, 40, 50)}, 1},
		{"per block", []Op{write(0, 0, 1, 0, 10, true), write(0, 1, 2, 20, 30, true), read(1, 0, 1, 40, 50), read(1, 1, 2, 40, 50)}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			var a Anomalies
			checkLinearizable(c.ops, nil, 2, 10*time.Second, func(b int) string { return filepath.Join(dir, "viz.html") }, &a)
			if a.Linearizability != c.bad || a.Unknown != 0 {
				t.Fatalf("anomalies %+v, want %d", a, c.bad)
			}
			if c.bad > 0 {
				if b, err := os.ReadFile(filepath.Join(dir, "viz.html")); err != nil || !bytes.Contains(b, []byte("<html")) {
					t.Fatalf("no visualization written: %v", err)
				}
			}
		})
	}
}

func TestDurabilityChecker(t *testing.T) {
	flush := func(call, ret int) Op { return Op{Kind: "flush", Call: ms(call), Return: ms(ret), OK: true} }
	final := func(block int, v uint64) Op {
		return Op{Kind: "final-read", Block: block, Value: v, OK: true, Call: ms(1000), Return: ms(1001)}
	}
	cases := []struct {
		name string
		ops  []Op
		bad  int
	}{
		{"flushed write present", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30), final(0, 1)}, 0},
		{"flushed write lost", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30), final(0, 0)}, 1},
		{"older value after flush", []Op{write(0, 0, 1, 0, 10, true), write(0, 0, 2, 20, 30, true), flush(40, 50), final(0, 1)}, 1},
		{"unflushed write may be lost", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30), write(0, 0, 2, 40, 50, true), final(0, 1)}, 0},
		{"later indeterminate write may win", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30), write(0, 0, 2, 40, 50, false), final(0, 2)}, 0},
		{"unknown value", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30), final(0, 7)}, 1},
		{"unreadable", []Op{write(0, 0, 1, 0, 10, true), flush(20, 30)}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var a Anomalies
			checkDurability(c.ops, 1, &a)
			if a.Durability != c.bad {
				t.Fatalf("durability anomalies %d (%v), want %d", a.Durability, a.Details, c.bad)
			}
		})
	}
}

func TestFencingChecker(t *testing.T) {
	open := func(epoch uint64, ret int) Op { return Op{Kind: "open", Epoch: epoch, OK: true, Return: ms(ret)} }
	w := func(epoch uint64, call int, ok bool) Op {
		o := write(0, 0, uint64(call), call, call+5, ok)
		o.Epoch = epoch
		return o
	}
	var a Anomalies
	checkFencing([]Op{open(1, 0), w(1, 10, true), open(2, 20), w(1, 15, true), w(1, 30, false), w(2, 30, true)}, &a)
	if a.Fencing != 0 {
		t.Fatalf("fencing anomalies %v in a correct history", a.Details)
	}
	checkFencing([]Op{open(1, 0), open(2, 20), w(1, 30, true)}, &a)
	if a.Fencing != 1 {
		t.Fatalf("a write acknowledged at epoch 1 after epoch 2 was opened: %d anomalies, want 1", a.Fencing)
	}
	// A detached volume's cut fences the engine that held it (a zombie):
	// its writes called before the fence may be acknowledged, none after.
	fence := func(epoch uint64, ret int) Op { return Op{Kind: "fence", Epoch: epoch, OK: true, Return: ms(ret)} }
	a = Anomalies{}
	checkFencing([]Op{open(3, 0), w(3, 10, true), fence(3, 20), w(3, 15, true), w(3, 30, false), open(4, 40), w(4, 50, true)}, &a)
	if a.Fencing != 0 {
		t.Fatalf("fencing anomalies %v in a correct history with a detach", a.Details)
	}
	checkFencing([]Op{open(3, 0), fence(3, 20), w(3, 30, true)}, &a)
	if a.Fencing != 1 {
		t.Fatalf("a zombie's write acknowledged at epoch 3 after the detached cut fenced it: %d anomalies, want 1", a.Fencing)
	}
}

// snap is replica rep's read of block of snapshot name (window call..ret)
// that returned value.
func snap(name, rep string, block int, value uint64, call, ret int) Op {
	return Op{Client: -1, Kind: "snapshot-read", Snapshot: name, Replica: rep, Block: block, Value: value, Call: ms(call), Return: ms(ret), OK: true}
}

// cloned is snap read from a replica of clone clone instead.
func cloned(o Op, clone string) Op {
	o.Clone = clone
	return o
}

func TestSnapshotChecker(t *testing.T) {
	unreadable := snap("s", "r2", 0, 0, 40, 50)
	unreadable.OK, unreadable.Err = false, "not found"
	cases := []struct {
		name string
		ops  []Op
		bad  int    // snapshot anomalies, from checkSnapshots and checkLinearizable together
		why  string // in the anomaly's detail: which check found it
	}{
		{"the volume at its cut", []Op{write(0, 0, 1, 0, 10, true), write(0, 1, 2, 20, 30, true),
			snap("s", "r1", 0, 1, 35, 50), snap("s", "r1", 1, 2, 35, 50), snap("s", "r2", 0, 1, 35, 50), snap("s", "r2", 1, 2, 35, 50)}, 0, ""},
		{"a write in flight at the cut may be in or out", []Op{write(0, 0, 1, 0, 10, true), write(0, 0, 2, 30, 60, true),
			snap("s", "r1", 0, 1, 20, 50), snap("a", "r1", 0, 2, 20, 50)}, 0, ""},
		{"an indeterminate write may be in it", []Op{write(0, 0, 1, 0, 10, false), snap("s", "r1", 0, 1, 20, 30)}, 0, ""},
		{"replicas disagree", []Op{write(0, 0, 1, 0, 10, true), write(0, 0, 2, 20, 30, true),
			snap("s", "r1", 0, 2, 40, 50), snap("s", "r2", 0, 1, 40, 50)}, 1, "replicas disagree on block 0"},
		{"acknowledged write missing", []Op{write(0, 0, 1, 0, 10, true), snap("s", "r1", 0, 0, 20, 30)}, 1, "not the volume at any one point"},
		{"write begun after it was ready", []Op{write(0, 0, 1, 40, 50, true), snap("s", "r1", 0, 1, 20, 30)}, 1, "which was called at 40ms"},
		// Each block alone is the volume at some point of the window, but
		// not at the same one: block 0 must be cut before 50, block 1 after 60.
		{"no single point", []Op{write(0, 0, 1, 0, 10, true), write(0, 0, 3, 40, 50, true), write(0, 1, 4, 60, 70, true),
			snap("s", "r1", 0, 1, 0, 100), snap("s", "r1", 1, 4, 0, 100)}, 1, "write 3, begun after that was over, was acknowledged at 50ms"},
		{"a cut replica cannot be read", []Op{write(0, 0, 1, 0, 10, true), snap("s", "r1", 0, 1, 40, 50), unreadable}, 1, "replica r2 cut it but its layer cannot be read"},
		{"a clone holds its snapshot", []Op{write(0, 0, 1, 0, 10, true),
			snap("s", "r1", 0, 1, 20, 30), cloned(snap("s", "c1", 0, 1, 20, 30), "c"), cloned(snap("s", "c2", 0, 1, 20, 30), "c")}, 0, ""},
		// Both values fit the writes alone; the clone is not its snapshot
		// (and, read in the same window, they cannot both be right).
		{"a clone that is not its snapshot", []Op{write(0, 0, 1, 0, 10, true), write(1, 0, 2, 0, 10, true),
			snap("s", "r1", 0, 2, 20, 30), cloned(snap("s", "c1", 0, 1, 20, 30), "c")}, 2, "block 0 holds 1, its snapshot 2"},
		{"a clone's replicas disagree", []Op{write(0, 0, 1, 0, 10, true), write(1, 0, 2, 0, 10, true),
			cloned(snap("s", "c1", 0, 1, 20, 30), "c"), cloned(snap("s", "c2", 0, 2, 20, 30), "c")}, 1, "s (clone c): replicas disagree"},
		{"a value no write carried", []Op{snap("s", "r1", 0, 7, 40, 50)}, 1, "which no write to it carried"},
		// The writes allow value 1 (they were concurrent), but a read had
		// already seen 2 win: only the reads show the snapshot is stale.
		{"older than a read before it", []Op{write(0, 0, 1, 0, 10, true), write(1, 0, 2, 0, 10, true), read(2, 0, 2, 20, 30),
			snap("s", "r1", 0, 1, 40, 50)}, 1, "not with the snapshots' contents"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			var a Anomalies
			extra := checkSnapshots(c.ops, &a)
			checkLinearizable(c.ops, extra, 2, 10*time.Second, func(b int) string { return filepath.Join(dir, "viz.html") }, &a)
			if a.Snapshot != c.bad || a.Linearizability != 0 || a.Unknown != 0 {
				t.Fatalf("anomalies %+v, want %d snapshot anomalies", a, c.bad)
			}
			if c.bad > 0 && !strings.Contains(strings.Join(a.Details, "\n"), c.why) {
				t.Fatalf("details %q do not say %q", a.Details, c.why)
			}
		})
	}
}

func TestAvailability(t *testing.T) {
	ops := []Op{write(0, 0, 1, 100, 200, true), write(0, 0, 2, 1100, 1200, false), write(0, 0, 3, 2100, 2200, true), write(0, 0, 4, 2300, 2400, true)}
	if got := availability(ops, int64(4*time.Second)); got != 0.5 {
		t.Fatalf("availability %v, want 0.5 (seconds 0 and 2 of 4)", got)
	}
}

func TestReplicaAgreementChecker(t *testing.T) {
	rr := func(rep string, block int, value uint64) Op {
		return Op{Client: -1, Kind: "replica-read", Replica: rep, Block: block, Value: value, OK: true}
	}
	var a Anomalies
	checkReplicasAgree([]Op{rr("r1", 0, 7), rr("r2", 0, 7), rr("r3", 0, 7), rr("r1", 1, 0), rr("r2", 1, 0),
		{Kind: "replica-read", Replica: "r3", Block: 1, Err: "unreachable"}}, &a)
	if a.Divergence != 0 {
		t.Fatalf("divergence %v where the replicas agree", a.Details)
	}
	checkReplicasAgree([]Op{rr("r1", 0, 7), rr("r2", 0, 7), rr("r3", 0, 6), rr("r1", 1, 3), rr("r2", 1, 3), rr("r3", 1, 3)}, &a)
	if a.Divergence != 1 {
		t.Fatalf("block 0 held by two replicas as 7 and by one as 6: %d divergence anomalies, want 1 (%v)", a.Divergence, a.Details)
	}
}

// TestReconciledReplicaAgreementChecker: reconcile-read ops are compared
// within their look (Round) only: a register that changed between two
// looks is no anomaly, one whose replicas differ within a look is.
func TestReconciledReplicaAgreementChecker(t *testing.T) {
	rr := func(round int, rep string, block int, value uint64) Op {
		return Op{Client: -1, Kind: "reconcile-read", Round: round, Replica: rep, Block: block, Value: value, OK: true}
	}
	var a Anomalies
	checkReconciledReplicasAgree([]Op{rr(1, "r1", 3, 7), rr(1, "r2", 3, 7), rr(1, "r3", 3, 7),
		rr(2, "r1", 3, 9), rr(2, "r2", 3, 9), {Kind: "reconcile-read", Round: 2, Replica: "r3", Block: 3, Err: "unreachable"}}, &a)
	if a.Divergence != 0 {
		t.Fatalf("divergence %v where the replicas agree within each look", a.Details)
	}
	checkReconciledReplicasAgree([]Op{rr(1, "r1", 3, 7), rr(1, "r2", 3, 7), rr(1, "r3", 3, 6), rr(2, "r1", 3, 6), rr(2, "r2", 3, 6)}, &a)
	if a.Divergence != 1 {
		t.Fatalf("block 3 held as 7 and 6 in look 1: %d divergence anomalies, want 1 (%v)", a.Divergence, a.Details)
	}
}

// TestLockHostsUnit: a second holder of the hosts lock is refused, saying
// who holds it, until the first lets go.
func TestLockHostsUnit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "jepsen.lock")
	first, err := lockHosts(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockHosts(path); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("second lock while the first is held: %v, want ErrLocked naming the holder", err)
	}
	first.Close()
	second, err := lockHosts(path)
	if err != nil {
		t.Fatalf("lock after the first let go: %v", err)
	}
	second.Close()
}

// TestSnapshotLossChecker: a snapshot seen ready whose copies all went
// with replicas that left the volume is counted as lost, not an anomaly,
// when the listing records the loss (failed, LOST entries with a reason);
// a snapshot that turned not-ready without a recorded loss is a silent
// loss, an anomaly.
func TestSnapshotLossChecker(t *testing.T) {
	const (
		cut    = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT
		missed = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED
		lost   = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST
	)
	entry := func(id string, st storpb.SnapshotReplicaState, reason string) *storpb.SnapshotReplica {
		return &storpb.SnapshotReplica{ReplicaId: id, State: st, Reason: reason}
	}
	const why = "its replica was removed from the volume; the copy went with it"
	cases := []struct {
		name    string
		listing *storpb.Snapshot
		lost    int    // counted in Report.SnapshotsLost
		bad     int    // snapshot anomalies
		detail  string // in the anomaly's detail
	}{
		{"every copy recorded lost", &storpb.Snapshot{Failed: true, StatusMessage: "every copy of the snapshot is lost",
			Replicas: []*storpb.SnapshotReplica{entry("r1", lost, why), entry("r2", lost, why), entry("r3", missed, "not healthy")}}, 1, 0, ""},
		{"failed with no copy recorded lost", &storpb.Snapshot{Failed: true, StatusMessage: "no replica could cut the snapshot",
			Replicas: []*storpb.SnapshotReplica{entry("r1", missed, "x"), entry("r2", missed, "y")}}, 0, 1, "no copy recorded lost"},
		{"lost without a reason", &storpb.Snapshot{Failed: true,
			Replicas: []*storpb.SnapshotReplica{entry("r1", lost, "")}}, 0, 1, "no copy recorded lost"},
		{"not ready, yet a copy is listed cut", &storpb.Snapshot{Failed: true,
			Replicas: []*storpb.SnapshotReplica{entry("r1", cut, ""), entry("r2", lost, why)}}, 0, 1, "no copy recorded lost"},
		{"not ready and not failed", &storpb.Snapshot{
			Replicas: []*storpb.SnapshotReplica{entry("r1", lost, why)}}, 0, 1, "no copy recorded lost"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ops := []Op{write(0, 0, 1, 0, 10, true), lostOp("s", 20, 100, c.listing)}
			var a Anomalies
			n := checkSnapshotLosses(ops, &a)
			if n != c.lost || a.Snapshot != c.bad || a.Total() != c.bad {
				t.Fatalf("lost %d, anomalies %+v; want lost %d and %d snapshot anomalies", n, a, c.lost, c.bad)
			}
			if c.bad > 0 && !strings.Contains(strings.Join(a.Details, "\n"), c.detail) {
				t.Fatalf("details %q do not say %q", a.Details, c.detail)
			}
		})
	}
}

// TestReplicaHoldsLastWriteChecker: a HEALTHY replica read after the
// writes to a register were all acknowledged must hold the last one; a
// register with a failed, unfinished or concurrent write is left out.
func TestReplicaHoldsLastWriteChecker(t *testing.T) {
	check := func(rep string, block int, value uint64, at int) Op {
		return Op{Client: -1, Kind: "replica-check", Replica: rep, Block: block, Value: value, Call: ms(at), Return: ms(at + 10), OK: true}
	}
	var a Anomalies
	checkReplicasHoldLastWrite([]Op{write(9, 0, 1, 100, 200, true), write(9, 0, 2, 300, 400, true),
		check("r1", 0, 2, 500), check("r2", 0, 2, 500), check("r3", 0, 0, 50)}, &a)
	if a.Divergence != 0 {
		t.Fatalf("divergence %v where every replica holds the last write", a.Details)
	}
	checkReplicasHoldLastWrite([]Op{write(9, 0, 1, 100, 200, true), write(9, 0, 2, 300, 400, true),
		check("r1", 0, 2, 500), check("r2", 0, 1, 500)}, &a)
	if a.Divergence != 1 || !strings.Contains(a.Details[0], "r2 holds 1") {
		t.Fatalf("r2 holds write 1 after write 2 was acknowledged: %d anomalies (%v), want 1 naming r2", a.Divergence, a.Details)
	}
	a = Anomalies{}
	checkReplicasHoldLastWrite([]Op{
		write(9, 0, 1, 100, 200, true), write(9, 0, 2, 300, 400, false), check("r1", 0, 1, 500), // failed
		write(9, 1, 3, 100, 200, true), write(9, 1, 4, 300, 600, true), check("r1", 1, 3, 500), // in flight
		write(9, 2, 5, 100, 350, true), write(8, 2, 6, 300, 400, true), check("r1", 2, 5, 500), // concurrent
	}, &a)
	if a.Divergence != 0 {
		t.Fatalf("divergence %v on registers whose last value is not known", a.Details)
	}
}

// TestStaleWritesLeaveTheColdRegistersAlone: the fenced engine's writes
// after a takeover fail, and a register with a failed write is left out
// of the replica checks for the rest of the run (see
// TestReplicaHoldsLastWriteChecker); staleWrites wrote every register,
// the cold ones included, so a takeover left nothing for the cold
// registers' checks to judge.
func TestStaleWritesLeaveTheColdRegistersAlone(t *testing.T) {
	for _, tc := range []struct{ blocks, cold int }{{16, 2}, {24, 12}, {4, 0}, {20, 2}} {
		r := &runner{cfg: RunConfig{Blocks: tc.blocks, ColdBlocks: tc.cold}}
		bs := staleBlocks(tc.blocks, r.cold)
		if len(bs) != staleWrite {
			t.Fatalf("%d registers, %d cold: %d stale writes, want %d", tc.blocks, tc.cold, len(bs), staleWrite)
		}
		seen := map[int]bool{}
		for _, b := range bs {
			if r.cold(b) || b < 0 || b >= tc.blocks {
				t.Fatalf("%d registers, %d cold: a stale write to register %d", tc.blocks, tc.cold, b)
			}
			seen[b] = true
		}
		if hot := min(tc.blocks-tc.cold, staleWrite); len(seen) != hot {
			t.Fatalf("%d registers, %d cold: stale writes reach %d registers, want all %d hot ones", tc.blocks, tc.cold, len(seen), hot)
		}
	}
	if bs := staleBlocks(2, func(int) bool { return true }); len(bs) != 0 {
		t.Fatalf("every register cold: stale writes %v", bs)
	}
}
