package replica

import "errors"

// Sentinel errors of the replica store. The data protocol carries each as
// its own status code, so a client sees the same errors.Is identity as a
// local caller. Corruption is its own class and is never retried.
var (
	// ErrStaleEpoch: the request's epoch is lower than the highest epoch
	// this replica has seen. The caller has been fenced by a newer attach
	// and must never write again.
	ErrStaleEpoch = errors.New("replica: stale epoch")
	// ErrNotFound: no such replica or snapshot on this server.
	ErrNotFound = errors.New("replica: not found")
	// ErrExists: a replica with this id exists with a different spec.
	ErrExists = errors.New("replica: exists with another spec")
	// ErrInvalid: a malformed request: out of range, misaligned, negative
	// or oversized length, shrinking.
	ErrInvalid = errors.New("replica: invalid request")
	// ErrIO: the disk failed the operation (EIO and the like).
	ErrIO = errors.New("replica: i/o error")
	// ErrNoSpace: the disk is full (ENOSPC).
	ErrNoSpace = errors.New("replica: no space")
	// ErrCorrupt: on-disk state failed validation (bad checksum, torn
	// metadata that cannot be recovered).
	ErrCorrupt = errors.New("replica: corrupt")
	// ErrHistoryLost: the replica cannot say which regions were written
	// since a generation (its write history does not reach back that far);
	// the caller must do a full rebuild instead of a delta.
	ErrHistoryLost = errors.New("replica: write history lost")
	// ErrClosed: the replica or store was closed.
	ErrClosed = errors.New("replica: closed")
	// ErrNotDirect: the replica cannot be read directly (short-circuit)
	// now; read it through its server (shortcircuit.go).
	ErrNotDirect = errors.New("replica: not readable directly")
)
