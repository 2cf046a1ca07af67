package engine_test

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// delayedFaults delays the engine's fault reports for one replica: the
// first by a little (so that a second failing request is queued behind it
// on faultMu), the second until the replica has come back and rejoined the
// engine's write set as a new incarnation (as happens when the reconciler's
// REBUILDING commit lands while the second report is queued or in flight).
type delayedFaults struct {
	storpb.VolumeServiceClient
	target    string
	rejoined  func() bool
	afterOne  func()
	calls     atomic.Int32
	mu        sync.Mutex
	stateSeen []storpb.ReplicaState // the target's state just before each report
}

func (v *delayedFaults) SetReplicaState(ctx context.Context, in *storpb.SetReplicaStateRequest, opts ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	if in.ReplicaId != v.target || in.State != storpb.ReplicaState_REPLICA_STATE_FAULTY {
		return v.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
	}
	switch v.calls.Add(1) {
	case 1:
		time.Sleep(300 * time.Millisecond)
	case 2:
		deadline := time.Now().Add(10 * time.Second)
		for !v.rejoined() && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
	if g, err := v.VolumeServiceClient.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: in.VolumeId}}); err == nil {
		for _, r := range g.Volume.Replicas {
			if r.Id == v.target {
				v.mu.Lock()
				v.stateSeen = append(v.stateSeen, r.State)
				v.mu.Unlock()
			}
		}
	}
	resp, err := v.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
	if v.calls.Load() == 1 && v.afterOne != nil {
		v.afterOne()
	}
	return resp, err
}

// Two writes fail on the same (current) incarnation of replica 2 at once:
// both pass settle's current() check, then queue on markFaulty's faultMu.
// The first records the replica faulty; it comes back REBUILDING as a new
// incarnation; the second report, decided on the old incarnation, then
// recorded the NEW incarnation faulty (found by review): current() was
// checked before the report was serialised. markFaulty now checks it
// under faultMu and before every attempt; only a report already sent can
// still land on a new incarnation (the report names only the replica id).
func TestAQueuedFaultReportDoesNotThrowOutTheNewIncarnation(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 15 * time.Second
	log := &joinLog{}
	cfg.Logger = slog.New(log)
	target := f.replica(2)
	vols := &delayedFaults{VolumeServiceClient: f.client.Volumes, target: target.id,
		rejoined: func() bool { return log.joins(target.id) > 0 },
		afterOne: func() {
			target.mu.Lock()
			target.failIO = false // the replica's server is fine again; it may rejoin
			target.mu.Unlock()
		}}
	cfg.Control.Volumes = vols
	e := f.open(cfg)

	holdWrites(target)
	defer release(target)
	w1, w2 := randomBytes(1, 4096), randomBytes(2, 4096)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 2)
	go func() { done <- e.WriteAt(ctx, w1, 0, false) }()
	go func() { done <- e.WriteAt(ctx, w2, 1<<20, false) }()
	waitFor(t, "both writes held in replica 2", func() bool {
		return f.replica(0).snapshot()[0] == w1[0] && f.replica(0).snapshot()[1<<20] == w2[0] &&
			f.replica(1).snapshot()[0] == w1[0] && f.replica(1).snapshot()[1<<20] == w2[0]
	})
	target.mu.Lock()
	target.failIO = true // both held writes now fail on incarnation 1, which is current
	target.mu.Unlock()
	release(target)
	for range 2 {
		if err := recv(t, "write", done); err != nil {
			t.Fatalf("write: %v", err)
		}
	}
	vols.mu.Lock()
	seen := append([]storpb.ReplicaState(nil), vols.stateSeen...)
	vols.mu.Unlock()
	t.Logf("fault reports for replica 2: %d; its state just before each: %v; joins: %d", vols.calls.Load(), seen, log.joins(target.id))
	if len(seen) >= 2 && seen[1] == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		t.Fatalf("the new incarnation of replica 2 (REBUILDING, rejoined) was recorded faulty by a report decided on the old incarnation's failure")
	}
}

// A rebuild whose SOURCE leaves the write set mid-rebuild (recorded faulty,
// its server down) stops without blame, and nothing started it again (found
// by review): the source's fault event reached startRebuilds while the
// failed rebuild still ran (rebuilding[id] set), and the target stayed
// REBUILDING with no rebuild running until some unrelated change of the
// volume (with the source's server down: ReplaceAfter, 10 min by default).
// retryJoins now starts, every second, the rebuilds that are not running.
func TestARebuildWhoseSourceLeftIsRestarted(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	cfg.IOTimeout = 5 * time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	e := f.open(cfg)
	target := f.replica(2)
	// The source is the healthy replica with the lowest id (readSet order).
	si := 0
	if f.vol.Replicas[1].Id < f.vol.Replicas[0].Id {
		si = 1
	}
	src := f.replica(si)
	node := -1
	for j, n := range f.cluster.Nodes {
		if n.ID == f.vol.Replicas[si].ServerId {
			node = j
		}
	}
	if node < 0 {
		t.Fatal("no node for the source")
	}
	// Replica 2 is recorded faulty through a failed write and comes back;
	// its rebuild is held at BeginRebuild.
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(7, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	begin := target.gates.shut("BeginRebuild")
	target.mu.Lock()
	target.failIO = false
	target.mu.Unlock()
	if begin.count(1, 10*time.Second) != 1 {
		t.Fatal("the rebuild of replica 2 did not start")
	}
	// The source's server goes down and the source is recorded faulty
	// (as the engine's own write path would, or the reconciler).
	f.cluster.Stop(node)
	src.mu.Lock()
	src.failIO = true
	src.mu.Unlock()
	ctx := ctx10(t)
	if _, err := f.client.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{VolumeId: f.vol.Id, ReplicaId: src.id,
		State: storpb.ReplicaState_REPLICA_STATE_FAULTY, Epoch: e.Epoch(), Reason: "test: source down"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the engine sees it on its watch and drops the source
	target.gates.open("BeginRebuild")
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if f.volume().Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("replica 2 is still %v 8 s after its rebuild's source left (the other replica is healthy and could serve): no rebuild restarted; chunks copied into it: %d",
		f.volume().Replicas[2].State, target.chunksCopied())
}

// An engine opens a replica again only from a view newer than the one it
// left the write set in. A stale view (a watch event from before the
// fault, retryJoins' last view) showing it REBUILDING at its old
// generation would open it as the old incarnation again, which its server
// does not order after the writes the old connection may still carry
// (wire's doc, "Incarnations"): they would land on the rebuilt replica.
// Found by a review of the incarnation order.
func TestAStaleViewDoesNotReopenAReplicaAsItsOldIncarnation(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	var mu sync.Mutex
	var opens []wire.OpenRequest
	inner := cfg.Connect
	cfg.Connect = func(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
		mu.Lock()
		opens = append(opens, open)
		mu.Unlock()
		return inner(ctx, addr, open)
	}
	e := f.open(cfg)
	before := f.volume()
	target := f.replica(2)
	old := before.Replicas[2].Generation
	// Replica 2 fails a write and is recorded faulty; it stays unreachable,
	// so the engine cannot open it again meanwhile.
	target.mu.Lock()
	target.failIO = true
	target.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(7, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	if g := f.volume().Replicas[2].Generation; g <= old {
		t.Fatalf("replica 2 is at generation %d after its fault, as before it (%d)", g, old)
	}
	mu.Lock()
	n := len(opens)
	mu.Unlock()
	stale := proto.Clone(before).(*storpb.Volume)
	stale.Replicas[2].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	engine.AddNewReplicas(e, stale)
	mu.Lock()
	defer mu.Unlock()
	for _, o := range opens[n:] {
		if o.Replica == target.id && o.Incarnation <= old {
			t.Fatalf("the engine opened replica 2 as incarnation %d from a view older than its fault (it left at a later generation)", o.Incarnation)
		}
	}
}
