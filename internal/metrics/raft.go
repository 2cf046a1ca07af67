package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// RaftStatus is what the Raft collector reads of a server at each scrape.
type RaftStatus struct {
	// State is hashicorp/raft's state name: Follower, Candidate, Leader or
	// Shutdown.
	State                                      string
	Term, CommitIndex, AppliedIndex, LastIndex uint64
	HasLeader                                  bool
	LeaderChanges                              uint64
}

// raftStates are the values of stor_raft_state's state label.
var raftStates = []string{"Follower", "Candidate", "Leader", "Shutdown"}

var (
	raftStateDesc   = prometheus.NewDesc("stor_raft_state", "1 for this server's Raft state (label state), 0 for the others.", []string{"state"}, nil)
	raftTermDesc    = prometheus.NewDesc("stor_raft_term", "This server's current Raft term.", nil, nil)
	raftCommitDesc  = prometheus.NewDesc("stor_raft_commit_index", "The highest Raft log index this server knows committed.", nil, nil)
	raftAppliedDesc = prometheus.NewDesc("stor_raft_applied_index", "The highest Raft log index this server's FSM applied.", nil, nil)
	raftLastDesc    = prometheus.NewDesc("stor_raft_last_index", "The last index in this server's Raft log.", nil, nil)
	raftLeaderDesc  = prometheus.NewDesc("stor_raft_has_leader", "1 if this server knows a Raft leader.", nil, nil)
	raftChangesDesc = prometheus.NewDesc("stor_raft_leader_changes_total", "Leader changes (to a new leader or to none) this server observed.", nil, nil)
)

// Raft collects a server's Raft state at each scrape from status, and
// observes the apply latency of its proposals (ObserveApply).
type Raft struct {
	status func() RaftStatus
	apply  prometheus.Histogram
}

// NewRaft returns the Raft collector of the server status describes.
func NewRaft(status func() RaftStatus) *Raft {
	return &Raft{status: status, apply: prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "stor_raft_apply_duration_seconds",
		Help:    "Time from proposing a metadata change as leader to the FSM's answer.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14), // 0.5 ms .. 4 s
	})}
}

// ObserveApply records one proposal's latency (raftstore.Config.ObserveApply).
func (r *Raft) ObserveApply(d time.Duration) { r.apply.Observe(d.Seconds()) }

// Describe implements prometheus.Collector.
func (r *Raft) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{raftStateDesc, raftTermDesc, raftCommitDesc, raftAppliedDesc, raftLastDesc, raftLeaderDesc, raftChangesDesc} {
		ch <- d
	}
	r.apply.Describe(ch)
}

// Collect implements prometheus.Collector.
func (r *Raft) Collect(ch chan<- prometheus.Metric) {
	st := r.status()
	for _, s := range raftStates {
		ch <- prometheus.MustNewConstMetric(raftStateDesc, prometheus.GaugeValue, boolValue(st.State == s), s)
	}
	ch <- prometheus.MustNewConstMetric(raftTermDesc, prometheus.GaugeValue, float64(st.Term))
	ch <- prometheus.MustNewConstMetric(raftCommitDesc, prometheus.GaugeValue, float64(st.CommitIndex))
	ch <- prometheus.MustNewConstMetric(raftAppliedDesc, prometheus.GaugeValue, float64(st.AppliedIndex))
	ch <- prometheus.MustNewConstMetric(raftLastDesc, prometheus.GaugeValue, float64(st.LastIndex))
	ch <- prometheus.MustNewConstMetric(raftLeaderDesc, prometheus.GaugeValue, boolValue(st.HasLeader))
	ch <- prometheus.MustNewConstMetric(raftChangesDesc, prometheus.CounterValue, float64(st.LeaderChanges))
	r.apply.Collect(ch)
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
