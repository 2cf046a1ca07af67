package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
)

// follow watches the volume in the control plane until the engine closes,
// re-watching after a broken stream.
func (e *Engine) follow() {
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.retryJoins()
	}()
	backoff := 50 * time.Millisecond
	for e.ctx.Err() == nil {
		stream, err := e.cfg.Control.Volumes.WatchVolume(e.ctx, &storpb.WatchVolumeRequest{Volume: &storpb.VolumeRef{Id: e.id}})
		if err == nil {
			for {
				ev, err := stream.Recv()
				if err != nil {
					break
				}
				backoff = 50 * time.Millisecond
				if ev.Deleted {
					e.fence("the volume was deleted")
					return
				}
				e.mu.Lock()
				e.last = ev.Volume
				e.mu.Unlock()
				e.onVolume(ev.Volume)
			}
		}
		select {
		case <-e.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// retryJoins retries, every second, opening rebuilding replicas that
// could not be opened when they joined (their server was still starting,
// or moved to a new address), and starting the rebuilds of rebuilding
// replicas that have none running (one stopped when its source left the
// write set, say: no change of the volume may come to start it again).
func (e *Engine) retryJoins() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-e.ctx.Done():
			return
		case <-t.C:
		}
		e.mu.Lock()
		v := e.last
		e.mu.Unlock()
		if v == nil || e.fenced.Load() {
			continue
		}
		e.addNewReplicas(v)
		e.startRebuilds()
	}
}

// onVolume applies one committed state of the volume.
func (e *Engine) onVolume(v *storpb.Volume) {
	if v.Epoch > e.epoch {
		e.fence(fmt.Sprintf("volume attached again at epoch %d", v.Epoch))
		return
	}
	if v.SizeBytes > e.size.Load() {
		if err := e.grow(e.ctx, v.SizeBytes); err != nil {
			e.logger.Warn("grow replicas", "size", v.SizeBytes, "err", err)
		}
	}
	e.applyVolume(v)
	e.addNewReplicas(v)
	e.startRebuilds()
	e.cutSnapshots(v)
}

// grow grows every replica in the write set to size, then the engine: no
// write may reach past the end of a replica that has not grown yet. A
// replica at size already is left as it is (Grow to the same size is a
// no-op); one that fails to grow is recorded faulty. growMu orders it
// with joins (joinGrown), so a replica joining meanwhile is not left
// behind at the old size.
func (e *Engine) grow(ctx context.Context, size uint64) error {
	e.growMu.Lock()
	defer e.growMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, e.cfg.IOTimeout)
	defer cancel()
	err := e.fanOut(ctx, e.writeSet(), func(ctx context.Context, m *member) error {
		return m.conn.Grow(ctx, e.op(false), size)
	})
	if err != nil {
		return err
	}
	if e.size.Swap(size) != size {
		e.logger.Info("volume grew", "size", size)
	}
	return nil
}

// joinGrown grows a replica joining the set to the engine's size, then
// adds it to the write set (unless it is there already; it reports
// whether it added it). A replica that was away during an expansion is
// smaller than the volume.
func (e *Engine) joinGrown(ctx context.Context, r *storpb.Replica, conn ReplicaConn) (bool, error) {
	e.growMu.Lock()
	defer e.growMu.Unlock()
	err := e.call(ctx, func(ctx context.Context) error { return conn.Grow(ctx, e.op(false), e.size.Load()) })
	if err != nil {
		return false, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, raced := e.members[r.Id]; raced {
		return false, nil
	}
	if r.Generation <= e.leftAt[r.Id] {
		return false, nil // opened from a view older than its leaving, which happened meanwhile
	}
	e.joins++
	e.members[r.Id] = &member{info: r, conn: conn, local: e.newLocalRead(r.ServerId), incarnation: e.joins}
	return true, nil
}

// joinFault is the pace of recording one rebuilding replica faulty.
type joinFault struct {
	next time.Time
	wait time.Duration
}

// Recording a rebuilding replica faulty because its open failed waits
// joinFaultWait after the first failure, then doubles up to
// joinFaultMaxWait: each record is two Raft entries (the leader sets it
// rebuilding again while its server is up), as a server paces its own
// reports of a detached volume's failed replica.
var (
	joinFaultWait    = 2 * time.Second
	joinFaultMaxWait = time.Minute
)

// replicaFailure reports whether err, an open's, is the replica's own
// failure (its disk), not its server's reach or the open's rights.
func replicaFailure(err error) bool {
	return errors.Is(err, replica.ErrIO) || errors.Is(err, replica.ErrCorrupt) || errors.Is(err, replica.ErrNoSpace)
}

// recordJoinFault records the rebuilding replica id faulty, once. Unlike
// markFaulty, a failure to record it changes nothing for the engine: the
// replica is not in the write set and missed nothing; it is tried again
// at the pace of joinFaultDue.
func (e *Engine) recordJoinFault(id, reason string) {
	e.logger.Warn("a rebuilding replica cannot be opened for its rebuild; recording it faulty", "replica", id, "reason", reason)
	ctx, cancel := context.WithTimeout(e.ctx, e.cfg.IOTimeout)
	defer cancel()
	resp, err := e.cfg.Control.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
		VolumeId: e.id, ReplicaId: id, State: storpb.ReplicaState_REPLICA_STATE_FAULTY,
		Epoch: e.epoch, Reason: reason,
	})
	if err != nil {
		if faultAnswers[status.Code(err)] == faultFenced {
			e.fence("the control plane refused our epoch")
		}
		e.logger.Warn("record a rebuilding replica faulty", "replica", id, "err", err)
		return
	}
	e.applyVolume(resp.Volume)
}

// joinFaultDue reports whether the rebuilding replica id, whose open just
// failed on its own failure, is to be recorded faulty now.
func (e *Engine) joinFaultDue(id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := time.Now()
	f := e.joinFaults[id]
	if f == nil {
		e.joinFaults[id] = &joinFault{next: now.Add(joinFaultWait), wait: joinFaultWait}
		return false
	}
	if now.Before(f.next) {
		return false
	}
	f.wait = min(2*f.wait, joinFaultMaxWait)
	f.next = now.Add(f.wait)
	return true
}

// addNewReplicas opens replicas that joined the set (as rebuilding), so
// every later write reaches them too. It reports whether it added any.
func (e *Engine) addNewReplicas(v *storpb.Volume) (added bool) {
	refreshed := false
	for _, r := range v.Replicas {
		if r.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
			continue
		}
		e.mu.Lock()
		_, have := e.members[r.Id]
		_, known := e.servers[r.ServerId]
		stale := r.Generation <= e.leftAt[r.Id] // a view from before it left
		e.mu.Unlock()
		if have || stale {
			continue
		}
		if !known && !refreshed {
			if err := e.refreshServers(e.ctx); err != nil {
				e.logger.Warn("refresh servers", "err", err)
				continue
			}
			refreshed = true
		}
		conn, err := e.connect(e.ctx, r)
		if err != nil && !refreshed {
			// The server may have moved: look its address up again.
			if rerr := e.refreshServers(e.ctx); rerr == nil {
				refreshed = true
				conn, err = e.connect(e.ctx, r)
			}
		}
		if err != nil {
			if replicaFailure(err) && e.joinFaultDue(r.Id) {
				// The replica itself failed (a failed fsync refuses every
				// request until its server reopens it): retrying the open
				// never ends, and a rebuilding replica is never replaced.
				// Recorded faulty, it is set rebuilding again while its
				// server is up, and replaced once unhealthy for the
				// cluster's replacement wait.
				e.recordJoinFault(r.Id, fmt.Sprintf("open for its rebuild failed: %v", err))
				continue
			}
			e.logger.Warn("open new replica; will retry", "replica", r.Id, "server", r.ServerId, "err", err)
			continue
		}
		e.mu.Lock()
		delete(e.joinFaults, r.Id)
		e.mu.Unlock()
		joined, err := e.joinGrown(e.ctx, r, conn)
		if err != nil {
			e.logger.Warn("grow new replica; will retry", "replica", r.Id, "server", r.ServerId, "err", err)
		}
		if !joined {
			conn.Close(e.ctx)
			continue
		}
		added = true
		e.logger.Info("replica joined the write set", "replica", r.Id, "server", r.ServerId)
	}
	return added
}
