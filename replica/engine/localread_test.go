package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
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
	// The view of the old chain went stale; one of the new chain (blocks
	// from the snapshot's layer, or the head once written) is opened
	// after localRetry at most.
	untilDirect("with a snapshot")
	write(4, 304) // written after the view opened: read from the head
	write(6, 0)
	if n := readAll("with a snapshot, after more writes"); n != blocks {
		t.Fatalf("%d of %d reads short-circuited with a snapshot layer", n, blocks)
	}
	if err := e.WriteZeroes(ctx10(t), 8*block, block, false); err != nil {
		t.Fatal(err)
	}
	delete(seeds, 8)
	if n := readAll("with a snapshot, after a zeroed block"); n != blocks {
		t.Fatalf("%d of %d reads short-circuited after WriteZeroes", n, blocks)
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

	// A takeover fences this engine: its reads fail, direct or not. (Its
	// watch usually fences it before the read; that the replica's epoch
	// raise ends a view by itself is TestOpenDirect's and
	// TestViewReadsAndGoesStale's to show.)
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

// TestNoDirectReadsOfAServerProcessTheEngineDoesNotHold: an engine that
// has no view of its local replica open (here: it has only written) when
// the replica's server restarts must not open one of the restarted
// process. The first read after the restart goes through the server,
// whose connection died with the old process: the replica is recorded
// faulty and the read served by another. A new view used to be opened at
// once (same epoch, no rebuild: the replica store saw nothing wrong), and
// after a crash, which loses the writes a replica acknowledged since its
// last flush, it read holes where the engine had writes acknowledged.
// servertest's restart is clean (the store is flushed), so the data reads
// right either way; what must not happen is the direct read itself. A
// handle of the replica at the same epoch opened by anyone else (here an
// inspection; a rebuild's copy source is another) vouches for nothing.
func TestNoDirectReadsOfAServerProcessTheEngineDoesNotHold(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{LocalSockets: true})
	v := createVol(t, c, "sc-restart", 4<<20, 3)
	cfg := c.EngineConfig("sc-restart", "node-a")
	cfg.LocalReaders = c.LocalReaders(0)
	e := c.OpenEngine(cfg)
	const blocks = 16
	for b := int64(0); b < blocks; b++ {
		if err := e.WriteAt(ctx10(t), blockData(uint64(700+b)), b*block, false); err != nil {
			t.Fatal(err)
		}
	}
	c.Restart(0)

	// Someone else's handle of the restarted replica at the volume's epoch.
	cl := c.Dial()
	gv, err := cl.Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	if err != nil {
		t.Fatal(err)
	}
	var rid string
	for _, r := range gv.Volume.Replicas {
		if r.ServerId == c.Nodes[0].ID {
			rid = r.Id
		}
	}
	var d net.Dialer
	conn, err := wire.Dial(ctx10(t), "tcp", c.Nodes[0].DataAddr, wire.ClientConfig{Dial: d.DialContext})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.OpenFor(ctx10(t), wire.OpenRequest{Replica: rid, Volume: v.Id, Epoch: gv.Volume.Epoch, Purpose: wire.PurposeInspect}); err != nil {
		t.Fatal(err)
	}

	got := make([]byte, block)
	for b := int64(0); b < blocks; b++ {
		if err := e.ReadAt(ctx10(t), got, b*block); err != nil {
			t.Fatalf("read block %d after the local server restarted: %v", b, err)
		}
		if !bytes.Equal(got, blockData(uint64(700+b))) {
			t.Fatalf("block %d after the local server restarted does not hold its acknowledged write", b)
		}
	}
	if n := e.ShortCircuitReads(); n != 0 {
		t.Fatalf("%d of %d reads after the restart went directly to the restarted server's replica, which this engine never opened", n, blocks)
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

// TestShortCircuitReadsUnderFaults: writers write blocks and read each one
// straight back (the block's only writer, so the read must return that
// write) while every step that must end a direct view happens under
// them, in turn: snapshot cuts and merges, the restart of a server whose
// replica is being read directly, a replica moved (rebuilt elsewhere), an
// expansion. Every server is on this host, so every read that can go
// direct does.
func TestShortCircuitReadsUnderFaults(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, LocalSockets: true})
	v := createVol(t, c, "scf", 4<<20, 3)
	cfg := c.EngineConfig("scf", "node-a")
	cfg.LocalReaders = c.LocalReaders(0, 1, 2, 3)
	e := c.OpenEngine(cfg)
	cl := c.Dial()

	const workers, blocks = 4, 256
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	acked := map[int64]uint64{}
	var checked atomic.Int64
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 9))
			got := make([]byte, block)
			for i := uint64(0); ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				b := int64(rng.IntN(blocks/workers)*workers + w) // this worker's blocks only
				seed := uint64(w)<<40 | i
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				err := e.WriteAt(ctx, blockData(seed), b*block, false)
				if err == nil {
					err = e.ReadAt(ctx, got, b*block)
				}
				cancel()
				if err != nil {
					t.Errorf("worker %d, block %d: %v", w, b, err)
					return
				}
				if !bytes.Equal(got, blockData(seed)) {
					t.Errorf("worker %d: block %d read right after its acknowledged write returned other data (direct reads so far: %d)", w, b, e.ShortCircuitReads())
					return
				}
				checked.Add(1)
				mu.Lock()
				acked[b] = seed
				mu.Unlock()
			}
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	// phase waits, after a step, until 200 more writes were read back
	// directly.
	phase := func(what string) {
		t.Helper()
		n0, d0 := checked.Load(), e.ShortCircuitReads()
		deadline := time.Now().Add(20 * time.Second)
		for checked.Load() < n0+200 || e.ShortCircuitReads() < d0+200 {
			if t.Failed() {
				t.FailNow()
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d reads checked, %d direct, within 20s", what, checked.Load()-n0, e.ShortCircuitReads()-d0)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	phase("start")
	for round := range 2 {
		snap, err := cl.Snapshots.CreateSnapshot(ctx10(t), &storpb.CreateSnapshotRequest{VolumeId: v.Id, Name: fmt.Sprintf("s%d", round)})
		if err != nil {
			t.Fatal(err)
		}
		waitSnapshotReady(t, cl, snap.Snapshot.Id)
		time.Sleep(200 * time.Millisecond) // writes and reads with the snapshot layer
		if _, err := cl.Snapshots.DeleteSnapshot(ctx10(t), &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: snap.Snapshot.Id}}); err != nil {
			t.Fatal(err)
		}
		phase(fmt.Sprintf("snapshot %d merged", round))
	}
	cur := func() *storpb.Volume {
		resp, err := cl.Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Volume
	}
	// The replica read directly is the first healthy one by id (every
	// server is local): restart its server.
	first := cur().Replicas[0]
	for _, r := range cur().Replicas {
		if r.Id < first.Id {
			first = r
		}
	}
	for i, n := range c.Nodes {
		if n.ID == first.ServerId {
			c.Restart(i)
		}
	}
	waitAllHealthy(t, c, v.Id, 30*time.Second)
	phase("the read replica's server restarted")

	if _, err := cl.Volumes.ReplaceReplica(ctx10(t), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: cur().Replicas[1].Id}); err != nil {
		t.Fatal(err)
	}
	waitAllHealthy(t, c, v.Id, 30*time.Second)
	phase("a replica moved")

	if _, err := cl.Volumes.ExpandVolume(ctx10(t), &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, SizeBytes: 8 << 20}); err != nil {
		t.Fatal(err)
	}
	// The engine grows every replica before it takes the new size.
	for deadline := time.Now().Add(20 * time.Second); e.Size() != 8<<20; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the engine did not grow to 8 MiB within 20s (size %d)", e.Size())
		}
	}
	phase("expanded")

	close(stop)
	wg.Wait()
	stop = make(chan struct{})
	mu.Lock()
	defer mu.Unlock()
	got := make([]byte, block)
	for b, s := range acked {
		if err := e.ReadAt(ctx10(t), got, b*block); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, blockData(s)) {
			t.Fatalf("block %d does not hold its last acknowledged write", b)
		}
	}
	requireIdentical(t, c, v.Id, 30*time.Second)
	t.Logf("%d writes read back, %d reads direct", checked.Load(), e.ShortCircuitReads())
}
