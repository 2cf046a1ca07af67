package server

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/replicatest"
)

func TestStrayLayer(t *testing.T) {
	const (
		pending = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING
		cut     = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT
		missed  = storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED
	)
	snap := func(st storpb.SnapshotReplicaState, cutEpoch uint64) *storpb.Snapshot {
		return &storpb.Snapshot{Id: "s", CutEpoch: cutEpoch, Replicas: []*storpb.SnapshotReplica{{ReplicaId: "r1", State: st}}}
	}
	for _, tc := range []struct {
		name       string
		s          *storpb.Snapshot
		replica    string
		layerEpoch uint64
		volEpoch   uint64
		merge      bool
	}{
		{"cut at the recorded epoch", snap(cut, 3), "r1", 3, 5, false},
		{"cut at another epoch", snap(cut, 3), "r1", 2, 5, true},
		{"pending, cut at the current epoch (record in flight)", snap(pending, 0), "r1", 5, 5, false},
		{"pending, cut at an epoch the volume left", snap(pending, 0), "r1", 4, 5, true},
		{"pending, cut at an epoch this view has not seen yet", snap(pending, 0), "r1", 6, 5, false},
		{"missed", snap(missed, 3), "r1", 3, 5, true},
		{"not in the snapshot", snap(cut, 3), "r9", 3, 5, true},
	} {
		why := strayLayer(tc.s, &storpb.Volume{Epoch: tc.volEpoch}, tc.replica, tc.layerEpoch)
		if (why != "") != tc.merge {
			t.Errorf("%s: strayLayer = %q, want merge %v", tc.name, why, tc.merge)
		}
	}
}

// TestAFailingTaskIsRetriedLessAndLessOften: a snapshot task that keeps
// failing is retried after a wait that doubles with each failure, up to
// a bound, and at the first wait again once it has succeeded. It used to
// be retried every second for as long as it failed: a detached cut that
// could not complete raised its volume's epoch (a Raft entry) every
// second.
func TestAFailingTaskIsRetriedLessAndLessOften(t *testing.T) {
	oldWait, oldMax := taskRetryWait, taskRetryMaxWait
	taskRetryWait, taskRetryMaxWait = 20*time.Millisecond, 160*time.Millisecond
	defer func() { taskRetryWait, taskRetryMaxWait = oldWait, oldMax }()
	for failures, want := range map[int]time.Duration{1: 20, 2: 40, 4: 160, 9: 160} {
		if got := taskRetryDelay(failures); got != want*time.Millisecond {
			t.Errorf("after %d failures: a wait of %v, want %v", failures, got, want*time.Millisecond)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &dataPlane{s: &Server{ctx: ctx, logger: replicatest.Logger(t)}, tasks: map[string]bool{}}
	defer d.wg.Wait()
	defer cancel()

	var mu sync.Mutex
	var starts []time.Time
	fail := true
	task := func() error {
		mu.Lock()
		defer mu.Unlock()
		starts = append(starts, time.Now())
		if fail {
			return errors.New("the cut failed")
		}
		return nil
	}
	setFail := func(f bool) {
		mu.Lock()
		fail = f
		mu.Unlock()
	}
	waitIdle := func(key string) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			d.mu.Lock()
			running := d.tasks[key]
			d.mu.Unlock()
			if !running {
				return
			}
		}
		t.Fatalf("task %s is still running", key)
	}
	failures := func(key string) int {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.taskFailures[key]
	}

	// Reconciles asking for the task every 5 ms for 1.3 s: at a fixed
	// wait of 20 ms that is about 60 attempts; with the doubling one
	// (20, 40, 80, 160, 160, ... ms) about 11.
	for end := time.Now().Add(1300 * time.Millisecond); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		d.runTask("cut/v1", task)
	}
	mu.Lock()
	n := len(starts)
	gaps := make([]time.Duration, 0, n)
	for i := 1; i < n; i++ {
		gaps = append(gaps, starts[i].Sub(starts[i-1]))
	}
	mu.Unlock()
	if n > 16 {
		t.Fatalf("%d attempts in 1.3 s of a task failing every time (gaps %v): its retries are not backing off", n, gaps)
	}
	if n < 4 {
		t.Fatalf("only %d attempts in 1.3 s (gaps %v)", n, gaps)
	}
	for i, g := range gaps {
		if want := taskRetryDelay(i + 1); g < want {
			t.Errorf("attempt %d came %v after the one before, want at least %v", i+2, g, want)
		}
	}

	// A success starts the count over.
	waitIdle("cut/v1")
	setFail(false)
	d.runTask("cut/v1", task)
	waitIdle("cut/v1")
	if n := failures("cut/v1"); n != 0 {
		t.Fatalf("after a success the task still counts %d failures", n)
	}

	// The counts of tasks no reconcile asks for any more are dropped.
	setFail(true)
	d.runTask("clone/r1", task)
	waitIdle("clone/r1")
	d.forgetTasksGone(map[string]bool{"clone/r1": true})
	if n := failures("clone/r1"); n != 1 {
		t.Fatalf("a task still asked for counts %d failures, want 1", n)
	}
	d.forgetTasksGone(map[string]bool{})
	if n := failures("clone/r1"); n != 0 {
		t.Fatalf("a task no longer asked for still counts %d failures", n)
	}
}
