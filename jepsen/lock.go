package jepsen

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// LockPath is the file a jepsen test binary locks while it may create
// hosts. Every run uses the same namespaces and addresses
// (198.18.0.0/24) and removes whatever hosts it finds at its start, so a
// second binary running at the same time would kill the first one's
// servers and clients in the middle of its run.
const LockPath = "/run/stor-jepsen.lock"

// ErrLocked: another jepsen test binary holds LockPath.
var ErrLocked = errors.New("jepsen: another jepsen run holds the hosts")

// lockHosts takes an exclusive lock on path without waiting, for as long
// as the returned file stays open (the process's life, in TestMain).
func lockHosts(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w (%s is locked by %q); runs share the hosts and remove each other's: wait for it", ErrLocked, path, holder)
		}
		return nil, fmt.Errorf("jepsen: lock %s: %w", path, err)
	}
	_ = f.Truncate(0)
	_, _ = fmt.Fprintf(f, "pid %d", os.Getpid())
	return f, nil
}
