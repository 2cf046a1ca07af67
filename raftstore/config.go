package raftstore

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"
)

// Config configures a Store. DefaultConfig fills every field but ID, Dir
// and the addresses.
type Config struct {
	// ID is this server's Raft id; required, stable across restarts.
	ID string
	// Dir holds identity.json, raft.db, snapshots/ and meta.db; required.
	Dir string
	// RaftListener, if set, is used for the Raft transport instead of
	// listening on RaftBind (tests pass pre-bound listeners).
	RaftListener net.Listener
	// RaftBind is the address the Raft transport listens on.
	// Default 127.0.0.1:7401.
	RaftBind string
	// RaftAdvertise is the address other servers dial; default RaftBind
	// (or the listener's address).
	RaftAdvertise string
	// Dial opens connections to other servers' Raft transports. Default
	// net.Dialer.DialContext. Tests inject partitions here.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)

	// HeartbeatTimeout and ElectionTimeout: a follower that hears nothing
	// for a random time in [HeartbeatTimeout, 2*HeartbeatTimeout) starts an
	// election. Default 500ms each: stor runs on a LAN, where a round trip
	// is well under 1 ms, and a short timeout keeps failover under 3 s
	// (hashicorp/raft's 1 s default is tuned for WANs).
	HeartbeatTimeout time.Duration
	ElectionTimeout  time.Duration
	// LeaderLeaseTimeout: a leader that cannot reach a quorum for this long
	// steps down. Default 250ms (must not exceed HeartbeatTimeout).
	LeaderLeaseTimeout time.Duration
	// CommitTimeout bounds how long a follower may wait to learn a commit
	// index without new entries. Default 20ms.
	CommitTimeout time.Duration
	// SnapshotInterval and SnapshotThreshold: Raft checks every interval
	// and snapshots when more than threshold entries are in the log.
	// Default 2m and 8192.
	SnapshotInterval  time.Duration
	SnapshotThreshold uint64
	// TrailingLogs: entries kept after a snapshot so slow followers can
	// catch up without a snapshot install. Default 10240.
	TrailingLogs uint64
	// SnapshotRetain: snapshots kept on disk. Default 2.
	SnapshotRetain int

	// MaxVoters: the first MaxVoters servers to join are voters, the rest
	// non-voters. Default 3 (use 5 for clusters that must survive two
	// server failures).
	MaxVoters int
	// ServerDownTimeout: the leader marks a server down when it has not
	// reported for this long. Default 10s.
	ServerDownTimeout time.Duration
	// ReplicaGrace: replicas on a server that has been down this long are
	// marked faulty by the leader (an attached engine marks a replica
	// faulty at its first failed write, without waiting). Default 30s.
	ReplicaGrace time.Duration
	// ReplaceAfter: a replica unhealthy this long is replaced by a new one
	// on another server (a full rebuild). A replica whose server returns
	// sooner gets a delta rebuild. Default 10m.
	ReplaceAfter time.Duration
	// ApplyTimeout bounds how long a proposal may wait to be enqueued when
	// the caller's context has no deadline. Default 10s.
	ApplyTimeout time.Duration

	// Logger receives structured logs; default slog.Default().
	Logger *slog.Logger
	// ObserveApply, if set, is called after each proposal this server
	// made as leader was committed and applied, with the time from
	// proposing to the FSM's answer (the apply latency a client of the
	// control API waits for). It must not block. Default nil.
	ObserveApply func(time.Duration)
	// Now is the clock used to stamp proposals and track liveness; default
	// time.Now. The FSM itself never reads a clock.
	Now func() time.Time
}

// DefaultConfig returns a Config with every default set.
func DefaultConfig() Config {
	return Config{
		RaftBind:           "127.0.0.1:7401",
		HeartbeatTimeout:   500 * time.Millisecond,
		ElectionTimeout:    500 * time.Millisecond,
		LeaderLeaseTimeout: 250 * time.Millisecond,
		CommitTimeout:      20 * time.Millisecond,
		SnapshotInterval:   2 * time.Minute,
		SnapshotThreshold:  8192,
		TrailingLogs:       10240,
		SnapshotRetain:     2,
		MaxVoters:          3,
		ServerDownTimeout:  10 * time.Second,
		ReplicaGrace:       30 * time.Second,
		ReplaceAfter:       10 * time.Minute,
		ApplyTimeout:       10 * time.Second,
	}
}

// Validate reports the first problem with the configuration.
func (c *Config) Validate() error {
	switch {
	case c.ID == "":
		return fmt.Errorf("raftstore: config: ID is required")
	case c.Dir == "":
		return fmt.Errorf("raftstore: config: Dir is required")
	case c.RaftListener == nil && c.RaftBind == "":
		return fmt.Errorf("raftstore: config: RaftBind or RaftListener is required")
	case c.HeartbeatTimeout < 10*time.Millisecond:
		return fmt.Errorf("raftstore: config: HeartbeatTimeout %v is below 10ms", c.HeartbeatTimeout)
	case c.ElectionTimeout < c.HeartbeatTimeout:
		return fmt.Errorf("raftstore: config: ElectionTimeout %v is below HeartbeatTimeout %v", c.ElectionTimeout, c.HeartbeatTimeout)
	case c.LeaderLeaseTimeout <= 0 || c.LeaderLeaseTimeout > c.HeartbeatTimeout:
		return fmt.Errorf("raftstore: config: LeaderLeaseTimeout %v must be in (0, HeartbeatTimeout]", c.LeaderLeaseTimeout)
	case c.MaxVoters < 1:
		return fmt.Errorf("raftstore: config: MaxVoters must be at least 1")
	case c.ServerDownTimeout <= 0:
		return fmt.Errorf("raftstore: config: ServerDownTimeout must be positive")
	case c.SnapshotRetain < 1:
		return fmt.Errorf("raftstore: config: SnapshotRetain must be at least 1")
	}
	return nil
}

// withDefaults replaces every zero field with its default.
func (c *Config) withDefaults() {
	d := DefaultConfig()
	setDefault(&c.RaftBind, d.RaftBind)
	setDefault(&c.HeartbeatTimeout, d.HeartbeatTimeout)
	setDefault(&c.ElectionTimeout, d.ElectionTimeout)
	setDefault(&c.LeaderLeaseTimeout, d.LeaderLeaseTimeout)
	setDefault(&c.CommitTimeout, d.CommitTimeout)
	setDefault(&c.SnapshotInterval, d.SnapshotInterval)
	setDefault(&c.SnapshotThreshold, d.SnapshotThreshold)
	setDefault(&c.TrailingLogs, d.TrailingLogs)
	setDefault(&c.SnapshotRetain, d.SnapshotRetain)
	setDefault(&c.MaxVoters, d.MaxVoters)
	setDefault(&c.ServerDownTimeout, d.ServerDownTimeout)
	setDefault(&c.ReplicaGrace, d.ReplicaGrace)
	setDefault(&c.ReplaceAfter, d.ReplaceAfter)
	setDefault(&c.ApplyTimeout, d.ApplyTimeout)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Dial == nil {
		var d net.Dialer
		c.Dial = d.DialContext
	}
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}
