package engine_test

import (
	"context"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// TestVolumeGrownDuringAFullRebuildIsWholeOnTheTarget: an online
// expansion (a CSI ControllerExpandVolume) that lands while a replica is
// being filled by a full rebuild. The copy planned its ranges at the old
// size; the target is in the write set, so it must be grown with the
// others (by the engine, and by its server's reconcile, which grows every
// local replica to the volume's size) and take every write to the new
// space. Afterwards every acknowledged write reads back, every replica,
// the rebuilt one included, holds the same bytes over the whole grown
// volume, and none was recorded faulty. The test fails if the copy ended
// before the engine grew the volume; it does not force the writes to the
// new space into the copy (they usually land in it: the copy takes
// 0.2-0.5 s here).
func TestVolumeGrownDuringAFullRebuildIsWholeOnTheTarget(t *testing.T) {
	const oldSize, newSize = 16 << 20, 24 << 20
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour
	}})
	v := createVol(t, c, "v", oldSize, 3)
	cfg := c.EngineConfig("v", "client")
	// Small chunks, one at a time: a copy of 16 MiB long enough for the
	// expansion to land inside it.
	cfg.RebuildChunkBytes, cfg.RebuildInFlight = 8<<10, 1
	e := c.OpenEngine(cfg)
	fill := make([]byte, 1<<20)
	for off := int64(0); off < oldSize; off += int64(len(fill)) {
		copy(fill, randomBytes(uint64(off), len(fill)))
		if err := e.WriteAt(ctx10(t), fill, off, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	l := &ledger{acked: map[int64]uint64{}}
	stop := make(chan struct{})
	done := writer(t, e, oldSize/block, 50, l, stop, nil)

	if _, err := c.Dial().Volumes.ReplaceReplica(ctx10(t), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		copied, left := e.RebuildProgress()
		if left > 0 {
			break // its copy began: it reported its total
		}
		if time.Now().After(deadline) {
			t.Fatalf("the full rebuild's copy did not begin within 20 s (%d bytes copied)", copied)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := c.Dial().Volumes.ExpandVolume(ctx10(t), &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, SizeBytes: newSize}); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(20 * time.Second)
	for e.Size() != newSize {
		if time.Now().After(deadline) {
			t.Fatalf("the engine did not follow the expansion to %d bytes within 20 s (size %d)", newSize, e.Size())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, left := e.RebuildProgress(); left == 0 {
		t.Fatal("the copy ended before the engine grew the volume: the test did not make its sequence")
	}
	// Writes to the new space, each block twice (the second must win on
	// every replica).
	for pass := uint64(1); pass <= 2; pass++ {
		for b := int64(oldSize / block); b < newSize/block; b += 7 {
			s := 60<<32 | pass<<20 | uint64(b)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			err := e.WriteAt(ctx, blockData(s), b*block, false)
			cancel()
			if err != nil {
				t.Fatalf("write to block %d of the new space: %v", b, err)
			}
			l.mu.Lock()
			l.acked[b] = s
			l.mu.Unlock()
		}
	}
	close(stop)
	<-done
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	l.verify(t, e)
	requireIdentical(t, c, v.Id, 60*time.Second)
	// And every replica came through: none was given up (and rebuilt
	// again, which the comparison above would not show).
	evs, err := c.Dial().Cluster.ListEvents(ctx10(t), &storpb.ListEventsRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs.Events {
		if ev.Reason == "ReplicaFaulty" {
			t.Errorf("a replica was recorded faulty: %s", ev.Message)
		}
	}
}
