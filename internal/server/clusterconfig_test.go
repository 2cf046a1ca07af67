package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

func setClusterConfig(t *testing.T, c servertest.Clients, in *storpb.ClusterConfig) *storpb.ClusterConfig {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.SetClusterConfigResponse, error) {
		return c.Cluster.SetClusterConfig(ctx, &storpb.SetClusterConfigRequest{Config: in})
	}).Config
}

func getClusterConfig(t *testing.T, c servertest.Clients) *storpb.ClusterConfig {
	t.Helper()
	return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.GetClusterConfigResponse, error) {
		return c.Cluster.GetClusterConfig(ctx, &storpb.GetClusterConfigRequest{})
	}).Config
}

// tryCreateVolume creates a volume and returns the status code (retrying
// while there is no leader).
func tryCreateVolume(t *testing.T, c servertest.Clients, name string, size uint64) (codes.Code, string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := c.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: size, ReplicaCount: 3})
		cancel()
		code := status.Code(err)
		if (code != codes.Unavailable && code != codes.DeadlineExceeded) || time.Now().After(deadline) {
			return code, status.Convert(err).Message()
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestOverProvisioningTakesEffectWithoutRestart: on the same running
// servers, a volume refused for capacity at the default ratio is placed
// after the ratio is raised, and the next one is refused again once it is
// lowered; the volumes placed meanwhile stay. The change is made through
// a follower (forwarded to the leader) and survives a leader change.
func TestOverProvisioningTakesEffectWithoutRestart(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Capacity = 4 * gib
	}})
	leader := c.Leader(10 * time.Second)
	follower := (leader + 1) % 3
	createVolume(t, c.Client(leader), "one", 3*gib, 3)
	if code, msg := tryCreateVolume(t, c.Client(leader), "two", 3*gib); code != codes.ResourceExhausted {
		t.Fatalf("second 3 GiB volume on 4 GiB servers at 100%%: %v %q, want ResourceExhausted", code, msg)
	}

	got := setClusterConfig(t, c.Client(follower), &storpb.ClusterConfig{OverProvisioningPercent: 300})
	if got.GetOverProvisioningPercent() != 300 {
		t.Fatalf("SetClusterConfig answered %v, want over-provisioning 300", got)
	}
	createVolume(t, c.Client(leader), "two", 3*gib, 3)
	servers := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(follower).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	if servers.GetOverProvisioningPercent() != 300 {
		t.Fatalf("ListServers over-provisioning %d, want 300", servers.GetOverProvisioningPercent())
	}
	for _, s := range servers.GetServers() {
		if s.GetAllocatedBytes() != 6*gib {
			t.Fatalf("server %s provisioned %d bytes, want %d", s.GetId(), s.GetAllocatedBytes(), 6*gib)
		}
	}

	setClusterConfig(t, c.Client(leader), &storpb.ClusterConfig{OverProvisioningPercent: 100})
	if code, msg := tryCreateVolume(t, c.Client(leader), "three", gib); code != codes.ResourceExhausted {
		t.Fatalf("1 GiB volume on over-provisioned servers back at 100%%: %v %q, want ResourceExhausted", code, msg)
	}
	vols := listVolumes(t, c.Client(leader))
	if len(vols) != 2 || len(vols["one"].GetReplicas()) != 3 || len(vols["two"].GetReplicas()) != 3 {
		t.Fatalf("volumes after lowering the ratio: %v, want one and two with 3 replicas each", vols)
	}

	// A new leader reads the same committed config.
	setClusterConfig(t, c.Client(leader), &storpb.ClusterConfig{OverProvisioningPercent: 250, ReplaceAfterSeconds: 90})
	c.Stop(leader)
	next := c.Leader(15 * time.Second)
	if next == leader {
		t.Fatalf("leader %d stopped but still leads", leader)
	}
	if got := getClusterConfig(t, c.Client(next)); got.GetOverProvisioningPercent() != 250 || got.GetReplaceAfterSeconds() != 90 {
		t.Fatalf("config under the new leader: %v, want 250%% and 90s", got)
	}
}

func TestSetClusterConfigRefusesBadValues(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1})
	cl := c.Client(c.Leader(10 * time.Second))
	setClusterConfig(t, cl, &storpb.ClusterConfig{ReplaceAfterSeconds: 120, OverProvisioningPercent: 200})
	for _, tc := range []struct {
		in   *storpb.ClusterConfig
		want string
	}{
		{&storpb.ClusterConfig{ReplaceAfterSeconds: 10}, "replace-after 10s is outside 30s..168h0m0s"},
		{&storpb.ClusterConfig{ReplaceAfterSeconds: 8 * 24 * 3600}, "replace-after 192h0m0s is outside 30s..168h0m0s"},
		{&storpb.ClusterConfig{OverProvisioningPercent: 50}, "over-provisioning 50% is outside 100..10000%"},
		{&storpb.ClusterConfig{ReplaceAfterSeconds: 60, OverProvisioningPercent: 20000}, "over-provisioning 20000% is outside 100..10000%"},
		{&storpb.ClusterConfig{}, "nothing to set"},
		{nil, "nothing to set"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := cl.Cluster.SetClusterConfig(ctx, &storpb.SetClusterConfigRequest{Config: tc.in})
		cancel()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
			t.Errorf("SetClusterConfig(%v): %v, want InvalidArgument containing %q", tc.in, err, tc.want)
		}
	}
	if got := getClusterConfig(t, cl); got.GetReplaceAfterSeconds() != 120 || got.GetOverProvisioningPercent() != 200 {
		t.Fatalf("config after refused changes: %v, want 120s and 200%% kept", got)
	}
}

// TestReplaceAfterTakesEffectWithoutRestart: the servers start with a
// replacement wait of an hour; the cluster config shortens it to 30s, and
// a replica of a server killed for good is replaced after that, with no
// server restarted.
func TestReplaceAfterTakesEffectWithoutRestart(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplicaGrace = 200 * time.Millisecond
		cfg.Raft.ReplaceAfter = time.Hour
	}})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "v", gib, 3)
	victim := -1
	for i, n := range c.Nodes {
		if i != leader && replicaOn(v, n.ID) != nil {
			victim = i
			break
		}
	}
	setClusterConfig(t, c.Client(victim), &storpb.ClusterConfig{ReplaceAfterSeconds: 30})
	gone := c.Nodes[victim].ID
	c.Kill(victim)
	faulty := waitVolume(t, c, leader, v.Id, 15*time.Second, "replica faulty after its server died", func(v *storpb.Volume) bool {
		return replicaOn(v, gone).GetState() == storpb.ReplicaState_REPLICA_STATE_FAULTY
	})
	since := time.Unix(0, replicaOn(faulty, gone).UnhealthySinceUnixNano)
	waitVolume(t, c, leader, v.Id, 60*time.Second, "replacement after the configured 30s", func(v *storpb.Volume) bool {
		return replicaOn(v, gone) == nil && len(v.Replicas) == 3
	})
	if waited := time.Since(since); waited < 30*time.Second {
		t.Fatalf("replaced %v after the replica became unhealthy, before the configured 30s", waited)
	}
}
