package engine_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
)

// Tests of the engine's ordering (overlap.go, Engine.flushOrdered): what
// a rebuild copy, a read and a flush wait for. Each holds one request to
// one replica half-way through a fan-out and checks what a user would:
// the bytes on every replica, and reads after an unclean stop.

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// recv waits up to 10 s for a value from ch.
func recv[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	panic("unreachable")
}

func release(r *memReplica) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.hold != nil {
		close(r.hold)
		r.hold = nil
	}
}

func holdWrites(r *memReplica) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hold = make(chan struct{})
}

// ISSUE13 C: a rebuild's target joins the write set before the rebuild
// begins its tracking (BeginRebuild), so a write W could reach the target
// untracked while it was still in flight on the rebuild's source; the copy
// of W's block, read from the source before W reached it, then overwrote
// W on the target, W was acknowledged by all three replicas, and the
// target came back healthy without it. A copy of a block and a write to
// that block must never interleave. Run with the chunks copied by the
// target's server (REBUILD_COPY) and relayed through the engine.
func TestRebuildCopyNeverOverwritesAWriteInFlight(t *testing.T) {
	bothCopies(t, testRebuildCopyNeverOverwritesAWriteInFlight)
}

// bothCopies runs test with the rebuild's chunks copied by the target
// (the default) and relayed through the engine (Config.RebuildRelay).
func bothCopies(t *testing.T, test func(t *testing.T, relay bool)) {
	for _, relay := range []bool{false, true} {
		name := "copy=target"
		if relay {
			name = "copy=relay"
		}
		t.Run(name, func(t *testing.T) { test(t, relay) })
	}
}

// requireCopiedBy fails unless target's rebuild chunks were all copied the
// way relay says, at least one.
func requireCopiedBy(t *testing.T, target *memReplica, relay bool) {
	t.Helper()
	target.mu.Lock()
	relayed, copied := target.rebuildOps, target.copies
	target.mu.Unlock()
	if relay && (relayed == 0 || copied != 0) || !relay && (copied == 0 || relayed != 0) {
		t.Fatalf("the rebuild relayed %d chunks and the target copied %d; want them all %s", relayed, copied, map[bool]string{true: "relayed", false: "copied by the target"}[relay])
	}
}

func testRebuildCopyNeverOverwritesAWriteInFlight(t *testing.T, relay bool) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.RebuildRelay = relay
	cfg.IOTimeout = 10 * time.Second               // the held requests below must not time out
	cfg.LocalServerID = f.vol.Replicas[0].ServerId // replica 0 is the rebuild's source
	e := f.open(cfg)
	source, target := f.replica(0), f.replica(2)
	const off = 64 << 10

	// Replica 2 fails a write and is recorded faulty; the write, applied
	// again at the new generation, makes its region the delta to copy.
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	old := randomBytes(80, 4096)
	if err := e.WriteAt(ctx10(t), old, off, false); err != nil {
		t.Fatal(err)
	}
	// Replica 2 comes back: the leader makes it rebuilding, the engine
	// adds it to the write set and starts its rebuild, held at
	// BeginRebuild.
	begin := target.gates.shut("BeginRebuild")
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()
	if begin.count(1, 10*time.Second) != 1 {
		t.Fatal("the rebuild of replica 2 did not start")
	}
	// W reaches replica 1 and the target, not yet the source.
	holdWrites(source)
	defer release(source)
	w := randomBytes(81, 4096)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(ctx10(t), w, off, false) }()
	waitFor(t, "W on replicas 1 and 2", func() bool {
		return bytes.Equal(f.replica(1).snapshot()[off:off+4096], w) && bytes.Equal(target.snapshot()[off:off+4096], w)
	})
	// The rebuild goes on while W is in flight on the source; its copy
	// has a second to run before W reaches the source.
	target.gates.open("BeginRebuild")
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if target.chunksCopied() > 0 {
			break
		}
	}
	release(source)
	if err := recv(t, "W", wrote); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "replica 2 healthy", func() bool {
		return f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	for i := range 3 {
		if got := f.replica(i).snapshot()[off : off+4096]; !bytes.Equal(got, w) {
			t.Fatalf("replica %d lacks the acknowledged write W after the rebuild (it holds the older block: %v)", i, bytes.Equal(got, old))
		}
	}
	requireCopiedBy(t, target, relay)
}

// ISSUE13 C, the other half: a write W that took the write set just
// before the rebuild's target joined it never reaches the target, and if
// it is not yet on any source when the rebuild reads their write history
// (or extents) to plan the copy, the copy skips its region: W is
// acknowledged and the target comes back healthy without it. The rebuild
// plans only after the writes that missed the target are done.
func TestRebuildCopiesAWriteThatMissedTheTarget(t *testing.T) {
	bothCopies(t, testRebuildCopiesAWriteThatMissedTheTarget)
}

func testRebuildCopiesAWriteThatMissedTheTarget(t *testing.T, relay bool) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.RebuildRelay = relay
	cfg.IOTimeout = 10 * time.Second
	e := f.open(cfg)
	target := f.replica(2)
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	// Replica 2 is recorded faulty; the delta starts at region 0.
	if err := e.WriteAt(ctx10(t), randomBytes(84, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	// W, in another region, goes to replicas 0 and 1 (the write set
	// without replica 2), and neither has applied it yet.
	holdWrites(f.replica(0))
	defer release(f.replica(0))
	holdWrites(f.replica(1))
	defer release(f.replica(1))
	const off = 3 << 20
	w := randomBytes(85, 4096)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(ctx10(t), w, off, false) }()
	time.Sleep(50 * time.Millisecond) // W has taken the write set
	// Replica 2 comes back and joins; its rebuild has three seconds to
	// run while W is in flight.
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			break
		}
	}
	release(f.replica(0))
	release(f.replica(1))
	if err := recv(t, "W", wrote); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "replica 2 healthy", func() bool {
		return f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	for i := range 3 {
		if !bytes.Equal(f.replica(i).snapshot()[off:off+4096], w) {
			t.Fatalf("replica %d lacks the acknowledged write W after the rebuild", i)
		}
	}
	requireCopiedBy(t, target, relay)
}

// The broken mode for the jepsen harness: with UnsafeUnorderedRebuild the
// test above loses W, so the knob really reintroduces ISSUE13 C, whoever
// copies.
func TestUnsafeUnorderedRebuildReintroducesTheBug(t *testing.T) {
	bothCopies(t, testUnsafeUnorderedRebuildReintroducesTheBug)
}

func testUnsafeUnorderedRebuildReintroducesTheBug(t *testing.T, relay bool) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.RebuildRelay = relay
	cfg.IOTimeout = 10 * time.Second
	cfg.LocalServerID = f.vol.Replicas[0].ServerId
	cfg.UnsafeUnorderedRebuild = true
	e := f.open(cfg)
	source, target := f.replica(0), f.replica(2)
	const off = 64 << 10
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(82, 4096), off, false); err != nil {
		t.Fatal(err)
	}
	begin := target.gates.shut("BeginRebuild")
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()
	if begin.count(1, 10*time.Second) != 1 {
		t.Fatal("the rebuild of replica 2 did not start")
	}
	holdWrites(source)
	defer release(source)
	w := randomBytes(83, 4096)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(ctx10(t), w, off, false) }()
	waitFor(t, "W on the target", func() bool { return bytes.Equal(target.snapshot()[off:off+4096], w) })
	target.gates.open("BeginRebuild")
	waitFor(t, "the unordered copy", func() bool { return target.chunksCopied() > 0 })
	release(source)
	if err := recv(t, "W", wrote); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "replica 2 healthy", func() bool {
		return f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	if bytes.Equal(target.snapshot()[off:off+4096], w) {
		t.Fatal("with UnsafeUnorderedRebuild the rebuilt target still holds W: the broken mode does not break")
	}
	requireCopiedBy(t, target, relay)
}

// ISSUE13 J: a read returned the value of a write still in flight (on
// the local replica, not yet on another); the engine crashed, the next
// open reconciled the region from a replica without the write, and the
// value the read had returned vanished. A read of a block with a write in
// flight waits for that write.
func TestReadDoesNotReturnAWriteStillInFlight(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 10 * time.Second
	cfg.LocalServerID = f.vol.Replicas[0].ServerId // reads go to replica 0
	e := f.open(cfg)
	const off = 1 << 20
	old := randomBytes(90, 4096)
	if err := e.WriteAt(ctx10(t), old, off, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	// W reaches replicas 0 and 1; replica 2 has not answered yet.
	slow := f.replica(2)
	holdWrites(slow)
	defer release(slow)
	w := randomBytes(91, 4096)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(context.Background(), w, off, false) }()
	waitFor(t, "W on replica 0", func() bool { return bytes.Equal(f.replica(0).snapshot()[off:off+4096], w) })
	type result struct {
		p   []byte
		err error
	}
	read := make(chan result, 1)
	go func() {
		p := make([]byte, 4096)
		err := e.ReadAt(context.Background(), p, off)
		read <- result{p, err}
	}()
	var first *result
	select {
	case r := <-read:
		first = &r
	case <-time.After(300 * time.Millisecond):
	}
	// The engine crashes. The volume is opened again on replica 2's node,
	// whose copy the reconcile keeps.
	cfg2 := f.config("n2")
	cfg2.Takeover = true
	cfg2.LocalServerID = f.vol.Replicas[2].ServerId
	e2 := f.open(cfg2)
	release(slow)
	if err := recv(t, "W", wrote); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("W of the crashed engine: %v, want ErrFenced", err)
	}
	if first == nil {
		r := recv(t, "the first read", read)
		first = &r
	}
	got := make([]byte, 4096)
	if err := e2.ReadAt(ctx10(t), got, off); err != nil {
		t.Fatal(err)
	}
	if first.err == nil && bytes.Equal(first.p, w) && !bytes.Equal(got, w) {
		t.Fatalf("a read returned W while it was in flight; after a crash and reopen the block reads as before W (old: %v)", bytes.Equal(got, old))
	}
}

// ISSUE13 D: two flushes in flight together (multi-connection NBD) each
// waited for the writes before it and then went out side by side, so a
// write W that began after both reached replicas 0 and 1, and both
// flushes then reached them: two flushes after W, so by the dirty-log
// rule both cleared W's region, while W had not reached replica 2. After
// an unclean stop the next open found no dirty region, and the replicas
// kept two versions of the block. Real replica stores: the rule is
// theirs.
func TestConcurrentFlushesLeaveNoUnreconciledDifference(t *testing.T) {
	f := newFixture(t)
	stores := newStoreReplicas(t, f.vol.Id, volSize)
	var ids [3]string
	var g [3]*gates
	for i := range 3 {
		ids[i] = f.vol.Replicas[i].Id
		_, g[i] = stores.get(ids[i])
	}
	cfg := f.config("n1")
	cfg.Connect = stores.connect
	cfg.IOTimeout = 10 * time.Second
	e := f.open(cfg)
	const off = 2 << 20
	old := randomBytes(100, 4096)
	if err := e.WriteAt(ctx10(t), old, off, false); err != nil {
		t.Fatal(err)
	}
	for range 2 { // clean: every region's bit is cleared
		if err := e.Flush(ctx10(t)); err != nil {
			t.Fatal(err)
		}
	}

	// Two flushes; hold them at every replica.
	var flushGate [3]*gate
	for i := range 3 {
		flushGate[i] = g[i].shut("Flush")
	}
	flushed := make(chan error, 2)
	for range 2 {
		go func() { flushed <- e.Flush(context.Background()) }()
	}
	if flushGate[0].count(1, 10*time.Second) != 1 {
		t.Fatal("no flush reached replica 0")
	}
	flushGate[0].count(1, 300*time.Millisecond) // the second, if it goes out

	// W, begun after both flushes, reaches replicas 0 and 1, not 2.
	g[2].shut("WriteAt")
	defer g[2].open("WriteAt")
	w := randomBytes(101, 4096)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(context.Background(), w, off, false) }()
	waitFor(t, "W on replicas 0 and 1", func() bool {
		return bytes.Equal(stores.read(ids[0], e.Epoch(), off, 4096), w) && bytes.Equal(stores.read(ids[1], e.Epoch(), off, 4096), w)
	})
	// The flushes go on.
	for i := range 3 {
		g[i].open("Flush")
	}
	if err := recv(t, "the first flush", flushed); err != nil {
		t.Fatal(err)
	}
	select { // the second, unless it waits for W
	case <-flushed:
	case <-time.After(300 * time.Millisecond):
	}

	// The engine crashes with W in flight; the next open reconciles. W
	// reaches replica 2 only once the open has fenced it, as after a
	// crash.
	cfg2 := cfg
	cfg2.Takeover = true
	reopened := make(chan *engine.Engine, 1)
	go func() {
		e2, err := engine.Open(ctx10(t), cfg2)
		if err != nil {
			t.Errorf("reopen: %v", err)
		}
		reopened <- e2
	}()
	r2, _ := stores.get(ids[2])
	waitFor(t, "the reopen to fence replica 2", func() bool { return r2.Epoch() > e.Epoch() })
	g[2].open("WriteAt")
	e2 := recv(t, "the reopen", reopened)
	if e2 == nil {
		t.FailNow()
	}
	t.Cleanup(func() { e2.Close(context.Background(), false) })
	if err := recv(t, "W", wrote); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("W of the crashed engine: %v, want ErrFenced", err)
	}
	a := stores.read(ids[0], e2.Epoch(), off, 4096)
	for i := 1; i < 3; i++ {
		if got := stores.read(ids[i], e2.Epoch(), off, 4096); !bytes.Equal(got, a) {
			t.Fatalf("after the reopen replica %d differs from replica 0 (replica 0 holds W: %v, replica %d holds W: %v)",
				i, bytes.Equal(a, w), i, bytes.Equal(got, w))
		}
	}
}

// ISSUE13 D, Close's path: Close flushed without waiting for the writes
// in flight. Every flush path waits for the writes begun before it.
func TestCloseFlushesAfterTheWritesInFlight(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 10 * time.Second
	e := f.open(cfg)
	slow := f.replica(2)
	holdWrites(slow)
	defer release(slow)
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(context.Background(), randomBytes(110, 4096), 0, false) }()
	waitFor(t, "the write on replica 0", func() bool {
		f.replica(0).mu.Lock()
		defer f.replica(0).mu.Unlock()
		return f.replica(0).writes > 0
	})
	closed := make(chan error, 1)
	go func() { closed <- e.Close(context.Background(), false) }()
	time.Sleep(300 * time.Millisecond)
	for i := range 3 {
		f.replica(i).mu.Lock()
		n := f.replica(i).flushes
		f.replica(i).mu.Unlock()
		if n != 0 {
			t.Fatalf("Close sent replica %d a flush while a write begun before it was unanswered by replica 2", i)
		}
	}
	release(slow)
	if err := recv(t, "the write", wrote); err != nil {
		t.Fatal(err)
	}
	if err := recv(t, "Close", closed); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		f.replica(i).mu.Lock()
		n := f.replica(i).flushes
		f.replica(i).mu.Unlock()
		if n == 0 {
			t.Fatalf("Close did not flush replica %d", i)
		}
	}
}
