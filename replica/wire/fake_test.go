package wire

import (
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stor-io/stor/replica"
)

// fakeReplica is an in-memory Replica: a flat byte slice, a set of written
// blocks, snapshots as copies, and the store's epoch rule. Tests block or
// fail requests through hook.
type fakeReplica struct {
	id string
	// quiet skips the bookkeeping tests inspect (lastOp, lastArg,
	// history), so benchmarks measure the protocol rather than the fake.
	quiet bool
	// hook, if set, runs before every operation, outside mu. It may block
	// (to hold a request in the store) or return an error to fail it.
	hook atomic.Pointer[func(op string, off int64) error]
	pins atomic.Int64 // Pin calls not undone

	mu           sync.Mutex
	size         uint64
	epoch        uint64
	data         []byte
	written      map[int64]bool // block number -> holds data
	snaps        map[string]fakeSnap
	dirty        []replica.Extent
	history      []fakeWrite
	historyFloor uint64 // WrittenSince below this is ErrHistoryLost
	rebuilding   bool
	rebuilt      int // RebuildWrite calls
	flushes      int
	lastOp       replica.Op
	lastArg      string // the last op's name and arguments
}

type fakeSnap struct {
	data    []byte
	written map[int64]bool
}

type fakeWrite struct {
	gen uint64
	ext replica.Extent
}

func newFakeReplica(id string, size uint64) *fakeReplica {
	return &fakeReplica{
		id:      id,
		size:    size,
		data:    make([]byte, size),
		written: make(map[int64]bool),
		snaps:   make(map[string]fakeSnap),
	}
}

func (f *fakeReplica) setHook(h func(op string, off int64) error) {
	if h == nil {
		f.hook.Store(nil)
		return
	}
	f.hook.Store(&h)
}

// begin runs the hook, takes mu and applies the epoch rule; desc
// describes the call for lastArg. On success the
// caller holds mu and must call f.mu.Unlock.
func (f *fakeReplica) begin(o replica.Op, name string, off int64, desc func() string) error {
	if h := f.hook.Load(); h != nil {
		if err := (*h)(name, off); err != nil {
			return err
		}
	}
	f.mu.Lock()
	if cur := f.epoch; o.Epoch < cur {
		f.mu.Unlock()
		return fmt.Errorf("fake %s: %s epoch %d < %d: %w", f.id, name, o.Epoch, cur, replica.ErrStaleEpoch)
	}
	f.epoch = o.Epoch
	if !f.quiet {
		f.lastOp = o
		f.lastArg = desc()
	}
	return nil
}

func (f *fakeReplica) checkRangeLocked(off, n int64) error {
	if off < 0 || n < 0 || off%replica.SectorSize != 0 || n%replica.SectorSize != 0 || uint64(off+n) > f.size {
		return fmt.Errorf("fake %s: range %d+%d of %d: %w", f.id, off, n, f.size, replica.ErrInvalid)
	}
	return nil
}

func (f *fakeReplica) markLocked(o replica.Op, off, n int64, written bool) {
	for b := off / replica.BlockSize; b*replica.BlockSize < off+n; b++ {
		if written {
			f.written[b] = true
		} else {
			delete(f.written, b)
		}
	}
	if !f.quiet {
		f.history = append(f.history, fakeWrite{o.Generation, replica.Extent{Off: off, Len: n}})
	}
}

func (f *fakeReplica) ID() string { return f.id }

func (f *fakeReplica) Size() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.size
}

func (f *fakeReplica) Epoch() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.epoch
}

func (f *fakeReplica) Fence(epoch uint64) error {
	if err := f.begin(replica.Op{Epoch: epoch}, "Fence", 0, func() string { return argString("Fence", epoch) }); err != nil {
		return err
	}
	f.mu.Unlock()
	return nil
}

func (f *fakeReplica) ReadAt(o replica.Op, p []byte, off int64) error {
	if err := f.begin(o, "ReadAt", off, func() string { return argString("ReadAt", off, len(p)) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if err := f.checkRangeLocked(off, int64(len(p))); err != nil {
		return err
	}
	copy(p, f.data[off:])
	return nil
}

func (f *fakeReplica) WriteAt(o replica.Op, p []byte, off int64) error {
	if err := f.begin(o, "WriteAt", off, func() string { return argString("WriteAt", off, len(p)) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if err := f.checkRangeLocked(off, int64(len(p))); err != nil {
		return err
	}
	copy(f.data[off:], p)
	f.markLocked(o, off, int64(len(p)), true)
	return nil
}

func (f *fakeReplica) zero(o replica.Op, name string, off, n int64) error {
	if err := f.begin(o, name, off, func() string { return argString(name, off, n) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if err := f.checkRangeLocked(off, n); err != nil {
		return err
	}
	clear(f.data[off : off+n])
	f.markLocked(o, off, n, false)
	return nil
}

func (f *fakeReplica) WriteZeroes(o replica.Op, off, n int64) error {
	return f.zero(o, "WriteZeroes", off, n)
}

func (f *fakeReplica) Trim(o replica.Op, off, n int64) error { return f.zero(o, "Trim", off, n) }

func (f *fakeReplica) Flush(o replica.Op) error {
	if err := f.begin(o, "Flush", 0, func() string { return argString("Flush") }); err != nil {
		return err
	}
	f.flushes++
	f.mu.Unlock()
	return nil
}

func (f *fakeReplica) Grow(o replica.Op, size uint64) error {
	if err := f.begin(o, "Grow", 0, func() string { return argString("Grow", size) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if size < f.size || size%replica.BlockSize != 0 {
		return fmt.Errorf("fake %s: grow %d to %d: %w", f.id, f.size, size, replica.ErrInvalid)
	}
	f.data = append(f.data, make([]byte, size-f.size)...)
	f.size = size
	return nil
}

func (f *fakeReplica) CreateSnapshot(o replica.Op, id string) error {
	if err := f.begin(o, "CreateSnapshot", 0, func() string { return argString("CreateSnapshot", id) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if _, ok := f.snaps[id]; ok {
		return fmt.Errorf("fake %s: snapshot %s: %w", f.id, id, replica.ErrExists)
	}
	written := make(map[int64]bool, len(f.written))
	for b := range f.written {
		written[b] = true
	}
	f.snaps[id] = fakeSnap{data: slices.Clone(f.data), written: written}
	return nil
}

func (f *fakeReplica) DeleteSnapshot(o replica.Op, id string) error {
	if err := f.begin(o, "DeleteSnapshot", 0, func() string { return argString("DeleteSnapshot", id) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if _, ok := f.snaps[id]; !ok {
		return fmt.Errorf("fake %s: snapshot %s: %w", f.id, id, replica.ErrNotFound)
	}
	delete(f.snaps, id)
	return nil
}

func (f *fakeReplica) ReadSnapshotAt(o replica.Op, id string, p []byte, off int64) error {
	if err := f.begin(o, "ReadSnapshotAt", off, func() string { return argString("ReadSnapshotAt", id, off, len(p)) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	s, ok := f.snaps[id]
	if !ok {
		return fmt.Errorf("fake %s: snapshot %s: %w", f.id, id, replica.ErrNotFound)
	}
	if off < 0 || off+int64(len(p)) > int64(len(s.data)) {
		return fmt.Errorf("fake %s: snapshot range: %w", f.id, replica.ErrInvalid)
	}
	copy(p, s.data[off:])
	return nil
}

// Extents lists written blocks at or after from, one extent per run of
// consecutive blocks.
func (f *fakeReplica) Extents(o replica.Op, snapshotID string, from int64, limit int) ([]replica.Extent, error) {
	if err := f.begin(o, "Extents", from, func() string { return argString("Extents", snapshotID, from, limit) }); err != nil {
		return nil, err
	}
	defer f.mu.Unlock()
	written := f.written
	if snapshotID != "" {
		s, ok := f.snaps[snapshotID]
		if !ok {
			return nil, fmt.Errorf("fake %s: snapshot %s: %w", f.id, snapshotID, replica.ErrNotFound)
		}
		written = s.written
	}
	var blocks []int64
	for b := range written {
		if b*replica.BlockSize >= from {
			blocks = append(blocks, b)
		}
	}
	slices.Sort(blocks)
	var es []replica.Extent
	for _, b := range blocks {
		off := b * replica.BlockSize
		if n := len(es); n > 0 && es[n-1].Off+es[n-1].Len == off {
			es[n-1].Len += replica.BlockSize
			continue
		}
		if len(es) == limit {
			break
		}
		es = append(es, replica.Extent{Off: off, Len: replica.BlockSize})
	}
	return es, nil
}

func (f *fakeReplica) DirtyRegions(o replica.Op) ([]replica.Extent, error) {
	if err := f.begin(o, "DirtyRegions", 0, func() string { return argString("DirtyRegions") }); err != nil {
		return nil, err
	}
	defer f.mu.Unlock()
	return slices.Clone(f.dirty), nil
}

func (f *fakeReplica) WrittenSince(o replica.Op, generation uint64) ([]replica.Extent, error) {
	if err := f.begin(o, "WrittenSince", 0, func() string { return argString("WrittenSince", generation) }); err != nil {
		return nil, err
	}
	defer f.mu.Unlock()
	if generation < f.historyFloor {
		return nil, fmt.Errorf("fake %s: history starts at %d: %w", f.id, f.historyFloor, replica.ErrHistoryLost)
	}
	var es []replica.Extent
	for _, w := range f.history {
		if w.gen > generation {
			es = append(es, w.ext)
		}
	}
	return es, nil
}

func (f *fakeReplica) BeginRebuild(o replica.Op) error {
	if err := f.begin(o, "BeginRebuild", 0, func() string { return argString("BeginRebuild") }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if f.rebuilding {
		return fmt.Errorf("fake %s: already rebuilding: %w", f.id, replica.ErrInvalid)
	}
	f.rebuilding = true
	return nil
}

func (f *fakeReplica) RebuildWrite(o replica.Op, p []byte, off int64) error {
	if err := f.begin(o, "RebuildWrite", off, func() string { return argString("RebuildWrite", off, len(p)) }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if !f.rebuilding {
		return fmt.Errorf("fake %s: not rebuilding: %w", f.id, replica.ErrInvalid)
	}
	if err := f.checkRangeLocked(off, int64(len(p))); err != nil {
		return err
	}
	copy(f.data[off:], p)
	f.rebuilt++
	return nil
}

func (f *fakeReplica) EndRebuild(o replica.Op) error {
	if err := f.begin(o, "EndRebuild", 0, func() string { return argString("EndRebuild") }); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if !f.rebuilding {
		return fmt.Errorf("fake %s: not rebuilding: %w", f.id, replica.ErrInvalid)
	}
	f.rebuilding = false
	return nil
}

// argString formats an op's name and arguments, space-separated.
func argString(name string, args ...any) string {
	return strings.TrimSpace(fmt.Sprintln(append([]any{name}, args...)...))
}

// fakeBackend serves a fixed set of fake replicas.
type fakeBackend map[string]*fakeReplica

func (b fakeBackend) Replica(id string) (Replica, error) {
	r, ok := b[id]
	if !ok {
		return nil, fmt.Errorf("fake backend: replica %q: %w", id, replica.ErrNotFound)
	}
	return r, nil
}

// testLogger routes logs to t.Log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tbWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tbWriter struct{ t testing.TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Pin counts the handles that have the replica open (as *replica.Replica
// keeps its files open for them).
func (f *fakeReplica) Pin() func() {
	f.pins.Add(1)
	var once sync.Once
	return func() { once.Do(func() { f.pins.Add(-1) }) }
}
