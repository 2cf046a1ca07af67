package server_test

import (
	"context"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// unansweringControl is a control plane that takes every SetReplicaState
// and answers none (a leader whose disk hangs does so: its connection
// stays healthy, keepalives included), recording the states asked for.
type unansweringControl struct {
	storpb.UnimplementedVolumeServiceServer
	mu     sync.Mutex
	states []storpb.ReplicaState
}

func (u *unansweringControl) SetReplicaState(ctx context.Context, req *storpb.SetReplicaStateRequest) (*storpb.SetReplicaStateResponse, error) {
	u.mu.Lock()
	u.states = append(u.states, req.State)
	u.mu.Unlock()
	<-ctx.Done()
	return nil, ctx.Err()
}

func (u *unansweringControl) seen() []storpb.ReplicaState {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.states)
}

// TestADetachedRebuildIsNotHeldByAControlPlaneThatDoesNotAnswer: a server
// rebuilding a replica of a detached volume reports its progress, and
// then the rebuild's end, to the control plane. Those calls had no
// deadline: a control plane that took a report and never answered held
// the copy at its first report, and the replica's rebuild, until the
// server restarted. Now a progress report is dropped after 2 s (as the
// engine's are) and the copy goes on; a record of the end that is not
// taken in time fails the attempt, which is retried.
func TestADetachedRebuildIsNotHeldByAControlPlaneThatDoesNotAnswer(t *testing.T) {
	fake := &unansweringControl{}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}))
	storpb.RegisterVolumeServiceServer(srv, fake)
	go srv.Serve(lis)
	defer srv.Stop()

	// Every server's calls to itself (how its detached rebuilds report)
	// go to the fake while redirect is set.
	var redirect atomic.Bool
	redirect.Store(true)
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
		dial, self := cfg.Dial, cfg.Listen
		cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if addr == self && redirect.Load() {
				addr = lis.Addr().String()
			}
			return dial(ctx, network, addr)
		}
	}})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "reported", 16<<20, 3)
	var spare string
	for _, n := range c.Nodes {
		if replicaOn(v, n.ID) == nil {
			spare = n.ID
		}
	}
	retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
		return c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id, ServerId: spare})
	})

	// The copy goes on past the reports not taken, to the record of its end.
	const (
		rebuilding = storpb.ReplicaState_REPLICA_STATE_REBUILDING
		healthy    = storpb.ReplicaState_REPLICA_STATE_HEALTHY
	)
	start := time.Now()
	waitFor := func(within time.Duration, what string, cond func([]storpb.ReplicaState) bool) {
		t.Helper()
		for !cond(fake.seen()) {
			if time.Since(start) > within {
				t.Fatalf("%s: after %v the control plane was asked for %v", what, within, fake.seen())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitFor(20*time.Second, "the rebuild did not go on past its progress reports to record its end", func(s []storpb.ReplicaState) bool {
		return slices.Contains(s, healthy)
	})
	// The record not taken fails the attempt, and the next one begins.
	waitFor(40*time.Second, "the rebuild's unanswered record held it: no next attempt", func(s []storpb.ReplicaState) bool {
		i := slices.Index(s, healthy)
		return i >= 0 && slices.Contains(s[i+1:], rebuilding)
	})
	t.Logf("asked for %v in %v", fake.seen(), time.Since(start).Round(time.Millisecond))

	// A control plane that answers again: the rebuild completes.
	redirect.Store(false)
	srv.Stop() // its connections close, and the servers dial themselves
	waitVolume(t, c, leader, v.Id, time.Minute, "the replacement healthy", func(v *storpb.Volume) bool {
		r := replicaOn(v, spare)
		return r != nil && r.State == healthy
	})
}
