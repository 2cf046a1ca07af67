package raftstore

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

func allocated(t *testing.T, f *FSM, server string) uint64 {
	t.Helper()
	var s *storpb.Server
	if err := f.View(func(r *Reader) error {
		var err error
		s, err = r.Server(server)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return s.AllocatedBytes
}

func volumeErr(f *FSM, id string) error {
	return f.View(func(r *Reader) error { _, err := r.Volume(id); return err })
}

// listedIDs is what ListVolumes shows a user, with or without the deleted.
func listedIDs(t *testing.T, f *FSM, includeDeleted bool) []string {
	t.Helper()
	var ids []string
	if err := f.View(func(r *Reader) error {
		vols, _, err := r.ListVolumes(Page{}, includeDeleted)
		for _, v := range vols {
			ids = append(ids, v.Id)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestFSMDeleteVolumeWithSnapshotsKeepsIt: snapshots outlive their volume
// (Kubernetes restores a VolumeSnapshot after its claim is deleted). A
// volume deleted while it has snapshots is a tombstone: gone from the
// users' view, its name free for a new volume, not attachable, expandable
// or snapshottable, but its replicas are kept (still allocated), repaired
// and rebuilt, its pending snapshots cut, and its snapshots cloned from.
// Deleting it again succeeds and changes nothing; deleting its last
// snapshot removes it and frees its replicas' space, and leaves the new
// volume of the same name alone. An attached volume is still refused.
func TestFSMDeleteVolumeWithSnapshotsKeepsIt(t *testing.T) {
	f := snapshotBase(t)
	mustApply(t, f, cmdRegisterServer("s4", "d", gib, nil))
	mustApply(t, f,
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
		cmdCreateSnapshot("snap-2", "vol-1", "snap-two"), // still pending when the volume is deleted
	)
	servers := replicaServers(readVolume(t, f, "vol-1"))
	before := map[string]uint64{}
	for _, s := range servers {
		before[s] = allocated(t, f, s)
	}

	// Attached: refused, as before snapshots were kept.
	mustApply(t, f, cmdAttachVolume("vol-1", "node-1", false))
	if r := applyCommands(t, f, cmdDeleteVolume("vol-1"))[0]; !errors.Is(r.err, ErrFailedPrecondition) || !strings.Contains(r.err.Error(), "attached") {
		t.Fatalf("delete an attached volume: %v, want ErrFailedPrecondition (attached)", r.err)
	}
	mustApply(t, f, cmdDetachVolume("vol-1", "node-1"))

	v := mustApply(t, f, cmdDeleteVolume("vol-1"))[0].msg.(*storpb.Volume)
	if v.State != storpb.VolumeState_VOLUME_STATE_DELETED || v.DeletedUnixNano == 0 || len(v.Replicas) != 3 {
		t.Fatalf("volume deleted with snapshots: %v, want DELETED with its 3 replicas", v)
	}
	if err := f.View(func(r *Reader) error { _, err := r.VolumeByName("pvc-1"); return err }); !errors.Is(err, ErrNotFound) {
		t.Errorf("the deleted volume's name still resolves: %v", err)
	}
	if got := listedIDs(t, f, false); slices.Contains(got, "vol-1") {
		t.Errorf("ListVolumes shows the deleted volume: %v", got)
	}
	if got := listedIDs(t, f, true); !slices.Contains(got, "vol-1") {
		t.Errorf("ListVolumes with the deleted does not show it: %v", got)
	}
	for _, s := range servers {
		if got := allocated(t, f, s); got != before[s] {
			t.Errorf("server %s: %d bytes allocated after the delete, want %d (the replicas are kept)", s, got, before[s])
		}
	}

	// A retried delete succeeds and changes nothing.
	state := withoutApplied(dumpState(t, f))
	if r := applyCommands(t, f, cmdDeleteVolume("vol-1"))[0]; r.err != nil {
		t.Fatalf("delete again: %v", r.err)
	}
	requireSameState(t, state, withoutApplied(dumpState(t, f)), "after deleting the deleted volume again")

	// What a user may no longer do: refused with what happened, and no trace.
	for _, tc := range []struct {
		name string
		cmd  command
	}{
		{"attach", cmdAttachVolume("vol-1", "node-1", false)},
		{"attach with takeover", cmdAttachVolume("vol-1", "node-2", true)},
		{"expand", cmdExpandVolume("vol-1", 2*mib)},
		{"snapshot", cmdCreateSnapshot("snap-x", "vol-1", "snap-new")},
		{"clone the volume", cmdCreateVolumeReq("clone-x", &storpb.CreateVolumeRequest{
			Name: "pvc-x", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}},
		})},
	} {
		before := withoutApplied(dumpState(t, f))
		r := applyCommands(t, f, tc.cmd)[0]
		if !errors.Is(r.err, ErrNotFound) || !strings.Contains(r.err.Error(), "was deleted") {
			t.Errorf("%s of the deleted volume: %v, want ErrNotFound saying it was deleted", tc.name, r.err)
		}
		requireSameState(t, before, withoutApplied(dumpState(t, f)), tc.name+" of the deleted volume")
	}

	// The name is free for a new volume.
	nv := mustApply(t, f, cmdCreateVolume("vol-2", "pvc-1", mib, 1))[0].msg.(*storpb.Volume)
	if nv.Id != "vol-2" || nv.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Fatalf("a new volume with the deleted one's name: %v", nv)
	}

	// Its snapshots are still served: the pending one is cut as for any
	// detached volume (a fence, then the cuts at that epoch).
	epoch := mustApply(t, f, cmdFenceDetached("vol-1", ""))[0].msg.(*storpb.Volume).Epoch
	mustApply(t, f, cmdRecordCut("snap-2", epoch, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil))
	if s := readSnapshot(t, f, "snap-2"); !s.ReadyToUse {
		t.Fatalf("snapshot pending when its volume was deleted, after its cuts: %v", s)
	}

	// Its replicas are kept healthy: a fault, a rebuild, and the leader's
	// repair move them as for any volume.
	mustApply(t, f, cmdSetReplicaState("vol-1", "vol-1-r2", storpb.ReplicaState_REPLICA_STATE_FAULTY, epoch, 0),
		cmdSetReplicaState("vol-1", "vol-1-r2", storpb.ReplicaState_REPLICA_STATE_REBUILDING, epoch, 0))
	r2 := findReplica(readVolume(t, f, "vol-1"), "vol-1-r2")
	mustApply(t, f, cmdSetReplicaState("vol-1", "vol-1-r2", storpb.ReplicaState_REPLICA_STATE_HEALTHY, epoch, r2.Generation))
	mustApply(t, f, cmdSetReplicaState("vol-1", "vol-1-r3", storpb.ReplicaState_REPLICA_STATE_FAULTY, epoch, 0),
		command{Op: opRepairReplica, ID: "vol-1-r4", Body: &storpb.ReplaceReplicaRequest{
			Volume: &storpb.VolumeRef{Id: "vol-1"}, ReplicaId: "vol-1-r3"}})
	v = readVolume(t, f, "vol-1")
	if v.State != storpb.VolumeState_VOLUME_STATE_DELETED || healthyCount(v) != 2 || findReplica(v, "vol-1-r4") == nil ||
		findReplica(v, "vol-1-r4").ServerId != "s4" || findReplica(v, "vol-1-r2").State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		t.Fatalf("the deleted volume after a rebuild and a repair: %v", v)
	}

	// A clone from its snapshot is filled and becomes available.
	clone := mustApply(t, f, cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
		Name: "pvc-restore", SizeBytes: 2 * mib, ReplicaCount: 1,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
	}))[0].msg.(*storpb.Volume)
	if clone.State != storpb.VolumeState_VOLUME_STATE_CREATING || clone.CloneSnapshotId != "snap-1" {
		t.Fatalf("clone from the deleted volume's snapshot: %v", clone)
	}
	mustApply(t, f, cmdRecordCloneCopied("clone-1", "clone-1-r1"))
	if c := readVolume(t, f, "clone-1"); c.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Fatalf("clone after its copy: %v", c)
	}

	// Its snapshots go one by one; the last takes the volume with it.
	mustApply(t, f, cmdDeleteSnapshot("snap-2"))
	if v := readVolume(t, f, "vol-1"); v.State != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("the deleted volume with one snapshot left: %v", v)
	}
	servers = replicaServers(readVolume(t, f, "vol-1"))
	held := map[string]uint64{}
	for _, s := range servers {
		held[s] = allocated(t, f, s)
	}
	mustApply(t, f, cmdDeleteSnapshot("snap-1"))
	if err := volumeErr(f, "vol-1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the deleted volume after its last snapshot was deleted: %v, want ErrNotFound", err)
	}
	if got := listedIDs(t, f, true); slices.Contains(got, "vol-1") {
		t.Errorf("ListVolumes still shows the removed volume: %v", got)
	}
	for _, s := range servers {
		if got := allocated(t, f, s); got != held[s]-mib {
			t.Errorf("server %s: %d bytes allocated after the removal, want %d", s, got, held[s]-mib)
		}
	}
	if err := f.View(func(r *Reader) error {
		v, err := r.VolumeByName("pvc-1")
		if err == nil && v.Id != "vol-2" {
			t.Errorf("pvc-1 names %s, want the new volume vol-2", v.Id)
		}
		return err
	}); err != nil {
		t.Fatalf("the new volume's name after the old one was removed: %v", err)
	}
	// Retries after the removal: not found, which CSI answers as success.
	if r := applyCommands(t, f, cmdDeleteSnapshot("snap-1"))[0]; !errors.Is(r.err, ErrNotFound) {
		t.Errorf("delete the last snapshot again: %v, want ErrNotFound", r.err)
	}
	if r := applyCommands(t, f, cmdDeleteVolume("vol-1"))[0]; !errors.Is(r.err, ErrNotFound) {
		t.Errorf("delete the removed volume again: %v, want ErrNotFound", r.err)
	}
}

// TestFSMDeleteVolumeWithoutSnapshots: a volume with no snapshots is
// removed at once, its name and space freed, as before tombstones.
func TestFSMDeleteVolumeWithoutSnapshots(t *testing.T) {
	f := snapshotBase(t)
	s := readVolume(t, f, "vol-1").Replicas[0].ServerId
	before := allocated(t, f, s)
	mustApply(t, f, cmdCreateSnapshot("snap-1", "vol-1", "snap-one"), cmdDeleteSnapshot("snap-1"))
	v := mustApply(t, f, cmdDeleteVolume("vol-1"))[0].msg.(*storpb.Volume)
	if v.State == storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("a volume without snapshots was kept: %v", v)
	}
	if err := volumeErr(f, "vol-1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("volume after its delete: %v", err)
	}
	if got := allocated(t, f, s); got != before-mib {
		t.Errorf("server %s: %d bytes allocated, want %d", s, got, before-mib)
	}
}

// TestFSMDeleteSourceOfCopyingClone: a volume deleted while a clone copies
// from it (the clone's implicit snapshot of it) is kept until the copy is
// done, and removed when the implicit snapshot is dropped; the same when
// the copying clone is deleted instead.
func TestFSMDeleteSourceOfCopyingClone(t *testing.T) {
	for _, end := range []string{"copy done", "clone deleted"} {
		t.Run(end, func(t *testing.T) {
			f := snapshotBase(t)
			mustApply(t, f, cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
				Name: "pvc-clone", SizeBytes: mib, ReplicaCount: 1,
				ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}},
			}))
			implicit := ImplicitSnapshotID("clone-1")
			mustApply(t, f, cmdDeleteVolume("vol-1"))
			if v := readVolume(t, f, "vol-1"); v.State != storpb.VolumeState_VOLUME_STATE_DELETED {
				t.Fatalf("source deleted while a clone copies from it: %v, want DELETED", v)
			}
			mustApply(t, f, cmdFenceDetached("vol-1", ""))
			mustApply(t, f, cmdRecordCut(implicit, readVolume(t, f, "vol-1").Epoch, []string{"vol-1-r1"}, []string{"vol-1-r2", "vol-1-r3"}))
			if end == "copy done" {
				mustApply(t, f, cmdRecordCloneCopied("clone-1", "clone-1-r1"))
				if c := readVolume(t, f, "clone-1"); c.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
					t.Fatalf("clone: %v", c)
				}
			} else {
				mustApply(t, f, cmdDeleteVolume("clone-1"))
			}
			if err := volumeErr(f, "vol-1"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("source after its clone's implicit snapshot went (%s): %v, want ErrNotFound", end, err)
			}
		})
	}
}

// TestFSMDeletedVolumeSurvivesRestore: the tombstone is state, not memory:
// an FSM restored from a snapshot taken after the delete (a follower that
// installs it, a new leader) holds it, serves its snapshot and removes it
// with its last snapshot exactly as the source FSM does. Watchers of the
// volume see it stay through the delete and go with its last snapshot.
func TestFSMDeletedVolumeSurvivesRestore(t *testing.T) {
	src := snapshotBase(t)
	mustApply(t, src,
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
	)
	events, cancel := src.Watch("vol-1")
	defer cancel()
	if ev := <-events; ev.Deleted {
		t.Fatalf("first watch event: %+v", ev)
	}
	mustApply(t, src, cmdDeleteVolume("vol-1"))
	if ev := <-events; ev.Deleted || ev.Volume.GetState() != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("watch event of the delete: %+v, want the volume in state DELETED", ev)
	}

	snap, err := src.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	dst := openTestFSM(t, "")
	if err := dst.Restore(io.NopCloser(bytes.NewReader(persist(t, snap)))); err != nil {
		t.Fatal(err)
	}
	if v := readVolume(t, dst, "vol-1"); v.State != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("restored volume: %v, want DELETED", v)
	}
	if err := dst.View(func(r *Reader) error { _, err := r.VolumeByName("pvc-1"); return err }); !errors.Is(err, ErrNotFound) {
		t.Errorf("restored state resolves the deleted volume's name: %v", err)
	}
	next := []command{
		cmdCreateVolume("vol-2", "pvc-1", mib, 1),
		cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
			Name: "pvc-restore", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
		}),
		cmdRecordCloneCopied("clone-1", "clone-1-r1"),
		cmdDeleteSnapshot("snap-1"),
	}
	for _, f := range []*FSM{src, dst} {
		mustApply(t, f, next...)
		if err := volumeErr(f, "vol-1"); !errors.Is(err, ErrNotFound) {
			t.Errorf("after its last snapshot: %v, want ErrNotFound", err)
		}
	}
	requireSameState(t, dumpState(t, src), dumpState(t, dst), "source and restored FSM after the same entries")
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev, ok := <-events:
			switch {
			case !ok:
				t.Fatal("the watch ended without a Deleted event")
			case ev.Deleted:
				return
			case ev.Volume.GetState() != storpb.VolumeState_VOLUME_STATE_DELETED:
				t.Fatalf("watch event before the removal: %+v", ev)
			}
		case <-timeout:
			t.Fatal("no Deleted watch event within 10s of the removal")
		}
	}
}

// TestAReattachKeepsThePublicationsMode: a node re-attaches (require
// attached: its plugin restarted, or restaged) only in the mode the
// volume was published to it in. It used to set whatever mode it asked
// for, so a node's certificate turned a read-only publication into a
// read-write attachment, and a later publish in the published mode was
// then refused as a conflict.
func TestAReattachKeepsThePublicationsMode(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"))
	for _, id := range []string{"s1", "s2", "s3"} {
		mustApply(t, f, cmdRegisterServer(id, "", 0, nil), cmdSetServerState(id, storpb.ServerState_SERVER_STATE_UP))
	}
	attach := func(id string, mode storpb.AccessMode, requireAttached bool) command {
		return command{Op: opAttachVolume, Body: &storpb.AttachVolumeRequest{
			Volume: &storpb.VolumeRef{Id: id}, NodeId: "node-a", Mode: mode, RequireAttached: requireAttached}}
	}
	ro, rw := storpb.AccessMode_ACCESS_MODE_READ_ONLY, storpb.AccessMode_ACCESS_MODE_READ_WRITE
	mustApply(t, f, cmdCreateVolume("v1", "ro", mib, 3), attach("v1", ro, false))
	epoch := readVolume(t, f, "v1").Epoch
	if r := applyCommands(t, f, attach("v1", rw, true))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Fatalf("a read-write re-attach of a volume published read-only: %v, want ErrFailedPrecondition", r.err)
	}
	if v := readVolume(t, f, "v1"); v.Attachment.GetMode() != ro || v.Epoch != epoch {
		t.Fatalf("after the refused re-attach: mode %v at epoch %d, want %v at %d", v.Attachment.GetMode(), v.Epoch, ro, epoch)
	}
	mustApply(t, f, attach("v1", ro, true))
	if v := readVolume(t, f, "v1"); v.Attachment.GetMode() != ro || v.Epoch != epoch+1 {
		t.Fatalf("after a read-only re-attach: mode %v at epoch %d, want %v at %d", v.Attachment.GetMode(), v.Epoch, ro, epoch+1)
	}
	// A read-only re-attach of a read-write publication opens it
	// read-only on the node; the publication stays read-write.
	mustApply(t, f, cmdCreateVolume("v2", "rw", mib, 3), attach("v2", rw, false), attach("v2", ro, true))
	if v := readVolume(t, f, "v2"); v.Attachment.GetMode() != rw {
		t.Fatalf("a read-write publication re-attached read-only: mode %v, want %v", v.Attachment.GetMode(), rw)
	}
}
