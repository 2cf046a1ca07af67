package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// Crash-consistent snapshots of an attached volume (DESIGN.md "Snapshots,
// clones, expansion"). CreateSnapshot in the control plane names the
// snapshot in the volume's pending_snapshot_ids, which reaches the engine
// on its watch. The engine then, for each pending snapshot:
//
//  1. reads the snapshot's record for the replicas still PENDING;
//  2. quiesces: takes quiesce exclusively, which waits for every write in
//     flight (each holds it shared from beginWrite to endWrite) and holds
//     new ones;
//  3. cuts the layer on every pending replica that is healthy in its write
//     set, in parallel (the ack rule applies: a replica that fails the cut
//     is committed faulty first);
//  4. resumes writes, and records the cut replicas as CUT and the others
//     as MISSED (they were not healthy at the cut point, so they can never
//     cut at it) with RecordSnapshotCut at its epoch.
//
// Every replica therefore cuts exactly the writes acknowledged before the
// quiesce, none after. The layer is named replica.LayerName(snapshot,
// epoch), so a layer cut at an older epoch (which the control plane then
// refused) is never taken for this cut.
//
// One engine cuts a snapshot at one point only. A cut of an existing layer
// is a no-op on the replica, so a second attempt at the same epoch (after
// a failed record, or a cut that failed on some replicas) would be a no-op
// where the first attempt cut and a fresh, later cut elsewhere: two points
// under one name. So the first attempt that sends a cut to any replica
// fixes the point, and the engine remembers which replicas confirmed it
// (cutPoints); a retry sends no cut, and records those replicas (if still
// healthy) as CUT and every other pending one as MISSED.
//
// A detached volume has no engine: CutDetached opens one for the cut
// (below), at an epoch of its own.

// snapshotCutter is the ReplicaConn capability to cut a snapshot layer
// (the wire client has it). A replica without it is recorded as missed.
type snapshotCutter interface {
	CreateSnapshot(ctx context.Context, o replica.Op, id string) error
}

// cutSnapshots starts cutting v's pending snapshots unless a cut is
// already running (which then looks at the latest state again when done).
func (e *Engine) cutSnapshots(v *storpb.Volume) {
	if len(v.PendingSnapshotIds) == 0 {
		return
	}
	if e.cfg.Control.Snapshots == nil {
		e.logger.Warn("snapshots pending but the engine has no snapshot client; they stay pending", "snapshots", v.PendingSnapshotIds)
		return
	}
	e.mu.Lock()
	if e.cutting {
		e.cutAgain = true
		e.mu.Unlock()
		return
	}
	e.cutting = true
	e.mu.Unlock()
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			e.mu.Lock()
			ids := slices.Clone(e.last.GetPendingSnapshotIds())
			e.mu.Unlock()
			failed := false
			for _, id := range ids {
				if err := e.cutSnapshot(id); err != nil && e.ctx.Err() == nil {
					failed = true
					e.logger.Warn("snapshot cut failed; will retry", "snapshot", id, "err", err)
				}
			}
			if failed && !e.fenced.Load() {
				select {
				case <-e.ctx.Done():
				case <-time.After(time.Second):
				}
			}
			e.mu.Lock()
			if (!failed && !e.cutAgain) || e.ctx.Err() != nil || e.fenced.Load() {
				e.cutting = false
				e.mu.Unlock()
				return
			}
			e.cutAgain = false
			e.mu.Unlock()
		}
	}()
}

// cutSnapshot runs the protocol in the file comment for snapshot id.
func (e *Engine) cutSnapshot(id string) error {
	if err := e.usable(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(e.ctx, 3*e.cfg.IOTimeout)
	defer cancel()
	resp, err := e.cfg.Control.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
	if status.Code(err) == codes.NotFound {
		e.forgetCut(id)
		return nil // deleted meanwhile
	} else if err != nil {
		return fmt.Errorf("get snapshot: %w", err)
	}
	s := resp.Snapshot
	var pending []string
	anyCut := false
	for _, r := range s.Replicas {
		switch r.State {
		case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING:
			pending = append(pending, r.ReplicaId)
		case storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT:
			anyCut = true
		}
	}
	if len(pending) == 0 {
		e.forgetCut(id)
		return nil
	}
	req := &storpb.RecordSnapshotCutRequest{SnapshotId: id, Epoch: e.epoch}
	if anyCut && s.CutEpoch != e.epoch {
		// Other replicas cut before this attach; the volume may have been
		// written since, so these can no longer cut at their point.
		req.MissedReplicaIds = pending
		req.Reason = fmt.Sprintf("the other replicas cut at epoch %d, before the attach at epoch %d", s.CutEpoch, e.epoch)
	} else {
		req.CutReplicaIds, err = e.cutOnce(ctx, id, pending)
		if err != nil {
			return err
		}
		for _, r := range pending {
			if !slices.Contains(req.CutReplicaIds, r) {
				req.MissedReplicaIds = append(req.MissedReplicaIds, r)
			}
		}
		req.Reason = fmt.Sprintf("not healthy in the engine's write set when it cut at epoch %d", e.epoch)
	}
	rec, err := e.cfg.Control.Snapshots.RecordSnapshotCut(ctx, req)
	if status.Code(err) == codes.Aborted {
		e.fence("the control plane refused our epoch when recording a snapshot cut")
		return err
	} else if err != nil {
		return fmt.Errorf("record cut: %w", err)
	}
	e.forgetCut(id)
	e.logger.Info("snapshot cut", "snapshot", s.Name, "cut", req.CutReplicaIds, "missed", req.MissedReplicaIds,
		"ready", rec.Snapshot.ReadyToUse)
	return nil
}

// cutOnce returns the pending replicas that hold snapshot id's layer at
// the one point this engine cuts it at: on the first attempt, by cutting
// (quiesceAndCut); on a retry, from what that attempt confirmed, without
// cutting again (see the file comment).
func (e *Engine) cutOnce(ctx context.Context, id string, pending []string) ([]string, error) {
	e.mu.Lock()
	confirmed, fixed := e.cutPoints[id]
	confirmed = slices.Clone(confirmed)
	e.mu.Unlock()
	if !fixed {
		return e.quiesceAndCut(ctx, id, pending)
	}
	cut := e.stillHealthy(slices.DeleteFunc(confirmed, func(r string) bool { return !slices.Contains(pending, r) }))
	e.logger.Info("snapshot cut retried: recording the replicas the first attempt cut", "snapshot", id, "cut", cut)
	return cut, nil
}

// quiesceAndCut holds writes, cuts snapshot id on the pending replicas
// that are healthy in the write set, resumes writes, and returns the
// replicas that cut. Once it sends a cut, the point is fixed: each replica
// that confirms is remembered in cutPoints, even if the attempt fails.
func (e *Engine) quiesceAndCut(ctx context.Context, id string, pending []string) ([]string, error) {
	e.quiesce.Lock()
	defer e.quiesce.Unlock()
	var set []*member
	for _, m := range e.writeSet() {
		_, can := m.conn.(snapshotCutter)
		if can && m.info.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && slices.Contains(pending, m.info.Id) {
			set = append(set, m)
		}
	}
	if len(set) == 0 {
		return nil, nil
	}
	e.mu.Lock()
	if e.cutPoints == nil {
		e.cutPoints = map[string][]string{}
	}
	e.cutPoints[id] = []string{}
	e.mu.Unlock()
	start := time.Now()
	err := e.fanOut(ctx, set, func(ctx context.Context, m *member) error {
		if err := m.conn.(snapshotCutter).CreateSnapshot(ctx, e.op(false), replica.LayerName(id, e.epoch)); err != nil {
			return err
		}
		e.mu.Lock()
		if !slices.Contains(e.cutPoints[id], m.info.Id) {
			e.cutPoints[id] = append(e.cutPoints[id], m.info.Id)
		}
		e.mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	cut := slices.Clone(e.cutPoints[id])
	e.mu.Unlock()
	e.logger.Info("writes held for a snapshot cut", "snapshot", id, "held", time.Since(start).Round(time.Microsecond))
	// A replica that failed was committed faulty by fanOut; only those
	// still in the write set as healthy count as cut.
	return e.stillHealthy(cut), nil
}

// stillHealthy returns the replicas of ids that are healthy in the write
// set now.
func (e *Engine) stillHealthy(ids []string) []string {
	healthy := map[string]bool{}
	for _, m := range e.writeSet() {
		healthy[m.info.Id] = m.info.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY
	}
	return slices.DeleteFunc(ids, func(id string) bool { return !healthy[id] })
}

// forgetCut drops what the engine remembers of snapshot id's cut, once
// the cut is recorded (or the snapshot is gone).
func (e *Engine) forgetCut(id string) {
	e.mu.Lock()
	delete(e.cutPoints, id)
	e.mu.Unlock()
}

// CutDetached cuts the pending snapshots of a volume that is not attached
// (DESIGN.md "Snapshots, clones, expansion"). An engine that died, or a
// zombie of one still writing after its detach, may have left the
// replicas different in their dirty regions, so they cannot each cut
// where they stand. Instead CutDetached, like Open:
//
//  1. fences the volume at a new epoch of its own (a detach with
//     fence_detached, refused while the volume is attached);
//  2. opens its replicas at that epoch, which fences every older engine
//     on each of them (a healthy replica that does not open is recorded
//     faulty, as Open does);
//  3. reconciles the dirty regions from one healthy replica (the local
//     one when cfg.LocalServerID has one);
//
// then cuts each pending snapshot as an attached engine does (one point,
// recorded at the new epoch; a pending replica not healthy in the write
// set is recorded as missed), and closes. No engine writes at that epoch,
// so every replica's layer holds the same data. cfg is an engine Config
// whose Control has Snapshots; Takeover and ReadOnly are unused.
//
// If the volume is attached, CutDetached does nothing: the attached
// engine cuts. An attach meanwhile raises the epoch again: the replicas
// refuse the rest of this cut, the control plane refuses its record, and
// the attached engine cuts the snapshots itself. A cut that fails (or a
// server that crashes during it) leaves its layers unrecorded at an epoch
// the volume has left; the servers merge them away, and a retry fences
// anew.
func CutDetached(ctx context.Context, cfg Config) error {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return err
	}
	if cfg.Control.Snapshots == nil {
		return errors.New("engine: config: Control.Snapshots is required to cut snapshots")
	}
	cfg.Control.Volumes = cutVolumes{cfg.Control.Volumes, ctx}
	resp, err := cfg.Control.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: cfg.ref(), FenceDetached: true})
	if status.Code(err) == codes.FailedPrecondition {
		cfg.Logger.Info("no detached snapshot cut: the volume is attached; its engine cuts", "volume", cfg.Volume, "why", err)
		return nil
	} else if err != nil {
		return fmt.Errorf("engine: fence %s for a snapshot cut: %w", cfg.Volume, err)
	}
	v := resp.Volume
	if len(v.PendingSnapshotIds) == 0 {
		return nil // recorded meanwhile (by an engine attached and detached since)
	}
	e := newEngine(cfg, v)
	e.purpose = wire.PurposeSnapshotCut
	e.logger.Info("detached volume fenced for a snapshot cut", "snapshots", v.PendingSnapshotIds)
	if err := e.refreshServers(ctx); err != nil {
		e.abort()
		return err
	}
	if err := e.openReplicas(ctx, v); err != nil {
		e.abort()
		return err
	}
	if err := e.reconcile(ctx); err != nil {
		e.abort()
		return err
	}
	var errs []error
	for _, id := range v.PendingSnapshotIds {
		if err := e.cutSnapshot(id); err != nil {
			errs = append(errs, fmt.Errorf("engine: cut snapshot %s of %s: %w", id, v.Name, err))
		}
	}
	if err := e.Close(ctx, false); err != nil {
		errs = append(errs, fmt.Errorf("engine: close %s after a snapshot cut: %w", v.Name, err))
	}
	return errors.Join(errs...)
}

// cutVolumes bounds a detached cut's reports of failed replicas by the
// cut's context. An engine that serves I/O waits up to FaultTimeout for
// the control plane, whatever its caller's context, because it must not
// acknowledge a write on a guess; a detached cut acknowledges nothing, so
// when its context ends (its server shuts down) it gives up instead, and
// is retried.
type cutVolumes struct {
	storpb.VolumeServiceClient
	ctx context.Context
}

func (c cutVolumes) SetReplicaState(ctx context.Context, in *storpb.SetReplicaStateRequest, opts ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	if err := c.ended(); err != nil {
		return nil, err
	}
	ctx, cancel := c.bound(ctx)
	defer cancel()
	return c.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
}

func (c cutVolumes) GetVolume(ctx context.Context, in *storpb.GetVolumeRequest, opts ...grpc.CallOption) (*storpb.GetVolumeResponse, error) {
	if err := c.ended(); err != nil {
		return nil, err
	}
	ctx, cancel := c.bound(ctx)
	defer cancel()
	return c.VolumeServiceClient.GetVolume(ctx, in, opts...)
}

// ended is the answer once the cut's context has ended: Aborted, which the
// engine takes as being fenced (faultAnswers) and so stops at once. It
// retries Canceled, DeadlineExceeded and the like until FaultTimeout, as it
// must through a leader election while it serves I/O; a detached cut serves
// none and is retried by its server with a new fence.
func (c cutVolumes) ended() error {
	if err := c.ctx.Err(); err != nil {
		return status.Errorf(codes.Aborted, "engine: the detached cut ended: %v", err)
	}
	return nil
}

// bound returns ctx, also cancelled when the cut's context ends.
func (c cutVolumes) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(c.ctx, func() { cancel(context.Cause(c.ctx)) })
	return ctx, func() {
		stop()
		cancel(nil)
	}
}
