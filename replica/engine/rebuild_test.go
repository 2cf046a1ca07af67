package engine_test

import (
	"bytes"
	"context"
	"testing"

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
