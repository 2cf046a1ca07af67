package server_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// Data-port dial rules of TestACloneReplicaIsNotRebuiltFromOneNotYetFilled.
const (
	dialAll         = iota
	dialNoData      // no data port: a clone copy cannot read its source
	dialOwnDataOnly // its own data port only: a copy reads the local source
)

// TestACloneReplicaIsNotRebuiltFromOneNotYetFilled: a clone's replicas
// are HEALTHY from their creation, and each server fills its own from the
// snapshot. A replica placed on another server while the clone fills
// (an operator's replace, a drain, a repair) is REBUILDING, and its server
// both rebuilt it from a HEALTHY replica and filled it from the snapshot.
// When its copy was done first, the rebuild then read a replica not yet
// filled and wrote its holes over the copy; the replica stayed counted as
// filled, and the clone became AVAILABLE with that replica reading zeroes.
func TestACloneReplicaIsNotRebuiltFromOneNotYetFilled(t *testing.T) {
	var rules [4]atomic.Int32
	var dataAddrs atomic.Pointer[[]string]
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
		dial, own := cfg.Dial, cfg.DataListen
		cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			rule := rules[i].Load()
			if addrs := dataAddrs.Load(); rule != dialAll && addrs != nil && slices.Contains(*addrs, addr) &&
				!(rule == dialOwnDataOnly && addr == own) {
				return nil, fmt.Errorf("test: server %d may not dial data port %s now", i, addr)
			}
			return dial(ctx, network, addr)
		}
	}})
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.DataAddr)
	}
	dataAddrs.Store(&addrs)
	leader := c.Leader(10 * time.Second)

	// A source on every server (so each can fill its clone replica from
	// its own), written, and a snapshot of it.
	const size = 1 << 20
	src, data := writtenVolume(t, c, leader, "clone-src", size, 4, 16)
	s := createSnapshot(t, c, leader, src.Id, "clone-src-snap")
	waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse })

	// The clone, which no server can fill yet; one of its replicas moved
	// to the server without one.
	for i := range rules {
		rules[i].Store(dialNoData)
	}
	clone := createClone(t, c, leader, "clone", size, fromSnapshot(s.Id))
	spare := -1
	for i, n := range c.Nodes {
		if replicaOn(clone, n.ID) == nil {
			spare = i
		}
	}
	moved := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ReplaceReplicaResponse, error) {
		return c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: clone.Id}, ReplicaId: clone.Replicas[0].Id, ServerId: c.Nodes[spare].ID})
	}).Volume
	d := replicaOn(moved, c.Nodes[spare].ID)
	if d == nil || d.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		t.Fatalf("the clone's replica moved to %s: %v", c.Nodes[spare].ID, moved.Replicas)
	}

	// The moved replica's server fills it from its own source replica
	// and cannot read the other clone replicas: its copy is done first.
	rules[spare].Store(dialOwnDataOnly)
	waitVolume(t, c, leader, clone.Id, time.Minute, "the moved replica filled", func(v *storpb.Volume) bool {
		return slices.Contains(v.CloneDoneReplicaIds, d.Id)
	})
	// Now it can read the others, none of them filled: it must not be
	// rebuilt from them (before the fix it was, within these 10 s).
	rules[spare].Store(dialAll)
	time.Sleep(10 * time.Second)
	if v := getVolume(t, c, leader, clone.Id); replicaOn(v, c.Nodes[spare].ID).GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		t.Errorf("the moved replica was rebuilt while no other replica of the clone was filled: %v", v)
	}

	// Every server may fill its replica: the clone is whole everywhere.
	for i := range rules {
		rules[i].Store(dialAll)
	}
	waitVolume(t, c, leader, clone.Id, time.Minute, "the clone filled, every replica healthy", func(v *storpb.Volume) bool {
		return available(v) && !slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool {
			return r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY
		})
	})
	requireChecksums(t, c, clone.Id, data, "clone filled while one of its replicas was moved")
}
