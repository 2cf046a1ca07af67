package csi

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
)

// Start, in node mode, prepares the process for serving the kernel's
// writeback (PR_SET_IO_FLUSHER, oom_score_adj) before it recovers, and a
// refusal does not stop it.
func TestNodeStartPreparesTheProcess(t *testing.T) {
	var flusher int
	var adj []int
	proc := attach.Process{
		SetIOFlusher:   func() error { flusher++; return unix.EPERM },
		SetOOMScoreAdj: func(a int) error { adj = append(adj, a); return nil },
	}
	d, err := New(Config{
		Mode: ModeNode, NodeID: "worker-1", StateDir: t.TempDir(), Process: &proc,
		Cluster:  Cluster{Cluster: &fakeRegistry{}, Volumes: storpb.NewVolumeServiceClient(nil), Snapshots: storpb.NewSnapshotServiceClient(nil)},
		Attacher: newFakeAttacher(nil), Logger: testLogger(t), CallTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		t.Fatalf("Start with PR_SET_IO_FLUSHER refused: %v, want it to go on", err)
	}
	if flusher != 1 || len(adj) != 1 || adj[0] != attach.OOMScoreAdj {
		t.Fatalf("Start set PR_SET_IO_FLUSHER %d times and oom_score_adj %v; want once each, %d", flusher, adj, attach.OOMScoreAdj)
	}
	if err := d.Ready(ctx); err != nil {
		t.Fatalf("not ready after Start: %v", err)
	}
}
