package server_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
)

// TestSnapshotsSurviveARestartOfEveryServer: a volume with two
// snapshots, each server restarted in turn (whose store then leaves the
// snapshot layers unopened until a request needs them: replica/doc.go,
// "Open files"), serves each snapshot as it was cut from every replica,
// the head as last written, and a snapshot deleted after the restart
// merges into the layer above it without changing what the other reads.
func TestSnapshotsSurviveARestartOfEveryServer(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	const blocks = 256 // 1 MiB
	v := createVolume(t, c.Client(leader), "restarted", blocks*snapBlock, 3)
	e := c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	ctx := ctxT(t, 3*time.Minute)
	write := func(b, g uint64) {
		t.Helper()
		if err := e.WriteAt(ctx, blockData(b, g), int64(b*snapBlock), false); err != nil {
			t.Fatal(err)
		}
	}
	// Block 0 at generation 1 and block 1 at 1 under s1; block 1 at 2
	// under s2; block 0 at 3 in the head.
	write(0, 1)
	write(1, 1)
	snap := func(name string) *storpb.Snapshot {
		t.Helper()
		s := createSnapshot(t, c, leader, v.Id, name)
		return waitSnapshot(t, c, leader, s.Id, 30*time.Second, name+" ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse })
	}
	s1 := snap("s1")
	write(1, 2)
	s2 := snap("s2")
	write(0, 3)
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	for i := range c.Nodes {
		c.Restart(i)
	}
	leader = c.Leader(20 * time.Second)

	want := func(s *storpb.Snapshot, gens map[uint64]uint64) {
		t.Helper()
		for _, r := range v.Replicas {
			var data []byte
			var err error
			// A restarted server may still be catching up: retry briefly.
			for try := 0; try < 50; try++ {
				if data, err = c.ReadSnapshot(v.Id, replica.LayerName(s.Id, s.CutEpoch), r.Id, s.SizeBytes); err == nil {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				t.Fatalf("read snapshot %s from %s after the restarts: %v", s.Name, r.Id, err)
			}
			for b := uint64(0); b < 2; b++ {
				g, ok := decodeBlock(data[b*snapBlock:(b+1)*snapBlock], b)
				if !ok || g != gens[b] {
					t.Errorf("snapshot %s on %s, block %d: generation %d (whole %v), want %d", s.Name, r.Id, b, g, ok, gens[b])
				}
			}
			if !bytes.Equal(data[2*snapBlock:], make([]byte, len(data)-2*snapBlock)) {
				t.Errorf("snapshot %s on %s: data past block 1, where nothing was written", s.Name, r.Id)
			}
		}
	}
	want(s1, map[uint64]uint64{0: 1, 1: 1})
	want(s2, map[uint64]uint64{0: 1, 1: 2})

	e = c.OpenEngine(c.EngineConfig(v.Name, "node-1"))
	got := make([]byte, 2*snapBlock)
	if err := e.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	for b, g := range []uint64{3, 2} {
		if h, ok := decodeBlock(got[b*snapBlock:(b+1)*snapBlock], uint64(b)); !ok || h != g {
			t.Errorf("head block %d after the restarts: generation %d (whole %v), want %d", b, h, ok, g)
		}
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	// s1's layer merges into s2's on every replica; s2 reads the same.
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DeleteSnapshotResponse, error) {
		return c.Client(leader).Snapshots.DeleteSnapshot(ctx, &storpb.DeleteSnapshotRequest{Snapshot: snapRef(s1.Id)})
	})
	for _, r := range v.Replicas {
		deadline := time.Now().Add(30 * time.Second)
		for {
			_, err := c.ReadSnapshot(v.Id, replica.LayerName(s1.Id, s1.CutEpoch), r.Id, s1.SizeBytes)
			if errors.Is(err, replica.ErrNotFound) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("snapshot s1's layer on %s not merged within 30 s: %v", r.Id, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	want(s2, map[uint64]uint64{0: 1, 1: 2})
}
