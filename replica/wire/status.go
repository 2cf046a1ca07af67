package wire

import (
	"errors"
	"fmt"

	"github.com/stor-io/stor/replica"
)

// Errors of the protocol itself, distinct from the replica store's. A
// failed request's error wraps either one of these or one of replica's
// sentinels, so callers test both with errors.Is.
var (
	// ErrDisconnected: the connection broke (or was closed) before the
	// reply arrived. The request may or may not have been applied.
	ErrDisconnected = errors.New("wire: disconnected")
	// ErrBadHandle: the handle is not open on this connection.
	ErrBadHandle = errors.New("wire: bad handle")
	// ErrUnknownOp: the server does not know the opcode.
	ErrUnknownOp = errors.New("wire: unknown op")
	// ErrProtocol: a malformed frame (bad magic, checksum, version,
	// reserved fields, payload shape).
	ErrProtocol = errors.New("wire: protocol error")
	// ErrChecksum: a payload failed its CRC-32C. The stream is still in
	// sync; the request was not applied (for a request) or its data must
	// not be used (for a reply).
	ErrChecksum = errors.New("wire: payload checksum mismatch")
	// ErrInternal: the server failed with an error that is none of the
	// above nor a replica sentinel.
	ErrInternal = errors.New("wire: internal server error")
	// ErrDenied: the server's Authorizer refused an OPEN, or a request
	// on a handle its Grant does not allow (doc.go, "Authorisation").
	ErrDenied = errors.New("wire: access denied")
	// ErrServerClosed: Serve was called on, or returned from, a closed
	// Server.
	ErrServerClosed = errors.New("wire: server closed")
	// ErrServerBusy: the server's payload memory (ServerConfig.MaxMemory)
	// stayed spent for a whole FrameTimeout while a request was being
	// received; the connection is closed (its stream is mid-frame).
	ErrServerBusy = errors.New("wire: server busy: payload memory exhausted")
	// ErrCopySource: a REBUILD_COPY could not read its source (the source
	// refused, failed or could not be reached from the target's server
	// within the request's budget). Nothing was written to the target.
	// It says nothing of the source's health as the engine sees it: the
	// two servers may only be cut off from each other.
	ErrCopySource = errors.New("wire: rebuild copy: source unavailable")
)

// Status is the result code of a reply.
type Status uint8

// Status codes. 1-15 are the replica store's sentinels, 32 and up the
// protocol's own.
const (
	StatusOK          Status = 0
	StatusStaleEpoch  Status = 1
	StatusNotFound    Status = 2
	StatusExists      Status = 3
	StatusInvalid     Status = 4
	StatusIO          Status = 5
	StatusNoSpace     Status = 6
	StatusCorrupt     Status = 7
	StatusHistoryLost Status = 8
	StatusClosed      Status = 9
	StatusBadHandle   Status = 32
	StatusUnknownOp   Status = 33
	StatusProtocol    Status = 34
	StatusBadChecksum Status = 35
	StatusInternal    Status = 36
	StatusDenied      Status = 37
	StatusCopySource  Status = 38
)

// statusTable is the one mapping between errors and status codes, both
// ways. statusOf takes the first row whose error the given error wraps, so
// the order settles errors that wrap several sentinels: fencing first,
// then the error classes that must never be retried.
// name is the status's short name in metrics (Status.Name).
var statusTable = [...]struct {
	status Status
	err    error
	name   string
}{
	{StatusStaleEpoch, replica.ErrStaleEpoch, "stale_epoch"},
	{StatusDenied, ErrDenied, "denied"},
	{StatusCorrupt, replica.ErrCorrupt, "corrupt"},
	{StatusHistoryLost, replica.ErrHistoryLost, "history_lost"},
	{StatusNoSpace, replica.ErrNoSpace, "no_space"},
	{StatusIO, replica.ErrIO, "io"},
	{StatusNotFound, replica.ErrNotFound, "not_found"},
	{StatusExists, replica.ErrExists, "exists"},
	{StatusInvalid, replica.ErrInvalid, "invalid"},
	{StatusClosed, replica.ErrClosed, "closed"},
	{StatusBadHandle, ErrBadHandle, "bad_handle"},
	{StatusUnknownOp, ErrUnknownOp, "unknown_op"},
	{StatusBadChecksum, ErrChecksum, "bad_checksum"},
	{StatusProtocol, ErrProtocol, "protocol"},
	{StatusInternal, ErrInternal, "internal"},
	{StatusCopySource, ErrCopySource, "copy_source"},
}

// statusOf maps an error to the status code sent for it.
func statusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	for _, row := range statusTable {
		if errors.Is(err, row.err) {
			return row.status
		}
	}
	return StatusInternal
}

// Err returns the sentinel a status stands for: nil for StatusOK,
// ErrProtocol for a code this version does not know.
func (s Status) Err() error {
	if s == StatusOK {
		return nil
	}
	for _, row := range statusTable {
		if row.status == s {
			return row.err
		}
	}
	return ErrProtocol
}

// Name is a short lower_snake name of the status ("ok", "stale_epoch"),
// the label value metrics use.
func (s Status) Name() string {
	if s == StatusOK {
		return "ok"
	}
	for _, row := range statusTable {
		if row.status == s {
			return row.name
		}
	}
	return fmt.Sprintf("status_%d", uint8(s))
}

func (s Status) String() string {
	if s == StatusOK {
		return "OK"
	}
	for _, row := range statusTable {
		if row.status == s {
			return row.err.Error()
		}
	}
	return fmt.Sprintf("status %d", uint8(s))
}

// RemoteError is a failed reply: the server's status and its error text.
// It unwraps to the status's sentinel, so errors.Is(err,
// replica.ErrStaleEpoch) holds for a fenced remote write.
type RemoteError struct {
	Op     Opcode
	Status Status
	Msg    string // the server's error text; may be empty
}

func (e *RemoteError) Error() string {
	if e.Msg == "" {
		return fmt.Sprintf("wire: %v: %v", e.Op, e.Status)
	}
	return fmt.Sprintf("wire: %v: remote: %s", e.Op, e.Msg)
}

func (e *RemoteError) Unwrap() error { return e.Status.Err() }
