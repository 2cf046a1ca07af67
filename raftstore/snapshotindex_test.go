package raftstore

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"testing"

	bolt "go.etcd.io/bbolt"

	storpb "github.com/stor-io/stor/api/proto"
)

// snapshotIDs lists volumeID's snapshots ("" for all) in pages of two, as
// ListSnapshots hands them out.
func snapshotIDs(t testing.TB, f *FSM, volumeID string) []string {
	t.Helper()
	var ids []string
	token := ""
	for range 1000 {
		var page []*storpb.Snapshot
		err := f.View(func(r *Reader) error {
			var err error
			page, token, err = r.ListSnapshots(volumeID, Page{Token: token, Limit: 2})
			return err
		})
		if err != nil {
			t.Fatalf("ListSnapshots(%q): %v", volumeID, err)
		}
		for _, s := range page {
			ids = append(ids, s.Id)
		}
		if token == "" {
			return ids
		}
	}
	t.Fatalf("ListSnapshots(%q): more than 1000 pages", volumeID)
	return nil
}

// TestSnapshotsOfOneVolumeReadOnlyItsRecords: creating a snapshot (which
// counts the volume's snapshots against MaxSnapshotsPerVolume) and
// listing one volume's snapshots read that volume's snapshot records
// only, through the volume_snapshots index. Before the index both read
// and decoded every snapshot of the cluster, so applying 50,000 snapshots
// took time quadratic in their number (2,500 took 11 s, 50,000 would have
// taken hours; TestScaleSnapshots); here a record of another volume that
// cannot be decoded shows whether it is read.
func TestSnapshotsOfOneVolumeReadOnlyItsRecords(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"), cmdRegisterServer("s1", "a", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 1), cmdCreateVolume("vol-10", "pvc-10", mib, 1),
		cmdCreateSnapshot("snap-a", "vol-1", "a"), cmdCreateSnapshot("snap-b", "vol-10", "b"))
	// A record of some other volume's snapshot that does not decode.
	if err := f.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSnapshots).Put([]byte("snap-0-other"), []byte{0xff, 0xff})
	}); err != nil {
		t.Fatal(err)
	}
	mustApply(t, f, cmdCreateSnapshot("snap-c", "vol-1", "c"))
	if got, want := snapshotIDs(t, f, "vol-1"), []string{"snap-a", "snap-c"}; !slices.Equal(got, want) {
		t.Errorf("vol-1's snapshots %v, want %v", got, want)
	}
	if got, want := snapshotIDs(t, f, "vol-10"), []string{"snap-b"}; !slices.Equal(got, want) {
		t.Errorf("vol-10's snapshots %v, want %v (a volume whose id extends vol-1's)", got, want)
	}
	mustApply(t, f, cmdDeleteSnapshot("snap-a"))
	if got, want := snapshotIDs(t, f, "vol-1"), []string{"snap-c"}; !slices.Equal(got, want) {
		t.Errorf("vol-1's snapshots after deleting snap-a %v, want %v", got, want)
	}
}

// TestSnapshotIndexRebuiltWhenMissing: a state file or Raft snapshot
// image from before the volume_snapshots index (or one whose index
// disagrees with the snapshots) gets it rebuilt when opened, so one
// volume's listing and the per-volume limit see every snapshot.
func TestSnapshotIndexRebuiltWhenMissing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "meta.db")
	f, err := OpenFSM(path, newTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	mustApply(t, f, cmdInitCluster("c"), cmdRegisterServer("s1", "a", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 1), cmdCreateVolume("vol-2", "pvc-2", mib, 1))
	for i := range MaxSnapshotsPerVolume {
		mustApply(t, f, cmdCreateSnapshot(fmt.Sprintf("snap-%03d", i), "vol-1", fmt.Sprintf("s-%03d", i)))
	}
	mustApply(t, f, cmdCreateSnapshot("snap-x", "vol-2", "x"))
	want := snapshotIDs(t, f, "vol-1")
	if len(want) != MaxSnapshotsPerVolume {
		t.Fatalf("vol-1 lists %d snapshots, want %d", len(want), MaxSnapshotsPerVolume)
	}
	drop := func(f *FSM, keep int) { // leave keep entries of the index
		t.Helper()
		if err := f.db.Update(func(tx *bolt.Tx) error {
			c := tx.Bucket(bucketVolumeSnapshots).Cursor()
			n := 0
			for k, _ := c.First(); k != nil; k, _ = c.Next() {
				if n++; n > keep {
					if err := c.Delete(); err != nil {
						return err
					}
				}
			}
			if keep == 0 {
				return tx.DeleteBucket(bucketVolumeSnapshots)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	check := func(f *FSM, what string) {
		t.Helper()
		if got := snapshotIDs(t, f, "vol-1"); !slices.Equal(got, want) {
			t.Errorf("%s: vol-1 lists %d snapshots, want %d", what, len(got), len(want))
		}
		if got := snapshotIDs(t, f, "vol-2"); !slices.Equal(got, []string{"snap-x"}) {
			t.Errorf("%s: vol-2 lists %v, want [snap-x]", what, got)
		}
		if r := applyCommands(t, f, cmdCreateSnapshot("snap-y", "vol-1", "y"))[0]; !errors.Is(r.err, ErrResourceExhausted) {
			t.Errorf("%s: snapshot %d of vol-1: %v, want ErrResourceExhausted", what, MaxSnapshotsPerVolume+1, r.err)
		}
	}

	// A Raft snapshot image without the index, restored.
	drop(f, 0)
	image := snapshotBytes(t, f)
	g := openTestFSM(t, "")
	if err := g.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
		t.Fatal(err)
	}
	check(g, "restored from an image without the index")

	// The state file without the index, and with part of it, reopened.
	for _, keep := range []int{0, 10} {
		if keep > 0 {
			drop(f, keep)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if f, err = OpenFSM(path, newTestLogger(t)); err != nil {
			t.Fatal(err)
		}
		check(f, fmt.Sprintf("reopened with %d index entries", keep))
	}
	f.Close()
}

// TestDeleteSnapshotDecodesOnlyVolumesNamingIt: deleting a snapshot looks
// for a clone still copying from it (refused then) by decoding only the
// volume records that hold its id. It decoded every volume, 40 ms a
// delete with 10,000 volumes (TestScaleSnapshots); here a volume record
// that cannot be decoded shows whether it is read.
func TestDeleteSnapshotDecodesOnlyVolumesNamingIt(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"), cmdRegisterServer("s1", "a", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 1),
		cmdCreateSnapshot("snap-a", "vol-1", "a"), cmdCreateSnapshot("snap-b", "vol-1", "b"),
		cmdRecordCut("snap-a", 0, []string{"vol-1-r1"}, nil),
		cmdCreateVolumeReq("vol-2", &storpb.CreateVolumeRequest{Name: "pvc-2", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-a"}}}))
	if err := f.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketVolumes).Put([]byte("vol-0-other"), []byte{0xff, 0xff})
	}); err != nil {
		t.Fatal(err)
	}
	if r := applyCommands(t, f, cmdDeleteSnapshot("snap-a"))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Errorf("deleting a snapshot a clone copies from: %v, want ErrFailedPrecondition", r.err)
	}
	mustApply(t, f, cmdDeleteSnapshot("snap-b"))
	mustApply(t, f, cmdRecordCloneCopied("vol-2", "vol-2-r1"), cmdDeleteSnapshot("snap-a"))
}
