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

// drainMove: one replica of a volume at a time, a healthy one only when
// every other is healthy and none is missing.
func TestDrainMove(t *testing.T) {
	h, rb, fy := storpb.ReplicaState_REPLICA_STATE_HEALTHY, storpb.ReplicaState_REPLICA_STATE_REBUILDING, storpb.ReplicaState_REPLICA_STATE_FAULTY
	vol := func(count uint32, reps ...*storpb.Replica) *storpb.Volume {
		return &storpb.Volume{ReplicaCount: count, Replicas: reps}
	}
	rep := func(id, server string, st storpb.ReplicaState) *storpb.Replica {
		return &storpb.Replica{Id: id, ServerId: server, State: st}
	}
	draining := map[string]bool{"d": true}
	for _, tc := range []struct {
		name string
		v    *storpb.Volume
		want string
	}{
		{"all healthy", vol(3, rep("a", "s1", h), rep("b", "d", h), rep("c", "s2", h)), "b"},
		{"another rebuilding", vol(3, rep("a", "s1", rb), rep("b", "d", h), rep("c", "s2", h)), ""},
		{"another faulty", vol(3, rep("a", "s1", fy), rep("b", "d", h), rep("c", "s2", h)), ""},
		{"one missing", vol(3, rep("b", "d", h), rep("c", "s2", h)), ""},
		{"the drained one faulty", vol(3, rep("a", "s1", rb), rep("b", "d", fy), rep("c", "s2", h)), "b"},
		{"the drained one rebuilding, one missing", vol(3, rep("b", "d", rb), rep("c", "s2", h)), "b"},
		{"nothing on the drained server", vol(3, rep("a", "s1", h), rep("c", "s2", h), rep("e", "s3", h)), ""},
	} {
		got := ""
		if m := drainMove(tc.v, draining); m != nil {
			got = m.Id
		}
		if got != tc.want {
			t.Errorf("%s: drainMove %q, want %q", tc.name, got, tc.want)
		}
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
