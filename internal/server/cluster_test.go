package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/raftstore"
)

const gib = 1 << 30

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// retry calls fn until it succeeds or the deadline passes; cluster calls
// fail with Unavailable during an election.
func retry[T any](t *testing.T, d time.Duration, fn func(ctx context.Context) (T, error)) T {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		v, err := fn(ctx)
		cancel()
		if err == nil {
			return v
		}
		if status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("unexpected error: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing after %v: %v", d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func createVolume(t *testing.T, c servertest.Clients, name string, size uint64, replicas uint32) *storpb.Volume {
	t.Helper()
	resp := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.CreateVolumeResponse, error) {
		return c.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: size, ReplicaCount: replicas})
	})
	return resp.Volume
}

func listVolumes(t *testing.T, c servertest.Clients) map[string]*storpb.Volume {
	t.Helper()
	out := map[string]*storpb.Volume{}
	token := ""
	for {
		resp := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListVolumesResponse, error) {
			return c.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{PageSize: 7, PageToken: token})
		})
		for _, v := range resp.Volumes {
			out[v.Name] = v
		}
		if token = resp.NextPageToken; token == "" {
			return out
		}
	}
}

func TestVolumesCreatedThroughAnyServer(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	want := map[string]bool{}
	for i := range 9 {
		name := fmt.Sprintf("vol-%d", i)
		v := createVolume(t, c.Client(i%3), name, gib, 3)
		if v.Name != name || v.SizeBytes != gib || len(v.Replicas) != 3 {
			t.Fatalf("created %v", v)
		}
		want[name] = true
	}
	for i := range 3 {
		got := listVolumes(t, c.Client(i))
		if len(got) != len(want) {
			t.Fatalf("server %d lists %d volumes, want %d", i, len(got), len(want))
		}
		for name := range want {
			if got[name] == nil {
				t.Fatalf("server %d does not list %s", i, name)
			}
		}
	}
}

func TestLeaderKillKeepsCommittedVolumes(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	old := c.Leader(10 * time.Second)
	for i := range 10 {
		createVolume(t, c.Client(i%3), fmt.Sprintf("before-%d", i), gib, 3)
	}
	c.Kill(old)
	survivor := (old + 1) % 3
	newLeader := c.Leader(10 * time.Second)
	if newLeader == old {
		t.Fatalf("killed leader %d still leads", old)
	}
	got := listVolumes(t, c.Client(survivor))
	for i := range 10 {
		if got[fmt.Sprintf("before-%d", i)] == nil {
			t.Fatalf("volume before-%d lost after leader kill; have %d volumes", i, len(got))
		}
	}
	// Writes go on with two of three servers.
	createVolume(t, c.Client(survivor), "after", gib, 2)

	// The killed leader comes back and catches up.
	c.Start(old)
	waitLocal(t, c, old, func(r *raftstore.Reader) bool {
		_, err := r.VolumeByName("after")
		return err == nil
	})
}

// waitLocal waits until node i's own state machine satisfies cond.
func waitLocal(t *testing.T, c *servertest.Cluster, i int, cond func(r *raftstore.Reader) bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		ok := false
		if srv := c.Nodes[i].Server(); srv != nil {
			_ = srv.Store().View(func(r *raftstore.Reader) error { ok = cond(r); return nil })
		}
		if ok {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("node %d did not catch up within 15s", i)
}

func TestRestartedServerCatchesUpBySnapshot(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		// Compact aggressively so the lagging server needs a snapshot.
		cfg.Raft.SnapshotThreshold = 16
		cfg.Raft.TrailingLogs = 4
		cfg.Raft.SnapshotInterval = 50 * time.Millisecond
	}})
	leader := c.Leader(10 * time.Second)
	lag := (leader + 1) % 3
	c.Kill(lag)
	for i := range 60 {
		createVolume(t, c.Client(leader), fmt.Sprintf("v%02d", i), gib, 2)
	}
	// Give the leader time to snapshot and truncate its log.
	time.Sleep(500 * time.Millisecond)
	c.Start(lag)
	waitLocal(t, c, lag, func(r *raftstore.Reader) bool {
		vols, _, _ := r.Volumes("", 0)
		return len(vols) == 60
	})
	// A restart after the snapshot install resumes from the restored
	// state, without replaying anything twice.
	c.Restart(lag)
	waitLocal(t, c, lag, func(r *raftstore.Reader) bool {
		vols, _, _ := r.Volumes("", 0)
		return len(vols) == 60
	})
}

func TestCreateVolumeIdempotentByName(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	a := createVolume(t, c.Client(0), "db", 10*gib, 3)
	b := createVolume(t, c.Client(1), "db", 10*gib, 3)
	if a.Id != b.Id {
		t.Fatalf("second create returned id %s, first %s", b.Id, a.Id)
	}
	for _, req := range []*storpb.CreateVolumeRequest{
		{Name: "db", SizeBytes: 20 * gib, ReplicaCount: 3},
		{Name: "db", SizeBytes: 10 * gib, ReplicaCount: 2},
		{Name: "db", SizeBytes: 10 * gib, ReplicaCount: 3, Parameters: map[string]string{"fs": "xfs"}},
	} {
		_, err := c.Client(2).Volumes.CreateVolume(ctxT(t, 5*time.Second), req)
		if status.Code(err) != codes.AlreadyExists {
			t.Fatalf("create %v: got %v, want AlreadyExists", req, err)
		}
	}
	if n := len(listVolumes(t, c.Client(0))); n != 1 {
		t.Fatalf("%d volumes after idempotent creates, want 1", n)
	}
}

func TestPlacementSpreadsReplicas(t *testing.T) {
	zones := []string{"a", "b", "c"}
	c := servertest.NewCluster(t, servertest.Options{Servers: 6, Configure: func(i int, cfg *server.Config) {
		cfg.Zone = zones[i%3]
	}})
	servers := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(0).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	}).Servers
	zoneOf := map[string]string{}
	for _, s := range servers {
		zoneOf[s.Id] = s.Zone
	}
	perServer := map[string]int{}
	for i := range 30 {
		v := createVolume(t, c.Client(i%6), fmt.Sprintf("v%d", i), gib, 3)
		seen, seenZone := map[string]bool{}, map[string]bool{}
		for _, r := range v.Replicas {
			if seen[r.ServerId] {
				t.Fatalf("volume %s has two replicas on %s: %v", v.Name, r.ServerId, v.Replicas)
			}
			seen[r.ServerId], seenZone[zoneOf[r.ServerId]] = true, true
			perServer[r.ServerId]++
		}
		if len(seenZone) != 3 {
			t.Fatalf("volume %s spans zones %v, want all 3", v.Name, seenZone)
		}
	}
	// Capacity-aware tie-breaking balances allocation: 90 replicas over 6
	// servers of equal capacity.
	for id, n := range perServer {
		if n != 15 {
			t.Fatalf("server %s holds %d replicas, want 15 (%v)", id, n, perServer)
		}
	}
}

func TestBadInput(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Capacity = 100 * gib
	}})
	cl := c.Client(1)
	attached := createVolume(t, cl, "attached", gib, 3)
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
		return cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Name: "attached"}, NodeId: "node-a"})
	})
	snapped := createVolume(t, cl, "snapped", gib, 3)
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.CreateSnapshotResponse, error) {
		return cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: snapped.Id, Name: "snap-1"})
	})
	// Deleted with a snapshot: kept for it, out of its users' reach.
	del := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.DeleteVolumeResponse, error) {
		return cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Name: "snapped"}})
	})
	if del.GetRetained().GetState() != storpb.VolumeState_VOLUME_STATE_DELETED {
		t.Fatalf("delete of a volume with a snapshot answered %v, want it retained in state DELETED", del)
	}

	cases := []struct {
		name string
		call func(ctx context.Context) error
		want codes.Code
	}{
		{"get unknown volume", func(ctx context.Context) error {
			_, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "nope"}})
			return err
		}, codes.NotFound},
		{"get with no reference", func(ctx context.Context) error {
			_, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{})
			return err
		}, codes.InvalidArgument},
		{"delete unknown volume", func(ctx context.Context) error {
			_, err := cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: "no-such-id"}})
			return err
		}, codes.NotFound},
		{"size 0", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "zero", SizeBytes: 0})
			return err
		}, codes.InvalidArgument},
		{"empty name", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{SizeBytes: gib})
			return err
		}, codes.InvalidArgument},
		{"name with a space", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "a b", SizeBytes: gib})
			return err
		}, codes.InvalidArgument},
		{"more replicas than servers", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "four", SizeBytes: gib, ReplicaCount: 4})
			return err
		}, codes.ResourceExhausted},
		{"replica count over the limit", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "many", SizeBytes: gib, ReplicaCount: 99})
			return err
		}, codes.InvalidArgument},
		{"larger than any server", func(ctx context.Context) error {
			_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "huge", SizeBytes: 200 * gib, ReplicaCount: 1})
			return err
		}, codes.ResourceExhausted},
		{"shrink", func(ctx context.Context) error {
			_, err := cl.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Name: "attached"}, SizeBytes: gib / 2})
			return err
		}, codes.FailedPrecondition},
		{"expand past capacity", func(ctx context.Context) error {
			_, err := cl.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Name: "attached"}, SizeBytes: 150 * gib})
			return err
		}, codes.ResourceExhausted},
		{"attach where attached elsewhere", func(ctx context.Context) error {
			_, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: attached.Id}, NodeId: "node-b"})
			return err
		}, codes.FailedPrecondition},
		{"attach without node", func(ctx context.Context) error {
			_, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: attached.Id}})
			return err
		}, codes.InvalidArgument},
		{"delete attached volume", func(ctx context.Context) error {
			_, err := cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Name: "attached"}})
			return err
		}, codes.FailedPrecondition},
		{"get a deleted volume by name", func(ctx context.Context) error {
			_, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "snapped"}})
			return err
		}, codes.NotFound},
		{"attach a deleted volume", func(ctx context.Context) error {
			_, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: snapped.Id}, NodeId: "node-a"})
			return err
		}, codes.NotFound},
		{"expand a deleted volume", func(ctx context.Context) error {
			_, err := cl.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: snapped.Id}, SizeBytes: 2 * gib})
			return err
		}, codes.NotFound},
		{"snapshot a deleted volume", func(ctx context.Context) error {
			_, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: snapped.Id, Name: "snap-2"})
			return err
		}, codes.NotFound},
		{"bad page token", func(ctx context.Context) error {
			_, err := cl.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{PageToken: "garbage"})
			return err
		}, codes.InvalidArgument},
		{"snapshot of unknown volume", func(ctx context.Context) error {
			_, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: "nope", Name: "s"})
			return err
		}, codes.NotFound},
		{"snapshot name taken by another volume", func(ctx context.Context) error {
			_, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: attached.Id, Name: "snap-1"})
			return err
		}, codes.AlreadyExists},
		{"delete unknown snapshot", func(ctx context.Context) error {
			_, err := cl.Snapshots.DeleteSnapshot(ctx, &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Name: "nope"}})
			return err
		}, codes.NotFound},
		{"remove unknown server", func(ctx context.Context) error {
			_, err := cl.Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: "nope"})
			return err
		}, codes.NotFound},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call(ctxT(t, 5*time.Second))
			if status.Code(err) != tc.want {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			if msg := status.Convert(err).Message(); msg == "" {
				t.Fatalf("error has no message")
			}
		})
	}
}

func TestAttachFencingEpochAndTakeover(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	cl := c.Client(2)
	createVolume(t, cl, "v", gib, 3)
	attach := func(node string, takeover bool) *storpb.Volume {
		return retry(t, 5*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Name: "v"}, NodeId: node, Takeover: takeover})
		}).Volume
	}
	if v := attach("a", false); v.Epoch != 1 || v.Attachment.GetNodeId() != "a" {
		t.Fatalf("first attach: epoch %d node %q", v.Epoch, v.Attachment.GetNodeId())
	}
	if v := attach("a", false); v.Epoch != 2 {
		t.Fatalf("re-attach on the same node: epoch %d, want 2 (every attach fences)", v.Epoch)
	}
	if v := attach("b", true); v.Epoch != 3 || v.Attachment.GetNodeId() != "b" {
		t.Fatalf("takeover: epoch %d node %q", v.Epoch, v.Attachment.GetNodeId())
	}
	// Detach by the old holder is a no-op; by the holder it detaches.
	d := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
		return cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Name: "v"}, NodeId: "a"})
	})
	if d.Volume.Attachment.GetNodeId() != "b" {
		t.Fatalf("detach by a stale node detached the volume")
	}
	d = retry(t, 5*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
		return cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Name: "v"}, NodeId: "b"})
	})
	if d.Volume.Attachment != nil || d.Volume.Epoch != 4 {
		t.Fatalf("after detach: %v; want epoch 4 (a detach fences the holder)", d.Volume)
	}

	// A full cluster restart replays the log; no attach may apply twice.
	for i := range c.Nodes {
		c.Kill(i)
	}
	for i := range c.Nodes {
		c.Start(i)
	}
	if v := attach("c", false); v.Epoch != 5 {
		t.Fatalf("after full restart, attach gave epoch %d, want 5", v.Epoch)
	}
}

func TestPartitionedLeaderStepsDownAndCatchesUp(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	old := c.Leader(10 * time.Second)
	createVolume(t, c.Client(old), "before", gib, 3)
	c.Partition(old)
	majority := (old + 1) % 3
	createVolume(t, c.Client(majority), "during", gib, 2)

	// The isolated server cannot commit: it steps down, and calls to it
	// fail with Unavailable instead of answering from stale state.
	deadline := time.Now().Add(5 * time.Second)
	for c.Nodes[old].Server().Store().IsLeader() {
		if time.Now().After(deadline) {
			t.Fatalf("isolated leader did not step down")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, err := c.Client(old).Volumes.GetVolume(ctxT(t, 2*time.Second), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "during"}})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("read through the isolated server: %v, want Unavailable", err)
	}

	c.Heal()
	waitLocal(t, c, old, func(r *raftstore.Reader) bool {
		_, err := r.VolumeByName("during")
		return err == nil
	})
	if got := listVolumes(t, c.Client(old)); len(got) != 2 {
		t.Fatalf("after heal, %d volumes, want 2", len(got))
	}
}

func serverState(t *testing.T, c *servertest.Cluster, from int, id string) storpb.ServerState {
	t.Helper()
	resp := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(from).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	for _, s := range resp.Servers {
		if s.Id == id {
			return s.State
		}
	}
	t.Fatalf("server %s not listed", id)
	return 0
}

func waitServerState(t *testing.T, c *servertest.Cluster, from int, id string, want storpb.ServerState, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for serverState(t, c, from, id) != want {
		if time.Since(start) > within {
			t.Fatalf("server %s not %v within %v", id, want, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return time.Since(start)
}

func TestServerLiveness(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	victim := (leader + 1) % 3
	id := c.Nodes[victim].ID
	c.Kill(victim)
	// ServerDownTimeout is 2s in servertest; allow ticks and scheduling.
	took := waitServerState(t, c, leader, id, storpb.ServerState_SERVER_STATE_DOWN, 6*time.Second)
	if took < time.Second {
		t.Fatalf("server marked down after %v, before the 2s timeout could pass", took)
	}
	// Down servers receive no replicas.
	v := createVolume(t, c.Client(leader), "two", gib, 2)
	for _, r := range v.Replicas {
		if r.ServerId == id {
			t.Fatalf("replica placed on down server %s", id)
		}
	}
	c.Start(victim)
	waitServerState(t, c, leader, id, storpb.ServerState_SERVER_STATE_UP, 6*time.Second)
}

func TestVotersAndNonVoters(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4})
	suffrage := func() (voters, nonvoters []string) {
		st := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.StatusResponse, error) {
			return c.Client(c.Leader(10*time.Second)).Cluster.Status(ctx, &storpb.StatusRequest{})
		})
		for _, m := range st.Members {
			if m.Suffrage == storpb.Suffrage_SUFFRAGE_VOTER {
				voters = append(voters, m.Id)
			} else {
				nonvoters = append(nonvoters, m.Id)
			}
		}
		return voters, nonvoters
	}
	voters, nonvoters := suffrage()
	// Joins race, so which server is the non-voter varies; the counts do not.
	if len(voters) != 3 || len(nonvoters) != 1 {
		t.Fatalf("voters %v, non-voters %v; want three voting and one not", voters, nonvoters)
	}
	// A voter leaves: the non-voter is promoted so the cluster keeps three.
	var gone string
	for _, v := range voters {
		if v != "s1" { // s1 is every other server's join seed; keep it
			gone = v
			break
		}
	}
	idx := -1
	for i, n := range c.Nodes {
		if n.ID == gone {
			idx = i
		}
	}
	c.Stop(idx)
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.LeaveResponse, error) {
		return c.Client(0).Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: gone})
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		voters, nonvoters = suffrage()
		if len(voters) == 3 && len(nonvoters) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s left: voters %v, non-voters %v", gone, voters, nonvoters)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, v := range voters {
		if v == gone {
			t.Fatalf("%s still votes after leaving", gone)
		}
	}
}

func TestWatchVolumeThroughFollower(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	follower := (leader + 1) % 3
	v := createVolume(t, c.Client(leader), "w", gib, 3)
	stream, err := c.Client(follower).Volumes.WatchVolume(ctxT(t, 20*time.Second), &storpb.WatchVolumeRequest{Volume: &storpb.VolumeRef{Name: "w"}})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil || first.Volume.GetId() != v.Id {
		t.Fatalf("first event %v, %v", first, err)
	}
	cl := c.Client(leader)
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
		return cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1"})
	})
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ExpandVolumeResponse, error) {
		return cl.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, SizeBytes: 2 * gib})
	})
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
		return cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	})
	retry(t, 5*time.Second, func(ctx context.Context) (*storpb.DeleteVolumeResponse, error) {
		return cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	})
	var events []*storpb.VolumeEvent
	for {
		ev, err := stream.Recv()
		if err != nil {
			break // the stream ends after the delete event
		}
		events = append(events, ev)
	}
	if len(events) != 4 {
		t.Fatalf("got %d events after the first, want 4 (attach, expand, detach, delete): %v", len(events), events)
	}
	if e := events[0].Volume; e.Epoch != 1 || e.Attachment.GetNodeId() != "n1" {
		t.Fatalf("attach event: %v", e)
	}
	if events[1].Volume.SizeBytes != 2*gib || events[2].Volume.Attachment != nil || !events[3].Deleted {
		t.Fatalf("events: %v", events)
	}
	for i := 1; i < len(events); i++ {
		if events[i].Index <= events[i-1].Index {
			t.Fatalf("event indexes not increasing: %v", events)
		}
	}
}

func TestSetReplicaStateIsFencedAndKeepsTheLastCopy(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	cl := c.Client(1)
	v := createVolume(t, cl, "v", gib, 3)
	attach := func(node string) uint64 {
		return retry(t, 5*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: node, Takeover: true})
		}).Volume.Epoch
	}
	set := func(replica int, state storpb.ReplicaState, epoch, gen uint64) (*storpb.Volume, error) {
		resp, err := cl.Volumes.SetReplicaState(ctxT(t, 5*time.Second), &storpb.SetReplicaStateRequest{
			VolumeId: v.Id, ReplicaId: v.Replicas[replica].Id, State: state, Epoch: epoch, Generation: gen, Reason: "test",
		})
		return resp.GetVolume(), err
	}
	e1 := attach("a")
	got, err := set(1, storpb.ReplicaState_REPLICA_STATE_FAULTY, e1, 0)
	if err != nil || got.Replicas[1].State != storpb.ReplicaState_REPLICA_STATE_FAULTY || got.Generation != 2 {
		t.Fatalf("mark faulty: %v %v", got, err)
	}
	e2 := attach("b")
	if _, err := set(2, storpb.ReplicaState_REPLICA_STATE_FAULTY, e1, 0); status.Code(err) != codes.Aborted {
		t.Fatalf("fenced engine marked a replica faulty: %v", err)
	}
	if _, err := set(2, storpb.ReplicaState_REPLICA_STATE_FAULTY, e2, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := set(0, storpb.ReplicaState_REPLICA_STATE_FAULTY, e2, 0); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("marking the last healthy replica faulty: %v, want FailedPrecondition", err)
	}
	got, err = set(1, storpb.ReplicaState_REPLICA_STATE_REBUILDING, e2, 0)
	if err != nil {
		t.Fatal(err)
	}
	started := got.Replicas[1].Generation
	if _, err := set(1, storpb.ReplicaState_REPLICA_STATE_HEALTHY, e2, started-1); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("healthy from a stale rebuild: %v", err)
	}
	got, err = set(1, storpb.ReplicaState_REPLICA_STATE_HEALTHY, e2, started)
	if err != nil || got.Replicas[1].State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		t.Fatalf("rebuild done: %v %v", got, err)
	}
}

func TestKilledLeaderIsNotSeenAfterItDied(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	old := c.Leader(10 * time.Second)
	id := c.Nodes[old].ID
	killed := time.Now()
	c.Kill(old)
	survivor := (old + 1) % 3
	waitServerState(t, c, survivor, id, storpb.ServerState_SERVER_STATE_DOWN, 10*time.Second)
	resp := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(survivor).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	for _, s := range resp.Servers {
		if s.Id == id && s.LastSeenUnixNano > killed.UnixNano() {
			t.Fatalf("server %s killed at %v is reported last seen %v after that", id, killed, time.Unix(0, s.LastSeenUnixNano).Sub(killed))
		}
	}
}

// TestACallForwardedToALostLeaderIsGivenUp: a follower forwards every
// call to its leader; when the path between them drops packets without
// breaking the connection (servertest's Stall), the forwarded call used
// to wait for the caller's deadline (jepsen seed 6404: an engine's open
// through such a server failed after 30 s, and the volume served nothing
// meanwhile). Once the follower sees it has lost its leader, the call is
// answered Unavailable, which the client retries through another server.
func TestACallForwardedToALostLeaderIsGivenUp(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	f, other := (leader+1)%3, (leader+2)%3
	// A forwarded call first, so the follower's connection to the leader
	// is open (a stall holds it open, passing nothing).
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(f).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	c.Net.Stall(f, leader)
	c.Net.Stall(f, other)
	defer c.Heal()
	start := time.Now()
	_, err := c.Client(f).Cluster.ListServers(ctxT(t, 20*time.Second), &storpb.ListServersRequest{})
	took := time.Since(start)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "lost its leader") || took > 10*time.Second {
		t.Fatalf("a call forwarded by a server whose leader stopped answering: %v after %v; want Unavailable well before the caller's 20 s", err, took.Round(time.Millisecond))
	}
	t.Logf("answered %v after %v", status.Code(err), took.Round(time.Millisecond))
}

// TestACallForwardedOverAStalledControlPortIsGivenUp: when the path from
// a follower to its leader's control port drops packets while Raft's
// traffic still flows, the follower never sees its leader lost, and a
// forwarded call used to wait for the caller's deadline. The forwarding
// connection's keepalive finds the dead path and the call is answered
// Unavailable, which the client retries through another server.
func TestACallForwardedOverAStalledControlPortIsGivenUp(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	f := (leader + 1) % 3
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(f).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	})
	c.Net.StallPort(f, c.Nodes[leader].Addr)
	defer c.Heal()
	start := time.Now()
	// About 20 s: the keepalive's 15 s, and 5 s that gRPC waits to write
	// its GOAWAY into the stalled connection. Up to 40 s if a heartbeat
	// (every 100 ms, on the same connection) was written first after the
	// stall: the call then waits in gRPC's send queue, unsent, and gRPC
	// retries it on a new connection, whose dial waits out its 20 s
	// connect timeout.
	_, err := c.Client(f).Cluster.ListServers(ctxT(t, time.Minute), &storpb.ListServersRequest{})
	took := time.Since(start)
	if status.Code(err) != codes.Unavailable || took > 45*time.Second {
		t.Fatalf("a call forwarded over a stalled path to the leader's control port: %v after %v; want Unavailable well before the caller's 60 s", err, took.Round(time.Millisecond))
	}
	if l := c.Leader(time.Second); l != leader {
		t.Fatalf("the leader moved from %d to %d: the stall was not of the control port alone", leader, l)
	}
	t.Logf("answered %v after %v: %v", status.Code(err), took.Round(time.Millisecond), err)
}
