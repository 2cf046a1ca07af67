package server

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica/wire"
)

// errNotReady is /readyz's answer while the server, a member, knows no
// leader.
var errNotReady = errors.New("server: not ready: no known Raft leader (cut off from the majority)")

// registerMetrics registers this server's collectors (package metrics).
func (s *Server) registerMetrics() {
	reg := s.metrics
	reg.MustRegister(s.raftMetrics, s.apiMetrics,
		metrics.NewCluster(s.clusterView),
		metrics.NewDisk(s.cfg.DataDir),
		metrics.NewDataPort(func() wire.Stats {
			if s.data == nil {
				return wire.Stats{}
			}
			return s.data.wire.Stats()
		}))
}

// serveMetrics serves /metrics, /healthz and /readyz on
// Config.MetricsListener or MetricsListen, if either is set. /readyz is
// what the gRPC health service's readiness answers (ready).
func (s *Server) serveMetrics() error {
	h := metrics.Handler(s.metrics, metrics.Health{Ready: func(context.Context) error {
		return s.notReady()
	}})
	switch {
	case s.cfg.MetricsListener != nil:
		s.metricsSrv = metrics.Serve(s.cfg.MetricsListener, h, s.logger)
	case s.cfg.MetricsListen != "":
		var err error
		if s.metricsSrv, err = metrics.Listen(s.cfg.MetricsListen, h, s.logger); err != nil {
			return err
		}
	}
	return nil
}

// MetricsAddr is the address /metrics is served on; "" when none.
func (s *Server) MetricsAddr() string {
	if s.metricsSrv == nil {
		return ""
	}
	return s.metricsSrv.Addr()
}

// Metrics is the server's registry (in-process tests gather it directly).
func (s *Server) Metrics() *prometheus.Registry { return s.metrics }

func (s *Server) raftStatus() metrics.RaftStatus {
	if s.store == nil {
		return metrics.RaftStatus{State: "Shutdown"}
	}
	st := s.store.Status()
	return metrics.RaftStatus{
		State: st.RaftState, Term: st.Term, CommitIndex: st.CommitIndex, AppliedIndex: st.Applied,
		LastIndex: st.LastIndex, HasLeader: st.LeaderID != "", LeaderChanges: s.store.LeaderChanges(),
	}
}

// stateName is an enum value's name without its prefix, lower case:
// REPLICA_STATE_HEALTHY -> healthy.
func stateName(enum fmt.Stringer, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(enum.String(), prefix))
}

// clusterView summarises the FSM for the cluster collector, on the leader
// only: one pass over the servers and a paged pass over the volumes,
// keeping sums per server and counts per state.
func (s *Server) clusterView() (metrics.ClusterView, bool) {
	if s.store == nil || !s.store.IsLeader() {
		return metrics.ClusterView{}, false
	}
	v := metrics.ClusterView{Replicas: map[string]int{}, Volumes: map[string]int{}}
	for _, st := range []storpb.ReplicaState{storpb.ReplicaState_REPLICA_STATE_HEALTHY, storpb.ReplicaState_REPLICA_STATE_REBUILDING, storpb.ReplicaState_REPLICA_STATE_FAULTY} {
		v.Replicas[stateName(st, "REPLICA_STATE_")] = 0
	}
	for st := range storpb.VolumeState_name {
		if st != 0 {
			v.Volumes[stateName(storpb.VolumeState(st), "VOLUME_STATE_")] = 0
		}
	}
	byID := map[string]*metrics.ServerView{}
	err := s.store.View(func(r *raftstore.Reader) error {
		servers, err := r.Servers()
		if err != nil {
			return err
		}
		v.Servers = make([]metrics.ServerView, len(servers))
		for i, sv := range servers {
			v.Servers[i] = metrics.ServerView{
				ID: sv.Id, Up: sv.State != storpb.ServerState_SERVER_STATE_DOWN, Cordoned: sv.Cordoned,
				Capacity: sv.CapacityBytes, Allocated: sv.AllocatedBytes,
			}
			byID[sv.Id] = &v.Servers[i]
		}
		token := ""
		for {
			vols, next, err := r.Volumes(token, 1000)
			if err != nil {
				return err
			}
			for _, vol := range vols {
				v.Volumes[stateName(vol.State, "VOLUME_STATE_")]++
				for _, rep := range vol.Replicas {
					v.Replicas[stateName(rep.State, "REPLICA_STATE_")]++
					sv := byID[rep.ServerId]
					if sv == nil || rep.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
						continue
					}
					sv.Rebuilds++
					sv.RebuildDone += rep.RebuildDoneBytes
					if rep.RebuildTotalBytes > rep.RebuildDoneBytes {
						sv.RebuildRemaining += rep.RebuildTotalBytes - rep.RebuildDoneBytes
					}
				}
			}
			if next == "" {
				return nil
			}
			token = next
		}
	})
	if err != nil {
		s.logger.Warn("metrics: read the cluster state", "err", err)
		return metrics.ClusterView{}, false
	}
	return v, true
}
