package server_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// A drained server gives up every replica while its volumes stay
// writable: an attached volume written throughout and a detached one are
// moved, each write is read back after, the replicas agree, and the
// drained server holds nothing.
func TestDrainServerUnderWrites(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // nothing but the drain moves replicas
	}})
	leader := c.Leader(10 * time.Second)
	const size = 4 << 20
	const blocks = 64
	att := createVolume(t, c.Client(leader), "attached", size, 3)
	det := createVolume(t, c.Client(leader), "detached", size, 3)
	ctx := ctxT(t, 3*time.Minute)

	// The detached volume: written, then closed.
	e := c.OpenEngine(c.EngineConfig(det.Name, "node-1"))
	for i := range uint64(blocks) {
		if err := e.WriteAt(ctx, blockData(i, 1), int64(i)*4096, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	// The drained server holds a replica of both (of 4 servers, at least
	// two hold one of each); not the leader if another will do.
	target := ""
	for i, n := range c.Nodes {
		if replicaOn(att, n.ID) != nil && replicaOn(det, n.ID) != nil && (target == "" || i != leader) {
			target = n.ID
		}
	}

	// The attached volume: written throughout the drain.
	w := c.OpenEngine(c.EngineConfig(att.Name, "node-2"))
	var (
		mu      sync.Mutex
		last    = map[uint64]uint64{} // block -> generation last acknowledged
		werr    error
		writes  int
		stop    = make(chan struct{})
		stopped = make(chan struct{})
	)
	go func() {
		defer close(stopped)
		for g := uint64(1); ; g++ {
			for i := range uint64(blocks) {
				select {
				case <-stop:
					return
				default:
				}
				wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				err := w.WriteAt(wctx, blockData(i, g), int64(i)*4096, false)
				cancel()
				mu.Lock()
				if err != nil && werr == nil {
					werr = err
				}
				if err == nil {
					last[i] = g
					writes++
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}
	}()

	// Throughout the move every volume keeps its three healthy copies
	// (the drain adds before it removes).
	minHealthy := map[string]int{att.Id: 3, det.Id: 3}
	watchStop, watched := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-watchStop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			for _, id := range []string{att.Id, det.Id} {
				wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				resp, err := c.Client(leader).Volumes.GetVolume(wctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
				cancel()
				if err != nil {
					continue
				}
				n := 0
				for _, r := range resp.Volume.Replicas {
					if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
						n++
					}
				}
				mu.Lock()
				minHealthy[id] = min(minHealthy[id], n)
				mu.Unlock()
			}
		}
	}()
	if _, err := c.Client(leader).Cluster.CordonServer(ctx, &storpb.CordonServerRequest{ServerId: target, Cordoned: true, Drain: true}); err != nil {
		t.Fatal(err)
	}
	moved := func(v *storpb.Volume) bool {
		if replicaOn(v, target) != nil || len(v.Replicas) != 3 {
			return false
		}
		for _, r := range v.Replicas {
			if r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				return false
			}
		}
		return true
	}
	waitVolume(t, c, leader, att.Id, 90*time.Second, "attached volume moved off "+target, moved)
	waitVolume(t, c, leader, det.Id, 90*time.Second, "detached volume moved off "+target, moved)
	close(stop)
	<-stopped
	close(watchStop)
	<-watched
	mu.Lock()
	defer mu.Unlock()
	for id, n := range minHealthy {
		if n < 3 {
			t.Fatalf("volume %s had %d healthy replicas during the drain, want 3 throughout (add before remove)", id, n)
		}
	}
	if werr != nil {
		t.Fatalf("a write failed during the drain (after %d): %v", writes, werr)
	}
	if writes < blocks {
		t.Fatalf("only %d writes during the drain", writes)
	}

	// Every acknowledged write reads back, and the replicas agree.
	buf := make([]byte, 4096)
	for i, g := range last {
		if err := w.ReadAt(ctx, buf, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, blockData(i, g)) {
			t.Fatalf("attached volume block %d: not generation %d's write after the drain", i, g)
		}
	}
	if err := w.Close(ctx, true); err != nil {
		t.Fatal(err)
	}
	for _, v := range []*storpb.Volume{att, det} {
		sums := c.Checksums(v.Id)
		for _, s := range sums {
			if s.Err != nil || s.SHA256 != sums[0].SHA256 || s.Replica.ServerId == target {
				t.Fatalf("volume %s after the drain: replicas %v", v.Name, sums)
			}
		}
	}
	r := c.OpenEngine(c.EngineConfig(det.Name, "node-3"))
	for i := range uint64(blocks) {
		if err := r.ReadAt(ctx, buf, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, blockData(i, 1)) {
			t.Fatalf("detached volume block %d lost in the drain", i)
		}
	}

	srv := func() *storpb.Server {
		l := retry(t, 5*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
			return c.Client(leader).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
		})
		for _, s := range l.Servers {
			if s.Id == target {
				return s
			}
		}
		t.Fatalf("server %s not listed", target)
		return nil
	}
	if s := srv(); !s.Draining || !s.Cordoned || s.AllocatedBytes != 0 {
		t.Fatalf("drained server %v: want draining, cordoned, nothing allocated", s)
	}
	if _, err := c.Client(leader).Cluster.CordonServer(ctx, &storpb.CordonServerRequest{ServerId: target}); err != nil {
		t.Fatal(err)
	}
	if s := srv(); s.Draining || s.Cordoned {
		t.Fatalf("uncordoned server %v: still draining or cordoned", s)
	}
}
