//go:build linux

package replica

import (
	"os"

	"golang.org/x/sys/unix"
)

func punchHole(f *os.File, off, n int64) error {
	for {
		err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fallocate", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}

// openFileLimit is the process's RLIMIT_NOFILE (soft), or 1024 if it
// cannot be read.
func openFileLimit() int {
	var l unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &l); err != nil || l.Cur > 1<<30 {
		return 1024
	}
	return int(l.Cur)
}

func datasync(f *os.File) error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}
