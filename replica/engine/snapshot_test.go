package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// snapLayers gives memReplicas snapshot layers: a cut copies the
// replica's data under the layer name, and a cut of an existing layer is
// a no-op, as in the store (replica.Replica.CreateSnapshot).
type snapLayers struct {
	mu      sync.Mutex
	layers  map[string]map[string][]byte // replica id -> layer -> data
	failCut map[string]bool              // replica ids whose cuts fail with ErrIO
}

func newSnapLayers() *snapLayers {
	return &snapLayers{layers: map[string]map[string][]byte{}, failCut: map[string]bool{}}
}

func (s *snapLayers) setFailCut(id string, fail bool) {
	s.mu.Lock()
	s.failCut[id] = fail
	s.mu.Unlock()
}

func (s *snapLayers) layer(replicaID, name string) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.layers[replicaID][name]
}

func (s *snapLayers) connect(mem *memReplicas) engine.Connector {
	return func(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
		c, err := mem.connect(ctx, addr, open)
		if err != nil {
			return nil, err
		}
		return snapConn{c.(*openConn), s}, nil
	}
}

type snapConn struct {
	*openConn
	s *snapLayers
}

func (c snapConn) CreateSnapshot(ctx context.Context, o replica.Op, id string) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if err := c.r.check(o, 0, 0); err != nil {
		return err
	}
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.failCut[c.r.id] {
		return fmt.Errorf("%w: injected cut failure", replica.ErrIO)
	}
	if c.s.layers[c.r.id] == nil {
		c.s.layers[c.r.id] = map[string][]byte{}
	}
	if _, ok := c.s.layers[c.r.id][id]; !ok {
		c.s.layers[c.r.id][id] = bytes.Clone(c.r.data)
	}
	return nil
}

// retriedCut fails the first RecordSnapshotCut (as a leader election
// would) and then holds every GetSnapshot until release is closed, so the
// test decides what happens between a cut attempt and its retry.
type retriedCut struct {
	storpb.SnapshotServiceClient
	mu       sync.Mutex
	failed   bool
	recorded chan struct{} // closed when the first record failed
	release  chan struct{}
}

func (r *retriedCut) RecordSnapshotCut(ctx context.Context, in *storpb.RecordSnapshotCutRequest, opts ...grpc.CallOption) (*storpb.RecordSnapshotCutResponse, error) {
	r.mu.Lock()
	first := !r.failed
	r.failed = true
	r.mu.Unlock()
	if first {
		close(r.recorded)
		return nil, status.Error(codes.Unavailable, "injected: no leader")
	}
	return r.SnapshotServiceClient.RecordSnapshotCut(ctx, in, opts...)
}

func (r *retriedCut) GetSnapshot(ctx context.Context, in *storpb.GetSnapshotRequest, opts ...grpc.CallOption) (*storpb.GetSnapshotResponse, error) {
	r.mu.Lock()
	hold := r.failed
	r.mu.Unlock()
	if hold {
		select {
		case <-r.release:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	return r.SnapshotServiceClient.GetSnapshot(ctx, in, opts...)
}

// TestSnapshotCutRetryKeepsThePoint: a cut attempt cuts two replicas, the
// third fails its cut (recorded faulty) and the record of the cut fails.
// Before the retry a write is acknowledged and the third replica is
// rebuilt to healthy. The retry must not cut it now (the other two keep
// the first attempt's layer, a cut of an existing layer being a no-op):
// every replica recorded as cut holds the first point, and the third is
// recorded as missed.
func TestSnapshotCutRetryKeepsThePoint(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 5 * time.Second
	layers := newSnapLayers()
	cfg.Connect = layers.connect(f.mem)
	snaps := &retriedCut{SnapshotServiceClient: f.client.Snapshots, recorded: make(chan struct{}), release: make(chan struct{})}
	cfg.Control.Snapshots = snaps
	e := f.open(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := randomBytes(1, 4096)
	if err := e.WriteAt(ctx, before, 0, false); err != nil {
		t.Fatal(err)
	}
	third := f.vol.Replicas[2].Id
	layers.setFailCut(third, true)
	resp, err := f.client.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: f.vol.Id, Name: "retried"})
	if err != nil {
		t.Fatal(err)
	}
	s := resp.Snapshot
	select {
	case <-snaps.recorded:
	case <-ctx.Done():
		t.Fatal("the engine never tried to record the cut")
	}

	// Between the attempts: a write is acknowledged, and the third replica
	// (its server is up) is rebuilt and healthy again.
	if err := e.WriteAt(ctx, randomBytes(2, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	layers.setFailCut(third, false)
	for {
		v := f.volume()
		if v.Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && v.Replicas[2].Generation > f.vol.Generation {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the third replica was not rebuilt: %v", v.Replicas[2])
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(snaps.release)

	for {
		got, err := f.client.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: s.Id}})
		if err != nil {
			t.Fatal(err)
		}
		s = got.Snapshot
		if s.ReadyToUse || s.Failed {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("snapshot not ready: %v", s)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !s.ReadyToUse {
		t.Fatalf("snapshot failed: %v", s)
	}
	name := replica.LayerName(s.Id, s.CutEpoch)
	for _, r := range s.Replicas {
		if r.State != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
			continue
		}
		data := layers.layer(r.ReplicaId, name)
		if data == nil {
			t.Fatalf("replica %s recorded as cut has no layer %s", r.ReplicaId, name)
		}
		if !bytes.Equal(data[:4096], before) {
			t.Errorf("replica %s recorded as cut holds a later point than the first attempt's (block 0 has the write acknowledged after it)", r.ReplicaId)
		}
	}
	for _, r := range s.Replicas {
		cut := r.State == storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT
		if cut == (r.ReplicaId == third) {
			t.Errorf("snapshot entry %v: want the replica that failed the first attempt missed, the others cut", r)
		}
	}
}
