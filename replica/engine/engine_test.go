package engine_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
)

const volSize = 8 << 20

type fixture struct {
	t       *testing.T
	cluster *servertest.Cluster
	client  *client.Client
	mem     *memReplicas
	vol     *storpb.Volume
}

func newFixture(t *testing.T) *fixture {
	c := servertest.NewCluster(t, servertest.Options{})
	cl := c.Dial()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "vol", SizeBytes: volSize, ReplicaCount: 3})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, cluster: c, client: cl, mem: newMemReplicas(volSize), vol: resp.Volume}
}

func (f *fixture) config(node string) engine.Config {
	return engine.Config{
		Volume: "vol", NodeID: node,
		Control: engine.ControlPlane{Volumes: f.client.Volumes, Cluster: f.client.Cluster},
		Connect: f.mem.connect, IOTimeout: 2 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

func (f *fixture) open(cfg engine.Config) *engine.Engine {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := engine.Open(ctx, cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { e.Close(context.Background(), false) })
	return e
}

func (f *fixture) replica(i int) *memReplica { return f.mem.get(f.vol.Replicas[i].Id) }

func (f *fixture) volume() *storpb.Volume {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := f.client.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: f.vol.Id}})
	if err != nil {
		f.t.Fatal(err)
	}
	return resp.Volume
}

func ctx10(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

func TestWritesReachEveryReplicaAndReadBack(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if e.Epoch() != 1 || e.Size() != volSize {
		t.Fatalf("epoch %d size %d", e.Epoch(), e.Size())
	}
	data := randomBytes(1, 64<<10)
	if err := e.WriteAt(ctx10(t), data, 4096*3, false); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if got := f.replica(i).snapshot()[4096*3 : 4096*3+len(data)]; !bytes.Equal(got, data) {
			t.Fatalf("replica %d does not hold the acknowledged write", i)
		}
	}
	got := make([]byte, len(data))
	if err := e.ReadAt(ctx10(t), got, 4096*3); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v, equal %v", err, bytes.Equal(got, data))
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if f.replica(i).flushes == 0 {
			t.Fatalf("replica %d was not flushed", i)
		}
	}
}

func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	cases := []struct {
		name string
		call func() error
	}{
		{"write past the end", func() error { return e.WriteAt(ctx10(t), make([]byte, 4096), volSize-2048, false) }},
		{"write at the end", func() error { return e.WriteAt(ctx10(t), make([]byte, 512), volSize, false) }},
		{"negative offset", func() error { return e.WriteAt(ctx10(t), make([]byte, 512), -512, false) }},
		{"misaligned offset", func() error { return e.WriteAt(ctx10(t), make([]byte, 512), 100, false) }},
		{"misaligned length", func() error { return e.WriteAt(ctx10(t), make([]byte, 100), 0, false) }},
		{"read past the end", func() error { return e.ReadAt(ctx10(t), make([]byte, 8192), volSize-4096) }},
		{"negative zeroes", func() error { return e.WriteZeroes(ctx10(t), 0, -4096, false) }},
		{"trim past the end", func() error { return e.Trim(ctx10(t), volSize-4096, 8192) }},
	}
	for _, tc := range cases {
		if err := tc.call(); !errors.Is(err, replica.ErrInvalid) {
			t.Errorf("%s: got %v, want replica.ErrInvalid", tc.name, err)
		}
	}
	for i := range 3 {
		if w := f.replica(i).writes; w != 0 {
			t.Fatalf("replica %d saw %d writes from refused requests", i, w)
		}
	}
	if v := f.volume(); v.Generation != 1 {
		t.Fatalf("bad input changed the replica set: generation %d", v.Generation)
	}
}

// gatedVolumes holds SetReplicaState until released, as if the leader
// were unreachable.
type gatedVolumes struct {
	storpb.VolumeServiceClient
	mu      sync.Mutex
	gate    chan struct{}
	entered chan struct{}
}

func (g *gatedVolumes) SetReplicaState(ctx context.Context, in *storpb.SetReplicaStateRequest, opts ...grpc.CallOption) (*storpb.SetReplicaStateResponse, error) {
	g.mu.Lock()
	gate := g.gate
	g.mu.Unlock()
	if gate != nil {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.VolumeServiceClient.SetReplicaState(ctx, in, opts...)
}

func TestAckRuleCommitsTheFaultBeforeAcknowledging(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	gated := &gatedVolumes{VolumeServiceClient: f.client.Volumes, entered: make(chan struct{}, 1)}
	cfg.Control.Volumes = gated
	e := f.open(cfg)

	// Replica 2 starts failing, and the control plane is unreachable.
	gated.mu.Lock()
	gated.gate = make(chan struct{})
	gated.mu.Unlock()
	f.replica(2).mu.Lock()
	f.replica(2).failIO = true
	f.replica(2).mu.Unlock()

	data := randomBytes(2, 4096)
	done := make(chan error, 1)
	go func() { done <- e.WriteAt(ctx10(t), data, 0, false) }()
	<-gated.entered
	select {
	case err := <-done:
		t.Fatalf("write returned (%v) before the fault was committed", err)
	case <-time.After(300 * time.Millisecond):
	}
	if v := f.volume(); v.Replicas[2].State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		t.Fatalf("replica marked %v while the control plane was unreachable", v.Replicas[2].State)
	}
	close(gated.gate)
	if err := <-done; err != nil {
		t.Fatalf("write after the fault was committed: %v", err)
	}
	v := f.volume()
	if v.Replicas[2].State != storpb.ReplicaState_REPLICA_STATE_FAULTY || v.Generation != 2 {
		t.Fatalf("after the ack: replica 2 %v, generation %d", v.Replicas[2].State, v.Generation)
	}
	// The two healthy replicas hold the write; later writes skip the faulty one.
	for i := range 2 {
		if !bytes.Equal(f.replica(i).snapshot()[:4096], data) {
			t.Fatalf("healthy replica %d lacks the acknowledged write", i)
		}
	}
	before := f.replica(2).writes
	if err := e.WriteAt(ctx10(t), data, 8192, false); err != nil {
		t.Fatal(err)
	}
	if f.replica(2).writes != before {
		t.Fatal("a faulty replica still receives writes")
	}
}

func TestLastHealthyReplicaFailingFailsTheWrite(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	for i := range 3 {
		f.replica(i).mu.Lock()
		f.replica(i).failIO = true
		f.replica(i).mu.Unlock()
	}
	err := e.WriteAt(ctx10(t), make([]byte, 4096), 0, false)
	if !errors.Is(err, engine.ErrIO) {
		t.Fatalf("all replicas failing: %v, want ErrIO", err)
	}
	healthy := 0
	for _, r := range f.volume().Replicas {
		if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			healthy++
		}
	}
	if healthy != 1 {
		t.Fatalf("%d healthy replicas left, want exactly 1 (the last copy is never marked faulty)", healthy)
	}
	// The replicas may now differ: the engine serves nothing more.
	for i := range 3 {
		f.replica(i).mu.Lock()
		f.replica(i).failIO = false
		f.replica(i).mu.Unlock()
	}
	if err := e.ReadAt(ctx10(t), make([]byte, 4096), 0); !errors.Is(err, engine.ErrIO) {
		t.Fatalf("read after the last healthy replica failed: %v, want ErrIO", err)
	}
}

// blindVolumes never delivers watch events, as if the engine's node were
// partitioned from the control plane.
type blindVolumes struct{ storpb.VolumeServiceClient }

func (blindVolumes) WatchVolume(ctx context.Context, in *storpb.WatchVolumeRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[storpb.VolumeEvent], error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func TestNewerAttachFencesTheOldEngine(t *testing.T) {
	f := newFixture(t)
	cfgA := f.config("node-a")
	cfgA.Control.Volumes = blindVolumes{f.client.Volumes} // A never hears of B
	a := f.open(cfgA)
	if err := a.WriteAt(ctx10(t), randomBytes(3, 4096), 0, false); err != nil {
		t.Fatal(err)
	}
	cfgB := f.config("node-b")
	cfgB.Takeover = true
	b := f.open(cfgB)
	if b.Epoch() != a.Epoch()+1 {
		t.Fatalf("epochs a=%d b=%d", a.Epoch(), b.Epoch())
	}
	bData := randomBytes(4, 4096)
	if err := b.WriteAt(ctx10(t), bData, 0, false); err != nil {
		t.Fatal(err)
	}
	err := a.WriteAt(ctx10(t), randomBytes(5, 4096), 0, false)
	if !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("old engine's write: %v, want ErrFenced", err)
	}
	if err := a.Flush(ctx10(t)); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("old engine's flush: %v, want ErrFenced", err)
	}
	for i := range 3 {
		r := f.replica(i)
		if !bytes.Equal(r.snapshot()[:4096], bData) {
			t.Fatalf("replica %d does not hold the new engine's write", i)
		}
		r.mu.Lock()
		for j, ep := range r.accepted {
			if j > 0 && ep < r.accepted[j-1] {
				t.Fatalf("replica %d accepted epoch %d after epoch %d", i, ep, r.accepted[j-1])
			}
		}
		r.mu.Unlock()
	}
	// The fenced engine did not mark any replica faulty.
	if v := f.volume(); v.Generation != 1 {
		t.Fatalf("generation %d: the fenced engine changed the replica set", v.Generation)
	}
}

func TestOpenReconcilesDirtyRegions(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	base := randomBytes(6, 2<<20)
	if err := e.WriteAt(ctx10(t), base, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	// An unclean stop mid-write: replica 1 got a write the others did not.
	r1 := f.replica(1)
	r1.mu.Lock()
	copy(r1.data[1<<20:], randomBytes(7, 4096))
	r1.dirty[1<<20] = true
	r1.mu.Unlock()

	e2 := f.open(func() engine.Config { c := f.config("n1"); c.Takeover = true; return c }())
	a, b, c := f.replica(0).snapshot(), f.replica(1).snapshot(), f.replica(2).snapshot()
	if !bytes.Equal(a, b) || !bytes.Equal(b, c) {
		t.Fatal("replicas differ after the reconciling open")
	}
	got := make([]byte, 2<<20)
	if err := e2.ReadAt(ctx10(t), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:1<<20], base[:1<<20]) || !bytes.Equal(got[1<<20+4096:], base[1<<20+4096:]) {
		t.Fatal("reconcile changed data outside the dirty region")
	}
}

func TestReadFailsOverToAnotherReplica(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	data := randomBytes(8, 4096)
	if err := e.WriteAt(ctx10(t), data, 0, false); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		f.replica(i).mu.Lock()
		f.replica(i).failIO = true
		f.replica(i).mu.Unlock()
	}
	got := make([]byte, 4096)
	if err := e.ReadAt(ctx10(t), got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read with two failing replicas: %v", err)
	}
}

func TestEngineFollowsExpansion(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if _, err := f.client.Volumes.ExpandVolume(ctx10(t), &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: f.vol.Id}, SizeBytes: 2 * volSize}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for e.Size() != 2*volSize {
		if time.Now().After(deadline) {
			t.Fatalf("engine size %d after expansion", e.Size())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := e.WriteAt(ctx10(t), make([]byte, 4096), 2*volSize-4096, false); err != nil {
		t.Fatalf("write in the grown space: %v", err)
	}
}

func TestFaultyReplicaIsRebuiltWhileWritesGoOn(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	if err := e.WriteAt(ctx10(t), randomBytes(10, 2<<20), 0, false); err != nil {
		t.Fatal(err)
	}
	// Replica 2 fails a write: the engine records it faulty and goes on.
	r2 := f.replica(2)
	r2.mu.Lock()
	r2.failIO = true
	r2.mu.Unlock()
	if err := e.WriteAt(ctx10(t), randomBytes(11, 4096), 1<<20, false); err != nil {
		t.Fatal(err)
	}
	missed := randomBytes(12, 64<<10) // written while replica 2 is out
	if err := e.WriteAt(ctx10(t), missed, 3<<20, false); err != nil {
		t.Fatal(err)
	}
	// Its server is up, so the leader starts a delta rebuild; the engine
	// drives it while a writer keeps writing.
	r2.mu.Lock()
	r2.failIO = false
	r2.mu.Unlock()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := uint64(0); ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			off := int64(i%128) * 4096 * 4 // below 2 MiB: never over the missed range
			if err := e.WriteAt(context.Background(), randomBytes(100+i, 4096), off, false); err != nil {
				t.Errorf("write during rebuild: %v", err)
				return
			}
		}
	}()
	deadline := time.Now().Add(15 * time.Second)
	for {
		v := f.volume()
		if v.Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica 2 not healthy again: %v", v.Replicas[2])
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	a, b, c := f.replica(0).snapshot(), f.replica(1).snapshot(), f.replica(2).snapshot()
	if !bytes.Equal(a, b) || !bytes.Equal(a, c) {
		t.Fatal("replicas differ after the rebuild")
	}
	if !bytes.Equal(c[3<<20:3<<20+len(missed)], missed) {
		t.Fatal("the rebuilt replica lacks a write made while it was out")
	}
	r2.mu.Lock()
	defer r2.mu.Unlock()
	if r2.rebuilds == 0 {
		t.Fatal("no rebuild ran")
	}
	// A delta copies the regions written while it was out, not the volume.
	if copied := r2.rebuildOps + r2.copies; copied == 0 || copied > 8 {
		t.Fatalf("delta rebuild copied %d chunks; want a few regions' worth", copied)
	}
}

func TestReadsPreferTheLocalReplica(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("n1")
	local := f.vol.Replicas[1]
	cfg.LocalServerID = local.ServerId
	e := f.open(cfg)
	for i := range 20 {
		if err := e.ReadAt(ctx10(t), make([]byte, 4096), int64(i)*4096); err != nil {
			t.Fatal(err)
		}
	}
	for i, r := range f.vol.Replicas {
		got := f.mem.get(r.Id)
		got.mu.Lock()
		reads := got.reads
		got.mu.Unlock()
		want := 0
		if r.Id == local.Id {
			want = 20
		}
		if reads != want {
			t.Fatalf("replica %d (%s) served %d reads, want %d: reads go to the local replica", i, r.ServerId, reads, want)
		}
	}
}

func TestFlushWaitsForWritesThatBeganBeforeIt(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	slow := f.replica(2)
	slow.mu.Lock()
	slow.hold = make(chan struct{})
	slow.mu.Unlock()
	wrote := make(chan error, 1)
	go func() { wrote <- e.WriteAt(ctx10(t), randomBytes(50, 4096), 0, false) }()
	time.Sleep(50 * time.Millisecond) // the write reaches replicas 0 and 1, waits on 2
	flushed := make(chan error, 1)
	go func() { flushed <- e.Flush(ctx10(t)) }()
	select {
	case err := <-flushed:
		t.Fatalf("flush returned (%v) while a write that began before it was still unanswered by a replica", err)
	case <-time.After(300 * time.Millisecond):
	}
	for i := range 3 {
		f.replica(i).mu.Lock()
		n := f.replica(i).flushes
		f.replica(i).mu.Unlock()
		if n != 0 {
			t.Fatalf("replica %d was sent a flush before the earlier write was answered everywhere", i)
		}
	}
	slow.mu.Lock()
	close(slow.hold)
	slow.hold = nil
	slow.mu.Unlock()
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if err := <-flushed; err != nil {
		t.Fatal(err)
	}
}

func TestCallerCancellationDoesNotLeaveReplicasDifferent(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1")) // IOTimeout 2s
	stuck := f.replica(2)
	stuck.mu.Lock()
	stuck.hold = make(chan struct{}) // never released: replica 2 stops answering
	stuck.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	data := randomBytes(51, 4096)
	done := make(chan error, 1)
	go func() { done <- e.WriteAt(ctx, data, 8192, false) }()
	time.Sleep(50 * time.Millisecond)
	cancel() // the caller gives up while replica 2 has not answered
	if err := <-done; err != nil {
		t.Fatalf("write: %v (it reached two replicas; the third timed out and must be recorded faulty)", err)
	}
	// Replicas 0 and 1 hold the write; replica 2, which does not, is out.
	if v := f.volume(); v.Replicas[2].State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
		t.Fatal("a replica that missed a write is still healthy")
	}
	for i := range 2 {
		if !bytes.Equal(f.replica(i).snapshot()[8192:8192+4096], data) {
			t.Fatalf("replica %d lacks the write", i)
		}
	}
	stuck.mu.Lock()
	close(stuck.hold)
	stuck.hold = nil
	stuck.mu.Unlock()
}

// An engine stops serving when a write fails on the last healthy replica
// (which the control plane refuses to record faulty) after a rebuilding
// replica took it: the replicas may differ, and the next open reconciles
// their dirty regions. Its rebuild of that replica went on, flushed the
// target (clearing the failed write's dirty region there) and recorded it
// HEALTHY: a healthy replica holding a write its source never took, with
// nothing left to reconcile it by. A broken engine now flushes nothing,
// and its rebuild records nothing.
func TestABrokenEnginesRebuildFlushesAndRecordsNothing(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	v := f.volume()
	state := func(i int, st storpb.ReplicaState) {
		t.Helper()
		if _, err := f.client.Volumes.SetReplicaState(ctx10(t), &storpb.SetReplicaStateRequest{
			VolumeId: v.Id, ReplicaId: v.Replicas[i].Id, State: st, Epoch: v.Epoch,
		}); err != nil {
			t.Fatal(err)
		}
	}
	// Replica 0 is the last healthy one; replica 2 starts rebuilding, held
	// at its BeginRebuild.
	target := f.replica(2)
	begin := target.gates.shut("BeginRebuild")
	state(1, storpb.ReplicaState_REPLICA_STATE_FAULTY)
	state(2, storpb.ReplicaState_REPLICA_STATE_FAULTY)
	state(2, storpb.ReplicaState_REPLICA_STATE_REBUILDING)
	select {
	case <-begin.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the engine did not start rebuilding replica 2")
	}
	// A write the last healthy replica fails: the engine stops.
	f.replica(0).mu.Lock()
	f.replica(0).failIO = true
	f.replica(0).mu.Unlock()
	if err := e.WriteAt(ctx10(t), bytes.Repeat([]byte{0xd3}, 4096), 0, false); !errors.Is(err, engine.ErrIO) {
		t.Fatalf("a write the last healthy replica failed: %v, want ErrIO", err)
	}
	f.replica(0).mu.Lock()
	f.replica(0).failIO = false
	f.replica(0).mu.Unlock()
	target.mu.Lock()
	flushes := target.flushes
	target.mu.Unlock()

	// The rebuild goes on from its BeginRebuild.
	target.gates.open("BeginRebuild")
	time.Sleep(2 * time.Second)
	if got := f.volume().Replicas[2].State; got != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		t.Errorf("the broken engine's rebuild left replica 2 %v, want REBUILDING", got)
	}
	target.mu.Lock()
	if target.flushes != flushes {
		t.Errorf("the broken engine flushed the rebuilding replica %d times", target.flushes-flushes)
	}
	target.mu.Unlock()
	// Nor does it start the rebuild again (the engine retries rebuilds
	// every second): each attempt would copy and be refused its flush.
	again := target.gates.shut("BeginRebuild")
	defer target.gates.open("BeginRebuild")
	select {
	case <-again.entered:
		t.Error("the broken engine started another rebuild of replica 2")
	case <-time.After(3 * time.Second):
	}
}
