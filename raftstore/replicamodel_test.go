package raftstore

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

var replicaModelSeedFlag = flag.Uint64("replicamodel.seed", 0, "seed for TestReplicaModel: run only this seed (0: several seeds from the clock)")

// The replica model test drives the replica state machine through the
// real apply path (commands applied by the FSM) with random sequences of
// what the data path and the leader do to a volume's replicas, and keeps
// beside it a model of the data: which acknowledged writes each replica
// holds, and each replica's write history (per write, the highest
// generation it was noted at, as replica/history.go keeps per region).
// Rebuilds copy exactly what replica/engine's Rebuild plans from the
// committed replica record: a delta of the writes any healthy replica's
// history notes at or after rebuild_from_generation (a full copy when a
// history does not reach back that far), or, for a full rebuild,
// everything the source holds from the resume offset on. The oracle: every
// replica the FSM says is HEALTHY holds every acknowledged write.

const (
	modelBlocks    = 64 // a write goes to one block of a 64-block volume
	modelSteps     = 400
	modelRuns      = 40
	modelRunsShort = 8
)

type modelReplica struct {
	held     map[int]bool   // ids of the writes it holds
	hist     map[int]uint64 // write id -> highest generation a write of it was noted at
	histFrom uint64         // its history is complete from this generation (WrittenSince refuses lower)
	maxGen   uint64         // highest generation of a request it has seen
}

func newModelReplica() *modelReplica {
	return &modelReplica{held: map[int]bool{}, hist: map[int]uint64{}}
}

// note applies write w at generation gen, as a replica's writeLocked does
// (a rebuild copy is noted like a write).
func (r *modelReplica) note(w int, gen uint64) {
	r.held[w] = true
	r.hist[w] = max(r.hist[w], gen)
	r.maxGen = max(r.maxGen, gen)
}

// modelRun is a rebuild an engine is running (engine.Rebuild): its plan
// was made when it started, from the replica record committed then.
type modelRun struct {
	epoch, gen uint64 // the engine's epoch; the replica's generation at the start (names the attempt)
	opGen      uint64 // the generation of the engine's requests when it started
	delta      bool
	regions    map[int]bool // delta: the writes whose regions it copies
	pos        int          // full: blocks below are copied and flushed
}

type replicaModel struct {
	t      *testing.T
	rng    *rand.Rand
	f      *FSM
	v      *storpb.Volume // as last committed
	writes []int          // acknowledged writes: id -> block
	reps   map[string]*modelReplica
	runs   map[string]*modelRun
	past   []pastRun // runs that ended, for late progress reports
	trace  []string
	nextID int
}

type pastRun struct {
	replica    string
	epoch, gen uint64
	resume     uint64
}

func TestReplicaModel(t *testing.T) {
	seeds := []uint64{*replicaModelSeedFlag}
	if seeds[0] == 0 {
		base := uint64(time.Now().UnixNano())
		n := modelRuns
		if testing.Short() {
			n = modelRunsShort
		}
		seeds = seeds[:0]
		for i := range n {
			seeds = append(seeds, base+uint64(i))
		}
		t.Logf("seeds %d..%d; reproduce one with -run TestReplicaModel -replicamodel.seed=SEED", seeds[0], seeds[len(seeds)-1])
	}
	counts := map[string]int{}
	for _, seed := range seeds {
		if t.Failed() {
			break
		}
		runReplicaModel(t, seed, counts)
	}
	t.Logf("events applied: %v", counts)
	// Guard the generator: a model run that never completes a rebuild, or
	// never retries one, proves nothing about rebuilds.
	if len(seeds) >= modelRunsShort && !t.Failed() {
		for _, ev := range []string{"write", "fault", "rebuild", "checkpoint", "rebuilt delta", "rebuilt full", "rebuilt full (history lost)", "rebuild failed", "replace", "restart", "attach"} {
			if counts[ev] == 0 {
				t.Errorf("no %q event in %d runs; generator too narrow", ev, len(seeds))
			}
		}
	}
}

func runReplicaModel(t *testing.T, seed uint64, counts map[string]int) {
	f := openTestFSM(t, "")
	f.db.NoSync = true // a model run applies thousands of entries; durability is not what it tests
	m := &replicaModel{t: t, rng: rand.New(rand.NewPCG(seed, 0)), f: f, reps: map[string]*modelReplica{}, runs: map[string]*modelRun{}}
	setup := []command{cmdInitCluster("c1")}
	for i := 1; i <= 6; i++ {
		setup = append(setup, cmdRegisterServer(fmt.Sprintf("s%d", i), fmt.Sprintf("z%d", i), 1<<40, nil))
	}
	mustApply(t, f, append(setup, cmdCreateVolume("vol", "pvc", gib, 3), cmdAttachVolume("vol", "node-1", false))...)
	m.v = readVolume(t, f, "vol")
	for _, r := range m.v.Replicas {
		m.reps[r.Id] = newModelReplica()
	}
	type event struct {
		weight int
		do     func() string // "" when it did nothing
	}
	events := []event{
		{30, m.write}, {8, m.fault}, {12, m.startRebuild}, {8, m.checkpoint}, {12, m.complete},
		{8, m.failRebuild}, {3, m.replace}, {5, m.restart}, {2, m.attach}, {6, m.lateProgress},
	}
	total := 0
	for _, e := range events {
		total += e.weight
	}
	for step := range modelSteps {
		n := m.rng.IntN(total)
		var what string
		for _, e := range events {
			if n < e.weight {
				what = e.do()
				break
			}
			n -= e.weight
		}
		if what == "" {
			continue
		}
		counts[what]++
		m.v = readVolume(t, f, "vol")
		if problem := m.check(); problem != "" {
			t.Fatalf("seed %d, step %d: %s\nreproduce: go test ./raftstore/ -run TestReplicaModel -replicamodel.seed=%d\nlast events:\n\t%s\nvolume: %v",
				seed, step, problem, seed, strings.Join(m.trace[max(0, len(m.trace)-40):], "\n\t"), m.v)
		}
	}
}

// check is the oracle: every HEALTHY replica holds every acknowledged
// write; the model knows the FSM's replicas and no others.
func (m *replicaModel) check() string {
	if len(m.v.Replicas) != len(m.reps) {
		return fmt.Sprintf("the FSM has %d replicas, the model %d", len(m.v.Replicas), len(m.reps))
	}
	for _, r := range m.v.Replicas {
		mr := m.reps[r.Id]
		if mr == nil {
			return fmt.Sprintf("replica %s unknown to the model", r.Id)
		}
		if r.State != healthy {
			continue
		}
		var missing []int
		for w := range m.writes {
			if !mr.held[w] {
				missing = append(missing, w)
			}
		}
		if len(missing) > 0 {
			return fmt.Sprintf("HEALTHY replica %s (generation %d) lacks %d of %d acknowledged writes, e.g. write %d",
				r.Id, r.Generation, len(missing), len(m.writes), missing[0])
		}
	}
	return ""
}

func (m *replicaModel) logf(format string, args ...any) {
	m.trace = append(m.trace, fmt.Sprintf("gen %d: ", m.v.Generation)+fmt.Sprintf(format, args...))
}

// apply applies one command and returns its error; the committed volume is
// read again.
func (m *replicaModel) apply(c command) error {
	r := applyCommands(m.t, m.f, c)[0]
	m.v = readVolume(m.t, m.f, "vol")
	return r.err
}

func (m *replicaModel) must(what string, c command) {
	if err := m.apply(c); err != nil {
		m.t.Fatalf("%s: refused: %v\nlast events:\n\t%s", what, err, strings.Join(m.trace[max(0, len(m.trace)-40):], "\n\t"))
	}
}

// pick returns a random replica in one of the states, or nil.
func (m *replicaModel) pick(states ...storpb.ReplicaState) *storpb.Replica {
	var in []*storpb.Replica
	for _, r := range m.v.Replicas {
		if slices.Contains(states, r.State) && !r.ServerRemoved {
			in = append(in, r)
		}
	}
	if len(in) == 0 {
		return nil
	}
	return in[m.rng.IntN(len(in))]
}

func (m *replicaModel) healthy() []*storpb.Replica {
	var out []*storpb.Replica
	for _, r := range m.v.Replicas {
		if r.State == healthy {
			out = append(out, r)
		}
	}
	return out
}

func (m *replicaModel) faultCmd(id string) command {
	return cmdSetReplicaState(m.v.Id, id, faulty, m.v.Epoch, 0)
}

// endRun forgets the rebuild running for a replica (its engine gave up or
// is gone), keeping it for late progress reports.
func (m *replicaModel) endRun(id string) {
	if run := m.runs[id]; run != nil && !run.delta {
		m.past = append(m.past, pastRun{replica: id, epoch: run.epoch, gen: run.gen, resume: uint64(run.pos) * BlockSize})
	}
	delete(m.runs, id)
}

// write acknowledges a new write at the engine's generation: every
// replica in the write set (HEALTHY and REBUILDING) applies it, or fails
// and is committed FAULTY first; then those that applied it apply it
// again at the new generation (engine.settle).
func (m *replicaModel) write() string {
	w, block := len(m.writes), m.rng.IntN(modelBlocks)
	m.writes = append(m.writes, block)
	gen := m.v.Generation
	var ok, failed []string
	for _, r := range m.v.Replicas {
		if r.State == faulty {
			continue
		}
		if m.rng.IntN(10) == 0 {
			failed = append(failed, r.Id)
		} else {
			ok = append(ok, r.Id)
		}
	}
	// The last healthy replica cannot fail a write that is acknowledged.
	if !slices.ContainsFunc(ok, func(id string) bool { return findReplica(m.v, id).State == healthy }) {
		for i, id := range failed {
			if findReplica(m.v, id).State == healthy {
				ok, failed = append(ok, id), slices.Delete(failed, i, i+1)
				break
			}
		}
	}
	for _, id := range ok {
		m.reps[id].note(w, gen)
	}
	for _, id := range failed {
		m.logf("write %d (block %d) fails on %s", w, block, id)
		m.must("fault of a replica that failed a write", m.faultCmd(id))
		m.endRun(id)
	}
	if len(failed) > 0 {
		for _, id := range ok {
			m.reps[id].note(w, m.v.Generation)
		}
	}
	m.logf("write %d acknowledged at generation %d on %v (again at %d)", w, gen, ok, m.v.Generation)
	return "write"
}

// fault: a replica fails outside a write (its server is down, it could not
// be opened, its rebuild failed).
func (m *replicaModel) fault() string {
	r := m.pick(healthy, rebuilding)
	if r == nil {
		return ""
	}
	last := r.State == healthy && len(m.healthy()) == 1
	err := m.apply(m.faultCmd(r.Id))
	switch {
	case last && errors.Is(err, ErrFailedPrecondition):
		return "" // the last healthy replica is never faulty
	case err != nil || last:
		m.t.Fatalf("fault of %s (last healthy %v): %v", r.Id, last, err)
	}
	m.endRun(r.Id)
	m.logf("%s (%v) faulty", r.Id, r.State)
	return "fault"
}

// startRebuild: the leader starts rebuilding a faulty replica whose server
// is back.
func (m *replicaModel) startRebuild() string {
	r := m.pick(faulty)
	if r == nil {
		return ""
	}
	m.must("rebuild of a faulty replica", cmdSetReplicaState(m.v.Id, r.Id, rebuilding, m.v.Epoch, 0))
	now := findReplica(m.v, r.Id)
	m.logf("%s rebuilding from generation %d (resume %d)", r.Id, now.RebuildFromGeneration, now.RebuildResumeOffset)
	return "rebuild"
}

// run returns the rebuild the engine runs for REBUILDING replica r,
// starting one (engine.startRebuilds) from the committed record if none
// runs. The plan is engine.planRanges's.
func (m *replicaModel) run(r *storpb.Replica) *modelRun {
	if run := m.runs[r.Id]; run != nil && run.gen == r.Generation && run.epoch == m.v.Epoch {
		return run
	}
	m.endRun(r.Id)
	run := &modelRun{epoch: m.v.Epoch, gen: r.Generation, opGen: m.v.Generation}
	if from := r.RebuildFromGeneration; from > 0 {
		run.delta, run.regions = true, map[int]bool{}
		for _, s := range m.healthy() {
			h := m.reps[s.Id]
			if from < h.histFrom {
				run.delta = false // ErrHistoryLost: a full rebuild
				break
			}
			for w, g := range h.hist {
				if g >= from {
					run.regions[w] = true
				}
			}
		}
	}
	if !run.delta {
		run.regions = nil
		run.pos = int(r.RebuildResumeOffset / BlockSize)
	}
	m.runs[r.Id] = run
	return run
}

// copyBlocks copies, from a healthy source, the writes to blocks [from,
// to) (full) into the target, noted at the run's generation.
func (m *replicaModel) copyBlocks(run *modelRun, dst *modelReplica, from, to int) {
	src := m.reps[m.healthy()[m.rng.IntN(len(m.healthy()))].Id]
	for w := range src.held {
		if b := m.writes[w]; b >= from && b < to {
			dst.note(w, run.opGen)
		}
	}
}

// checkpoint: a full rebuild copies some more blocks, flushes and reports
// the offset below which the target is complete.
func (m *replicaModel) checkpoint() string {
	r := m.pick(rebuilding)
	if r == nil {
		return ""
	}
	run := m.run(r)
	if run.delta || run.pos >= modelBlocks {
		return ""
	}
	to := min(modelBlocks, run.pos+1+m.rng.IntN(modelBlocks/4))
	m.copyBlocks(run, m.reps[r.Id], run.pos, to)
	run.pos = to
	m.must("checkpoint of the current attempt", progressCmd(m.v, r.Id, run.gen, uint64(to)*BlockSize))
	m.logf("%s full rebuild (attempt %d) checkpoint at block %d", r.Id, run.gen, to)
	return "checkpoint"
}

// complete: a rebuild copies what its plan says and reports the replica
// healthy.
func (m *replicaModel) complete() string {
	r := m.pick(rebuilding)
	if r == nil {
		return ""
	}
	run := m.run(r)
	dst := m.reps[r.Id]
	what := "rebuilt full"
	if run.delta {
		what = "rebuilt delta"
		src := m.reps[m.healthy()[m.rng.IntN(len(m.healthy()))].Id]
		for w := range run.regions {
			if src.held[w] {
				dst.note(w, run.opGen)
			}
		}
	} else {
		if r.RebuildFromGeneration > 0 {
			what = "rebuilt full (history lost)"
		}
		m.copyBlocks(run, dst, run.pos, modelBlocks)
	}
	m.must("the end of the current rebuild attempt", cmdSetReplicaState(m.v.Id, r.Id, healthy, m.v.Epoch, run.gen))
	delete(m.runs, r.Id)
	m.logf("%s %s (attempt %d, from generation %d, resumed at block %d)", r.Id, what, run.gen, r.RebuildFromGeneration, run.pos)
	return what
}

// failRebuild: a running rebuild fails; the engine blames the target (it
// becomes faulty) or a source (that one becomes faulty, unless it is the
// last healthy replica: the rebuild is then only abandoned).
func (m *replicaModel) failRebuild() string {
	r := m.pick(rebuilding)
	if r == nil {
		return ""
	}
	run := m.run(r)
	blame := r.Id
	if m.rng.IntN(2) == 0 {
		hs := m.healthy()
		blame = hs[m.rng.IntN(len(hs))].Id
		if len(hs) == 1 {
			m.endRun(r.Id)
			m.logf("%s rebuild (attempt %d) abandoned", r.Id, run.gen)
			return "rebuild failed"
		}
	}
	m.must("fault blamed for a failed rebuild", m.faultCmd(blame))
	m.endRun(r.Id)
	m.endRun(blame)
	m.logf("%s rebuild (attempt %d) failed; %s faulty", r.Id, run.gen, blame)
	return "rebuild failed"
}

// replace: a replica is replaced by a new, empty one elsewhere (the leader
// after ReplaceAfter, or an operator).
func (m *replicaModel) replace() string {
	old := m.v.Replicas[m.rng.IntN(len(m.v.Replicas))]
	m.nextID++
	newID := fmt.Sprintf("vol-n%d", m.nextID)
	err := m.apply(cmdReplaceReplica(m.v.Id, old.Id, "", newID, false))
	if err != nil {
		if errors.Is(err, ErrFailedPrecondition) || errors.Is(err, ErrInsufficientServers) || errors.Is(err, ErrInsufficientCapacity) {
			return ""
		}
		m.t.Fatalf("replace %s: %v", old.Id, err)
	}
	m.endRun(old.Id)
	delete(m.reps, old.Id)
	m.reps[newID] = newModelReplica()
	m.logf("%s (%v) replaced by %s", old.Id, old.State, newID)
	return "replace"
}

// restart: a replica's server restarts. It keeps what it holds (a process
// restart keeps the page cache; a lost machine is a replace), but its
// requests in flight fail: a replica in the write set becomes faulty. Now
// and then its write history cannot be read and starts afresh.
func (m *replicaModel) restart() string {
	r := m.pick(healthy, rebuilding, faulty)
	if r == nil {
		return ""
	}
	if r.State == healthy && len(m.healthy()) == 1 {
		return ""
	}
	if r.State != faulty {
		m.must("fault of a restarted replica", m.faultCmd(r.Id))
		m.endRun(r.Id)
	}
	mr := m.reps[r.Id]
	lost := m.rng.IntN(3) == 0
	if lost {
		mr.histFrom, mr.hist = mr.maxGen+1, map[int]uint64{}
	}
	m.logf("%s (%v) restarted (history lost: %v)", r.Id, r.State, lost)
	return "restart"
}

// attach: the volume is attached again (a new engine, a new epoch); the
// old engine's rebuilds stop, the new one starts them from the record.
func (m *replicaModel) attach() string {
	m.must("attach", cmdAttachVolume(m.v.Id, fmt.Sprintf("node-%d", m.rng.IntN(2)), true))
	for _, id := range slices.Sorted(maps.Keys(m.runs)) { // in order: a seed replays exactly
		m.endRun(id)
	}
	m.logf("attached at epoch %d", m.v.Epoch)
	return "attach"
}

// lateProgress: a progress report of a rebuild that ended arrives late.
func (m *replicaModel) lateProgress() string {
	if len(m.past) == 0 {
		return ""
	}
	recent := m.past[max(0, len(m.past)-4):] // late, not ancient: most are from this epoch
	p := recent[m.rng.IntN(len(recent))]
	if findReplica(m.v, p.replica) == nil || p.resume == 0 {
		return ""
	}
	req := progressCmd(m.v, p.replica, p.gen, p.resume)
	req.Body.(*storpb.SetReplicaStateRequest).Epoch = p.epoch
	err := m.apply(req)
	m.logf("late checkpoint of %s (epoch %d, attempt %d) at block %d: %v", p.replica, p.epoch, p.gen, p.resume/BlockSize, err)
	return "late progress"
}
