//go:build !linux

package replica

import (
	"os"
	"syscall"
)

func punchHole(*os.File, int64, int64) error { return syscall.EOPNOTSUPP }

func openFileLimit() int { return 1024 }

func datasync(f *os.File) error { return f.Sync() }
