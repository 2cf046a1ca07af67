package replica_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/replicatest"
)

// A rebuild is named from BeginRebuild to EndRebuild: BeginRebuild again
// keeps the name (a resumed rebuild keeps its tracking), and a rebuild
// that starts over has a new one. A write for a rebuild that has ended
// (a copy that read its source for it and arrives late) writes nothing,
// even when another rebuild is in progress; one for the rebuild in
// progress is a RebuildWrite.
func TestRebuildSessions(t *testing.T) {
	s := openStore(t, replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t)})
	defer s.Close()
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1, Generation: 1}
	if _, err := r.RebuildSession(o); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("RebuildSession without a rebuild: %v, want ErrInvalid", err)
	}
	if err := r.BeginRebuild(o); err != nil {
		t.Fatal(err)
	}
	first, err := r.RebuildSession(o)
	if err != nil || first == 0 {
		t.Fatalf("RebuildSession = %d, %v", first, err)
	}
	if err := r.BeginRebuild(o); err != nil {
		t.Fatal(err)
	}
	if again, _ := r.RebuildSession(o); again != first {
		t.Fatalf("BeginRebuild during a rebuild renamed it: %d, then %d", first, again)
	}
	if err := r.EndRebuild(o); err != nil {
		t.Fatal(err)
	}
	if err := r.BeginRebuild(o); err != nil {
		t.Fatal(err)
	}
	second, err := r.RebuildSession(o)
	if err != nil || second == first {
		t.Fatalf("a rebuild that started over has the name %d of the one before (%v)", second, err)
	}
	old := bytes.Repeat([]byte{1}, 4096)
	if err := r.RebuildWriteSession(first, o, old, 0); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("a write for the rebuild that ended: %v, want ErrInvalid", err)
	}
	if err := r.RebuildWriteSession(0, o, old, 0); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("a write for session 0: %v, want ErrInvalid", err)
	}
	got := make([]byte, 4096)
	if err := r.ReadAt(o, got, 0); err != nil || !bytes.Equal(got, make([]byte, 4096)) {
		t.Fatalf("a refused write changed the replica (%v)", err)
	}
	cur := bytes.Repeat([]byte{2}, 4096)
	if err := r.RebuildWriteSession(second, o, cur, 0); err != nil {
		t.Fatal(err)
	}
	if err := r.ReadAt(o, got, 0); err != nil || !bytes.Equal(got, cur) {
		t.Fatalf("the write for the rebuild in progress is not there (%v)", err)
	}
	// The rebuild's protection of newer writes holds for named writes too.
	newer := bytes.Repeat([]byte{3}, 4096)
	if err := r.WriteAt(o, newer, 4096); err != nil {
		t.Fatal(err)
	}
	if err := r.RebuildWriteSession(second, o, bytes.Repeat([]byte{4}, 8192), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.ReadAt(o, got, 4096); err != nil || !bytes.Equal(got, newer) {
		t.Fatalf("a named rebuild write overwrote a newer write (%v)", err)
	}
	// A fenced rebuilder learns it from the session, before any copy.
	if err := r.Fence(2); err != nil {
		t.Fatal(err)
	}
	if _, err := r.RebuildSession(o); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("RebuildSession at an epoch below the replica's: %v, want ErrStaleEpoch", err)
	}
}
