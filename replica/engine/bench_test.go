package engine_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
)

// The engine benchmarks run a real in-process cluster (replica stores on
// the machine's disk, the data protocol over loopback TCP) and measure a
// 1-replica and a 3-replica volume in the same run, so their ratio is
// meaningful on a noisy machine. See docs/BENCHMARKS.md for the commands.

const benchVolSize = 256 << 20

func benchEngines(b *testing.B) (*servertest.Cluster, map[int]*engine.Engine) {
	c := servertest.NewCluster(b, servertest.Options{})
	engines := map[int]*engine.Engine{}
	for _, n := range []int{1, 3} {
		name := fmt.Sprintf("bench-%d", n)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if _, err := c.Dial().Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: benchVolSize, ReplicaCount: uint32(n)}); err != nil {
			b.Fatal(err)
		}
		cancel()
		engines[n] = c.OpenEngine(c.EngineConfig(name, "bench"))
		// Fill it so reads hit data and the dirty-region log is warm.
		buf := randomBytes(uint64(n), 1<<20)
		for off := int64(0); off < benchVolSize; off += 1 << 20 {
			if err := engines[n].WriteAt(context.Background(), buf, off, false); err != nil {
				b.Fatal(err)
			}
		}
		if err := engines[n].Flush(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	return c, engines
}

// runQD issues b.N requests from qd goroutines and reports IOPS and the
// latency percentiles.
func runQD(b *testing.B, qd int, op func(rng *rand.Rand, buf []byte) error, size int) {
	var next atomic.Int64
	lats := make([][]time.Duration, qd)
	b.SetBytes(int64(size))
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for g := range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			buf := randomBytes(uint64(g), size)
			for next.Add(1) <= int64(b.N) {
				t0 := time.Now()
				if err := op(rng, buf); err != nil {
					b.Error(err)
					return
				}
				lats[g] = append(lats[g], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	all := slices.Concat(lats...)
	slices.Sort(all)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "IOPS")
	if len(all) > 0 {
		b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-us")
		b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-us")
	}
}

func BenchmarkEngine(b *testing.B) {
	_, engines := benchEngines(b)
	ctx := context.Background()
	blocks := int64(benchVolSize / 4096)
	for _, n := range []int{1, 3} {
		e := engines[n]
		b.Run(fmt.Sprintf("replicas=%d/randwrite-4k-qd32", n), func(b *testing.B) {
			runQD(b, 32, func(rng *rand.Rand, buf []byte) error {
				return e.WriteAt(ctx, buf, rng.Int64N(blocks)*4096, false)
			}, 4096)
		})
		b.Run(fmt.Sprintf("replicas=%d/randread-4k-qd32", n), func(b *testing.B) {
			runQD(b, 32, func(rng *rand.Rand, buf []byte) error {
				return e.ReadAt(ctx, buf, rng.Int64N(blocks)*4096)
			}, 4096)
		})
		b.Run(fmt.Sprintf("replicas=%d/write-4k-qd1", n), func(b *testing.B) {
			runQD(b, 1, func(rng *rand.Rand, buf []byte) error {
				return e.WriteAt(ctx, buf, rng.Int64N(blocks)*4096, false)
			}, 4096)
		})
		var seq atomic.Int64
		b.Run(fmt.Sprintf("replicas=%d/seqwrite-1m-qd1", n), func(b *testing.B) {
			runQD(b, 1, func(_ *rand.Rand, buf []byte) error {
				off := seq.Add(1<<20) % benchVolSize
				return e.WriteAt(ctx, buf, off, false)
			}, 1<<20)
		})
		b.Run(fmt.Sprintf("replicas=%d/seqread-1m-qd1", n), func(b *testing.B) {
			runQD(b, 1, func(_ *rand.Rand, buf []byte) error {
				off := seq.Add(1<<20) % benchVolSize
				return e.ReadAt(ctx, buf, off)
			}, 1<<20)
		})
	}
}

// waitState polls a replica until it reaches state, returning when.
func waitState(b *testing.B, c *servertest.Cluster, volumeID, replicaID string, state storpb.ReplicaState, within time.Duration) time.Time {
	deadline := time.Now().Add(within)
	cl := c.Dial()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}})
		cancel()
		if err == nil {
			for _, r := range resp.Volume.Replicas {
				if r.Id == replicaID && r.State == state {
					return time.Now()
				}
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("replica %s not %v within %v", replicaID, state, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// BenchmarkRebuild measures, for full volumes of two sizes: a full
// rebuild (a replica moved to a new server) in seconds per GiB, and a
// delta rebuild after 8 MiB were written while one replica was out. The
// delta must cost about the same at both sizes: it copies the regions
// written while the replica was out plus the regions the returning
// replica itself still marks dirty (writes not yet two flushes old).
// Run with -benchtime=1x.
func BenchmarkRebuild(b *testing.B) {
	for _, size := range []int64{256 << 20, 1 << 30} {
		b.Run(fmt.Sprintf("size=%dMiB", size>>20), func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				c := servertest.NewCluster(b, servertest.Options{Servers: 4, Configure: func(i int, cfg *server.Config) {
					cfg.Raft.ReplaceAfter = time.Hour // only the benchmark moves replicas
				}})
				cl := c.Dial()
				ctx := context.Background()
				resp, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "r", SizeBytes: uint64(size), ReplicaCount: 3})
				if err != nil {
					b.Fatal(err)
				}
				v := resp.Volume
				ecfg := c.EngineConfig("r", "bench")
				rebuilds := &rebuildLog{}
				ecfg.Logger = slog.New(rebuilds)
				e := c.OpenEngine(ecfg)
				buf := randomBytes(9, 1<<20)
				for off := int64(0); off < size; off += 1 << 20 {
					if err := e.WriteAt(ctx, buf, off, false); err != nil {
						b.Fatal(err)
					}
				}
				// Two flushes, as a filesystem's periodic commits would do:
				// a replica clears a dirty region once a write there is two
				// flushes old, and a delta also copies the returning
				// replica's own dirty regions.
				for range 2 {
					if err := e.Flush(ctx); err != nil {
						b.Fatal(err)
					}
				}

				// Full: move replica 0 to the server that holds none.
				start := time.Now()
				moved, err := cl.Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: &storpb.VolumeRef{Id: v.Id}, ReplicaId: v.Replicas[0].Id})
				if err != nil {
					b.Fatal(err)
				}
				var fresh string
				for _, r := range moved.Volume.Replicas {
					if r.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
						fresh = r.Id
					}
				}
				full := waitState(b, c, v.Id, fresh, storpb.ReplicaState_REPLICA_STATE_HEALTHY, 5*time.Minute).Sub(start)

				// Delta: replica 1 is out while 8 MiB are written, then returns.
				out := v.Replicas[1].Id
				faulted, err := cl.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{VolumeId: v.Id, ReplicaId: out,
					State: storpb.ReplicaState_REPLICA_STATE_FAULTY, Epoch: e.Epoch(), Reason: "benchmark"})
				if err != nil {
					b.Fatal(err)
				}
				// The writes below must miss the replica: wait until the
				// engine has applied the fault (its watch delivers it).
				for deadline := time.Now().Add(5 * time.Second); e.Generation() < faulted.Volume.Generation; time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						b.Fatal("the engine did not learn of the fault")
					}
				}
				rng := rand.New(rand.NewPCG(1, 2))
				for range 8 {
					if err := e.WriteAt(ctx, buf, rng.Int64N(size>>20)<<20, false); err != nil {
						b.Fatal(err)
					}
				}
				// The leader starts the delta (its server reports); the
				// engine's own record of the rebuild gives its duration.
				waitState(b, c, v.Id, out, storpb.ReplicaState_REPLICA_STATE_HEALTHY, 5*time.Minute)
				delta, copied := rebuilds.last(b, out)
				if copied < 8<<20 {
					b.Fatalf("the delta copied %d bytes; the replica missed 8 MiB", copied)
				}
				b.ReportMetric(float64(copied)/(1<<20), "delta-copied-MiB")

				b.ReportMetric(full.Seconds()/(float64(size)/(1<<30)), "full-s/GiB")
				b.ReportMetric(float64(full.Milliseconds()), "full-ms")
				b.ReportMetric(float64(delta.Milliseconds()), "delta-8MiB-ms")
				b.StartTimer()
			}
		})
	}
}

// rebuildLog is a slog.Handler that keeps the engine's "rebuild complete"
// records (replica, took, bytes).
type rebuildLog struct {
	mu   sync.Mutex
	done map[string][2]int64 // replica -> {took ns, bytes}
}

func (h *rebuildLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *rebuildLog) WithGroup(string) slog.Handler            { return h }
func (h *rebuildLog) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrLog{h: h, attrs: as}
}
func (h *rebuildLog) Handle(_ context.Context, r slog.Record) error {
	return (&attrLog{h: h}).Handle(context.Background(), r)
}

type attrLog struct {
	h     *rebuildLog
	attrs []slog.Attr
}

func (a *attrLog) Enabled(context.Context, slog.Level) bool { return true }
func (a *attrLog) WithGroup(string) slog.Handler            { return a }
func (a *attrLog) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrLog{h: a.h, attrs: append(append([]slog.Attr(nil), a.attrs...), as...)}
}
func (a *attrLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "rebuild complete" {
		return nil
	}
	var replicaID string
	var took, bytes int64
	visit := func(at slog.Attr) bool {
		switch at.Key {
		case "replica":
			replicaID = at.Value.String()
		case "took":
			took = int64(at.Value.Duration())
		case "bytes":
			bytes = at.Value.Int64()
		}
		return true
	}
	for _, at := range a.attrs {
		visit(at)
	}
	r.Attrs(visit)
	a.h.mu.Lock()
	defer a.h.mu.Unlock()
	if a.h.done == nil {
		a.h.done = map[string][2]int64{}
	}
	a.h.done[replicaID] = [2]int64{took, bytes}
	return nil
}

// last returns the duration and bytes of the replica's rebuild; the
// engine logs it just after the control plane recorded the replica
// healthy, so it waits a little for the record.
func (h *rebuildLog) last(b *testing.B, replicaID string) (time.Duration, int64) {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		h.mu.Lock()
		d, ok := h.done[replicaID]
		h.mu.Unlock()
		if ok {
			return time.Duration(d[0]), d[1]
		}
	}
	b.Fatalf("no rebuild of %s was recorded by the engine", replicaID)
	return 0, 0
}

// BenchmarkEngineLocalReads compares reads of two 3-replica volumes of the
// same cluster, one read through the servers and one with short-circuit
// reads (every server is on this host), alternating between them per
// sub-benchmark, so the A/B shares the machine's load.
func BenchmarkEngineLocalReads(b *testing.B) {
	c := servertest.NewCluster(b, servertest.Options{LocalSockets: true})
	engines := map[string]*engine.Engine{}
	for _, mode := range []string{"server", "local"} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if _, err := c.Dial().Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: mode, SizeBytes: benchVolSize, ReplicaCount: 3}); err != nil {
			b.Fatal(err)
		}
		cancel()
		cfg := c.EngineConfig(mode, "bench")
		if mode == "local" {
			cfg.LocalReaders = c.LocalReaders(0, 1, 2)
		}
		e := c.OpenEngine(cfg)
		buf := randomBytes(3, 1<<20)
		for off := int64(0); off < benchVolSize; off += 1 << 20 {
			if err := e.WriteAt(context.Background(), buf, off, false); err != nil {
				b.Fatal(err)
			}
		}
		engines[mode] = e
	}
	ctx := context.Background()
	blocks := int64(benchVolSize / 4096)
	for _, w := range []string{"randread-4k-qd32", "randread-4k-qd1", "seqread-1m-qd8"} {
		for _, mode := range []string{"server", "local"} {
			e := engines[mode]
			var seq atomic.Int64
			b.Run(w+"/"+mode, func(b *testing.B) {
				before := e.ShortCircuitReads()
				switch w {
				case "randread-4k-qd32", "randread-4k-qd1":
					qd := 32
					if w == "randread-4k-qd1" {
						qd = 1
					}
					runQD(b, qd, func(rng *rand.Rand, buf []byte) error {
						return e.ReadAt(ctx, buf, rng.Int64N(blocks)*4096)
					}, 4096)
				default:
					runQD(b, 8, func(_ *rand.Rand, buf []byte) error {
						return e.ReadAt(ctx, buf, seq.Add(1<<20)%benchVolSize)
					}, 1<<20)
				}
				direct := e.ShortCircuitReads() - before
				if mode == "local" && direct < int64(b.N) {
					b.Fatalf("%d of %d reads went direct", direct, b.N)
				}
				if mode == "server" && direct != 0 {
					b.Fatalf("%d reads went direct without local readers", direct)
				}
			})
		}
	}
}
