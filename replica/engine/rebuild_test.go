package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
)

func TestInterruptedFullRebuildResumesFromItsCheckpoint(t *testing.T) {
	const size = 8 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(30, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	plan := engine.RebuildPlan{Size: size, CheckpointBytes: 1 << 20}

	// First attempt: stopped after its third checkpoint.
	ctx, cancel := context.WithCancel(context.Background())
	var checkpoints []int64
	_, err := engine.Rebuild(ctx, o, engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}, conn{dst}, plan,
		func(p engine.Progress) {
			if p.ResumeOffset == 0 {
				return
			}
			dst.mu.Lock()
			flushed := dst.flushes
			dst.mu.Unlock()
			if flushed < len(checkpoints)+1 {
				t.Errorf("checkpoint at %d reported before the target flushed", p.ResumeOffset)
			}
			checkpoints = append(checkpoints, p.ResumeOffset)
			if len(checkpoints) == 3 {
				cancel()
			}
		})
	if err == nil {
		t.Fatal("the interrupted rebuild reported success")
	}
	if len(checkpoints) != 3 || checkpoints[2] != 3<<20 {
		t.Fatalf("checkpoints %v, want three, the last at 3 MiB", checkpoints)
	}

	// Second attempt resumes: it copies only what lies above the checkpoint.
	dst.mu.Lock()
	before := dst.rebuildOps
	dst.mu.Unlock()
	plan.ResumeFrom = checkpoints[2]
	st, err := engine.Rebuild(context.Background(), o, engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}, conn{dst}, plan, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st.Bytes != size-3<<20 {
		t.Fatalf("resumed rebuild copied %d bytes, want %d", st.Bytes, size-3<<20)
	}
	if !bytes.Equal(dst.snapshot(), full) {
		t.Fatal("after the resumed rebuild the target differs from the source")
	}
	dst.mu.Lock()
	defer dst.mu.Unlock()
	if dst.rebuildOps-before != 5 {
		t.Fatalf("resumed rebuild issued %d copy writes, want 5 (1 MiB each above 3 MiB)", dst.rebuildOps-before)
	}
}

// A full rebuild resumed with no write order (a server's rebuild of a
// detached volume) at a checkpoint an engine recorded, after that engine
// died with two writes that reached only the target: one below the
// checkpoint, one above it in a sector the target's tracking then kept.
// The resumed copy skipped the first (below its start) and the second
// (tracked), and its flushes would clear their dirty regions: the target
// came out different from the source. Now it resets the tracking and
// copies the target's dirty regions below the checkpoint too.
func TestAnUnorderedResumeTrustsNoDeadEnginesWrites(t *testing.T) {
	const size = 8 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(31, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	plan := engine.RebuildPlan{Size: size, CheckpointBytes: 1 << 20}
	source := engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}

	// The engine's rebuild, stopped after its third checkpoint (3 MiB).
	ctx, cancel := context.WithCancel(context.Background())
	var resume int64
	_, err := engine.Rebuild(ctx, o, source, conn{dst}, plan, func(p engine.Progress) {
		if p.ResumeOffset >= 3<<20 && resume == 0 {
			resume = p.ResumeOffset
			cancel()
		}
	})
	if err == nil || resume != 3<<20 {
		t.Fatalf("the first attempt: %v, checkpoint %d; want it stopped at 3 MiB", err, resume)
	}
	// Its last writes, which reached the target alone.
	unacked := bytes.Repeat([]byte{0xd1}, 4096)
	for _, off := range []int64{1<<20 + 4096, 5 << 20} {
		if err := (conn{dst}).WriteAt(context.Background(), o, unacked, off); err != nil {
			t.Fatal(err)
		}
	}

	// Resumed by a server, with no write order.
	plan.ResumeFrom = resume
	if _, err := engine.Rebuild(context.Background(), o, source, conn{dst}, plan, nil); err != nil {
		t.Fatal(err)
	}
	got := dst.snapshot()
	for _, off := range []int{1<<20 + 4096, 5 << 20} {
		if !bytes.Equal(got[off:off+4096], full[off:off+4096]) {
			t.Errorf("after the resumed rebuild the target's block at %d is the dead engine's write, not the source's", off)
		}
	}
	if !bytes.Equal(got, full) {
		t.Error("after the resumed rebuild the target differs from the source")
	}
}

// The same resume takes no checkpoint while it copies the target's dirty
// regions below its start: a checkpoint there flushes the target, which
// clears the dirty regions not yet copied, and an attempt interrupted
// after it would leave the next one no record of them. Here the resume
// is interrupted at its first checkpoint and resumed again.
func TestAnUnorderedResumeTakesNoCheckpointBelowItsStart(t *testing.T) {
	const size = 8 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(32, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	// An engine copied and flushed everything below 3 MiB (its
	// checkpoint), then died with two writes on the target alone.
	if err := (conn{dst}).WriteAt(context.Background(), o, full[:3<<20], 0); err != nil {
		t.Fatal(err)
	}
	if err := (conn{dst}).Flush(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	unacked := bytes.Repeat([]byte{0xd2}, 4096)
	for _, off := range []int64{4096, 2<<20 + 4096} { // two dirty regions below the checkpoint
		if err := (conn{dst}).WriteAt(context.Background(), o, unacked, off); err != nil {
			t.Fatal(err)
		}
	}
	plan := engine.RebuildPlan{Size: size, CheckpointBytes: 1 << 20, ChunkBytes: 1 << 20, InFlight: 1, ResumeFrom: 3 << 20}
	source := engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}
	// The resumed rebuild is itself interrupted at its first checkpoint
	// (its server restarts, say), and resumed again from there.
	ctx, cancel := context.WithCancel(context.Background())
	var first int64
	_, err := engine.Rebuild(ctx, o, source, conn{dst}, plan, func(p engine.Progress) {
		if p.ResumeOffset > 0 && first == 0 {
			first = p.ResumeOffset
			cancel()
		}
	})
	cancel()
	if err == nil || first == 0 {
		t.Fatalf("the resumed rebuild, to be stopped at its first checkpoint: %v, checkpoint %d", err, first)
	}
	if first <= plan.ResumeFrom {
		t.Errorf("checkpoint %d of a rebuild resumed at %d: a checkpoint below it flushed the target while dirty regions below it were still to copy", first, plan.ResumeFrom)
	}
	plan.ResumeFrom = max(plan.ResumeFrom, first) // what Raft keeps
	if _, err := engine.Rebuild(context.Background(), o, source, conn{dst}, plan, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.snapshot(), full) {
		t.Error("after the rebuild, resumed twice, the target differs from the source")
	}
}

// Found by jepsen (seed 7, link-lossy): a rebuild failed half-way (the
// target's connection was reset), the target was marked faulty and left
// the write set, and missed writes; the next rebuild's BeginRebuild kept
// the first attempt's tracking, so the blocks written during that attempt
// were skipped by the copy and the target came back healthy with old
// data. A rebuild that starts over must start its tracking over.
func TestRebuildAfterAFailedOneCopiesBlocksTheFailedOneSawWritten(t *testing.T) {
	const size = 2 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	ctx := context.Background()
	// The failed attempt: tracking begun, a normal write reached both.
	if err := (conn{dst}).BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	old := randomBytes(70, 4096)
	for _, r := range []*memReplica{src, dst} {
		if err := (conn{r}).WriteAt(ctx, o, old, 8192); err != nil {
			t.Fatal(err)
		}
	}
	// The target is out of the write set: a newer write reaches only the
	// source.
	o2 := replica.Op{Epoch: 1, Generation: 2}
	newer := randomBytes(71, 4096)
	if err := (conn{src}).WriteAt(ctx, o2, newer, 8192); err != nil {
		t.Fatal(err)
	}
	// The next rebuild, a delta from the fault's generation.
	plan := engine.RebuildPlan{Size: size, FromGeneration: 2}
	if _, err := engine.Rebuild(ctx, o2, engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}, conn{dst}, plan, nil); err != nil {
		t.Fatal(err)
	}
	if got := dst.snapshot()[8192 : 8192+4096]; !bytes.Equal(got, newer) {
		t.Fatalf("the rebuilt target holds the older write (%v) instead of the newer one", bytes.Equal(got, old))
	}
}

// A delta rebuild reads the write history of every healthy replica. When
// one of them fails to give it, that replica is the one to record faulty,
// not the rebuild's read source: blaming the source took a replica that
// held every write out of the read set and left the failing one as the
// last healthy copy, which then lost a write a read had already returned
// (jepsen seed 1016; see docs/JEPSEN.md).
func TestRebuildBlamesTheReplicaWhoseHistoryFailed(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.LocalServerID = f.vol.Replicas[0].ServerId // replica 0 is the rebuild's read source
	e := f.open(cfg)
	if err := e.WriteAt(ctx10(t), randomBytes(20, 64<<10), 0, false); err != nil {
		t.Fatal(err)
	}
	// Replica 2 fails a write and is recorded faulty; a write at the new
	// generation gives the delta something to copy.
	target, source, broken := f.replica(2), f.replica(0), f.replica(1)
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(21, 4096), 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := e.WriteAt(ctx10(t), randomBytes(22, 4096), 3<<20, false); err != nil {
		t.Fatal(err)
	}
	// Replica 1 can no longer read its write history; replica 2 comes
	// back, and the leader starts its delta rebuild.
	broken.mu.Lock()
	broken.failHist = true
	broken.mu.Unlock()
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()

	deadline := time.Now().Add(15 * time.Second)
	for {
		v := f.volume()
		if v.Replicas[0].State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			t.Fatalf("the rebuild's read source %s was recorded %v for another replica's history failure; replica 1 is %v",
				v.Replicas[0].Id, v.Replicas[0].State, v.Replicas[1].State)
		}
		if v.Replicas[1].State == storpb.ReplicaState_REPLICA_STATE_FAULTY {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica 1, whose write history fails, not recorded faulty: %v", v.Replicas)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Replica 0, which holds every write, still serves: the rebuild goes on
	// from it alone and the volume stays writable.
	if err := e.WriteAt(ctx10(t), randomBytes(23, 4096), 5<<20, false); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(15 * time.Second)
	for f.volume().Replicas[2].State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		if time.Now().After(deadline) {
			t.Fatalf("replica 2 not rebuilt from replica 0: %v", f.volume().Replicas[2])
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(source.snapshot(), target.snapshot()) {
		t.Fatal("the rebuilt replica differs from its source")
	}
}

// recordingOrder is a WriteOrder that records what it holds, for a target
// that checks each request against it.
type recordingOrder struct {
	mu       sync.Mutex
	held     map[replica.Extent]int // ranges held by LockCopy
	flushing bool                   // a flush runs in Flush
	flushes  int
}

func (o *recordingOrder) LockCopy(ctx context.Context, off, n int64) (context.Context, func(), error) {
	x := replica.Extent{Off: off, Len: n}
	o.mu.Lock()
	o.held[x]++
	o.mu.Unlock()
	return ctx, func() {
		o.mu.Lock()
		o.held[x]--
		o.mu.Unlock()
	}, nil
}

func (o *recordingOrder) Flush(ctx context.Context, flush func(context.Context) error) error {
	o.mu.Lock()
	o.flushing = true
	o.flushes++
	o.mu.Unlock()
	defer func() {
		o.mu.Lock()
		o.flushing = false
		o.mu.Unlock()
	}()
	return flush(ctx)
}

// orderedTarget fails a copy written outside a range its order holds, and
// a flush sent outside the order's Flush.
type orderedTarget struct {
	conn
	o *recordingOrder
}

func (c orderedTarget) RebuildWrite(ctx context.Context, op replica.Op, p []byte, off int64) error {
	c.o.mu.Lock()
	held := false
	for x, n := range c.o.held {
		held = held || (n > 0 && x.Off <= off && off+int64(len(p)) <= x.Off+x.Len)
	}
	c.o.mu.Unlock()
	if !held {
		return fmt.Errorf("copy of %d bytes at %d written without holding its range against writes", len(p), off)
	}
	return c.conn.RebuildWrite(ctx, op, p, off)
}

func (c orderedTarget) Flush(ctx context.Context, op replica.Op) error {
	c.o.mu.Lock()
	inOrder := c.o.flushing
	c.o.mu.Unlock()
	if !inOrder {
		return errors.New("target flushed outside the engine's flush order")
	}
	return c.conn.Flush(ctx, op)
}

// ISSUE13 C and D on the rebuild's side: each chunk is copied while its
// range is held against writes, and every flush of the target (the
// checkpoints and the last) goes through the engine's flush order.
func TestRebuildCopiesUnderItsOrderAndFlushesInIt(t *testing.T) {
	const size = 4 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(40, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	order := &recordingOrder{held: map[replica.Extent]int{}}
	plan := engine.RebuildPlan{Size: size, CheckpointBytes: 1 << 20, Order: order}
	if _, err := engine.Rebuild(context.Background(), o, engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}},
		orderedTarget{conn{dst}, order}, plan, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.snapshot(), full) {
		t.Fatal("the target differs from the source")
	}
	if order.flushes != 4 { // three checkpoints and the last (none at the end, where the last follows at once)
		t.Fatalf("%d flushes in the engine's order, want 4", order.flushes)
	}
}

// heldRead is a source whose read at off waits until release is closed.
type heldRead struct {
	conn
	off     int64
	release chan struct{}
}

func (c heldRead) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if off == c.off {
		select {
		case <-c.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return c.conn.ReadAt(ctx, o, p, off)
}

// The copy has several chunks in flight, and they finish out of order: a
// checkpoint still names only an offset below which every chunk was
// written to the target before its flush. Here the first chunk's read
// waits until the three after it are on the target; a checkpoint counted
// from those would let a resumed rebuild skip the first chunk.
func TestPipelinedRebuildCheckpointsOnlyBelowEveryCopiedChunk(t *testing.T) {
	const size = 8 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(50, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	go func() { // the first chunk's read goes on once three others are copied
		defer close(release)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			dst.mu.Lock()
			copied := dst.rebuildOps
			dst.mu.Unlock()
			if copied >= 3 {
				return
			}
		}
		t.Error("the chunks after the first were not copied while its read was held: the copy is not pipelined")
	}()
	plan := engine.RebuildPlan{Size: size, CheckpointBytes: 1 << 20, ChunkBytes: 1 << 20, InFlight: 4}
	var checkpoints []int64
	_, err := engine.Rebuild(context.Background(), o, engine.RebuildSource{Read: heldRead{conn{src}, 0, release}, History: []engine.ReplicaConn{conn{src}}}, conn{dst}, plan,
		func(p engine.Progress) {
			if p.ResumeOffset == 0 {
				return
			}
			if got := dst.snapshot()[:p.ResumeOffset]; !bytes.Equal(got, full[:p.ResumeOffset]) {
				t.Errorf("checkpoint at %d MiB, but the target below it differs from the source", p.ResumeOffset>>20)
			}
			checkpoints = append(checkpoints, p.ResumeOffset)
		})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.snapshot(), full) {
		t.Fatal("the target differs from the source")
	}
	var want []int64
	for off := int64(1 << 20); off < size; off += 1 << 20 {
		want = append(want, off)
	}
	if fmt.Sprint(checkpoints) != fmt.Sprint(want) {
		t.Fatalf("checkpoints %v, want one after every MiB but the last: %v", checkpoints, want)
	}
}

// Each chunk of a pipelined copy keeps the rule of a single copy (ISSUE13
// C): a write in flight on the source when its chunk's copy begins is not
// overwritten by that copy. Four writes, one in each chunk of a delta of
// four 1 MiB regions copied four at once, are in flight on the rebuild's
// source (and already on the target) while the copy runs; after it every
// replica holds every one of them, and the target is the source's copy.
func TestPipelinedRebuildCopiesNoChunkOverAWriteInFlight(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 10 * time.Second               // the held requests below must not time out
	cfg.LocalServerID = f.vol.Replicas[0].ServerId // replica 0 is the rebuild's source
	cfg.RebuildInFlight, cfg.RebuildChunkBytes = 4, 1<<20
	e := f.open(cfg)
	source, target := f.replica(0), f.replica(2)
	offs := []int64{64 << 10, 1<<20 + 8<<10, 2<<20 + 512<<10, 4<<20 - 4096}

	// Replica 2 fails a write and is recorded faulty; writes at the new
	// generation make the four regions the delta to copy.
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	for i, off := range offs {
		if err := e.WriteAt(ctx10(t), randomBytes(200+uint64(i), 4096), off, false); err != nil {
			t.Fatal(err)
		}
	}
	begin := target.gates.shut("BeginRebuild")
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()
	if begin.count(1, 10*time.Second) != 1 {
		t.Fatal("the rebuild of replica 2 did not start")
	}
	// The writes reach replica 1 and the target, not yet the source.
	holdWrites(source)
	defer release(source)
	ws := make([][]byte, len(offs))
	wrote := make(chan error, len(offs))
	for i, off := range offs {
		ws[i] = randomBytes(210+uint64(i), 4096)
		go func() { wrote <- e.WriteAt(ctx10(t), ws[i], off, false) }()
	}
	waitFor(t, "the writes on replicas 1 and 2", func() bool {
		r1, r2 := f.replica(1).snapshot(), target.snapshot()
		for i, off := range offs {
			if !bytes.Equal(r1[off:off+4096], ws[i]) || !bytes.Equal(r2[off:off+4096], ws[i]) {
				return false
			}
		}
		return true
	})
	// The copy runs while every write is in flight on the source; it has
	// a second before they reach it.
	target.gates.open("BeginRebuild")
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		target.mu.Lock()
		copied := target.rebuildOps
		target.mu.Unlock()
		if copied == len(offs) {
			break
		}
	}
	release(source)
	for range offs {
		if err := recv(t, "a write", wrote); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "replica 2 healthy", func() bool {
		return f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	})
	for r := range 3 {
		got := f.replica(r).snapshot()
		for i, off := range offs {
			if !bytes.Equal(got[off:off+4096], ws[i]) {
				t.Fatalf("replica %d lacks the acknowledged write at %d after the rebuild", r, off)
			}
		}
	}
	if !bytes.Equal(source.snapshot(), target.snapshot()) {
		t.Fatal("the rebuilt replica differs from its source")
	}
}

// A chunk size that is not whole sectors is rounded down to whole sectors:
// every copy request is one a replica takes.
func TestRebuildChunkIsWholeSectors(t *testing.T) {
	const size = 6 << 20
	src, dst := newMemReplica("src", size), newMemReplica("dst", size)
	o := replica.Op{Epoch: 1, Generation: 1}
	full := randomBytes(60, size)
	if err := (conn{src}).WriteAt(context.Background(), o, full, 0); err != nil {
		t.Fatal(err)
	}
	plan := engine.RebuildPlan{Size: size, ChunkBytes: 3<<19 + 100, InFlight: 3} // 1.5 MiB and 100 bytes
	st, err := engine.Rebuild(context.Background(), o, engine.RebuildSource{Read: conn{src}, History: []engine.ReplicaConn{conn{src}}}, conn{dst}, plan, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.snapshot(), full) || st.Bytes != size {
		t.Fatalf("the target differs from the source (%d bytes copied)", st.Bytes)
	}
	dst.mu.Lock()
	defer dst.mu.Unlock()
	if dst.rebuildOps != 4 {
		t.Fatalf("%d copy requests, want 4 of 1.5 MiB", dst.rebuildOps)
	}
}
