package raftstore

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

func readSnapshot(t testing.TB, f *FSM, id string) *storpb.Snapshot {
	t.Helper()
	var s *storpb.Snapshot
	if err := f.View(func(r *Reader) error {
		var err error
		s, err = r.Snapshot(id)
		return err
	}); err != nil {
		t.Fatalf("snapshot %s: %v", id, err)
	}
	return s
}

func snapStates(s *storpb.Snapshot) map[string]storpb.SnapshotReplicaState {
	m := map[string]storpb.SnapshotReplicaState{}
	for _, r := range s.Replicas {
		m[r.ReplicaId] = r.State
	}
	return m
}

func snapshotBase(t *testing.T) *FSM {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdInitCluster("c1"),
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "b", gib, nil),
		cmdRegisterServer("s3", "c", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 3),
	)
	return f
}

// TestFSMSnapshotCutLifecycle: a snapshot is pending on every healthy
// replica, named on its volume (which is what the engine's watch sees),
// ready once every replica cut, and a cut at another epoch than the first
// is recorded as missed.
func TestFSMSnapshotCutLifecycle(t *testing.T) {
	f := snapshotBase(t)
	s := mustApply(t, f, cmdCreateSnapshot("snap-1", "vol-1", "snap-one"))[0].msg.(*storpb.Snapshot)
	if s.ReadyToUse || s.Failed || len(s.Replicas) != 3 || !strings.Contains(s.StatusMessage, "vol-1-r3") {
		t.Fatalf("new snapshot: %v", s)
	}
	if v := readVolume(t, f, "vol-1"); !slices.Equal(v.PendingSnapshotIds, []string{"snap-1"}) {
		t.Fatalf("volume pending snapshots %v, want [snap-1]", v.PendingSnapshotIds)
	}

	// Two replicas cut while detached at epoch 0.
	mustApply(t, f, cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2"}, nil))
	s = readSnapshot(t, f, "snap-1")
	if s.ReadyToUse || s.CutEpoch != 0 || !strings.Contains(s.StatusMessage, "vol-1-r3 (server ") || strings.Contains(s.StatusMessage, "vol-1-r1") {
		t.Fatalf("after two cuts: %v", s)
	}
	// The volume is attached (a write may follow): the third replica's
	// late cut is refused as stale at epoch 0, and at epoch 1 recorded
	// as missed. The snapshot is ready from the two that cut.
	mustApply(t, f, cmdAttachVolume("vol-1", "node-1", false))
	if r := applyCommands(t, f, cmdRecordCut("snap-1", 0, []string{"vol-1-r3"}, nil))[0]; !errors.Is(r.err, ErrStaleEpoch) {
		t.Fatalf("cut at a stale epoch: %v, want ErrStaleEpoch", r.err)
	}
	mustApply(t, f, cmdRecordCut("snap-1", 1, []string{"vol-1-r3"}, nil))
	s = readSnapshot(t, f, "snap-1")
	want := map[string]storpb.SnapshotReplicaState{"vol-1-r1": snapCut, "vol-1-r2": snapCut, "vol-1-r3": snapMissed}
	if got := snapStates(s); !maps.Equal(got, want) || !s.ReadyToUse || s.StatusMessage != "" {
		t.Fatalf("after the late cut: %v (states %v)", s, got)
	}
	if !SnapshotServes(s, "vol-1-r1") || SnapshotServes(s, "vol-1-r3") {
		t.Errorf("SnapshotServes: r1 %v r3 %v", SnapshotServes(s, "vol-1-r1"), SnapshotServes(s, "vol-1-r3"))
	}
	if v := readVolume(t, f, "vol-1"); len(v.PendingSnapshotIds) != 0 {
		t.Errorf("volume still names pending snapshots %v", v.PendingSnapshotIds)
	}

	// An engine that could cut none: the snapshot fails, with the reasons.
	mustApply(t, f, cmdCreateSnapshot("snap-2", "vol-1", "snap-two"),
		cmdRecordCut("snap-2", 1, nil, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}))
	s = readSnapshot(t, f, "snap-2")
	if s.ReadyToUse || !s.Failed || !strings.Contains(s.StatusMessage, "test: missed") {
		t.Errorf("snapshot no replica cut: %v", s)
	}

	// A replica removed while a snapshot waits for it is missed.
	mustApply(t, f, cmdCreateSnapshot("snap-3", "vol-1", "snap-three"),
		cmdRecordCut("snap-3", 1, []string{"vol-1-r1", "vol-1-r2"}, nil),
		cmdReplaceReplica("vol-1", "vol-1-r3", "", "", true))
	s = readSnapshot(t, f, "snap-3")
	if !s.ReadyToUse || snapStates(s)["vol-1-r3"] != snapMissed {
		t.Errorf("snapshot after its pending replica was removed: %v", s)
	}

	// Deleting drops the record and the volume's pending mark.
	mustApply(t, f, cmdCreateSnapshot("snap-4", "vol-1", "snap-four"), cmdDeleteSnapshot("snap-4"))
	if v := readVolume(t, f, "vol-1"); len(v.PendingSnapshotIds) != 0 {
		t.Errorf("pending after delete: %v", v.PendingSnapshotIds)
	}
}

// TestFSMClone: a clone is CREATING and not attachable until each of its
// replicas recorded its copy; its source snapshot cannot be deleted
// meanwhile; a clone from a volume snapshots the source implicitly and
// drops that snapshot when done (or when the clone is deleted).
func TestFSMClone(t *testing.T) {
	f := snapshotBase(t)
	mustApply(t, f, cmdCreateSnapshot("snap-1", "vol-1", "snap-one"))
	v := mustApply(t, f, cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
		Name: "pvc-clone", SizeBytes: 2 * mib, ReplicaCount: 2,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
	}))[0].msg.(*storpb.Volume)
	if v.State != storpb.VolumeState_VOLUME_STATE_CREATING || v.CloneSnapshotId != "snap-1" {
		t.Fatalf("clone: %v", v)
	}
	r := applyCommands(t, f, cmdAttachVolume("clone-1", "node-1", false))[0]
	if !errors.Is(r.err, ErrFailedPrecondition) || !strings.Contains(r.err.Error(), "still being filled") {
		t.Fatalf("attach a copying clone: %v", r.err)
	}
	if r := applyCommands(t, f, cmdDeleteSnapshot("snap-1"))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Fatalf("delete the source of a copying clone: %v", r.err)
	}
	if r := applyCommands(t, f, cmdCreateSnapshot("snap-c", "clone-1", "snap-of-clone"))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Fatalf("snapshot a copying clone: %v", r.err)
	}
	mustApply(t, f, cmdRecordCloneCopied("clone-1", "clone-1-r1"), cmdRecordCloneCopied("clone-1", "clone-1-r1"))
	if v := readVolume(t, f, "clone-1"); v.State != storpb.VolumeState_VOLUME_STATE_CREATING || len(v.CloneDoneReplicaIds) != 1 {
		t.Fatalf("clone with one of two copies: %v", v)
	}
	mustApply(t, f, cmdRecordCloneCopied("clone-1", "clone-1-r2"), cmdAttachVolume("clone-1", "node-1", false), cmdDeleteSnapshot("snap-1"))

	// From a volume: an implicit snapshot, pending on the source.
	mustApply(t, f, cmdCreateVolumeReq("clone-2", &storpb.CreateVolumeRequest{
		Name: "pvc-clone-2", SizeBytes: mib, ReplicaCount: 1,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}},
	}))
	implicit := readSnapshot(t, f, ImplicitSnapshotID("clone-2"))
	if implicit.ImplicitForVolumeId != "clone-2" || implicit.VolumeId != "vol-1" || len(implicit.Replicas) != 3 {
		t.Fatalf("implicit snapshot: %v", implicit)
	}
	if v := readVolume(t, f, "vol-1"); !slices.Contains(v.PendingSnapshotIds, implicit.Id) {
		t.Fatalf("source volume does not name the implicit snapshot pending: %v", v.PendingSnapshotIds)
	}
	mustApply(t, f, cmdRecordCut(implicit.Id, 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
		cmdRecordCloneCopied("clone-2", "clone-2-r1"))
	if err := f.View(func(r *Reader) error { _, err := r.Snapshot(implicit.Id); return err }); !errors.Is(err, ErrNotFound) {
		t.Errorf("implicit snapshot after the copy: %v", err)
	}

	// A copying clone that is deleted takes its implicit snapshot along.
	mustApply(t, f, cmdCreateVolumeReq("clone-3", &storpb.CreateVolumeRequest{
		Name: "pvc-clone-3", SizeBytes: mib, ReplicaCount: 1,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}},
	}), cmdDeleteVolume("clone-3"))
	if v := readVolume(t, f, "vol-1"); len(v.PendingSnapshotIds) != 0 {
		t.Errorf("source still names %v pending", v.PendingSnapshotIds)
	}
	mustApply(t, f, cmdDeleteVolume("vol-1"))
}

// TestFSMReplicaLeavesSnapshot: a replica that leaves its volume takes
// its snapshot copies with it, and the records say so on every path: its
// CUT entries become LOST (the snapshot stays ready while another copy is
// CUT, and fails when none is), an operator's removal of the last copy of
// a ready snapshot while its server is up is refused, and the leader's
// repair, a removal while the server is down, and a server removed from
// the cluster record the loss instead.
func TestFSMReplicaLeavesSnapshot(t *testing.T) {
	cases := []struct {
		name  string
		cut   []string  // replicas that cut snap-1 (the others missed it)
		setup []command // before the removal
		// remove is the command that takes vol-1-r1 out (server: its server).
		remove  func(server string) command
		refused bool   // the removal fails with ErrFailedPrecondition
		lost    bool   // snap-1 is failed afterwards: every copy is lost
		reason  string // in r1's entry (and the status, when lost)
	}{
		{name: "operator removes one of three copies", cut: []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"},
			remove: func(string) command { return cmdReplaceReplica("vol-1", "vol-1-r1", "", "", true) },
			reason: "its replica was removed from the volume; the copy went with it"},
		{name: "operator replaces one of two copies", cut: []string{"vol-1-r1", "vol-1-r2"},
			setup:  []command{cmdRegisterServer("s4", "d", gib, nil)},
			remove: func(string) command { return cmdReplaceReplica("vol-1", "vol-1-r1", "", "vol-1-r4", false) },
			reason: "its replica was removed from the volume; the copy went with it"},
		{name: "operator removes the last copy, server up", cut: []string{"vol-1-r1"},
			remove:  func(string) command { return cmdReplaceReplica("vol-1", "vol-1-r1", "", "", true) },
			refused: true},
		{name: "operator replaces the last copy, server up", cut: []string{"vol-1-r1"},
			setup:   []command{cmdRegisterServer("s4", "d", gib, nil)},
			remove:  func(string) command { return cmdReplaceReplica("vol-1", "vol-1-r1", "", "vol-1-r4", false) },
			refused: true},
		{name: "operator removes the last copy, server down", cut: []string{"vol-1-r1"},
			setup:  []command{cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_DOWN)},
			remove: func(string) command { return cmdReplaceReplica("vol-1", "vol-1-r1", "", "", true) },
			lost:   true, reason: "its replica was removed from the volume; the copy went with it"},
		{name: "leader repairs the last copy, server up", cut: []string{"vol-1-r1"},
			setup: []command{cmdRegisterServer("s4", "d", gib, nil)},
			remove: func(string) command {
				return command{Op: opRepairReplica, ID: "vol-1-r4", Body: &storpb.ReplaceReplicaRequest{
					Volume: &storpb.VolumeRef{Id: "vol-1"}, ReplicaId: "vol-1-r1"}}
			},
			lost: true, reason: "its replica was removed from the volume; the copy went with it"},
		{name: "server of the last copy removed", cut: []string{"vol-1-r1"},
			remove: func(srv string) command { return cmdRemoveServer(srv) },
			lost:   true, reason: "was removed from the cluster; the copy went with it"},
		{name: "server of one of two copies removed", cut: []string{"vol-1-r1", "vol-1-r3"},
			remove: func(srv string) command { return cmdRemoveServer(srv) },
			reason: "was removed from the cluster; the copy went with it"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := snapshotBase(t)
			var missed []string
			for _, id := range []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"} {
				if !slices.Contains(c.cut, id) {
					missed = append(missed, id)
				}
			}
			mustApply(t, f, cmdCreateSnapshot("snap-1", "vol-1", "snap-one"), cmdRecordCut("snap-1", 0, c.cut, missed))
			if s := readSnapshot(t, f, "snap-1"); !s.ReadyToUse {
				t.Fatalf("snapshot before the removal: %v", s)
			}
			srv := findReplica(readVolume(t, f, "vol-1"), "vol-1-r1").ServerId
			for i := range c.setup {
				if c.setup[i].Op == opSetServerState {
					c.setup[i].Body.(*storpb.Server).Id = srv
				}
			}
			mustApply(t, f, c.setup...)
			err := applyCommands(t, f, c.remove(srv))[0].err
			s := readSnapshot(t, f, "snap-1")
			if c.refused {
				if !errors.Is(err, ErrFailedPrecondition) || !strings.Contains(err.Error(), `snapshot "snap-one"`) ||
					!strings.Contains(err.Error(), "last copy") {
					t.Fatalf("removal of the last copy: %v, want a refusal naming the snapshot", err)
				}
				if findReplica(readVolume(t, f, "vol-1"), "vol-1-r1") == nil || !s.ReadyToUse || !SnapshotServes(s, "vol-1-r1") {
					t.Fatalf("a refused removal changed something: snapshot %v", s)
				}
				return
			}
			if err != nil {
				t.Fatalf("removal: %v", err)
			}
			var r1 *storpb.SnapshotReplica
			for _, e := range s.Replicas {
				if e.ReplicaId == "vol-1-r1" {
					r1 = e
				}
			}
			if r1.State != snapLost || !strings.Contains(r1.Reason, c.reason) || SnapshotServes(s, "vol-1-r1") {
				t.Fatalf("r1's entry after the removal: %v, want LOST with %q", r1, c.reason)
			}
			clone := cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
				Name: "pvc-clone", SizeBytes: mib, ReplicaCount: 1,
				ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
			})
			cloneErr := applyCommands(t, f, clone)[0].err
			if !c.lost {
				if !s.ReadyToUse || s.Failed || s.StatusMessage != "" {
					t.Fatalf("snapshot with copies left: %v, want still ready", s)
				}
				if cloneErr != nil {
					t.Fatalf("clone of a snapshot with copies left: %v", cloneErr)
				}
				return
			}
			if s.ReadyToUse || !s.Failed || !strings.Contains(s.StatusMessage, "every copy of the snapshot is lost") ||
				!strings.Contains(s.StatusMessage, c.reason) {
				t.Fatalf("snapshot whose copies are gone: %v, want failed with the reason", s)
			}
			if !errors.Is(cloneErr, ErrFailedPrecondition) || !strings.Contains(cloneErr.Error(), "lost") {
				t.Fatalf("clone of a lost snapshot: %v, want refused as lost", cloneErr)
			}
		})
	}
}

// TestFSMCloneFilledWhenItsLastUnfilledReplicaLeaves: a clone turns
// AVAILABLE when every replica it keeps has its copy. Only a recorded
// copy used to check that, so a clone whose last replica without one
// left it (an operator's removal, a drain's, its server removed from the
// cluster) stayed CREATING for ever: no copy was left to record, and its
// PVC never bound.
func TestFSMCloneFilledWhenItsLastUnfilledReplicaLeaves(t *testing.T) {
	f := snapshotBase(t)
	mustApply(t, f, cmdRegisterServer("s4", "d", gib, nil),
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil))
	clone := func(id string) *storpb.Volume {
		t.Helper()
		return mustApply(t, f, cmdCreateVolumeReq(id, &storpb.CreateVolumeRequest{
			Name: "pvc-" + id, SizeBytes: mib, ReplicaCount: 3,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
		}))[0].msg.(*storpb.Volume)
	}

	// Removed by an operator (or a drain: RemoveOnly too).
	v := clone("clone-1")
	mustApply(t, f, cmdRecordCloneCopied(v.Id, v.Replicas[0].Id), cmdRecordCloneCopied(v.Id, v.Replicas[1].Id))
	if v := readVolume(t, f, v.Id); v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
		t.Fatalf("clone with two of three copies: %v", v)
	}
	mustApply(t, f, cmdReplaceReplica(v.Id, v.Replicas[2].Id, "", "", true))
	if v := readVolume(t, f, v.Id); v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Errorf("clone whose replica without a copy was removed: %v; want AVAILABLE", v.State)
	}

	// Replaced by a new replica: that one's copy is still to come.
	v = clone("clone-3")
	mustApply(t, f, cmdRecordCloneCopied(v.Id, v.Replicas[0].Id), cmdRecordCloneCopied(v.Id, v.Replicas[1].Id))
	var spare string
	for _, s := range []string{"s1", "s2", "s3", "s4"} {
		if !slices.Contains(replicaServers(v), s) {
			spare = s
		}
	}
	if spare == "" {
		t.Fatalf("clone-3 on %v: no server left to move a replica to", replicaServers(v))
	}
	mustApply(t, f, cmdReplaceReplica(v.Id, v.Replicas[2].Id, spare, v.Id+"-r9", false))
	if v := readVolume(t, f, v.Id); v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
		t.Errorf("clone whose replica without a copy was replaced by a new one: %v; want CREATING", v.State)
	}
	mustApply(t, f, cmdRecordCloneCopied(v.Id, v.Id+"-r9"))
	if v := readVolume(t, f, v.Id); v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Errorf("clone once the new replica's copy is recorded: %v; want AVAILABLE", v.State)
	}

	// Its server removed from the cluster.
	v = clone("clone-4")
	mustApply(t, f, cmdRecordCloneCopied(v.Id, v.Replicas[0].Id), cmdRecordCloneCopied(v.Id, v.Replicas[1].Id))
	mustApply(t, f, cmdRemoveServer(v.Replicas[2].ServerId))
	if v := readVolume(t, f, v.Id); v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Errorf("clone whose replica without a copy lost its server: %v; want AVAILABLE", v.State)
	}
}

// TestFSMServerRemovedFinishingACloneKeepsItsSourceGone: removing a
// server can finish a clone of a volume (its last unfilled replica was
// there), which drops the clone's implicit snapshot, and with it the
// source volume when that was deleted and kept only for the snapshot.
// removeServer worked through copies of every volume read before it
// began, and wrote the source's stale copy back after that: a deleted
// volume with no snapshot, which nothing would ever remove, its replicas
// left on disk and no longer counted on their servers (found by a review
// of the change that finishes clones there).
func TestFSMServerRemovedFinishingACloneKeepsItsSourceGone(t *testing.T) {
	f := snapshotBase(t) // vol-1 on s1, s2, s3
	mustApply(t, f, cmdRegisterServer("s4", "d", gib, nil))
	c := mustApply(t, f, cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{
		Name: "pvc-clone", SizeBytes: mib, ReplicaCount: 3,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}},
	}))[0].msg.(*storpb.Volume)
	mustApply(t, f, cmdRecordCut(ImplicitSnapshotID(c.Id), 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
		cmdDeleteVolume("vol-1")) // kept for the implicit snapshot
	// Every clone replica filled but one on a server that also holds
	// vol-1 (every server but one does), whose server is then removed.
	src := readVolume(t, f, "vol-1")
	victim := -1
	for i, r := range c.Replicas {
		if victim < 0 && slices.Contains(replicaServers(src), r.ServerId) {
			victim = i
		}
	}
	for i, r := range c.Replicas {
		if i != victim {
			mustApply(t, f, cmdRecordCloneCopied(c.Id, r.Id))
		}
	}
	mustApply(t, f, cmdRemoveServer(c.Replicas[victim].ServerId))
	if v := readVolume(t, f, c.Id); v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Errorf("clone whose unfilled replica lost its server: %v; want AVAILABLE", v.State)
	}
	if err := f.View(func(r *Reader) error { _, err := r.Volume("vol-1"); return err }); !errors.Is(err, ErrNotFound) {
		t.Errorf("deleted source volume after its last snapshot went: %v; want it gone", err)
	}
	for _, p := range allocationProblems(t, f) {
		t.Error(p)
	}
}

// TestFSMNoExpandWhileASnapshotIsBeingCut: a snapshot records its
// volume's size when it is taken, and its replicas freeze their layers
// at their own size when they cut it. A volume expanded (and written past
// its old end) between the two gave a snapshot holding more than its
// recorded size: a clone of that size never finished filling (its copy
// of the blocks past its end was refused on every attempt). An expand is
// now refused while the volume has snapshots not yet cut; a retry once
// they are succeeds, and an expand to the size the volume has already
// succeeds as before.
func TestFSMNoExpandWhileASnapshotIsBeingCut(t *testing.T) {
	f := snapshotBase(t)
	mustApply(t, f, cmdCreateSnapshot("snap-1", "vol-1", "snap-one"))
	r := applyCommands(t, f, cmdExpandVolume("vol-1", 2*mib))[0]
	if !errors.Is(r.err, ErrFailedPrecondition) || !strings.Contains(r.err.Error(), "snap-1") {
		t.Fatalf("expand with a snapshot pending: %v, want ErrFailedPrecondition naming snap-1", r.err)
	}
	if v := readVolume(t, f, "vol-1"); v.SizeBytes != mib {
		t.Fatalf("volume is %d bytes after the refused expand, want %d", v.SizeBytes, mib)
	}
	mustApply(t, f, cmdExpandVolume("vol-1", mib)) // its size already: nothing to refuse
	mustApply(t, f, cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil))
	mustApply(t, f, cmdExpandVolume("vol-1", 2*mib))
	if v := readVolume(t, f, "vol-1"); v.SizeBytes != 2*mib {
		t.Fatalf("volume is %d bytes after the expand, want %d", v.SizeBytes, 2*mib)
	}
	if s := readSnapshot(t, f, "snap-1"); s.SizeBytes != mib {
		t.Fatalf("snapshot is %d bytes, want the %d it was taken at", s.SizeBytes, mib)
	}
}

// TestFSMCloneOfAFailedSnapshotSaysSo: a clone may be made from a snapshot
// not yet cut (a user's, or the one a clone of a volume takes of it). If
// that snapshot then fails (no replica cut it, or every copy was lost),
// the clone can never be filled. It stayed CREATING with nothing said but
// "still being filled (0 of N replicas copied)" at every attach, for
// ever. Now the clone's events say it failed and why, and so does the
// attach refusal; the clone can be deleted as before.
func TestFSMCloneOfAFailedSnapshotSaysSo(t *testing.T) {
	f := snapshotBase(t)
	all := []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}
	mustApply(t, f,
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{Name: "from-snap", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}}}),
		cmdCreateVolumeReq("clone-2", &storpb.CreateVolumeRequest{Name: "from-vol", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}}}),
		cmdRecordCut("snap-1", 0, nil, all),
		cmdRecordCut(ImplicitSnapshotID("clone-2"), 0, nil, all),
	)
	for _, clone := range []string{"clone-1", "clone-2"} {
		if v := readVolume(t, f, clone); v.State != storpb.VolumeState_VOLUME_STATE_CREATING {
			t.Fatalf("%s: %v, want CREATING", clone, v.State)
		}
		if failed := cloneFailedEvents(t, f, clone); len(failed) != 1 || !strings.Contains(failed[0].Message, "can never be filled") ||
			!strings.Contains(failed[0].Message, "no replica could cut") {
			t.Errorf("%s: CloneFailed events %v, want one saying why", clone, failed)
		}
		r := applyCommands(t, f, cmdAttachVolume(clone, "node-1", false))[0]
		if !errors.Is(r.err, ErrFailedPrecondition) || !strings.Contains(r.err.Error(), "can never be filled") {
			t.Errorf("attach %s: %v, want ErrFailedPrecondition saying it can never be filled", clone, r.err)
		}
	}
	mustApply(t, f, cmdDeleteVolume("clone-1"), cmdDeleteVolume("clone-2"))
}

func cloneFailedEvents(t *testing.T, f *FSM, volumeID string) []*storpb.Event {
	t.Helper()
	var out []*storpb.Event
	for _, e := range readEvents(t, f, volumeID) {
		if e.Reason == "CloneFailed" {
			out = append(out, e)
		}
	}
	return out
}

// TestFSMPartlyFilledCloneOfALostSnapshotSaysWhatFinishesIt: a clone with
// one of its two replicas filled when every copy of its (ready) snapshot
// is lost can still be finished, from the filled one: its CloneFailed
// event and the attach refusal say to remove the other; removing it makes
// the clone AVAILABLE.
func TestFSMPartlyFilledCloneOfALostSnapshotSaysWhatFinishesIt(t *testing.T) {
	f := snapshotBase(t)
	mustApply(t, f, cmdRegisterServer("s4", "d", gib, nil), cmdRegisterServer("s5", "e", gib, nil), cmdRegisterServer("s6", "f", gib, nil))
	src := readVolume(t, f, "vol-1")
	mustApply(t, f,
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdRecordCut("snap-1", 0, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
		cmdCreateVolumeReq("clone-1", &storpb.CreateVolumeRequest{Name: "partly", SizeBytes: mib, ReplicaCount: 2,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}}}),
	)
	clone := readVolume(t, f, "clone-1")
	filled, unfilled := clone.Replicas[0].Id, clone.Replicas[1].Id
	mustApply(t, f, cmdRecordCloneCopied("clone-1", filled))
	// The leader's repair replaces every replica holding the snapshot
	// (their disks died, say): its copies are lost.
	for i, r := range src.Replicas {
		id := fmt.Sprintf("new-%d", i)
		repair := cmdReplaceReplica("vol-1", r.Id, "", id, false)
		repair.Op = opRepairReplica
		mustApply(t, f, repair)
		v := readVolume(t, f, "vol-1") // rebuilt (so that the next may go)
		mustApply(t, f, cmdSetReplicaState("vol-1", id, storpb.ReplicaState_REPLICA_STATE_HEALTHY, v.Epoch, replicaIn(v, id).Generation))
	}
	if s := readSnapshot(t, f, "snap-1"); !s.Failed {
		t.Fatalf("snapshot with every copy lost: %v, want failed", s)
	}
	failed := cloneFailedEvents(t, f, "clone-1")
	if len(failed) != 1 || !strings.Contains(failed[0].Message, "1 of its 2 replicas are filled") {
		t.Fatalf("CloneFailed events %v, want one saying 1 of 2 replicas are filled", failed)
	}
	if r := applyCommands(t, f, cmdAttachVolume("clone-1", "node-1", false))[0]; !errors.Is(r.err, ErrFailedPrecondition) ||
		!strings.Contains(r.err.Error(), "remove the others") {
		t.Fatalf("attach: %v, want ErrFailedPrecondition saying to remove the unfilled replicas", r.err)
	}
	mustApply(t, f, cmdReplaceReplica("clone-1", unfilled, "", "", true))
	if v := readVolume(t, f, "clone-1"); v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
		t.Fatalf("clone after its unfilled replica was removed: %v, want AVAILABLE", v.State)
	}
}
