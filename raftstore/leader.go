package raftstore

import (
	"context"
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
		if _, err := s.propose(ctx, command{Op: opInitCluster, ID: uuid.NewString()}); err != nil {
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
		seen := s.LastSeen(srv.Id)
		if seen.IsZero() {
			seen = leaderSince
		}
		if now.Sub(seen) <= s.cfg.ServerDownTimeout {
			continue
		}
		s.logger.Warn("server stopped reporting; marking it down", "down", srv.Id, "silent_for", now.Sub(seen).Round(time.Millisecond))
		down := &storpb.Server{Id: srv.Id, State: storpb.ServerState_SERVER_STATE_DOWN, LastSeenUnixNano: seen.UnixNano()}
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
