package server_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"log/slog"
	"slices"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// rebuildRecord is a "rebuild complete" log line: who logged it (an
// engine or a server) and what it copied.
type rebuildRecord struct {
	Engine, Server string
	Replica        string
	Bytes          int64
	Copied         int64 `json:"copied_by_target"`
}

// logRecords returns the JSON log lines whose msg is msg.
func logRecords[T any](t *testing.T, logs *lockedBuffer, msg string) []T {
	t.Helper()
	var out []T
	sc := bufio.NewScanner(bytes.NewReader([]byte(logs.String())))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var head struct{ Msg string }
		if err := json.Unmarshal(sc.Bytes(), &head); err != nil {
			t.Fatalf("not JSON: %q", sc.Text())
		}
		if head.Msg != msg {
			continue
		}
		var rec T
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatal(err)
		}
		out = append(out, rec)
	}
	return out
}

// A rebuild's chunks go from the source's server to the target's
// (REBUILD_COPY), for an attached volume (its engine rebuilds) and a
// detached one (the target's server rebuilds), under mutual TLS, where the
// target's server reads the source with its own certificate and the
// rebuild-source purpose. When the target's server cannot reach the
// sources' data ports (its Raft port still can), the engine relays every
// chunk itself and records no replica faulty: a healthy source is never
// blamed for a path between two servers.
func TestRebuildCopiedServerToServer(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  bool
		cut  bool
	}{
		{"tls", true, false},
		{"target cut off from the sources' data ports", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs lockedBuffer
			logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
			c := servertest.NewCluster(t, servertest.Options{Servers: 4, TLS: tc.tls, Configure: func(i int, cfg *server.Config) {
				cfg.Logger = logger.With("server", cfg.ID)
				cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
			}})
			leader := c.Leader(10 * time.Second)
			v := createVolume(t, c.Client(leader), "copied", 32<<20, 3)
			ctx := ctxT(t, 2*time.Minute)
			cfg := c.EngineConfig(v.Name, "node-1")
			cfg.Logger = logger.With("engine", "node-1")
			e := c.OpenEngine(cfg)
			for i := range uint64(64) {
				if err := e.WriteAt(ctx, bytes.Repeat(blockData(i, 1), (128<<10)/snapBlock), int64(i)*(512<<10), false); err != nil {
					t.Fatal(err)
				}
			}
			// The server without a replica takes the replacement.
			target := -1
			for i, n := range c.Nodes {
				if !slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool { return r.ServerId == n.ID }) {
					target = i
				}
			}
			if tc.cut {
				for i, n := range c.Nodes {
					if i != target {
						c.Net.CutPort(target, n.DataAddr)
					}
				}
			}
			replace := func(r *storpb.Replica) string {
				t.Helper()
				resp, err := c.Client(leader).Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: r.Id})
				if err != nil {
					t.Fatal(err)
				}
				var fresh string
				for _, x := range resp.Volume.Replicas {
					if !slices.ContainsFunc(v.Replicas, func(y *storpb.Replica) bool { return y.Id == x.Id }) {
						fresh = x.Id
					}
				}
				waitVolume(t, c, leader, v.Id, time.Minute, "the replacement healthy", func(v *storpb.Volume) bool {
					return !slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool { return r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY }) &&
						slices.ContainsFunc(v.Replicas, func(r *storpb.Replica) bool { return r.Id == fresh })
				})
				v = waitVolume(t, c, leader, v.Id, time.Second, "", func(*storpb.Volume) bool { return true })
				return fresh
			}
			fresh := replace(v.Replicas[0])
			requireSameReplicas(t, c, v.Id)
			var rec *rebuildRecord
			for _, r := range logRecords[rebuildRecord](t, &logs, "rebuild complete") {
				if r.Replica == fresh && r.Engine != "" {
					rec = &r
				}
			}
			switch {
			case rec == nil:
				t.Fatalf("no engine rebuild of %s logged", fresh)
			case rec.Bytes < 8<<20:
				t.Fatalf("the rebuild copied %d bytes, want the 8 MiB written", rec.Bytes)
			case !tc.cut && rec.Copied != rec.Bytes:
				t.Fatalf("the target copied %d of %d bytes; want all", rec.Copied, rec.Bytes)
			case tc.cut && rec.Copied != 0:
				t.Fatalf("the target, cut off from every source, copied %d of %d bytes", rec.Copied, rec.Bytes)
			}
			type faultRecord struct{ Replica, Reason string }
			if faults := logRecords[faultRecord](t, &logs, "replica failed; recording it faulty"); len(faults) > 0 {
				t.Fatalf("replicas recorded faulty during the rebuild: %+v", faults)
			}
			if tc.cut {
				return
			}

			// Detached: the target's server rebuilds, and still copies
			// server to server.
			if err := e.Close(ctx, true); err != nil {
				t.Fatal(err)
			}
			moved := v.Replicas[slices.IndexFunc(v.Replicas, func(r *storpb.Replica) bool { return r.Id != fresh })]
			fresh = replace(moved)
			requireSameReplicas(t, c, v.Id)
			rec = nil
			for _, r := range logRecords[rebuildRecord](t, &logs, "rebuild complete") {
				if r.Replica == fresh && r.Engine == "" {
					rec = &r
				}
			}
			if rec == nil || rec.Bytes < 8<<20 || rec.Copied != rec.Bytes {
				t.Fatalf("the detached rebuild of %s: %+v; want the 8 MiB written, all copied by the target", fresh, rec)
			}
		})
	}
}

// requireSameReplicas fails unless every replica of the volume holds the
// same bytes.
func requireSameReplicas(t *testing.T, c *servertest.Cluster, volumeID string) {
	t.Helper()
	sums := c.Checksums(volumeID)
	for _, s := range sums {
		if s.Err != nil {
			t.Fatalf("replica %s: %v", s.Replica.Id, s.Err)
		}
		if s.SHA256 != sums[0].SHA256 {
			t.Fatalf("replica %s differs from replica %s after the rebuild", s.Replica.Id, sums[0].Replica.Id)
		}
	}
}
