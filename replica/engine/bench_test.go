package engine_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
// With load=writes, 4 writers of random 4 KiB writes run on the engine
// for the whole full rebuild (and 2 s before it, their baseline), as an
// attached volume's rebuild runs; it reports their rate and p99 latency
// during the rebuild beside the baseline. full-copy is the engine's own
// record of the copy (from its start to the target's last flush), full
// the control plane's (from ReplaceReplica to the replica recorded
// healthy), full-cpu the CPU time the whole cluster (this process) spent
// meanwhile, which a busy machine disturbs less than the wall time.
// STOR_BENCH_REBUILD_COPY=relay,target runs each case twice, one after the
// other: with every chunk relayed through the engine (Config.RebuildRelay)
// and copied by the target's server (the default); unset, the default
// alone. Run with -benchtime=1x.
func BenchmarkRebuild(b *testing.B) {
	type benchCase struct {
		size  int64
		load  bool
		shape rebuildShape
		copy  string
	}
	var cases []benchCase
	for _, c := range []benchCase{{size: 256 << 20}, {size: 1 << 30}, {size: 1 << 30, load: true}} {
		for _, c.shape = range rebuildShapes(b) {
			for _, c.copy = range rebuildCopies(b) {
				cases = append(cases, c)
			}
		}
	}
	for _, bc := range cases {
		size, shape := bc.size, bc.shape
		name := fmt.Sprintf("size=%dMiB", size>>20)
		if bc.load {
			name += "/load=writes"
		}
		if shape.name != "" {
			name += "/shape=" + shape.name
		}
		if bc.copy != "" {
			name += "/copy=" + bc.copy
		}
		b.Run(name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				// Every run starts with the page cache of the runs before
				// it written back, as the first run does.
				syscall.Sync()
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
				ecfg.RebuildInFlight, ecfg.RebuildChunkBytes = shape.inFlight, shape.chunk
				ecfg.RebuildRelay = bc.copy == "relay"
				// The engine's default, not servertest's 3 s for tests: a
				// 1 GiB fill can meet the kernel's dirty-page throttling,
				// which holds one write for seconds on a slow disk.
				ecfg.IOTimeout = 10 * time.Second
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

				var load *writeLoad
				if bc.load {
					load = startWriteLoad(e, size, 4)
					time.Sleep(2 * time.Second)
					load.mark()
				}
				// Full: move replica 0 to the server that holds none.
				stopProfile := profileRebuild(b)
				cpu0 := cpuTime(b)
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
				cpu := cpuTime(b) - cpu0
				stopProfile()
				if load != nil {
					base, during, p99base, p99 := load.stop(b)
					b.ReportMetric(base, "load-base-IOPS")
					b.ReportMetric(during, "load-IOPS")
					b.ReportMetric(float64(p99base.Microseconds())/1000, "load-base-p99-ms")
					b.ReportMetric(float64(p99.Microseconds())/1000, "load-p99-ms")
				}
				fullCopy, _ := rebuilds.last(b, fresh)
				b.ReportMetric(full.Seconds()/(float64(size)/(1<<30)), "full-s/GiB")
				b.ReportMetric(float64(full.Milliseconds()), "full-ms")
				b.ReportMetric(fullCopy.Seconds()/(float64(size)/(1<<30)), "full-copy-s/GiB")
				b.ReportMetric(cpu.Seconds()/(float64(size)/(1<<30)), "full-cpu-s/GiB")
				if bc.load {
					// The writes left every replica dirty all over: a
					// delta now copies them all, and says nothing.
					b.StartTimer()
					continue
				}

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
				// The leader starts the delta as soon as the replica's
				// server reports (its heartbeat); on a busy machine that
				// can be before the 8 writes are done, and the later ones
				// reach the returning replica as writes, not in the delta.
				rejoined := e.Generation() != faulted.Volume.Generation
				// The engine's own record of the rebuild gives its duration.
				waitState(b, c, v.Id, out, storpb.ReplicaState_REPLICA_STATE_HEALTHY, 5*time.Minute)
				delta, copied := rebuilds.last(b, out)
				switch {
				case rejoined:
					b.Logf("the replica rejoined while the 8 MiB were written; the delta copied %d bytes", copied)
				case copied < 8<<20:
					b.Fatalf("the delta copied %d bytes; the replica missed 8 MiB", copied)
				}
				b.ReportMetric(float64(copied)/(1<<20), "delta-copied-MiB")
				b.ReportMetric(float64(delta.Milliseconds()), "delta-8MiB-ms")
				b.StartTimer()
			}
		})
	}
}

// rebuildShape is a rebuild's copy shape (Config.RebuildInFlight and
// RebuildChunkBytes); zero is the defaults.
type rebuildShape struct {
	name     string
	inFlight int
	chunk    int64
}

// rebuildShapes are the shapes STOR_BENCH_REBUILD_SHAPES names, as
// "<in flight>x<chunk MiB>" separated by commas (e.g. "1x1,4x1,4x4"), or
// the defaults alone.
func rebuildShapes(b *testing.B) []rebuildShape {
	env := os.Getenv("STOR_BENCH_REBUILD_SHAPES")
	if env == "" {
		return []rebuildShape{{}}
	}
	var out []rebuildShape
	for _, f := range strings.Split(env, ",") {
		var s rebuildShape
		var mib int64
		if _, err := fmt.Sscanf(f, "%dx%d", &s.inFlight, &mib); err != nil {
			b.Fatalf("STOR_BENCH_REBUILD_SHAPES: %q: %v", f, err)
		}
		s.name, s.chunk = f, mib<<20
		out = append(out, s)
	}
	return out
}

// rebuildCopies are the ways of copying STOR_BENCH_REBUILD_COPY names
// ("relay", "target"), or "" (the default alone, unnamed).
func rebuildCopies(b *testing.B) []string {
	env := os.Getenv("STOR_BENCH_REBUILD_COPY")
	if env == "" {
		return []string{""}
	}
	out := strings.Split(env, ",")
	for _, c := range out {
		if c != "relay" && c != "target" {
			b.Fatalf("STOR_BENCH_REBUILD_COPY: %q: want relay or target", c)
		}
	}
	return out
}

// profileRebuild writes a CPU profile of the full rebuild alone (all of
// the cluster's processes are this one) to the file named by
// STOR_BENCH_REBUILD_PROFILE, if set, numbered by run; the returned
// function stops it.
func profileRebuild(b *testing.B) func() {
	name := os.Getenv("STOR_BENCH_REBUILD_PROFILE")
	if name == "" {
		return func() {}
	}
	profileRuns++
	f, err := os.Create(fmt.Sprintf("%s.%d", name, profileRuns))
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

var profileRuns int

// cpuTime is the CPU time (user and system) this process has used: the
// whole benchmark cluster's, since it all runs in this process.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// writeLoad runs writers of random 4 KiB writes on an engine and keeps
// their latencies, split at mark.
type writeLoad struct {
	stopped atomic.Bool
	marked  atomic.Int64 // time of mark, unix ns
	wg      sync.WaitGroup
	mu      sync.Mutex
	before  []time.Duration
	after   []time.Duration
	t0, t1  time.Time
	errs    []error
}

func startWriteLoad(e *engine.Engine, size int64, writers int) *writeLoad {
	l := &writeLoad{t0: time.Now()}
	for g := range writers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 11))
			buf := randomBytes(uint64(g)+100, 4096)
			for !l.stopped.Load() {
				t0 := time.Now()
				err := e.WriteAt(context.Background(), buf, rng.Int64N(size/4096)*4096, false)
				d := time.Since(t0)
				l.mu.Lock()
				if err != nil {
					l.errs = append(l.errs, err)
				} else if m := l.marked.Load(); m != 0 && t0.UnixNano() >= m {
					l.after = append(l.after, d)
				} else {
					l.before = append(l.before, d)
				}
				l.mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	return l
}

func (l *writeLoad) mark() {
	l.t1 = time.Now()
	l.marked.Store(l.t1.UnixNano())
}

// stop returns the writes' rate and p99 before and after mark.
func (l *writeLoad) stop(b *testing.B) (base, during float64, p99base, p99 time.Duration) {
	end := time.Now()
	l.stopped.Store(true)
	l.wg.Wait()
	if len(l.errs) > 0 {
		b.Fatalf("a write under load failed: %v", l.errs[0])
	}
	p := func(xs []time.Duration) time.Duration {
		if len(xs) == 0 {
			return 0
		}
		slices.Sort(xs)
		return xs[len(xs)*99/100]
	}
	return float64(len(l.before)) / l.t1.Sub(l.t0).Seconds(), float64(len(l.after)) / end.Sub(l.t1).Seconds(), p(l.before), p(l.after)
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
