package engine_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
)

// TestShortCircuitReads runs an engine whose host also runs the first
// server, with short-circuit reads of its replica, through the sequence
// where a direct read could go wrong: reads after writes, a snapshot cut
// (the old head becomes the snapshot: a view still reading it would miss
// later writes), the snapshot's merge (direct reads resume), the local
// replica's server restarting (its replica rebuilt before it is read
// again), and a takeover (the fenced engine must fail, not read).
func TestShortCircuitReads(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{LocalSockets: true})
	v := createVol(t, c, "sc", 4<<20, 3)
	cfg := c.EngineConfig("sc", "node-a")
	cfg.LocalReaders = c.LocalReaders(0)
	e := c.OpenEngine(cfg)

	const blocks = 64
	seeds := map[int64]uint64{}
	write := func(b int64, seed uint64) {
		t.Helper()
		if err := e.WriteAt(ctx10(t), blockData(seed), b*block, false); err != nil {
			t.Fatalf("write block %d: %v", b, err)
		}
		seeds[b] = seed
	}
	readAll := func(what string) int64 {
		t.Helper()
		before := e.ShortCircuitReads()
		got := make([]byte, block)
		for b := int64(0); b < blocks; b++ {
			if err := e.ReadAt(ctx10(t), got, b*block); err != nil {
				t.Fatalf("%s: read block %d: %v", what, b, err)
			}
			want := make([]byte, block)
			if s, ok := seeds[b]; ok {
				want = blockData(s)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: block %d does not hold its last acknowledged write", what, b)
			}
		}
		return e.ShortCircuitReads() - before
	}
	// untilDirect reads everything until the reads go direct again (a
	// failed open is retried after engine's localRetry).
	untilDirect := func(what string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for readAll(what) != blocks {
			if time.Now().After(deadline) {
				t.Fatalf("%s: reads did not go direct again", what)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}

	for b := int64(0); b < blocks; b += 2 {
		write(b, uint64(100+b))
	}
	if n := readAll("after writes"); n != blocks {
		t.Fatalf("%d of %d reads were short-circuited; want all (the first server holds a healthy replica)", n, blocks)
	}
	write(1, 201) // a write after the view opened is read back directly
	if n := readAll("after a later write"); n != blocks {
		t.Fatalf("%d of %d reads short-circuited after a write", n, blocks)
	}

	// A snapshot: the head the view reads becomes the snapshot layer.
	cl := c.Dial()
	snap, err := cl.Snapshots.CreateSnapshot(ctx10(t), &storpb.CreateSnapshotRequest{VolumeId: v.Id, Name: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	waitSnapshotReady(t, cl, snap.Snapshot.Id)
	write(0, 300)
	write(1, 301)
	if n := readAll("with a snapshot"); n != 0 {
		t.Fatalf("%d reads short-circuited while the replica has a snapshot layer", n)
	}
	if _, err := cl.Snapshots.DeleteSnapshot(ctx10(t), &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: snap.Snapshot.Id}}); err != nil {
		t.Fatal(err)
	}
	untilDirect("after the snapshot was merged")

	// The local server restarts: its replica leaves the set at the next
	// write, is rebuilt, and is read directly again once healthy.
	c.Restart(0)
	write(2, 402)
	write(3, 403)
	requireIdentical(t, c, v.Id, 30*time.Second)
	untilDirect("after the local server restarted")

	// A takeover fences this engine: its reads fail, direct or not.
	cfg2 := c.EngineConfig("sc", "node-b")
	cfg2.Takeover = true
	e2 := c.OpenEngine(cfg2)
	if err := e2.WriteAt(ctx10(t), blockData(500), 0, false); err != nil {
		t.Fatal(err)
	}
	before := e.ShortCircuitReads()
	err = e.ReadAt(ctx10(t), make([]byte, block), 0)
	if !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("read by the fenced engine: %v, want ErrFenced", err)
	}
	if n := e.ShortCircuitReads() - before; n != 0 {
		t.Fatalf("the fenced engine read %d blocks directly", n)
	}
}

func waitSnapshotReady(t *testing.T, cl *client.Client, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, err := cl.Snapshots.GetSnapshot(ctx10(t), &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
		if err != nil {
			t.Fatal(err)
		}
		if got.Snapshot.ReadyToUse {
			return
		}
		if got.Snapshot.Failed || time.Now().After(deadline) {
			t.Fatalf("snapshot not ready: %v", got.Snapshot)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
