package ctl

import (
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// --wait follows what the cluster finishes after the command: the new
// replica's rebuild, a snapshot's cuts, a clone's copy; the result printed
// after is the finished one.
func TestWaitFlags(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 4-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 4})
	c.Leader(10 * time.Second)
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	srv := []string{"--server", strings.Join(addrs, ","), "--timeout", "90s"}
	mustRun(t, append(srv, "volume", "create", "w", "--size", "8MiB", "--replicas", "3")...)
	v, err := c.Dial().Volumes.GetVolume(listCtx(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "w"}})
	if err != nil {
		t.Fatal(err)
	}
	old := v.Volume.Replicas[0].Id

	if r := run(t, append(srv, "replica", "remove", "w", old, "--wait")...); r.code != 2 || !strings.Contains(r.stderr, "--replace") {
		t.Fatalf("--wait without --replace: exit %d, %q; want 2 naming --replace", r.code, r.stderr)
	}
	r := run(t, append(srv, "replica", "remove", "w", old, "--replace", "--wait")...)
	if r.code != 0 || !strings.Contains(r.stderr, "healthy") {
		t.Fatalf("replica remove --replace --wait: exit %d, stderr %q", r.code, r.stderr)
	}
	v, err = c.Dial().Volumes.GetVolume(listCtx(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: "w"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Volume.Replicas) != 3 || strings.Contains(r.stdout, old) {
		t.Fatalf("after the replacement: %v; printed\n%s", v.Volume.Replicas, r.stdout)
	}
	for _, rep := range v.Volume.Replicas {
		if rep.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY || !strings.Contains(r.stdout, rep.Id) {
			t.Fatalf("--wait returned before replica %s was healthy (%v); printed\n%s", rep.Id, rep.State, r.stdout)
		}
	}

	r = run(t, append(srv, "snapshot", "create", "w", "s1", "--wait")...)
	if r.code != 0 || !strings.Contains(r.stderr, "snapshot s1: [####################] 3 of 3 replicas cut") {
		t.Fatalf("snapshot create --wait: exit %d, stderr %q", r.code, r.stderr)
	}
	assertCells(t, r.stdout, "READY:", "yes")

	r = run(t, append(srv, "volume", "create", "w-copy", "--from-snapshot", "s1", "--wait")...)
	if r.code != 0 || !strings.Contains(r.stderr, "clone w-copy: [####################] 3 of 3 replicas filled") {
		t.Fatalf("volume create --from-snapshot --wait: exit %d, stderr %q", r.code, r.stderr)
	}
	assertCells(t, r.stdout, "STATE:", "available")
	if r := run(t, append(srv, "volume", "create", "plain", "--size", "8MiB", "--wait")...); r.code != 2 {
		t.Fatalf("--wait on a volume that is no clone: exit %d, %q; want 2", r.code, r.stderr)
	}
}

// TestWaitForACloneOfAFailedSnapshotEnds: `volume create --from-snapshot
// --wait` of a clone whose snapshot failed waited until its timeout with
// "0 of N replicas filled"; the clone can never be filled that way. The
// wait now ends at once with the snapshot's reason.
func TestWaitForACloneOfAFailedSnapshotEnds(t *testing.T) {
	f := newFake(t)
	f.snapshots.snapshots = append(f.snapshots.snapshots, &storpb.Snapshot{Id: "snap-f", Name: "broken", VolumeId: "vol-1",
		SizeBytes: 10 << 30, Failed: true, StatusMessage: "no replica could cut the snapshot: r-1: server removed"})
	f.volumes.volumes = append(f.volumes.volumes, &storpb.Volume{Id: "vol-new", Name: "restored", SizeBytes: 10 << 30, ReplicaCount: 1,
		State: storpb.VolumeState_VOLUME_STATE_CREATING, CloneSnapshotId: "snap-f", Replicas: []*storpb.Replica{healthy("r-9", "s1")}})
	start := time.Now()
	r := run(t, "--server", f.addr, "--timeout", "20s", "volume", "create", "restored", "--from-snapshot", "broken", "--wait")
	if r.code != 1 || !strings.Contains(r.stderr, "cannot be filled") || !strings.Contains(r.stderr, "server removed") {
		t.Fatalf("exit %d, stderr %q; want 1 saying the clone cannot be filled and why", r.code, r.stderr)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the wait took %v: it ended at the timeout, not at the failure", d)
	}
}
