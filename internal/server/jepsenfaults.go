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
)

// The disk-fault switch of the jepsen harness's stor-server (built with
// -tags jepsenfaults): SIGUSR1 makes every write and sync of the replica
// store fail with EIO, SIGUSR2 heals it. The signal goroutine lives as long
// as the process (a test build only).
func init() {
	jepsenReplicaFS = func(log *slog.Logger) replica.FS {
		fs := errorfs.New(replica.OS(), time.Now().UnixNano())
		sigs := make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGUSR2)
		go func() {
			for sig := range sigs {
				fs.Reset()
				if sig == syscall.SIGUSR1 {
					fs.Add(errorfs.Rule{Ops: errorfs.OpWrite | errorfs.OpSync})
					log.Warn("jepsenfaults: replica store writes and syncs now fail with EIO")
				} else {
					log.Warn("jepsenfaults: replica store disk faults healed")
				}
			}
		}()
		return fs
	}
}
