package raftstore

import (
	"errors"
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

func cmdCordonServer(id string, cordoned bool) command {
	return command{Op: opCordonServer, Body: &storpb.Server{Id: id, Cordoned: cordoned}}
}

// TestCordonServer: a cordoned server receives no new replica, keeps the
// ones it has, and stays cordoned across down/up and re-registration
// until uncordoned.
func TestCordonServer(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"))
	for _, id := range []string{"s1", "s2", "s3"} {
		mustApply(t, f, cmdRegisterServer(id, "", 0, nil), cmdSetServerState(id, storpb.ServerState_SERVER_STATE_UP))
	}
	mustApply(t, f, cmdCreateVolume("v1", "one", mib, 3))
	mustApply(t, f, cmdCordonServer("s1", true),
		cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_DOWN),
		cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_UP),
		cmdRegisterServer("s1", "", 0, nil))
	r := applyCommands(t, f, cmdCreateVolume("v2", "two", mib, 3))[0]
	if !errors.Is(r.err, ErrInsufficientServers) || !strings.Contains(r.err.Error(), "1 cordoned") {
		t.Fatalf("3 replicas with s1 cordoned: %v, want ErrInsufficientServers counting 1 cordoned", r.err)
	}
	mustApply(t, f, cmdCreateVolume("v3", "three", mib, 2))
	if v := readVolume(t, f, "v3"); replicaOnServer(v, "s1") {
		t.Fatalf("volume three placed a replica on cordoned s1: %v", v.Replicas)
	}
	if v := readVolume(t, f, "v1"); !replicaOnServer(v, "s1") || len(v.Replicas) != 3 {
		t.Fatalf("volume one lost its replica on cordoned s1: %v", v.Replicas)
	}
	if r := applyCommands(t, f, cmdCordonServer("s9", true))[0]; !errors.Is(r.err, ErrNotFound) {
		t.Fatalf("cordon of an unknown server: %v, want ErrNotFound", r.err)
	}
	mustApply(t, f, cmdCordonServer("s1", false), cmdCreateVolume("v2", "two", mib, 3))
}

func replicaOnServer(v *storpb.Volume, server string) bool {
	for _, r := range v.Replicas {
		if r.ServerId == server {
			return true
		}
	}
	return false
}

// A drain cordons; clearing the cordon ends the drain.
func TestDrainServerApply(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"), cmdRegisterServer("s1", "", 0, nil))
	mustApply(t, f, command{Op: opCordonServer, Body: &storpb.Server{Id: "s1", Cordoned: true, Draining: true}})
	if s := readServer(t, f, "s1"); !s.Draining || !s.Cordoned {
		t.Fatalf("after a drain: %v, want draining and cordoned", s)
	}
	mustApply(t, f, cmdCordonServer("s1", false))
	if s := readServer(t, f, "s1"); s.Draining || s.Cordoned {
		t.Fatalf("after uncordon: %v, want neither draining nor cordoned", s)
	}
}

// drainStep: add before removing; remove a drained replica only while the
// others healthy on up servers are at least the count; never the last copy
// of a ready snapshot; no add while one rebuilds or the cluster has no room.
func TestDrainStep(t *testing.T) {
	h, rb, fy := storpb.ReplicaState_REPLICA_STATE_HEALTHY, storpb.ReplicaState_REPLICA_STATE_REBUILDING, storpb.ReplicaState_REPLICA_STATE_FAULTY
	vol := func(count uint32, reps ...*storpb.Replica) *storpb.Volume {
		return &storpb.Volume{ReplicaCount: count, Replicas: reps}
	}
	rep := func(id, server string, st storpb.ReplicaState) *storpb.Replica {
		return &storpb.Replica{Id: id, ServerId: server, State: st}
	}
	up, down := storpb.ServerState_SERVER_STATE_UP, storpb.ServerState_SERVER_STATE_DOWN
	servers := map[string]*storpb.Server{}
	for _, id := range []string{"s1", "s2", "s3", "s4", "d", "d2"} {
		servers[id] = &storpb.Server{Id: id, State: up}
	}
	servers["s9"] = &storpb.Server{Id: "s9", State: down}
	draining := map[string]bool{"d": true, "d2": true}
	const add, addExtra, none = "add", "add extra", ""
	remove := func(id string) string { return "remove " + id }
	for _, tc := range []struct {
		name     string
		v        *storpb.Volume
		lastCopy string
		noRoom   bool
		want     string
	}{
		{"all healthy: add first", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", h)), "", false, addExtra},
		{"the added one rebuilds: wait", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", h), rep("e", "s3", rb)), "", false, none},
		{"the added one healthy: remove", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", h), rep("e", "s3", h)), "", false, remove("a")},
		{"another faulty: add", vol(3, rep("a", "d", h), rep("b", "s1", fy), rep("c", "s2", h)), "", false, addExtra},
		{"the drained one faulty: add, then remove", vol(3, rep("a", "d", fy), rep("b", "s1", h), rep("c", "s2", h)), "", false, addExtra},
		{"the drained one faulty, the new one healthy", vol(3, rep("a", "d", fy), rep("b", "s1", h), rep("c", "s2", h), rep("e", "s3", h)), "", false, remove("a")},
		{"one replica: add", vol(1, rep("a", "d", h)), "", false, addExtra},
		{"one replica, the new one healthy", vol(1, rep("a", "d", h), rep("e", "s3", h)), "", false, remove("a")},
		{"one missing: add within the count", vol(3, rep("a", "d", h), rep("b", "s1", h)), "", false, add},
		{"another rebuilding: wait", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", rb)), "", false, none},
		{"last copy of a snapshot: never removed", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", h), rep("e", "s3", h)), "a", false, none},
		{"no room for a rebuild", vol(3, rep("a", "d", h), rep("b", "s1", h), rep("c", "s2", h)), "", true, none},
		{"a healthy replica's server is down: not counted", vol(3, rep("a", "d", h), rep("b", "s9", h), rep("c", "s2", h), rep("e", "s3", h)), "", false, none},
		{"nothing on a draining server", vol(3, rep("a", "s4", h), rep("b", "s1", h), rep("c", "s2", h)), "", false, none},
		{"two draining: one at a time", vol(3, rep("a", "d", h), rep("b", "d2", h), rep("c", "s2", h), rep("e", "s3", h)), "", false, remove("a")},
	} {
		step := drainStep(tc.v, draining, servers, map[string]bool{tc.lastCopy: tc.lastCopy != ""}, !tc.noRoom)
		got := none
		switch r := step.req; {
		case r == nil:
		case r.RemoveOnly:
			got = remove(r.ReplicaId)
		case r.DrainExtra:
			got = addExtra
		default:
			got = add
		}
		if got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// A drain may add one replica beyond the count, and only for a volume
// with a replica on a draining server; a stale generation is refused.
func TestDrainExtraReplicaApply(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"))
	for _, id := range []string{"s1", "s2", "s3", "s4", "s5"} {
		mustApply(t, f, cmdRegisterServer(id, "", 0, nil), cmdSetServerState(id, storpb.ServerState_SERVER_STATE_UP))
	}
	mustApply(t, f, cmdCreateVolume("v1", "one", mib, 2))
	v := readVolume(t, f, "v1")
	extra := func(id string, gen uint64) command {
		return command{Op: opReplaceReplica, ID: id, Body: &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: "v1"}, DrainExtra: true, ExpectGeneration: gen}}
	}
	if r := applyCommands(t, f, extra("x1", v.Generation))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Fatalf("an extra replica with no server draining: %v, want FailedPrecondition", r.err)
	}
	mustApply(t, f, command{Op: opCordonServer, Body: &storpb.Server{Id: v.Replicas[0].ServerId, Cordoned: true, Draining: true}})
	if r := applyCommands(t, f, extra("x2", v.Generation+7))[0]; !errors.Is(r.err, ErrFailedPrecondition) || !strings.Contains(r.err.Error(), "generation") {
		t.Fatalf("an extra replica at a stale generation: %v, want FailedPrecondition naming the generation", r.err)
	}
	mustApply(t, f, extra("x3", v.Generation))
	if v = readVolume(t, f, "v1"); len(v.Replicas) != 3 {
		t.Fatalf("after the extra replica: %d replicas, want 3", len(v.Replicas))
	}
	if r := applyCommands(t, f, extra("x4", v.Generation))[0]; !errors.Is(r.err, ErrFailedPrecondition) {
		t.Fatalf("a second extra replica: %v, want FailedPrecondition", r.err)
	}
	// A plain cordon keeps the drain; uncordon ends it.
	mustApply(t, f, cmdCordonServer(v.Replicas[0].ServerId, true))
	if s := readServer(t, f, v.Replicas[0].ServerId); !s.Draining {
		t.Fatal("a cordon ended the drain")
	}
}

func readServer(t testing.TB, f *FSM, id string) *storpb.Server {
	t.Helper()
	var s *storpb.Server
	if err := f.View(func(r *Reader) error {
		var err error
		s, err = r.Server(id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return s
}
