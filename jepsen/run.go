package jepsen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

// RunConfig is one Jepsen run.
type RunConfig struct {
	// Seed drives every random choice of the schedule and the workload
	// (the timing of real processes is not reproducible; the choices are).
	Seed uint64
	// Duration of the faulty phase. Default 60s.
	Duration time.Duration
	// Nemeses to mix (names from Nemeses). Default all; empty slice with
	// NoFaults for none.
	Nemeses  []string
	NoFaults bool
	// Workers are concurrent logical clients. Default 6.
	Workers int
	// Blocks is the number of registers. Default 16.
	Blocks int
	// ColdBlocks of the registers (the last ones of the first Blocks) are
	// cold: the workers read them but never write them; the rebuild
	// nemeses write them while a replica is away, so that a rebuild that
	// skips what a replica missed during an earlier absence leaves a value
	// no later write covers (every hot register is written every second);
	// flush-storm writes them too, for a replica a kill left behind.
	// Default 2; -1 for none.
	ColdBlocks int
	// FillBytes of filler are written after each register's block, in
	// the rest of its 1 MiB stride, before the workload starts, so that a
	// rebuild (full or delta: a written register's whole region) copies
	// about a MiB per register and lasts long enough for the rebuild
	// nemeses to hit it. Default 1 MiB - 4 KiB (the whole stride); -1
	// for none.
	FillBytes int
	// Pace: each worker waits up to this long between operations.
	// Default 20ms.
	Pace time.Duration
	// Broken is a BrokenModes key (the "harness can fail" tests).
	Broken string
	// NoClones leaves clones out of the snapshot workload. The broken-mode
	// tests set it: a clone of a snapshot whose recorded cut was never
	// made can never be filled, and would hold the run for 90 s.
	NoClones bool
	// NoLocalReads runs without short-circuit reads: by default each
	// client host shares a machine with a server and reads its replica
	// directly (ClusterConfig.LocalReads).
	NoLocalReads bool
	// Dir receives the data dirs, logs, history and report.
	Dir string
	// ServerBin, SelfBin: see ClusterConfig.
	ServerBin, SelfBin string
	// Logf reports progress (t.Logf).
	Logf func(format string, args ...any)
}

// Report is what a run found.
type Report struct {
	Seed     uint64                    `json:"seed"`
	Duration string                    `json:"duration"`
	Nemeses  []string                  `json:"nemeses"`
	Broken   string                    `json:"broken,omitempty"`
	Ops      map[string]map[string]int `json:"ops"`    // kind -> ok/failed -> count
	Faults   map[string]int            `json:"faults"` // nemesis -> injections
	// FaultHits counts the faults of the compound nemeses that landed in
	// the window they aim at (a kill while the replica was REBUILDING,
	// several flushes in flight, ...), by what they hit; a nemesis whose
	// aim can miss says here how often it did not.
	FaultHits    map[string]int `json:"fault_hits,omitempty"`
	FaultErrors  int            `json:"fault_errors"`
	Anomalies    Anomalies      `json:"anomalies"`
	Availability float64        `json:"availability"` // fraction of seconds with an acknowledged write
	// SnapshotsChecked counts the ready snapshots whose contents were read
	// back from their replicas and checked.
	SnapshotsChecked int `json:"snapshots_checked"`
	// ClonesChecked counts the clones of those read back and checked.
	ClonesChecked int `json:"clones_checked"`
	// SnapshotsLost counts the snapshots seen ready whose every copy went
	// with replicas that left the volume, a loss the control plane
	// recorded (failed, LOST entries): a reported limitation, not an
	// anomaly (checkSnapshotLosses).
	SnapshotsLost int    `json:"snapshots_lost"`
	Dir           string `json:"dir"`
}

// Passed reports whether every checker found nothing.
func (r *Report) Passed() bool { return r.Anomalies.Total() == 0 && r.Anomalies.Unknown == 0 }

// Summary is the short human form of the report.
func (r *Report) Summary() string {
	var b strings.Builder
	verdict := "PASS"
	if !r.Passed() {
		verdict = "FAIL"
	}
	fmt.Fprintf(&b, "jepsen %s seed=%d duration=%s broken=%q availability=%.3f snapshots-checked=%d clones-checked=%d snapshots-lost=%d\n",
		verdict, r.Seed, r.Duration, r.Broken, r.Availability, r.SnapshotsChecked, r.ClonesChecked, r.SnapshotsLost)
	for _, k := range slices.Sorted(maps.Keys(r.Ops)) {
		fmt.Fprintf(&b, "  ops %-10s ok=%d failed=%d\n", k, r.Ops[k]["ok"], r.Ops[k]["failed"])
	}
	for _, k := range slices.Sorted(maps.Keys(r.Faults)) {
		fmt.Fprintf(&b, "  fault %-26s %d\n", k, r.Faults[k])
	}
	for _, k := range slices.Sorted(maps.Keys(r.FaultHits)) {
		fmt.Fprintf(&b, "  hit   %-60s %d\n", k, r.FaultHits[k])
	}
	a := r.Anomalies
	fmt.Fprintf(&b, "  anomalies linearizability=%d durability=%d integrity=%d fencing=%d expansion=%d snapshot=%d divergence=%d unknown=%d\n",
		a.Linearizability, a.Durability, a.Integrity, a.Fencing, a.Expansion, a.Snapshot, a.Divergence, a.Unknown)
	for i, d := range a.Details {
		if i == 20 {
			fmt.Fprintf(&b, "  ... %d more in report.json\n", len(a.Details)-20)
			break
		}
		fmt.Fprintf(&b, "  ! %s\n", d)
	}
	fmt.Fprintf(&b, "  output: %s\n", r.Dir)
	return b.String()
}

type runner struct {
	cfg   RunConfig
	c     *Cluster
	start time.Time
	rng   *rand.Rand // the schedule's; only the nemesis goroutine uses it
	ids   atomic.Uint64
	// blocks is the number of registers; online expansion adds one.
	blocks atomic.Int64
	// expansionFailures counts expansions the engine never served.
	expansionFailures atomic.Int64
	// held keeps the workers from reopening the engine while a nemesis
	// holds the volume detached (see detach.go).
	held atomic.Bool
	// copyPerBlock is how long the last rebuild-writes copy took per
	// register stride (0: none measured yet); only the nemesis goroutine
	// uses it.
	copyPerBlock time.Duration
	// looks counts the looks at the replicas after a reconcile (Op.Round
	// of reconcile-read); only the nemesis goroutine uses it.
	looks int

	volumeID string

	mu        sync.Mutex // guards the fields below
	history   []Op
	snaps     []*snapOp
	clones    []*cloneOp
	activeI   int
	reopening map[*ClientHost]bool
	lastOpen  map[*ClientHost]time.Time // a worker's last reopen attempt
	hits      map[string]int            // see Report.FaultHits

	staleWG sync.WaitGroup
}

func (r *runner) now() int64 { return int64(time.Since(r.start)) }

func (r *runner) record(o Op) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.history = append(r.history, o)
}

// hit counts a fault that landed where its nemesis aimed it (see
// Report.FaultHits).
func (r *runner) hit(what string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hits[what]++
}

func (r *runner) activeIdx() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.activeI
}

func (r *runner) active() *ClientHost { return r.c.Clients[r.activeIdx()] }

func (r *runner) setActive(ch *ClientHost) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.c.Clients {
		if x == ch {
			r.activeI = i
		}
	}
}

// pickServer returns the leader, or a random server.
func (r *runner) pickServer(ctx context.Context, rng *rand.Rand, leader bool) (*Server, error) {
	if !leader {
		return r.c.Servers[rng.IntN(len(r.c.Servers))], nil
	}
	if l := r.c.Leader(ctx); l != nil {
		return l, nil
	}
	return nil, errNoLeader
}

// reopen opens the volume on ch (starting its process if needed) and
// records the open; concurrent reopens of one host collapse into one.
func (r *runner) reopen(ctx context.Context, ch *ClientHost) error {
	r.mu.Lock()
	if r.reopening[ch] {
		r.mu.Unlock()
		return errReopening
	}
	r.reopening[ch] = true
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.reopening, ch)
		r.mu.Unlock()
	}()
	call := r.now()
	epoch, err := r.c.Open(ctx, ch)
	o := Op{Client: -1, Host: ch.Name, Kind: "open", Epoch: epoch, Call: call, Return: r.now(), OK: err == nil}
	if err != nil {
		o.Err = err.Error()
	}
	r.record(o)
	return err
}

var errReopening = errors.New("jepsen: a reopen of this host is already in progress")

// opTimeout bounds one workload request; a write still unanswered then is
// indeterminate.
const opTimeout = 15 * time.Second

// do runs one register operation on ch and records it.
func (r *runner) do(ctx context.Context, client int, ch *ClientHost, kind string, block int) Op {
	return r.doConn(ctx, client, ch, kind, block, 0)
}

// doConn is do over NBD connection conn of the client process (0: the
// engine directly; see nbdConns).
func (r *runner) doConn(ctx context.Context, client int, ch *ClientHost, kind string, block, conn int) Op {
	s, epoch := ch.Session()
	o := Op{Client: client, Host: ch.Name, Epoch: epoch, Kind: kind, Block: block}
	req := Request{Op: kind, TimeoutMS: int(opTimeout / time.Millisecond), Conn: conn}
	switch kind {
	case "write":
		o.Value = r.ids.Add(1)
		req.Off, req.Data = int64(block)*blockStride, encodeValue(o.Value, block, r.cfg.Seed)
	case "read", "final-read":
		req.Op, req.Off, req.Len = "read", int64(block)*blockStride, BlockSize
	}
	o.Call = r.now()
	if s == nil {
		o.Return, o.Err = r.now(), "no client process"
		r.record(o)
		return o
	}
	cctx, cancel := context.WithTimeout(ctx, opTimeout+5*time.Second)
	resp, err := s.Call(cctx, req)
	cancel()
	o.Return = r.now()
	switch {
	case err != nil:
		o.Err = err.Error()
	case !resp.OK:
		o.Err = resp.Kind + ": " + resp.Err
		o.Epoch = resp.Epoch
	default:
		o.OK, o.Epoch = true, resp.Epoch
		if req.Op == "read" {
			o.decode(resp.Data, r.cfg.Seed)
		}
	}
	r.record(o)
	return o
}

// worker issues random operations on the active client host until ctx ends.
func (r *runner) worker(ctx context.Context, id int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(id)))
	for ctx.Err() == nil {
		ch := r.active()
		kind := "read"
		switch p := rng.IntN(100); {
		case p < 50:
			kind = "write"
		case p < 55:
			kind = "flush"
		}
		b := rng.IntN(int(r.blocks.Load()))
		if kind == "write" && r.cold(b) {
			kind = "read"
		}
		o := r.do(ctx, id, ch, kind, b)
		// A short pause between operations keeps each block's history
		// small enough for the linearizability check to finish.
		sleep(ctx, time.Duration(rng.IntN(int(r.cfg.Pace)+1)))
		if !o.OK {
			// The engine may have stopped (fenced by a takeover that
			// made another host active, killed, or out of replicas):
			// reopen it if this host is still the active one.
			if r.active() == ch && ctx.Err() == nil && needsReopen(o.Err) && !r.held.Load() && r.reopenDue(ch) {
				_ = r.reopen(ctx, ch)
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(50+rng.IntN(200)) * time.Millisecond):
			}
		}
	}
}

// cold reports whether register b is cold (see RunConfig.ColdBlocks).
func (r *runner) cold(b int) bool {
	return r.cfg.ColdBlocks > 0 && b >= r.cfg.Blocks-r.cfg.ColdBlocks && b < r.cfg.Blocks
}

// writeCold writes every cold register once through the active engine
// and says how many writes were acknowledged.
func (r *runner) writeCold(ctx context.Context) int {
	n := 0
	for b := range r.cfg.Blocks {
		if r.cold(b) && r.do(ctx, r.cfg.Workers+1, r.active(), "write", b).OK {
			n++
		}
	}
	return n
}

// wroteSince reports whether a write to a block other than except was
// acknowledged after t.
func (r *runner) wroteSince(t int64, except int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range r.history {
		if o.Kind == "write" && o.OK && o.Block != except && o.Call > t {
			return true
		}
	}
	return false
}

// reopenDue rate-limits the workers' reopens of one host to one a second.
func (r *runner) reopenDue(ch *ClientHost) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.lastOpen[ch]) < time.Second {
		return false
	}
	r.lastOpen[ch] = time.Now()
	return true
}

func needsReopen(err string) bool {
	for _, k := range []string{"fenced:", "io:", "closed:", "no client process", "error: client: no engine", errClientDead.Error()} {
		if strings.HasPrefix(err, k) || strings.Contains(err, k) {
			return true
		}
	}
	return false
}

// staleWrites keeps the old engine on ch writing for a few seconds after
// a takeover (the fencing case); the checkers judge what it got. It
// leaves the cold registers alone, as the workers do: a write the fence
// refused may or may not have landed as far as the checkers know, so a
// cold register with one is no longer checked on the replicas
// (checkReplicasHoldLastWrite), and a takeover made every later check
// of them in the run empty.
func (r *runner) staleWrites(ch *ClientHost) {
	r.staleWG.Add(1)
	go func() {
		defer r.staleWG.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		for _, b := range staleBlocks(int(r.blocks.Load()), r.cold) {
			if ctx.Err() != nil {
				return
			}
			r.do(ctx, r.cfg.Workers, ch, "write", b)
		}
	}()
}

// staleWrite is how many writes staleWrites makes at most.
const staleWrite = 30

// staleBlocks are the registers staleWrites writes, in order: the
// registers that are not cold, round and round, staleWrite in all.
func staleBlocks(blocks int, cold func(int) bool) []int {
	var hot []int
	for b := range blocks {
		if !cold(b) {
			hot = append(hot, b)
		}
	}
	var out []int
	for i := 0; len(hot) > 0 && i < staleWrite; i++ {
		out = append(out, hot[i%len(hot)])
	}
	return out
}

// Run runs one Jepsen run: start the cluster, run the workload under the
// nemesis schedule for cfg.Duration, heal, fully restart, read everything
// back, check, and write the report. The error is for a harness failure;
// anomalies are in the report.
func Run(ctx context.Context, cfg RunConfig) (*Report, error) {
	if cfg.Duration == 0 {
		cfg.Duration = 60 * time.Second
	}
	if cfg.Workers == 0 {
		cfg.Workers = 6
	}
	if cfg.Blocks == 0 {
		cfg.Blocks = 16
	}
	if cfg.ColdBlocks == 0 {
		cfg.ColdBlocks = 2
	}
	cfg.ColdBlocks = min(cfg.ColdBlocks, cfg.Blocks/2)
	if cfg.FillBytes == 0 {
		cfg.FillBytes = blockStride - BlockSize
	}
	if cfg.Broken != "" {
		if _, ok := BrokenModes[cfg.Broken]; !ok {
			return nil, fmt.Errorf("jepsen: unknown broken mode %q", cfg.Broken)
		}
	}
	if cfg.Pace == 0 {
		cfg.Pace = 20 * time.Millisecond
	}
	if cfg.Nemeses == nil && !cfg.NoFaults {
		cfg.Nemeses = DefaultNemeses()
	}
	for _, n := range cfg.Nemeses {
		if Nemeses[n] == nil {
			return nil, fmt.Errorf("jepsen: unknown nemesis %q (have %s)", n, strings.Join(DefaultNemeses(), ", "))
		}
	}
	logf := cfg.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	logf("jepsen: seed %d, %v, nemeses %s, broken %q, output %s", cfg.Seed, cfg.Duration, strings.Join(cfg.Nemeses, ","), cfg.Broken, cfg.Dir)

	// A run replayed into the same directory (the same seed, the same
	// JEPSEN_OUT) must not start from the last one's servers' data: the
	// volume, created by name, would be the old one, with the old run's
	// values (the same op ids) in it.
	if err := os.RemoveAll(filepath.Join(cfg.Dir, "data")); err != nil {
		return nil, err
	}
	c, err := StartCluster(ctx, ClusterConfig{Servers: 3, Clients: 2, ServerBin: cfg.ServerBin, SelfBin: cfg.SelfBin,
		Dir: filepath.Join(cfg.Dir, "data"), Broken: cfg.Broken, ServerEnv: BrokenModes[cfg.Broken].ServerEnv, LocalReads: !cfg.NoLocalReads})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	vol, err := c.Control.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{
		Name: c.Volume, SizeBytes: uint64(cfg.Blocks) * blockStride, ReplicaCount: 3})
	if err != nil {
		return nil, err
	}
	r := &runner{cfg: cfg, c: c, volumeID: vol.Volume.Id, start: time.Now(), rng: rand.New(rand.NewPCG(cfg.Seed, 0x6a657073656e)),
		reopening: map[*ClientHost]bool{}, lastOpen: map[*ClientHost]time.Time{}, hits: map[string]int{}}
	r.blocks.Store(int64(cfg.Blocks))
	if err := r.reopen(ctx, c.Clients[0]); err != nil {
		return nil, err
	}
	if err := r.fill(ctx, c.Clients[0]); err != nil {
		return nil, err
	}

	report := &Report{Seed: cfg.Seed, Nemeses: cfg.Nemeses, Broken: cfg.Broken, Faults: map[string]int{}, Dir: cfg.Dir}
	wctx, stopWorkers := context.WithTimeout(ctx, cfg.Duration)
	var wg sync.WaitGroup
	for i := range cfg.Workers {
		wg.Add(1)
		go func() { defer wg.Done(); r.worker(wctx, i, cfg.Seed+uint64(i)*7919) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); r.snapshotter(wctx, cfg.Seed) }()
	// The schedule: quiet 1-3 s, one fault held 2-6 s, heal; repeat.
	for wctx.Err() == nil && len(cfg.Nemeses) > 0 {
		sleep(wctx, time.Duration(1000+r.rng.IntN(2000))*time.Millisecond)
		if wctx.Err() != nil {
			break
		}
		n := Nemeses[cfg.Nemeses[r.rng.IntN(len(cfg.Nemeses))]]
		hold := time.Duration(2000+r.rng.IntN(4000)) * time.Millisecond
		desc, err := n.Inject(ctx, r, r.rng)
		if err != nil {
			report.FaultErrors++
			logf("jepsen: %v %s: not injected: %v", time.Since(r.start).Round(time.Millisecond), n.Name(), err)
			continue
		}
		report.Faults[n.Name()]++
		logf("jepsen: %v %s: %s (for %v)", time.Since(r.start).Round(time.Millisecond), n.Name(), desc, hold)
		sleep(wctx, hold)
		if err := n.Heal(ctx, r); err != nil {
			report.FaultErrors++
			logf("jepsen: heal %s: %v", n.Name(), err)
		}
	}
	<-wctx.Done()
	stopWorkers()
	wg.Wait()
	r.staleWG.Wait()

	// Heal everything, let the cluster settle, flush, then a full restart
	// (every server and the engine killed -9) and read every block back.
	if err := r.healAll(ctx); err != nil {
		return nil, fmt.Errorf("healing: %w", err)
	}
	if err := c.WaitHealthy(ctx, 90*time.Second); err != nil {
		return nil, fmt.Errorf("after healing: %w", err)
	}
	final := c.Clients[0]
	if err := r.retryOpen(ctx, final); err != nil {
		return nil, fmt.Errorf("after healing: %w", err)
	}
	r.setActive(final)
	for i := 0; i < 5 && !r.do(ctx, 0, final, "flush", 0).OK; i++ {
		sleep(ctx, time.Second)
	}
	for _, ch := range c.Clients {
		c.KillClient(ch)
	}
	for _, s := range c.Servers {
		s.Proc.Kill()
	}
	for _, s := range c.Servers {
		if err := s.Proc.Start(false); err != nil {
			return nil, err
		}
	}
	if err := c.WaitHealthy(ctx, 90*time.Second); err != nil {
		return nil, fmt.Errorf("after the full restart: %w", err)
	}
	if err := r.retryOpen(ctx, final); err != nil {
		return nil, fmt.Errorf("after the full restart: %w", err)
	}
	for b := range int(r.blocks.Load()) {
		for i := 0; i < 5 && !r.do(ctx, 0, final, "final-read", b).OK; i++ {
			sleep(ctx, time.Second)
		}
	}
	if err := r.readReplicas(ctx); err != nil {
		return nil, fmt.Errorf("after the full restart: %w", err)
	}
	if err := r.readSnapshots(ctx); err != nil {
		return nil, fmt.Errorf("after the full restart: %w", err)
	}
	report.Duration = time.Since(r.start).Round(time.Second).String()
	r.mu.Lock()
	report.FaultHits = maps.Clone(r.hits)
	r.mu.Unlock()
	return r.check(report)
}

// fill writes cfg.FillBytes of filler after every register's block
// through the engine on ch (see RunConfig.FillBytes).
func (r *runner) fill(ctx context.Context, ch *ClientHost) error {
	if r.cfg.FillBytes <= 0 {
		return nil
	}
	s, _ := ch.Session()
	if s == nil {
		return errors.New("jepsen: fill: no client process")
	}
	n := min(r.cfg.FillBytes, blockStride-BlockSize)
	for b := range r.cfg.Blocks {
		cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		resp, err := s.Call(cctx, Request{Op: "fill", Off: int64(b)*blockStride + BlockSize, Len: n, TimeoutMS: 50000})
		cancel()
		if err == nil && !resp.OK {
			err = errors.New(resp.Err)
		}
		if err != nil {
			return fmt.Errorf("jepsen: filling register %d: %w", b, err)
		}
	}
	return nil
}

// readReplicas runs after the final reads: once every replica is healthy
// again (up to 30 s; the restart may have left rebuilds to do), it reads
// every register from every replica directly (Kind "replica-read", one op
// per replica and register), for checkReplicasAgree. Replicas still not
// healthy then are left out.
func (r *runner) readReplicas(ctx context.Context) error {
	var v *storpb.Volume
	deadline := time.Now().Add(30 * time.Second)
	for {
		var err error
		if v, err = r.volume(ctx); err != nil {
			return err
		}
		if len(healthy(v)) == len(v.Replicas) || time.Now().After(deadline) {
			break
		}
		sleep(ctx, 500*time.Millisecond)
	}
	return r.readHealthyReplicas(ctx, v, "replica-read", 0, func(int) bool { return true })
}

// readHealthyReplicas reads the registers keep picks from every replica
// of v that is HEALTHY, directly, and records a read op of kind kind for
// each (one per replica and register), in round round (Op.Round).
func (r *runner) readHealthyReplicas(ctx context.Context, v *storpb.Volume, kind string, round int, keep func(block int) bool) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	servers, err := r.c.Control.Cluster.ListServers(cctx, &storpb.ListServersRequest{})
	cancel()
	if err != nil {
		return err
	}
	dataAddr := map[string]string{}
	for _, s := range servers.Servers {
		dataAddr[s.Id] = s.DataAddress
	}
	blocks := int(r.blocks.Load())
	for _, rep := range healthy(v) {
		call := r.now()
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		data, err := readBlocks(cctx, r.c.Dial, dataAddr[rep.ServerId], v.Id, rep.Id, "", v.Epoch, blocks)
		cancel()
		ret := r.now()
		for b := range blocks {
			if !keep(b) {
				continue
			}
			o := Op{Client: -1, Kind: kind, Replica: rep.Id, Block: b, Call: call, Return: ret, Round: round}
			if err != nil {
				o.Err = err.Error()
			} else {
				o.OK = true
				o.decode(data[b], r.cfg.Seed)
			}
			r.record(o)
		}
	}
	return nil
}

func (r *runner) retryOpen(ctx context.Context, ch *ClientHost) error {
	var err error
	for i := 0; i < 10; i++ {
		if err = r.reopen(ctx, ch); err == nil {
			return nil
		}
		sleep(ctx, 2*time.Second)
	}
	return err
}

// healAll undoes every fault whatever the schedule left.
func (r *runner) healAll(ctx context.Context) error {
	var errs []error
	errs = append(errs, r.c.Net.HealAll(ctx))
	for _, s := range r.c.Servers {
		if !s.Proc.Running() {
			errs = append(errs, s.Proc.Start(false))
			continue
		}
		errs = append(errs, s.Proc.Resume(), s.ProxyCommand("ok"), s.Proc.Signal(sigDiskHeal))
	}
	return errors.Join(errs...)
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// check runs the checkers and writes report.json, history.jsonl and, for a
// block that is not linearizable, its porcupine visualization.
func (r *runner) check(rep *Report) (*Report, error) {
	r.mu.Lock()
	ops := append([]Op(nil), r.history...)
	r.mu.Unlock()
	rep.Ops = map[string]map[string]int{}
	for _, o := range ops {
		m := rep.Ops[o.Kind]
		if m == nil {
			m = map[string]int{}
			rep.Ops[o.Kind] = m
		}
		if o.OK {
			m["ok"]++
		} else {
			m["failed"]++
		}
	}
	rep.Availability = availability(ops, int64(r.cfg.Duration))
	checked, clones := map[string]bool{}, map[string]bool{}
	for _, o := range ops {
		switch {
		case o.Kind == "snapshot-read" && o.Clone != "":
			clones[o.Clone] = true
		case o.Kind == "snapshot-read":
			checked[o.Snapshot] = true
		}
	}
	rep.SnapshotsChecked, rep.ClonesChecked = len(checked), len(clones)
	a := &rep.Anomalies
	checkIntegrity(ops, a)
	if n := int(r.expansionFailures.Load()); n > 0 {
		a.Expansion += n
		a.Details = append(a.Details, fmt.Sprintf("expansion: %d online expansions were never served by the engine", n))
	}
	checkFencing(ops, a)
	checkDurability(ops, int(r.blocks.Load()), a)
	checkReplicasAgree(ops, a)
	checkReconciledReplicasAgree(ops, a)
	checkReplicasHoldLastWrite(ops, a)
	snapReads := checkSnapshots(ops, a)
	rep.SnapshotsLost = checkSnapshotLosses(ops, a)
	checkLinearizable(ops, snapReads, int(r.blocks.Load()), 2*time.Minute, func(b int) string {
		return filepath.Join(r.cfg.Dir, fmt.Sprintf("block-%d.html", b))
	}, a)
	if err := writeJSONLines(filepath.Join(r.cfg.Dir, "history.jsonl"), ops); err != nil {
		return rep, err
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(filepath.Join(r.cfg.Dir, "report.json"), append(b, '\n'), 0o644); err != nil {
		return rep, err
	}
	return rep, os.WriteFile(filepath.Join(r.cfg.Dir, "summary.txt"), []byte(rep.Summary()), 0o644)
}

// availability is the fraction of the whole seconds of the faulty phase
// in which at least one write was acknowledged.
func availability(ops []Op, dur int64) float64 {
	secs := int(dur / int64(time.Second))
	if secs == 0 {
		return 0
	}
	ok := make([]bool, secs)
	for _, o := range ops {
		if o.Kind == "write" && o.OK {
			if s := int(o.Return / int64(time.Second)); s >= 0 && s < secs {
				ok[s] = true
			}
		}
	}
	n := 0
	for _, v := range ok {
		if v {
			n++
		}
	}
	return float64(n) / float64(secs)
}

func writeJSONLines(path string, ops []Op) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	for _, o := range ops {
		if err := enc.Encode(o); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}
