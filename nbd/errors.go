package nbd

import (
	"context"
	"errors"
	"fmt"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
)

var (
	// ErrServerClosed is returned by Serve and ServeConn once Shutdown or
	// Close has been called.
	ErrServerClosed = errors.New("nbd: server closed")
	// ErrProtocol: the client broke the protocol in a way that leaves the
	// stream unusable (bad magic, unknown client flags, an option it may
	// not send); the connection is dropped.
	ErrProtocol = errors.New("nbd: protocol violation")
	// ErrServerBusy: the server's payload memory (Config.MaxMemory)
	// stayed spent for a whole FrameTimeout while a WRITE was being
	// received from a connection of Serve; the connection is closed.
	ErrServerBusy = errors.New("nbd: server busy: payload memory exhausted")
)

// Errno is an NBD error value, as carried in a reply. A Device may return
// one (possibly wrapped) to choose the value the client sees; see
// errnoOf for how other errors are mapped.
type Errno uint32

// The error values the protocol defines.
const (
	EPERM     Errno = 1
	EIO       Errno = 5
	ENOMEM    Errno = 12
	EINVAL    Errno = 22
	ENOSPC    Errno = 28
	EOVERFLOW Errno = 75
	ENOTSUP   Errno = 95
	ESHUTDOWN Errno = 108
)

func (e Errno) Error() string {
	switch e {
	case EPERM:
		return "nbd: EPERM: operation not permitted"
	case EIO:
		return "nbd: EIO: input/output error"
	case ENOMEM:
		return "nbd: ENOMEM: cannot allocate memory"
	case EINVAL:
		return "nbd: EINVAL: invalid argument"
	case ENOSPC:
		return "nbd: ENOSPC: no space left on device"
	case EOVERFLOW:
		return "nbd: EOVERFLOW: value too large"
	case ENOTSUP:
		return "nbd: ENOTSUP: operation not supported"
	case ESHUTDOWN:
		return "nbd: ESHUTDOWN: server is shutting down"
	}
	return fmt.Sprintf("nbd: error %d", uint32(e))
}

// errnoTable maps device errors to NBD error values: the one place the
// server chooses them. The first match wins; anything unmatched is EIO,
// because a block device that cannot say what went wrong has had an I/O
// error.
var errnoTable = []struct {
	err   error
	errno Errno
}{
	// The request itself is wrong (range, alignment, size): no replica is
	// at fault and retrying will not help.
	{replica.ErrInvalid, EINVAL},
	{replica.ErrNoSpace, ENOSPC},
	// A newer attach fenced this engine, or no healthy replica could
	// serve the request: the data cannot be reached from here.
	{engine.ErrFenced, EIO},
	{engine.ErrIO, EIO},
	{replica.ErrIO, EIO},
	{replica.ErrCorrupt, EIO},
	{replica.ErrStaleEpoch, EIO},
	// The engine is closing: the server is going away. Clients answer
	// ESHUTDOWN with a soft disconnect.
	{engine.ErrClosed, ESHUTDOWN},
	// The request's context ended: the server is being closed hard.
	{context.Canceled, ESHUTDOWN},
	{context.DeadlineExceeded, EIO},
}

// errnoOf returns the NBD error value for a device error (0 for nil).
func errnoOf(err error) Errno {
	if err == nil {
		return 0
	}
	var e Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	for _, m := range errnoTable {
		if errors.Is(err, m.err) {
			return m.errno
		}
	}
	return EIO
}
