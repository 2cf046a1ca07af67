package replica_test

import (
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

const testRegionSize = 256 << 10

// TestConformanceOS runs the suite on the real filesystem. Its Crash is
// process death: the store is abandoned without Close and reopened; the
// page cache keeps everything, so only the loss-free crash checks apply.
func TestConformanceOS(t *testing.T) {
	replicatest.Run(t, func(t *testing.T) replicatest.Env {
		dir := t.TempDir()
		return replicatest.Env{
			Open: func(t *testing.T) *replica.Store {
				return openStore(t, replica.Config{Dir: dir, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
			},
			Crash: func(*testing.T, int64) {},
		}
	})
}

// TestConformanceMemFS runs the suite on MemFS, whose Crash drops a random
// part of everything not synced: the durability checks apply.
func TestConformanceMemFS(t *testing.T) {
	replicatest.Run(t, func(t *testing.T) replicatest.Env {
		mem := errorfs.NewMemFS()
		return replicatest.Env{
			Open: func(t *testing.T) *replica.Store {
				return openStore(t, replica.Config{Dir: "/stor", FS: mem, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
			},
			Crash:         func(_ *testing.T, seed int64) { mem = mem.Crash(seed) },
			LosesUnsynced: true,
		}
	})
}

func openStore(t *testing.T, cfg replica.Config) *replica.Store {
	t.Helper()
	s, err := replica.OpenStore(cfg)
	if err != nil {
		t.Fatalf("OpenStore: %v", err)
	}
	if d := s.Damaged(); len(d) > 0 {
		t.Fatalf("damaged replicas: %v", d)
	}
	return s
}
