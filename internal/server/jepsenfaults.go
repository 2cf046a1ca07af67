//go:build jepsenfaults

package server

import (
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/wire"
)

// The disk-fault switch of the jepsen harness's stor-server (built with
// -tags jepsenfaults): SIGUSR1 makes every write and sync of the replica
// store fail with EIO, SIGXFSZ with ENOSPC (a full disk; an untagged
// server ignores SIGXFSZ, as every Go program does), SIGUSR2 heals both.
// The signal goroutine lives as long as the process (a test build only).
func init() {
	// STOR_JEPSEN_STALE_INCARNATIONS=1: the broken mode
	// "stale-incarnations" (wire.ServerConfig.UnsafeStaleIncarnations).
	// STOR_JEPSEN_IGNORE_DATA_DIR=1: the broken mode
	// "admit-new-data-dirs" (jepsenIgnoreDataDir).
	jepsenIgnoreDataDir = os.Getenv("STOR_JEPSEN_IGNORE_DATA_DIR") == "1"
	jepsenDataConfig = func(c *wire.ServerConfig) {
		if os.Getenv("STOR_JEPSEN_STALE_INCARNATIONS") == "1" {
			c.UnsafeStaleIncarnations = true
		}
	}
	jepsenReplicaFS = func(log *slog.Logger) replica.FS {
		fs := errorfs.New(replica.OS(), time.Now().UnixNano())
		sigs := make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGXFSZ, syscall.SIGUSR2)
		go func() {
			for sig := range sigs {
				fs.Reset()
				switch sig {
				case syscall.SIGUSR1:
					fs.Add(errorfs.Rule{Ops: errorfs.OpWrite | errorfs.OpSync})
					log.Warn("jepsenfaults: replica store writes and syncs now fail with EIO")
				case syscall.SIGXFSZ:
					fs.Add(errorfs.Rule{Ops: errorfs.OpWrite | errorfs.OpSync, Err: syscall.ENOSPC})
					log.Warn("jepsenfaults: replica store writes and syncs now fail with ENOSPC")
				default:
					log.Warn("jepsenfaults: replica store disk faults healed")
				}
			}
		}()
		return fs
	}
}
