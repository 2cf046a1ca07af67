package raftstore

import (
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

func readEvents(t *testing.T, f *FSM, volumeID string) []*storpb.Event {
	t.Helper()
	var out []*storpb.Event
	if err := f.View(func(r *Reader) error {
		var err error
		out, err = r.Events(volumeID, 0, MaxEvents)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// The state machine records what each command did, from the records it
// writes: a fault with the command's reason, a rebuild started and
// finished, an attach and a takeover, a replaced replica, a drain.
func TestEventsRecordWhatHappened(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"))
	for _, id := range []string{"s1", "s2", "s3", "s4"} {
		mustApply(t, f, cmdRegisterServer(id, "", 0, nil), cmdSetServerState(id, storpb.ServerState_SERVER_STATE_UP))
	}
	mustApply(t, f, cmdCreateVolume("v1", "db", mib, 3), cmdAttachVolume("v1", "node-a", false))
	v := readVolume(t, f, "v1")
	r := v.Replicas[1]
	fault := cmdSetReplicaState("v1", r.Id, storpb.ReplicaState_REPLICA_STATE_FAULTY, v.Epoch, 0)
	fault.Body.(*storpb.SetReplicaStateRequest).Reason = "write failed: disk error"
	mustApply(t, f, fault, cmdSetReplicaState("v1", r.Id, storpb.ReplicaState_REPLICA_STATE_REBUILDING, v.Epoch, 0))
	v = readVolume(t, f, "v1")
	mustApply(t, f, cmdSetReplicaState("v1", r.Id, storpb.ReplicaState_REPLICA_STATE_HEALTHY, v.Epoch, replicaIn(v, r.Id).Generation),
		cmdAttachVolume("v1", "node-b", true), cmdReplaceReplica("v1", v.Replicas[0].Id, "", "new-r", false),
		command{Op: opCordonServer, Body: &storpb.Server{Id: "s4", Cordoned: true, Draining: true}},
		cmdSetServerState("s3", storpb.ServerState_SERVER_STATE_DOWN))

	all := eventText(t, f)
	for _, want := range []string{
		"ServerRegistered: server s1 registered",
		"VolumeCreated: volume db created",
		"Attached: attached to node node-a at epoch 1",
		"ReplicaFaulty: replica " + r.Id + " on server " + r.ServerId + " faulty: write failed: disk error",
		"RebuildStarted: replica " + r.Id + " on server " + r.ServerId + " rebuilding (a delta rebuild from generation",
		"RebuildFinished: replica " + r.Id + " on server " + r.ServerId + " healthy: rebuild finished",
		"TakenOver: taken over by node node-b from node node-a",
		"ReplicaRemoved: replica " + v.Replicas[0].Id,
		"ReplicaAdded: replica new-r added",
		"ServerDraining: server s4 cordoned and draining",
		"ServerDown: server s3 down",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no event %q in:\n%s", want, all)
		}
	}
	for _, e := range readEvents(t, f, "v1") {
		if e.VolumeId != "v1" || e.VolumeName != "db" {
			t.Fatalf("volume v1's events include %v", e)
		}
	}
	// Snapshots: requested, then ready once every replica cut.
	mustApply(t, f, cmdCreateSnapshot("snap1", "v1", "nightly"))
	v = readVolume(t, f, "v1")
	var cut []string
	for _, rep := range v.Replicas {
		cut = append(cut, rep.Id)
	}
	mustApply(t, f, cmdRecordCut("snap1", v.Epoch, cut, nil), cmdDeleteSnapshot("snap1"))
	all = eventText(t, f)
	for _, want := range []string{"SnapshotRequested: snapshot nightly requested", "SnapshotReady: snapshot nightly ready", "SnapshotDeleted: snapshot nightly deleted"} {
		if !strings.Contains(all, want) {
			t.Errorf("no event %q in:\n%s", want, all)
		}
	}
	// A client's reason is clipped.
	v = readVolume(t, f, "v1")
	long := cmdSetReplicaState("v1", v.Replicas[2].Id, storpb.ReplicaState_REPLICA_STATE_FAULTY, v.Epoch, 0)
	long.Body.(*storpb.SetReplicaStateRequest).Reason = strings.Repeat("x", 100000)
	mustApply(t, f, long)
	evs := readEvents(t, f, "v1")
	if last := evs[len(evs)-1]; last.Reason != "ReplicaFaulty" || len(last.Message) > 1024 {
		t.Fatalf("a 100000-byte reason made a %d-byte %s event", len(last.Message), last.Reason)
	}

	// A refused command records nothing.
	before := len(readEvents(t, f, ""))
	if r := applyCommands(t, f, cmdAttachVolume("v1", "node-c", false))[0]; r.err == nil {
		t.Fatal("attach to a third node without takeover was not refused")
	}
	if n := len(readEvents(t, f, "")); n != before {
		t.Fatalf("a refused command recorded %d events", n-before)
	}
}

// The newest MaxEvents are kept.
func TestEventsBounded(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"), cmdRegisterServer("s1", "", 0, nil))
	for i := range MaxEvents/2 + 10 {
		_ = i
		mustApply(t, f, cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_UP), cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_DOWN))
	}
	evs := readEvents(t, f, "")
	if len(evs) != MaxEvents {
		t.Fatalf("%d events kept, want %d", len(evs), MaxEvents)
	}
	if last := evs[len(evs)-1].Seq; evs[0].Seq != last-MaxEvents+1 {
		t.Fatalf("kept seq %d..%d, want the newest %d", evs[0].Seq, last, MaxEvents)
	}
}

func replicaIn(v *storpb.Volume, id string) *storpb.Replica {
	for _, r := range v.Replicas {
		if r.Id == id {
			return r
		}
	}
	return nil
}

func eventText(t *testing.T, f *FSM) string {
	t.Helper()
	var got []string
	for _, e := range readEvents(t, f, "") {
		got = append(got, e.Reason+": "+e.Message)
	}
	return strings.Join(got, "\n")
}
