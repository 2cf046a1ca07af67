package raftstore

import (
	"bytes"
	"errors"
	"io"
	"math"
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

func cmdSetClusterConfig(replaceAfterSeconds uint64, overProvisioningPercent uint32) command {
	return command{Op: opSetClusterConfig, Body: &storpb.ClusterConfig{
		ReplaceAfterSeconds: replaceAfterSeconds, OverProvisioningPercent: overProvisioningPercent,
	}}
}

func readClusterConfig(t testing.TB, f *FSM) *storpb.ClusterConfig {
	t.Helper()
	var c *storpb.ClusterConfig
	if err := f.View(func(r *Reader) error {
		var err error
		c, err = r.ClusterConfig()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return c
}

func TestProvisionableBytes(t *testing.T) {
	for _, tc := range []struct {
		name                string
		capacity, allocated uint64
		percent             uint32
		want                uint64
	}{
		{"unset percent is 100", 10 * gib, 4 * gib, 0, 6 * gib},
		{"100", 10 * gib, 4 * gib, 100, 6 * gib},
		{"300", 10 * gib, 4 * gib, 300, 26 * gib},
		{"over-allocated", 10 * gib, 12 * gib, 100, 0},
		{"over-allocated but under the ratio", 10 * gib, 12 * gib, 150, 3 * gib},
		{"fractional", 3, 0, 150, 4},
		{"unreported capacity is unlimited", 0, 5 * gib, 100, math.MaxUint64},
		{"beyond 2^64 is unlimited", math.MaxUint64 / 2, 0, 10000, math.MaxUint64},
		{"just below 2^64", math.MaxUint64 / 100, 0, 100, math.MaxUint64 / 100},
	} {
		s := &storpb.Server{CapacityBytes: tc.capacity, AllocatedBytes: tc.allocated}
		if got := ProvisionableBytes(s, tc.percent); got != tc.want {
			t.Errorf("%s: ProvisionableBytes(capacity %d, allocated %d, %d%%) = %d, want %d",
				tc.name, tc.capacity, tc.allocated, tc.percent, got, tc.want)
		}
	}
}

func TestPlaceOverProvisioning(t *testing.T) {
	servers := []*storpb.Server{
		{Id: "a", State: storpb.ServerState_SERVER_STATE_UP, CapacityBytes: 10 * mib, AllocatedBytes: 9 * mib},
		{Id: "b", State: storpb.ServerState_SERVER_STATE_UP, CapacityBytes: 10 * mib, AllocatedBytes: 9 * mib},
	}
	req := PlaceRequest{Replicas: 2, SizeBytes: 2 * mib}
	if _, err := Place(servers, req); !errors.Is(err, ErrInsufficientCapacity) {
		t.Fatalf("Place at the default ratio: %v, want ErrInsufficientCapacity", err)
	}
	req.OverProvisioningPercent = 200
	got, err := Place(servers, req)
	if err != nil || len(got) != 2 {
		t.Fatalf("Place at 200%%: %v, %v; want both servers", got, err)
	}
}

// TestClusterConfigOverProvisioning: the ratio in the Raft state decides
// placement at apply time; lowering it again refuses new volumes and
// leaves existing ones alone.
func TestClusterConfigOverProvisioning(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"))
	for _, id := range []string{"s1", "s2", "s3"} {
		mustApply(t, f, cmdRegisterServer(id, "", 4*mib, nil), cmdSetServerState(id, storpb.ServerState_SERVER_STATE_UP))
	}
	mustApply(t, f, cmdCreateVolume("v1", "one", 3*mib, 3))
	if r := applyCommands(t, f, cmdCreateVolume("v2", "two", 3*mib, 3))[0]; !errors.Is(r.err, ErrInsufficientCapacity) {
		t.Fatalf("second volume at 100%%: %v, want ErrInsufficientCapacity", r.err)
	}
	if r := applyCommands(t, f, cmdExpandVolume("v1", 5*mib))[0]; !errors.Is(r.err, ErrInsufficientCapacity) {
		t.Fatalf("expand past capacity at 100%%: %v, want ErrInsufficientCapacity", r.err)
	}
	mustApply(t, f, cmdSetClusterConfig(0, 300))
	mustApply(t, f, cmdCreateVolume("v2", "two", 3*mib, 3), cmdExpandVolume("v1", 5*mib))
	mustApply(t, f, cmdSetClusterConfig(0, 100))
	if r := applyCommands(t, f, cmdCreateVolume("v3", "three", 1*mib, 3))[0]; !errors.Is(r.err, ErrInsufficientCapacity) {
		t.Fatalf("third volume back at 100%%: %v, want ErrInsufficientCapacity", r.err)
	}
	for _, id := range []string{"v1", "v2"} {
		if v := readVolume(t, f, id); len(v.Replicas) != 3 || v.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
			t.Fatalf("volume %s after lowering the ratio: %v", id, v)
		}
	}
	if got := readClusterConfig(t, f); got.OverProvisioningPercent != 100 || got.ReplaceAfterSeconds != 0 {
		t.Fatalf("cluster config = %v, want over-provisioning 100, replace-after unset", got)
	}
}

func TestClusterConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      *storpb.ClusterConfig
		wantErr string // "" for valid
	}{
		{"unset", &storpb.ClusterConfig{}, ""},
		{"bounds", &storpb.ClusterConfig{ReplaceAfterSeconds: 30, OverProvisioningPercent: 100}, ""},
		{"upper bounds", &storpb.ClusterConfig{ReplaceAfterSeconds: 7 * 24 * 3600, OverProvisioningPercent: 10000}, ""},
		{"replace-after too short", &storpb.ClusterConfig{ReplaceAfterSeconds: 29}, "replace-after 29s is outside 30s..168h0m0s"},
		{"replace-after too long", &storpb.ClusterConfig{ReplaceAfterSeconds: 7*24*3600 + 1}, "replace-after 168h0m1s is outside"},
		{"replace-after huge", &storpb.ClusterConfig{ReplaceAfterSeconds: math.MaxUint64}, "is outside 30s..168h0m0s"},
		{"ratio below 100", &storpb.ClusterConfig{OverProvisioningPercent: 99}, "over-provisioning 99% is outside 100..10000%"},
		{"ratio above 10000", &storpb.ClusterConfig{OverProvisioningPercent: 10001}, "over-provisioning 10001% is outside"},
	} {
		err := CheckClusterConfig(tc.in)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: %v, want valid", tc.name, err)
		case tc.wantErr != "" && (!errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: %v, want ErrInvalidArgument containing %q", tc.name, err, tc.wantErr)
		}
	}

	// The FSM refuses a bad value on its own and keeps the old config.
	f := openTestFSM(t, "")
	mustApply(t, f, cmdInitCluster("c"), cmdSetClusterConfig(120, 200))
	if r := applyCommands(t, f, cmdSetClusterConfig(60, 50))[0]; !errors.Is(r.err, ErrInvalidArgument) {
		t.Fatalf("apply of over-provisioning 50%%: %v, want ErrInvalidArgument", r.err)
	}
	if got := readClusterConfig(t, f); got.ReplaceAfterSeconds != 120 || got.OverProvisioningPercent != 200 {
		t.Fatalf("after a refused change: %v, want replace-after 120s and 200%% kept", got)
	}
}

// TestClusterConfigSurvivesSnapshotRestore: the config is FSM state like
// any other; a restored FSM and a reopened file keep it.
func TestClusterConfigSurvivesSnapshotRestore(t *testing.T) {
	path := t.TempDir() + "/meta.db"
	src := openTestFSM(t, path)
	mustApply(t, src, cmdInitCluster("c"), cmdSetClusterConfig(90, 0), cmdSetClusterConfig(0, 250))
	image := snapshotBytes(t, src)
	dst := openTestFSM(t, "")
	if err := dst.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if got := readClusterConfig(t, dst); got.ReplaceAfterSeconds != 90 || got.OverProvisioningPercent != 250 {
		t.Fatalf("restored cluster config = %v, want replace-after 90s, over-provisioning 250%%", got)
	}
	src.Close()
	reopened := openTestFSM(t, path)
	if got := readClusterConfig(t, reopened); got.ReplaceAfterSeconds != 90 || got.OverProvisioningPercent != 250 {
		t.Fatalf("reopened cluster config = %v, want replace-after 90s, over-provisioning 250%%", got)
	}
}
