package server_test

import (
	"context"
	"maps"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// reused is a dial seam that sends a node's dials of one address to
// another: the address its leader had, now another cluster's server's (a
// pod IP or a port given again).
type reused struct {
	mu    sync.Mutex
	from  int    // the node whose dials are redirected
	addr  string // the address it dials
	to    string // where its dials of addr go ("": not redirected)
	conns []dialed
}

// dialed is a connection node i dialed to addr.
type dialed struct {
	i    int
	addr string
	c    net.Conn
}

func (r *reused) wrap(i int, dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		to := addr
		r.mu.Lock()
		if i == r.from && addr == r.addr && r.to != "" {
			to = r.to
		}
		r.mu.Unlock()
		c, err := dial(ctx, network, to)
		if err == nil {
			r.mu.Lock()
			r.conns = append(r.conns, dialed{i, addr, c})
			r.mu.Unlock()
		}
		return c, err
	}
}

// redirect sends node from's dials of addr to to from now on, and closes
// the connections it has to addr, so that it dials again.
func (r *reused) redirect(from int, addr, to string) {
	r.mu.Lock()
	if r.from >= 0 {
		r.closeLocked(r.from, r.addr) // those that went to the old r.to
	}
	r.from, r.addr, r.to = from, addr, to
	if from >= 0 {
		r.closeLocked(from, addr)
	}
	r.mu.Unlock()
}

func (r *reused) closeLocked(from int, addr string) {
	kept := r.conns[:0]
	for _, d := range r.conns {
		if d.i == from && d.addr == addr {
			d.c.Close()
			continue
		}
		kept = append(kept, d)
	}
	r.conns = kept
}

// A follower whose leader's control address is now another cluster's
// server (the leader's pod gone, its IP given to a server of another
// cluster) reaches that server with the calls it forwards and with its
// heartbeats. The other cluster's server refuses them: a volume made
// through the follower is not made in the other cluster, the call fails
// Unavailable (its client retries elsewhere), and the follower does not
// take the other cluster's "no record of you" for its own removal.
func TestACallOfAnotherClustersServerIsRefused(t *testing.T) {
	other := servertest.NewCluster(t, servertest.Options{Servers: 1})
	var seam reused
	seam.from = -1
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		cfg.Dial = seam.wrap(i, cfg.Dial)
	}})
	leader := c.Leader(10 * time.Second)
	follower := (leader + 1) % len(c.Nodes)
	if ours, theirs := c.Nodes[leader].Server().Store().ClusterID(), other.Nodes[0].Server().Store().ClusterID(); ours == "" || ours == theirs {
		t.Fatalf("clusters %q and %q: want two named clusters", ours, theirs)
	}
	h := healthClient(t, c.Nodes[follower].Addr)
	waitHealth(t, h, server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 10*time.Second)

	seam.redirect(follower, c.Nodes[leader].Addr, other.Nodes[0].Addr)

	// The forwarded call.
	_, err := c.Client(follower).Volumes.CreateVolume(ctxT(t, 10*time.Second),
		&storpb.CreateVolumeRequest{Name: "meant-for-this-cluster", SizeBytes: 1 << 20, ReplicaCount: 1})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("a call forwarded to the other cluster's server: %v, want Unavailable", err)
	}
	if vols := listVolumes(t, other.Client(0)); len(vols) != 0 {
		t.Errorf("the other cluster has volumes %v: it applied a call forwarded by a server of another cluster", slices.Sorted(maps.Keys(vols)))
	}

	// The heartbeats: a few intervals of them, all to the other cluster.
	time.Sleep(20 * servertest.TestConfig().HeartbeatInterval)
	if got := check(t, h, server.HealthReadiness); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("the follower, whose heartbeats reached another cluster's server, is %v", got)
	}

	// Once its calls reach its own leader again, the call goes through.
	seam.redirect(-1, "", "")
	createVolume(t, c.Client(follower), "meant-for-this-cluster", 1<<20, 1)
	if vols := listVolumes(t, other.Client(0)); len(vols) != 0 {
		t.Errorf("the other cluster has volumes %v", slices.Sorted(maps.Keys(vols)))
	}
}

// A server of no cluster asks each seed in turn, and each time joins the
// cluster of the seed it asks, not the one an earlier seed named: its
// first seed's cluster (which knows a server of its name on another data
// dir) refuses it, its second seed's cluster admits it. (Seeds of two
// clusters: a cluster made again at a seed's address while a server was
// joining it does the same.)
func TestAJoinerFollowsTheClusterOfTheSeedItAsks(t *testing.T) {
	first := servertest.NewCluster(t, servertest.Options{Servers: 2}) // s1, s2
	second := servertest.NewCluster(t, servertest.Options{Servers: 1})
	want := second.Nodes[0].Server().Store().ClusterID()
	cfg := loopbackConfig(t, "s2", t.TempDir()) // "s2" of first is on another data dir
	cfg.Join = []string{first.Nodes[0].Addr, second.Nodes[0].Addr}
	srv, err := server.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Kill() })
	deadline := time.Now().Add(15 * time.Second)
	for srv.Store().MemberOf() != want {
		if time.Now().After(deadline) {
			t.Fatalf("the server did not join the second seed's cluster %s (member of %q; first seed's cluster %s)",
				want, srv.Store().MemberOf(), first.Nodes[0].Server().Store().ClusterID())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
