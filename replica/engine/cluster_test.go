package engine_test

// Tests of the whole data path in one process: real stor-servers (Raft,
// replica stores on disk, the data service), the engine over the wire
// protocol. Faults are process faults (Kill), network cuts, and disk
// errors through the replica store's filesystem seam.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/errorfs"
)

const block = 4096

func createVol(t *testing.T, c *servertest.Cluster, name string, size uint64, replicas uint32) *storpb.Volume {
	t.Helper()
	resp, err := c.Dial().Volumes.CreateVolume(ctx10(t), &storpb.CreateVolumeRequest{Name: name, SizeBytes: size, ReplicaCount: replicas})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Volume
}

// ledger records, per block, the last acknowledged content (a seed), so a
// test can check every acknowledged write reads back.
type ledger struct {
	mu    sync.Mutex
	acked map[int64]uint64 // block -> seed of the acknowledged write
}

func blockData(seed uint64) []byte { return randomBytes(seed, block) }

// writer writes self-identifying blocks at random offsets until stop,
// recording what was acknowledged. Failed writes are not recorded; the
// test fails if one fails unless tolerate returns true.
func writer(t *testing.T, e *engine.Engine, blocks int64, seed uint64, l *ledger, stop <-chan struct{}, tolerate func(error) bool) <-chan int {
	done := make(chan int, 1)
	go func() {
		rng := rand.New(rand.NewPCG(seed, 1))
		n := 0
		defer func() { done <- n }()
		for i := uint64(0); ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			b := rng.Int64N(blocks)
			s := seed<<32 | i
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			err := e.WriteAt(ctx, blockData(s), b*block, false)
			cancel()
			if err != nil {
				if tolerate == nil || !tolerate(err) {
					t.Errorf("write %d at block %d: %v", i, b, err)
				}
				return
			}
			l.mu.Lock()
			l.acked[b] = s
			l.mu.Unlock()
			n++
		}
	}()
	return done
}

func (l *ledger) verify(t *testing.T, e *engine.Engine) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	got := make([]byte, block)
	for b, s := range l.acked {
		if err := e.ReadAt(ctx10(t), got, b*block); err != nil {
			t.Fatalf("read block %d: %v", b, err)
		}
		if !bytes.Equal(got, blockData(s)) {
			t.Fatalf("block %d does not hold its acknowledged write", b)
		}
	}
}

// requireIdentical waits until every replica is healthy, then compares
// their checksums.
func requireIdentical(t *testing.T, c *servertest.Cluster, volumeID string, within time.Duration) {
	t.Helper()
	waitAllHealthy(t, c, volumeID, within)
	sums := c.Checksums(volumeID)
	for _, d := range sums {
		if d.Err != nil {
			t.Fatalf("checksum %s: %v", d.Replica.Id, d.Err)
		}
		if d.SHA256 != sums[0].SHA256 {
			t.Fatalf("replica %s on %s differs from %s: %s vs %s", d.Replica.Id, d.Replica.ServerId, sums[0].Replica.Id, d.SHA256, sums[0].SHA256)
		}
	}
}

// waitAllHealthy waits until the volume has its replica count of replicas,
// all healthy.
func waitAllHealthy(t *testing.T, c *servertest.Cluster, volumeID string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v, err := c.Dial().Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}})
		if err != nil {
			t.Fatal(err)
		}
		healthy := 0
		for _, r := range v.Volume.Replicas {
			if r.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				healthy++
			}
		}
		if healthy == int(v.Volume.ReplicaCount) && len(v.Volume.Replicas) == healthy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas not all healthy within %v: %v", within, v.Volume.Replicas)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestDataPathWriteReadFlushAcrossReplicas(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	v := createVol(t, c, "v", 32<<20, 3)
	e := c.OpenEngine(c.EngineConfig("v", "node-1"))
	l := &ledger{acked: map[int64]uint64{}}
	stop := make(chan struct{})
	done := writer(t, e, 32<<20/block, 1, l, stop, nil)
	time.Sleep(500 * time.Millisecond)
	close(stop)
	if n := <-done; n == 0 {
		t.Fatal("no write was acknowledged")
	}
	// A 1 MiB write and WRITE_ZEROES / TRIM ranges.
	big := randomBytes(2, 1<<20)
	if err := e.WriteAt(ctx10(t), big, 16<<20, true); err != nil {
		t.Fatal(err)
	}
	if err := e.WriteZeroes(ctx10(t), 16<<20, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Trim(ctx10(t), 16<<20+512<<10, 64<<10); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), big...)
	clear(want[:64<<10])
	clear(want[512<<10 : 576<<10])
	got := make([]byte, 1<<20)
	if err := e.ReadAt(ctx10(t), got, 16<<20); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("1 MiB region after zeroes and trim: %v", err)
	}
	l.mu.Lock()
	for b := range l.acked { // the big write replaced these
		if b*block >= 16<<20 && b*block < 17<<20 {
			delete(l.acked, b)
		}
	}
	l.mu.Unlock()
	l.verify(t, e)
	requireIdentical(t, c, v.Id, 10*time.Second)
}

func TestReplicaServerKilledDuringWritesIsRebuilt(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	v := createVol(t, c, "v", 16<<20, 3)
	e := c.OpenEngine(c.EngineConfig("v", "client"))
	l := &ledger{acked: map[int64]uint64{}}
	stop := make(chan struct{})
	done := writer(t, e, 16<<20/block, 3, l, stop, nil)

	time.Sleep(300 * time.Millisecond)
	// Kill a server holding a replica (not the leader: failover is tested
	// elsewhere; here the replica is the fault).
	leader := c.Leader(10 * time.Second)
	victim := -1
	for i, n := range c.Nodes {
		if i != leader && n.ID != "" {
			for _, r := range v.Replicas {
				if r.ServerId == n.ID {
					victim = i
				}
			}
		}
	}
	c.Kill(victim)
	time.Sleep(1500 * time.Millisecond) // writes go on with two replicas
	l.mu.Lock()
	before := len(l.acked)
	l.mu.Unlock()
	c.Start(victim)
	time.Sleep(500 * time.Millisecond)
	close(stop)
	n := <-done
	if n == 0 || len(l.acked) <= before/2 {
		t.Fatalf("writes did not continue through the fault: %d acknowledged", n)
	}
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	l.verify(t, e)
	requireIdentical(t, c, v.Id, 30*time.Second)
}

func TestDiskErrorOnOneReplicaMakesItFaulty(t *testing.T) {
	var bad *errorfs.FS
	c := servertest.NewCluster(t, servertest.Options{Configure: func(i int, cfg *server.Config) {
		if i == 2 {
			bad = errorfs.New(replica.OS(), 1)
			cfg.ReplicaFS = bad
		}
	}})
	v := createVol(t, c, "v", 8<<20, 3)
	e := c.OpenEngine(c.EngineConfig("v", "client"))
	if err := e.WriteAt(ctx10(t), randomBytes(4, 64<<10), 0, false); err != nil {
		t.Fatal(err)
	}
	bad.Add(errorfs.Rule{Ops: errorfs.OpWrite}) // every write fails with EIO
	data := randomBytes(5, 64<<10)
	if err := e.WriteAt(ctx10(t), data, 1<<20, false); err != nil {
		t.Fatalf("write with one replica's disk failing: %v", err)
	}
	got := make([]byte, len(data))
	if err := e.ReadAt(ctx10(t), got, 1<<20); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	resp, err := c.Dial().Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range resp.Volume.Replicas {
		want := storpb.ReplicaState_REPLICA_STATE_HEALTHY
		if r.ServerId == c.Nodes[2].ID {
			want = storpb.ReplicaState_REPLICA_STATE_FAULTY
		}
		// The failing replica may already be rebuilding again (its server
		// is up); it must not be healthy while its disk fails.
		if r.State != want && !(want == storpb.ReplicaState_REPLICA_STATE_FAULTY && r.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING) {
			t.Fatalf("replica on %s is %v, want %v", r.ServerId, r.State, want)
		}
	}
	// The disk recovers: the replica is rebuilt and identical.
	bad.Reset()
	requireIdentical(t, c, v.Id, 30*time.Second)
}

func TestEngineCrashThenReopenReconciles(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	v := createVol(t, c, "v", 16<<20, 3)
	cfg := c.EngineConfig("v", "client")
	a, err := engine.Open(ctx10(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	l := &ledger{acked: map[int64]uint64{}}
	stop := make(chan struct{})
	done := writer(t, a, 16<<20/block, 6, l, stop, nil)
	time.Sleep(300 * time.Millisecond)
	if err := a.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	// Crash: writes are in flight and nothing more is flushed or closed.
	var inflight sync.WaitGroup
	crash, cancelInflight := context.WithCancel(context.Background())
	for i := range 32 {
		inflight.Add(1)
		go func() {
			defer inflight.Done()
			_ = a.WriteAt(crash, randomBytes(uint64(1000+i), 64<<10), int64(i)*(256<<10), false)
		}()
	}
	time.Sleep(5 * time.Millisecond)
	cancelInflight()
	close(stop)
	<-done
	inflight.Wait()

	cfg.Takeover = true
	b := c.OpenEngine(cfg) // a new epoch; reconciles dirty regions first
	// The in-flight writes are indeterminate; acknowledged ones outside
	// their ranges must read back.
	l.mu.Lock()
	for blk := range l.acked {
		if blk*block < 32*(256<<10) && (blk*block)%(256<<10) < 64<<10 {
			delete(l.acked, blk)
		}
	}
	l.mu.Unlock()
	l.verify(t, b)
	if err := b.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	requireIdentical(t, c, v.Id, 10*time.Second)
	// The crashed engine is fenced.
	if err := a.WriteAt(ctx10(t), make([]byte, block), 0, false); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("crashed engine writes after a new open: %v", err)
	}
}

func TestFencedEnginePartitionedFromTheLeader(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	v := createVol(t, c, "v", 8<<20, 3)
	cfgA := c.EngineConfig("v", "node-a")
	cfgA.Control.Volumes = blindVolumes{cfgA.Control.Volumes} // A never hears of B's attach
	a := c.OpenEngine(cfgA)
	if err := a.WriteAt(ctx10(t), blockData(7), 0, false); err != nil {
		t.Fatal(err)
	}
	cfgB := c.EngineConfig("v", "node-b")
	cfgB.Takeover = true
	b := c.OpenEngine(cfgB)
	if err := b.WriteAt(ctx10(t), blockData(8), 0, false); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		err := a.WriteAt(ctx10(t), blockData(uint64(100+i)), int64(i)*block, false)
		if !errors.Is(err, engine.ErrFenced) {
			t.Fatalf("write %d from the fenced engine: %v, want ErrFenced", i, err)
		}
	}
	got := make([]byte, block)
	if err := b.ReadAt(ctx10(t), got, 0); err != nil || !bytes.Equal(got, blockData(8)) {
		t.Fatalf("the new engine's write was overwritten (%v)", err)
	}
	if err := b.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	requireIdentical(t, c, v.Id, 10*time.Second)
	for i := 1; i < 10; i++ { // nothing of A's refused writes landed anywhere
		if err := b.ReadAt(ctx10(t), got, int64(i)*block); err != nil || !bytes.Equal(got, make([]byte, block)) {
			t.Fatalf("block %d holds data from the fenced engine", i)
		}
	}
	if resp, _ := c.Dial().Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}}); resp.GetVolume().GetGeneration() != 1 {
		t.Fatalf("the fenced engine changed the replica set: %v", resp.GetVolume())
	}
	_ = fmt.Sprint()
}

func TestDetachedVolumeReplicaIsRebuiltByTheServer(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour // only the test moves replicas
	}})
	v := createVol(t, c, "v", 8<<20, 3)
	cfg := c.EngineConfig("v", "client")
	e, err := engine.Open(ctx10(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(21, 4<<20)
	if err := e.WriteAt(ctx10(t), data, 2<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(ctx10(t), true); err != nil { // flush and detach
		t.Fatal(err)
	}
	cl := c.Dial()
	moved, err := cl.Volumes.ReplaceReplica(ctx10(t), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id})
	if err != nil {
		t.Fatal(err)
	}
	if moved.Volume.Attachment != nil {
		t.Fatal("volume still attached")
	}
	// No engine runs: the new replica's server copies it.
	requireIdentical(t, c, v.Id, 30*time.Second)

	// A delta: one replica misses a write made while it was marked
	// faulty; it is rebuilt by whoever holds the volume when the leader
	// starts the rebuild (the engine, or after the detach its server).
	e2, err := engine.Open(ctx10(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := cl.Volumes.GetVolume(ctx10(t), &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	if err != nil {
		t.Fatal(err)
	}
	out := cur.Volume.Replicas[1].Id
	if _, err := cl.Volumes.SetReplicaState(ctx10(t), &storpb.SetReplicaStateRequest{VolumeId: v.Id, ReplicaId: out,
		State: storpb.ReplicaState_REPLICA_STATE_FAULTY, Epoch: e2.Epoch(), Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the engine learns of the fault from its watch
	if err := e2.WriteAt(ctx10(t), randomBytes(22, 64<<10), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := e2.Close(ctx10(t), true); err != nil {
		t.Fatal(err)
	}
	requireIdentical(t, c, v.Id, 30*time.Second)
}

func TestReplicaMovedWhileAttachedIsFullyRebuilt(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
		cfg.Raft.ReplaceAfter = time.Hour
	}})
	v := createVol(t, c, "v", 16<<20, 3)
	e := c.OpenEngine(c.EngineConfig("v", "client"))
	if copied, left := e.RebuildProgress(); copied != 0 || left != 0 {
		t.Fatalf("RebuildProgress before any rebuild: %d copied, %d left", copied, left)
	}
	l := &ledger{acked: map[int64]uint64{}}
	stop := make(chan struct{})
	done := writer(t, e, 16<<20/block, 40, l, stop, nil)
	time.Sleep(300 * time.Millisecond)
	moved, err := c.Dial().Volumes.ReplaceReplica(ctx10(t), &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range moved.Volume.Replicas {
		if r.ServerId == v.Replicas[0].ServerId {
			t.Fatalf("the new replica is on the server it left")
		}
	}
	time.Sleep(500 * time.Millisecond) // writes go on during the full rebuild
	close(stop)
	<-done
	if err := e.Flush(ctx10(t)); err != nil {
		t.Fatal(err)
	}
	l.verify(t, e)
	requireIdentical(t, c, v.Id, 30*time.Second)
	// The full rebuild copied the allocated blocks (every block written
	// was allocated on the source) and has nothing left.
	if copied, left := e.RebuildProgress(); copied < block || left != 0 {
		t.Fatalf("RebuildProgress after the rebuild: %d copied, %d left; want the written blocks copied, none left", copied, left)
	}
}
