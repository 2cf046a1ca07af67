package engine_test

import (
	"errors"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
)

// TestDetachFencesTheEngine: a detach raises the epoch, and an engine
// that is still open (its node lost, the volume unpublished) fences
// itself when its watch shows the higher epoch, without touching a
// replica again. (Blind engines are fenced by the replicas instead; see
// internal/server TestSnapshotDetachedFencesAZombieEngine.)
func TestDetachFencesTheEngine(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if err := e.WriteAt(ctx10(t), randomBytes(1, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	resp, err := f.client.Volumes.DetachVolume(ctx10(t), &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: f.vol.Id}, NodeId: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Volume.Epoch <= e.Epoch() {
		t.Fatalf("detach left the epoch at %d; the engine holds %d", resp.Volume.Epoch, e.Epoch())
	}
	deadline := time.Now().Add(10 * time.Second)
	for !e.Fenced() {
		if time.Now().After(deadline) {
			t.Fatal("the engine did not fence itself after its volume was detached")
		}
		time.Sleep(20 * time.Millisecond)
	}
	r := f.replica(0)
	count := func() int {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.writes
	}
	writes := count()
	if err := e.WriteAt(ctx10(t), randomBytes(2, 4096), 0, false); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("write after the detach: %v, want ErrFenced", err)
	}
	if got := count(); got != writes {
		t.Fatalf("a fenced engine's write reached a replica (%d writes, was %d)", got, writes)
	}
}
