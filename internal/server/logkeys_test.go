package server_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Every log line about a volume names it both ways, "volume" (its name)
// and "volume_id": servers', the leader's repair and the engine's, through
// a volume's life (create, attach, writes, a replica replaced and
// rebuilt, a snapshot, detach, delete).
func TestLogLinesNameVolumesByNameAndID(t *testing.T) {
	var logs lockedBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Logger = logger.With("server", cfg.ID)
	}})
	leader := c.Leader(10 * time.Second)
	v := createVolume(t, c.Client(leader), "logged", 1<<20, 3)
	ctx := ctxT(t, time.Minute)
	cfg := c.EngineConfig(v.Name, "node-1")
	cfg.Logger = logger.With("engine", "node-1")
	e := c.OpenEngine(cfg)
	if err := e.WriteAt(ctx, blockData(0, 1), 0, false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id}); err != nil {
		t.Fatal(err)
	}
	waitVolume(t, c, leader, v.Id, 30*time.Second, "the replacement healthy", func(v *storpb.Volume) bool {
		for _, r := range v.Replicas {
			if r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				return false
			}
		}
		return len(v.Replicas) == 3
	})
	s := createSnapshot(t, c, leader, v.Id, "logged-snap")
	waitSnapshot(t, c, leader, s.Id, 30*time.Second, "snapshot ready", func(s *storpb.Snapshot) bool { return s.ReadyToUse || s.Failed })
	if err := e.Close(ctx, true); err != nil {
		t.Fatal(err)
	}

	about := 0
	sc := bufio.NewScanner(bytes.NewReader([]byte(logs.String())))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("not JSON: %q", sc.Text())
		}
		name, hasName := rec["volume"]
		id, hasID := rec["volume_id"]
		if !hasName && !hasID {
			continue
		}
		about++
		if !hasName || !hasID || name == "" || id == "" {
			t.Errorf("a line about a volume without both its name and id: %s", sc.Text())
		}
	}
	if about < 5 {
		t.Fatalf("only %d log lines about a volume; the test exercised nothing", about)
	}
}
