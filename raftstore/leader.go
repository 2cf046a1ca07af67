package raftstore

import (
	"cmp"
	"context"
	"slices"
	"sort"
	"time"

	"github.com/google/uuid"
	"github.com/hashicorp/raft"

	storpb "github.com/stor-io/stor/api/proto"
)

// leadershipLoop follows leadership changes. While this server leads, one
// goroutine (owned here) performs the leader's duties; it is cancelled and
// waited for when leadership is lost.
func (s *Store) leadershipLoop(notify <-chan bool) {
	type term struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	var cur *term
	stepDown := func() {
		s.leaderReady.Store(false)
		if cur != nil {
			cur.cancel()
			<-cur.done
			cur = nil
		}
	}
	defer stepDown()
	for {
		select {
		case <-s.ctx.Done():
			return
		case leader := <-notify:
			stepDown()
			if !leader {
				continue
			}
			ctx, cancel := context.WithCancel(s.ctx)
			cur = &term{cancel: cancel, done: make(chan struct{})}
			go func(done chan struct{}) {
				defer close(done)
				s.lead(ctx)
			}(cur.done)
		}
	}
}

// lead runs the leader's duties until ctx is cancelled.
func (s *Store) lead(ctx context.Context) {
	// Apply every entry of earlier terms before answering reads.
	for {
		err := s.raft.Barrier(s.cfg.ApplyTimeout).Error()
		if err == nil {
			break
		}
		s.logger.Warn("leader barrier failed", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	s.leaderReady.Store(true)
	s.logger.Info("leading", "applied_index", s.fsm.AppliedIndex())

	var clusterID string
	_ = s.fsm.View(func(r *Reader) error { clusterID = r.ClusterID(); return nil })
	if clusterID == "" {
		name := s.ClusterID() // named at Bootstrap (by a version before that: "")
		if name == "" {
			name = uuid.NewString()
		}
		if _, err := s.propose(ctx, command{Op: opInitCluster, ID: name}); err != nil {
			s.logger.Warn("init cluster id", "err", err)
		}
		_ = s.fsm.View(func(r *Reader) error { clusterID = r.ClusterID(); return nil })
		if clusterID != "" {
			_ = s.markMember(clusterID)
		}
	}

	// A new leader has no memory of heartbeats: every server gets a full
	// timeout from now before it can be marked down.
	start := s.cfg.Now()
	s.seenMu.Lock()
	clear(s.lastSeen)
	s.seenMu.Unlock()

	tick := time.NewTicker(max(s.cfg.ServerDownTimeout/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		s.checkLiveness(ctx, start)
		s.promoteVoters(ctx)
		s.reconcileReplicas(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// checkLiveness marks up servers down when they have been silent longer
// than ServerDownTimeout.
func (s *Store) checkLiveness(ctx context.Context, leaderSince time.Time) {
	var servers []*storpb.Server
	_ = s.fsm.View(func(r *Reader) error {
		var err error
		servers, err = r.Servers()
		return err
	})
	now := s.cfg.Now()
	for _, srv := range servers {
		if srv.State != storpb.ServerState_SERVER_STATE_UP {
			continue
		}
		// A server this leader never heard from gets a full timeout from
		// when this leader took over; what is committed as its last-seen
		// time stays what an earlier leader recorded.
		seen := s.LastSeen(srv.Id)
		lastSeen := seen.UnixNano()
		if seen.IsZero() {
			seen, lastSeen = leaderSince, srv.LastSeenUnixNano
		}
		if now.Sub(seen) <= s.cfg.ServerDownTimeout {
			continue
		}
		s.logger.Warn("server stopped reporting; marking it down", "down", srv.Id, "silent_for", now.Sub(seen).Round(time.Millisecond))
		down := &storpb.Server{Id: srv.Id, State: storpb.ServerState_SERVER_STATE_DOWN, LastSeenUnixNano: lastSeen}
		if _, err := s.propose(ctx, command{Op: opSetServerState, Body: down}); err != nil {
			s.logger.Warn("mark server down", "server", srv.Id, "err", err)
			return
		}
	}
}

// promoteVoters keeps MaxVoters voters while up non-voters exist, so a
// voter that left is replaced. Down voters are never demoted here: that
// would shrink the quorum on a guess.
func (s *Store) promoteVoters(ctx context.Context) {
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	conf, err := s.configuration()
	if err != nil {
		return
	}
	voters := 0
	var nonvoters []raft.Server
	for _, m := range conf.Servers {
		if m.Suffrage == raft.Voter {
			voters++
		} else {
			nonvoters = append(nonvoters, m)
		}
	}
	if voters >= s.cfg.MaxVoters || len(nonvoters) == 0 {
		return
	}
	sort.Slice(nonvoters, func(i, j int) bool { return nonvoters[i].ID < nonvoters[j].ID })
	for _, m := range nonvoters {
		if voters >= s.cfg.MaxVoters {
			return
		}
		up := false
		_ = s.fsm.View(func(r *Reader) error {
			srv, err := r.Server(string(m.ID))
			up = err == nil && srv.State == storpb.ServerState_SERVER_STATE_UP
			return nil
		})
		if !up {
			continue
		}
		if err := s.raft.AddVoter(m.ID, m.Address, 0, s.cfg.ApplyTimeout).Error(); err != nil {
			s.logger.Warn("promote non-voter", "server", m.ID, "err", err)
			return
		}
		s.logger.Info("promoted non-voter to voter", "promoted", m.ID)
		voters++
	}
}

// reconcileReplicas is the leader's repair loop over every volume:
//
//   - a healthy or rebuilding replica on a server down longer than
//     ReplicaGrace becomes faulty;
//   - a faulty replica whose server has reported since the replica failed
//     starts rebuilding, while it has been unhealthy for less than
//     the replacement wait (the cluster config's replace-after, read at
//     every pass, else Config.ReplaceAfter): from where it stopped being healthy (a delta of the
//     regions written since), or in full if it never was healthy since it
//     was added, however many rebuilds of it failed (replicastate.go);
//   - a faulty replica unhealthy for longer than the replacement wait, or any
//     replica whose server was removed, is replaced by a new replica
//     elsewhere (full rebuild); a rebuild in progress is never replaced
//     for being slow; a snapshot whose last copy it held is then lost,
//     recorded as such and logged (replaceUnhealthy);
//   - a volume with fewer replicas than its count gets new ones.
//
// Each decision is one committed command, proposed with the volume's
// current epoch, so a concurrent attach makes it fail harmlessly (it is
// retried at the next tick).
func (s *Store) reconcileReplicas(ctx context.Context) {
	var vols []*storpb.Volume
	servers := map[string]*storpb.Server{}
	var replaceAfter time.Duration
	_ = s.fsm.View(func(r *Reader) error {
		replaceAfter = s.replaceAfter(r)
		vols, _, _ = r.Volumes("", 0)
		list, _ := r.Servers()
		for _, srv := range list {
			servers[srv.Id] = srv
		}
		return nil
	})
	now := s.cfg.Now()
	for _, v := range vols {
		for _, r := range v.Replicas {
			if ctx.Err() != nil {
				return
			}
			srv := servers[r.ServerId]
			down := srv == nil || srv.State == storpb.ServerState_SERVER_STATE_DOWN
			downFor := time.Duration(0)
			if srv != nil && down {
				downFor = now.Sub(time.Unix(0, srv.LastSeenUnixNano))
			}
			unhealthyFor := time.Duration(0)
			if r.UnhealthySinceUnixNano != 0 {
				unhealthyFor = now.Sub(time.Unix(0, r.UnhealthySinceUnixNano))
			}
			switch {
			case srv == nil || r.ServerRemoved || (r.State == storpb.ReplicaState_REPLICA_STATE_FAULTY && unhealthyFor > replaceAfter):
				s.repair(ctx, "replace", v, r, func() error { return s.replaceUnhealthy(ctx, v, r) })
			case r.State != storpb.ReplicaState_REPLICA_STATE_FAULTY && down && (srv == nil || downFor > s.cfg.ReplicaGrace):
				s.repair(ctx, "mark faulty (server down)", v, r, func() error {
					return s.setReplica(ctx, v, r, storpb.ReplicaState_REPLICA_STATE_FAULTY, "server "+r.ServerId+" is down")
				})
			case r.State == storpb.ReplicaState_REPLICA_STATE_FAULTY && !down && s.LastSeen(r.ServerId).UnixNano() > r.StateSinceUnixNano:
				// Its server has reported since the replica failed: it is
				// alive, and the replica can catch up.
				s.repair(ctx, "rebuild", v, r, func() error {
					return s.setReplica(ctx, v, r, storpb.ReplicaState_REPLICA_STATE_REBUILDING, "server "+r.ServerId+" is up")
				})
			}
		}
		if n := len(v.Replicas); n < int(v.ReplicaCount) && ctx.Err() == nil {
			s.repair(ctx, "add replica", v, nil, func() error {
				_, err := s.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
				return err
			})
		}
	}
	s.drainReplicas(ctx, servers)
}

// DrainParallel bounds the rebuilds a drain keeps under way: the drain
// adds no replica while this many replicas rebuild in the cluster, for any
// reason.
const DrainParallel = 2

// drainBackoff is how long the drain leaves a volume alone after a
// proposal for it was refused (no server to place on, the volume changed
// meanwhile): a refusal costs a Raft entry.
const drainBackoff = time.Minute

// drainReplicas moves replicas off draining servers (Server.draining), for
// the repair loop, adding before removing, one volume's step at a time
// (drainStep):
//
//   - a drained replica is removed once the volume's other HEALTHY replicas
//     on UP servers are at least its replica count, so a move never leaves
//     a volume with fewer healthy copies than it had (a volume short of
//     them first gets its new one);
//   - otherwise a replica is added elsewhere, one beyond the volume's count
//     if need be (DrainExtra), while no replica of the volume rebuilds and
//     fewer than DrainParallel rebuild in the cluster;
//   - a drained replica holding the last copy of a ready snapshot is not
//     removed, whatever its server's state: the drain waits for an
//     operator to delete (or clone) the snapshot. A moved replica's
//     snapshot copies go with it (a new replica holds the head only).
//
// Each proposal carries the volume's replica-set generation
// (ExpectGeneration): a decision taken on a view the replicas have since
// changed is refused, and the volume is left alone for drainBackoff.
// Placement never chooses a draining server (it is cordoned).
func (s *Store) drainReplicas(ctx context.Context, servers map[string]*storpb.Server) {
	draining := map[string]bool{}
	for id, srv := range servers {
		if srv.Draining {
			draining[id] = true
		}
	}
	if len(draining) == 0 {
		return
	}
	var vols []*storpb.Volume
	lastCopy := map[string]bool{} // replica ids holding the last copy of a ready snapshot
	_ = s.fsm.View(func(r *Reader) error {
		vols, _, _ = r.Volumes("", 0)
		for _, v := range vols {
			for _, rep := range v.Replicas {
				if draining[rep.ServerId] {
					if lost, err := r.lastCopies(v, rep.Id); err == nil && len(lost) > 0 {
						lastCopy[rep.Id] = true
					}
				}
			}
		}
		return nil
	})
	rebuilding := 0
	for _, v := range vols {
		for _, r := range v.Replicas {
			if r.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
				rebuilding++
			}
		}
	}
	now := s.cfg.Now()
	for _, v := range vols {
		if ctx.Err() != nil {
			return
		}
		if until, ok := s.drainWait[v.Id]; ok && now.Before(until) {
			continue
		}
		step := drainStep(v, draining, servers, lastCopy, rebuilding < DrainParallel)
		if step.req == nil {
			continue
		}
		step.req.Volume, step.req.ExpectGeneration = &storpb.VolumeRef{Id: v.Id}, v.Generation
		if _, err := s.ReplaceReplica(ctx, step.req); err != nil {
			if ctx.Err() == nil {
				s.drainWait[v.Id] = now.Add(drainBackoff)
				s.logger.Info("drain: not done now; the volume is left alone for a while", "step", step.what, "volume", v.Name, "volume_id", v.Id,
					"replica", step.req.ReplicaId, "wait", drainBackoff, "err", err)
			}
			continue
		}
		delete(s.drainWait, v.Id)
		s.logger.Info("drain", "step", step.what, "volume", v.Name, "volume_id", v.Id, "replica", step.req.ReplicaId)
		if !step.req.RemoveOnly {
			rebuilding++
		}
	}
}

// drainAction is one step of a drain: a ReplaceReplica to propose.
type drainAction struct {
	what string
	req  *storpb.ReplaceReplicaRequest
}

// drainStep is v's next drain step (drainReplicas), or none (req nil).
// mayAdd says whether the cluster has room for another rebuild.
func drainStep(v *storpb.Volume, draining map[string]bool, servers map[string]*storpb.Server, lastCopy map[string]bool, mayAdd bool) drainAction {
	var drained []*storpb.Replica
	for _, r := range v.Replicas {
		if draining[r.ServerId] && !r.ServerRemoved {
			drained = append(drained, r)
		}
	}
	if len(drained) == 0 {
		return drainAction{}
	}
	healthyUp := func(except string) int {
		n := 0
		for _, r := range v.Replicas {
			srv := servers[r.ServerId]
			if r.Id != except && r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY && srv != nil && srv.State == storpb.ServerState_SERVER_STATE_UP {
				n++
			}
		}
		return n
	}
	// Unhealthy drained replicas go first: they hold nothing the others lack.
	slices.SortStableFunc(drained, func(a, b *storpb.Replica) int {
		return cmp.Compare(healthyRank(a), healthyRank(b))
	})
	for _, r := range drained {
		if !lastCopy[r.Id] && healthyUp(r.Id) >= int(v.ReplicaCount) {
			return drainAction{what: "remove the drained replica", req: &storpb.ReplaceReplicaRequest{ReplicaId: r.Id, RemoveOnly: true}}
		}
	}
	if !mayAdd || len(v.Replicas) > int(v.ReplicaCount) {
		return drainAction{}
	}
	for _, r := range v.Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
			return drainAction{} // the replica added last is still being filled
		}
	}
	return drainAction{what: "add a replica elsewhere", req: &storpb.ReplaceReplicaRequest{DrainExtra: len(v.Replicas) == int(v.ReplicaCount)}}
}

// healthyRank orders replicas unhealthy first.
func healthyRank(r *storpb.Replica) int {
	if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		return 1
	}
	return 0
}

// replaceUnhealthy replaces replica r of v for the repair loop
// (opRepairReplica): unlike an operator's removal it is not refused when
// r holds the last copy of a ready snapshot, since a volume short of a
// replica for good is worse than a lost snapshot (package doc, "Snapshots
// and replicas that leave"). Each snapshot lost that way is logged; its
// record says so (LOST entries, failed, status_message).
func (s *Store) replaceUnhealthy(ctx context.Context, v *storpb.Volume, r *storpb.Replica) error {
	var lost []*storpb.Snapshot
	_ = s.fsm.View(func(rd *Reader) error {
		var err error
		lost, err = rd.lastCopies(v, r.Id)
		return err
	})
	_, err := asVolume(s.propose(ctx, command{Op: opRepairReplica, ID: uuid.NewString(),
		Body: &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: r.Id,
			LostReplicaFreesItsServer: s.everyServerNamesItsDataDir()}}))
	if err != nil {
		return err
	}
	for _, snap := range lost {
		s.logger.Warn("snapshot lost: its last copy went with a replaced replica",
			"snapshot", snap.Name, "snapshot_id", snap.Id, "volume", v.Name, "volume_id", v.Id, "replica", r.Id, "server", r.ServerId,
			"replica_state", r.State.String(), "server_removed", r.ServerRemoved)
	}
	return nil
}

func (s *Store) setReplica(ctx context.Context, v *storpb.Volume, r *storpb.Replica, state storpb.ReplicaState, reason string) error {
	_, err := s.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
		VolumeId: v.Id, ReplicaId: r.Id, State: state, Epoch: v.Epoch, Reason: reason,
	})
	return err
}

// repair runs one reconciler decision and logs its outcome. Refusals
// (the last healthy copy, no server to place on) are expected and retried
// at the next tick; they are logged at debug level.
func (s *Store) repair(ctx context.Context, what string, v *storpb.Volume, r *storpb.Replica, do func() error) {
	replicaID := ""
	if r != nil {
		replicaID = r.Id
	}
	err := do()
	switch {
	case err == nil:
		s.logger.Info("replica repair", "action", what, "volume", v.Name, "volume_id", v.Id, "replica", replicaID)
	case ctx.Err() != nil:
	default:
		s.logger.Debug("replica repair deferred", "action", what, "volume", v.Name, "volume_id", v.Id, "replica", replicaID, "err", err)
	}
}
