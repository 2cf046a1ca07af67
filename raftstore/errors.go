package raftstore

import "errors"

// Sentinel errors. Callers test them with errors.Is; the gRPC boundary maps
// each to one status code (see internal/server's code table). Errors returned
// by the FSM travel back to the proposer inside the apply response, wrapped
// with detail (which volume, which name) by %w.
var (
	// ErrNotFound: the server, volume or snapshot does not exist. A volume
	// deleted while it had snapshots is kept for them (state DELETED) but
	// does not exist for its users: attaching, expanding, snapshotting or
	// cloning it is ErrNotFound too.
	ErrNotFound = errors.New("raftstore: not found")
	// ErrAlreadyExists: the name is taken by an object with other parameters.
	ErrAlreadyExists = errors.New("raftstore: already exists")
	// ErrInvalidArgument: the request is malformed independent of state.
	ErrInvalidArgument = errors.New("raftstore: invalid argument")
	// ErrFailedPrecondition: the request is valid but the state forbids it
	// (attached volume, shrink, a clone still being filled, ...).
	ErrFailedPrecondition = errors.New("raftstore: failed precondition")
	// ErrInsufficientServers: fewer eligible distinct servers than replicas.
	ErrInsufficientServers = errors.New("raftstore: not enough servers to place replicas")
	// ErrInsufficientCapacity: enough servers, but too few with free capacity.
	ErrInsufficientCapacity = errors.New("raftstore: not enough free capacity to place replicas")
	// ErrResourceExhausted: the request is valid but would take an object
	// past a cap the cluster keeps (snapshots per volume).
	ErrResourceExhausted = errors.New("raftstore: resource exhausted")
	// ErrStaleEpoch: the caller's epoch is lower than the volume's: a newer
	// attach has fenced it.
	ErrStaleEpoch = errors.New("raftstore: stale epoch")
	// ErrNotLeader: this server is not the leader; the caller may retry
	// against the leader.
	ErrNotLeader = errors.New("raftstore: not the leader")
	// ErrNoLeader: the cluster has no leader right now; retry later.
	ErrNoLeader = errors.New("raftstore: no leader")
	// ErrCorrupt: on-disk state failed validation. Never retried, never
	// silently repaired.
	ErrCorrupt = errors.New("raftstore: corrupt state")
	// ErrForeignDataDir: the data directory belongs to another server or
	// cluster, or is not a stor data directory.
	ErrForeignDataDir = errors.New("raftstore: foreign data directory")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("raftstore: closed")
)
