package jepsen

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// The broken modes that reintroduce issue 13's rebuild bugs, each proven
// caught in CI by a test in jepsen_test.go.

// rebuildFromLatestFault is the "rebuild-from-latest-fault" broken mode
// (issue 13, A): the engine's view of its volume is rewritten so that a
// replica rebuilding after a failed rebuild restarts its delta from the
// generation of its latest fault, as raftstore's setReplicaState did
// before the fix, instead of from where it stopped being healthy. The
// control plane is not touched: only what this client's engine sees of it.
func rebuildFromLatestFault(cfg *engine.Config) {
	cfg.Control.Volumes = &latestFaultVolumes{VolumeServiceClient: cfg.Control.Volumes, lastFault: map[string]uint64{}}
}

// latestFaultVolumes remembers each replica's latest FAULTY generation in
// every volume the engine is shown, and shows a REBUILDING replica with a
// delta (from generation > 0: a full rebuild stays full) as rebuilding
// from that generation.
type latestFaultVolumes struct {
	storpb.VolumeServiceClient
	mu        sync.Mutex
	lastFault map[string]uint64 // replica id -> generation of its latest fault
}

func (c *latestFaultVolumes) rewrite(v *storpb.Volume) *storpb.Volume {
	if v == nil {
		return nil
	}
	v = proto.Clone(v).(*storpb.Volume)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range v.Replicas {
		switch r.State {
		case storpb.ReplicaState_REPLICA_STATE_FAULTY:
			c.lastFault[r.Id] = r.Generation
		case storpb.ReplicaState_REPLICA_STATE_REBUILDING:
			if r.RebuildFromGeneration == 0 {
				continue
			}
			if g, ok := c.lastFault[r.Id]; ok {
				r.RebuildFromGeneration = g
			} else if r.Generation > 1 {
				r.RebuildFromGeneration = r.Generation - 1 // its FAULTY record, when nothing came between
			}
		}
	}
	return v
}

func (c *latestFaultVolumes) AttachVolume(ctx context.Context, in *storpb.AttachVolumeRequest, opts ...grpc.CallOption) (*storpb.AttachVolumeResponse, error) {
	r, err := c.VolumeServiceClient.AttachVolume(ctx, in, opts...)
	if err == nil {
		r = &storpb.AttachVolumeResponse{Volume: c.rewrite(r.Volume)}
	}
	return r, err
}

func (c *latestFaultVolumes) GetVolume(ctx context.Context, in *storpb.GetVolumeRequest, opts ...grpc.CallOption) (*storpb.GetVolumeResponse, error) {
	r, err := c.VolumeServiceClient.GetVolume(ctx, in, opts...)
	if err == nil {
		r = &storpb.GetVolumeResponse{Volume: c.rewrite(r.Volume)}
	}
	return r, err
}

func (c *latestFaultVolumes) SetReplicaState(ctx context.Context, in *storpb.SetReplicaStateRequest, opts ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	r, err := c.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
	if err == nil {
		r = &storpb.SetReplicaStateResponse{Volume: c.rewrite(r.Volume)}
	}
	return r, err
}

func (c *latestFaultVolumes) WatchVolume(ctx context.Context, in *storpb.WatchVolumeRequest, opts ...grpc.CallOption) (storpb.VolumeService_WatchVolumeClient, error) {
	s, err := c.VolumeServiceClient.WatchVolume(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	return &latestFaultWatch{VolumeService_WatchVolumeClient: s, c: c}, nil
}

type latestFaultWatch struct {
	storpb.VolumeService_WatchVolumeClient
	c *latestFaultVolumes
}

func (w *latestFaultWatch) Recv() (*storpb.VolumeEvent, error) {
	ev, err := w.VolumeService_WatchVolumeClient.Recv()
	if err == nil && ev.Volume != nil {
		ev = proto.Clone(ev).(*storpb.VolumeEvent)
		ev.Volume = w.c.rewrite(ev.Volume)
	}
	return ev, err
}

// unorderedRebuild is the engine half of the "unordered-rebuild" broken
// mode (issue 13, C): rebuild copies are not ordered against writes in
// flight, and a rebuild plans its copy without waiting for the writes that
// took the write set before its target joined
// (engine.Config.UnsafeUnorderedRebuild).
func unorderedRebuild(cfg *engine.Config) { cfg.UnsafeUnorderedRebuild = true }

// untrackedRebuildWrites is the connection half of "unordered-rebuild": a
// rebuild's copy is written to the target as a plain write, so the
// target's tracking of the blocks written since the rebuild began (which
// makes RebuildWrite skip them) no longer keeps an older block from
// overwriting a newer acknowledged one. The wrapper hides the target's
// engine.CopyTarget, so every chunk is relayed and written so: a chunk the
// target's server copies itself (REBUILD_COPY) is always tracked.
func untrackedRebuildWrites(c engine.ReplicaConn) engine.ReplicaConn { return untrackedConn{c} }

type untrackedConn struct{ engine.ReplicaConn }

func (c untrackedConn) RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error {
	return c.ReplicaConn.WriteAt(ctx, o, p, off)
}

// blindReconcile is the "blind-reconcile" broken mode: every replica's
// DIGEST answers the same digests whatever the replica holds, so the
// engine's reconcile after an unclean stop takes the replicas for
// identical and copies nothing, and what the stop left different stays
// different (a reconcile that trusts digests it should not: issue 16's
// reconcile by digests, engine.Digester).
func blindReconcile(c engine.ReplicaConn) engine.ReplicaConn { return blindConn{c} }

type blindConn struct{ engine.ReplicaConn }

func (blindConn) Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error) {
	return make([]uint64, (n+wire.DigestBlock-1)/wire.DigestBlock), nil
}
