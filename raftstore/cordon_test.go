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
