package replica_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

// countingFS counts the files open through it, and the most ever open.
type countingFS struct {
	replica.FS
	open, peak atomic.Int64
}

func (c *countingFS) OpenFile(name string, flag int, perm os.FileMode) (replica.File, error) {
	f, err := c.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	n := c.open.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
	return &countedFile{File: f, fs: c}, nil
}

type countedFile struct {
	replica.File
	fs     *countingFS
	closed atomic.Bool
}

func (f *countedFile) Close() error {
	if f.closed.Swap(true) {
		return errors.New("countingFS: file closed twice")
	}
	f.fs.open.Add(-1)
	return f.File.Close()
}

// TestIdleReplicasAreClosedAndNothingIsLost: with room for two replicas'
// files, ten replicas are written (without a flush) one after another, so
// the store closes idle ones to stay within its budget. Reading them back
// reopens them and returns what was written; their dirty regions are
// still reported; and since closing syncs first, a crash that loses every
// unsynced byte keeps the writes to every closed replica, and those of a
// replica flushed after it was reopened.
func TestIdleReplicasAreClosedAndNothingIsLost(t *testing.T) {
	const n, budget = 10, 10
	mem := errorfs.NewMemFS()
	cfs := &countingFS{FS: mem}
	cfg := replica.Config{Dir: "/stor", FS: cfs, Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: budget}
	s := openStore(t, cfg)
	id := func(i int) string { return fmt.Sprintf("r%02d", i) }
	for i := range n {
		r := create(t, s, id(i), 1<<20)
		if err := r.WriteAt(op, pattern(byte(i+1)), testRegionSize); err != nil {
			t.Fatalf("WriteAt: %v", err)
		}
	}
	// r00 is closed by now: write to it again (reopening it) and flush it.
	if err := get(t, s, id(0)).WriteAt(op, pattern(0xee), 0); err != nil {
		t.Fatalf("WriteAt after reopen: %v", err)
	}
	if err := get(t, s, id(0)).Flush(op); err != nil {
		t.Fatalf("Flush after reopen: %v", err)
	}
	files, opens, closes := replica.FileCacheStats(s)
	t.Logf("files open %d (counted %d, peak %d), opened %d, closed idle %d", files, cfs.open.Load(), cfs.peak.Load(), opens, closes)
	if closes < n-2 {
		t.Errorf("only %d idle replicas were closed; the budget leaves room for 2 of %d", closes, n)
	}
	if got := cfs.open.Load(); got > budget || int(got) != files {
		t.Errorf("%d files open (the cache counts %d), budget %d", got, files, budget)
	}
	// A create opens a scratch file or two beyond the replicas' own.
	if p := cfs.peak.Load(); p > budget+2 {
		t.Errorf("at most %d files were open at once; budget %d", p, budget)
	}
	for i := range n {
		r := get(t, s, id(i))
		if got := readBlock(t, r, testRegionSize); !bytes.Equal(got, pattern(byte(i+1))) {
			t.Errorf("%s: read %x..., want %02x...", id(i), got[:4], i+1)
		}
		dirty, err := r.DirtyRegions(op)
		if err != nil {
			t.Fatalf("DirtyRegions: %v", err)
		}
		if i > 0 && (len(dirty) != 1 || dirty[0] != (replica.Extent{Off: testRegionSize, Len: testRegionSize})) {
			t.Errorf("%s: dirty regions %v after a close and reopen, want the one written", id(i), dirty)
		}
	}
	if got := cfs.open.Load(); got > budget {
		t.Errorf("%d files open after reading every replica, budget %d", got, budget)
	}

	// Crash without closing the store: what was not synced is lost.
	crashed := mem.CrashLoseAll()
	s.Close()
	cfg.FS = crashed
	s = openStore(t, cfg)
	defer s.Close()
	_, _, closes = replica.FileCacheStats(s)
	for i := range n {
		r := get(t, s, id(i))
		got := readBlock(t, r, testRegionSize)
		if !bytes.Equal(got, pattern(byte(i+1))) {
			// Only the replicas still open at the crash may lose it.
			t.Logf("%s: write lost by the crash (it was open and never flushed)", id(i))
			if i < n-2 {
				t.Errorf("%s: a write made durable by closing the replica was lost: read %x...", id(i), got[:4])
			}
		}
		dirty, err := r.DirtyRegions(op)
		if err != nil {
			t.Fatalf("DirtyRegions: %v", err)
		}
		if !covers(dirty, testRegionSize) {
			t.Errorf("%s: dirty regions %v after the crash, want the one written", id(i), dirty)
		}
	}
	if got := readBlock(t, get(t, s, id(0)), 0); !bytes.Equal(got, pattern(0xee)) {
		t.Errorf("a write flushed after a reopen was lost by the crash: read %x...", got[:4])
	}
}

func covers(exts []replica.Extent, off int64) bool {
	for _, e := range exts {
		if e.Off <= off && off < e.Off+e.Len {
			return true
		}
	}
	return false
}

// TestRequestsRaceTheClosingOfIdleReplicas: many goroutines write, read,
// zero, flush, snapshot and delete snapshots of a dozen replicas while a budget for one replica
// keeps the store closing and reopening them. Every read sees
// its goroutine's last write. Run it with -race.
func TestRequestsRaceTheClosingOfIdleReplicas(t *testing.T) {
	const nrep, workers, rounds = 12, 4, 400
	cfg := replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: 12}
	s := openStore(t, cfg)
	defer s.Close()
	reps := make([]*replica.Replica, nrep)
	for i := range reps {
		reps[i] = create(t, s, fmt.Sprintf("r%d", i), 4<<20)
	}
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed + int64(w)))
			// Each worker owns block w of every replica.
			last := make([]byte, nrep)
			snaps := make([][]string, nrep) // this worker's snapshots per replica
			off := int64(w) * replica.BlockSize
			buf := make([]byte, replica.BlockSize)
			for k := range rounds {
				i := rng.Intn(nrep)
				r := reps[i]
				var err error
				switch rng.Intn(20) {
				case 0, 1, 2, 3, 4, 5:
					v := byte(rng.Intn(255) + 1)
					if err = r.WriteAt(op, pattern(v), off); err == nil {
						last[i] = v
					}
				case 6:
					if err = r.WriteZeroes(op, off, replica.BlockSize); err == nil {
						last[i] = 0
					}
				case 7:
					err = r.Flush(op)
				case 8:
					if rng.Intn(4) > 0 {
						continue
					}
					name := fmt.Sprintf("s%d-%d", w, k)
					if err = r.CreateSnapshot(op, name); err == nil {
						snaps[i] = append(snaps[i], name)
					}
				case 9:
					if len(snaps[i]) == 0 {
						continue
					}
					err = r.DeleteSnapshot(op, snaps[i][0])
					snaps[i] = snaps[i][1:]
				default:
					if err = r.ReadAt(op, buf, off); err == nil && !bytes.Equal(buf, bytes.Repeat([]byte{last[i]}, replica.BlockSize)) {
						err = fmt.Errorf("replica %d block %d: read %x..., want %02x...", i, w, buf[:4], last[i])
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
			for i, r := range reps {
				if err := r.ReadAt(op, buf, off); err != nil {
					errs <- err
					return
				} else if !bytes.Equal(buf, bytes.Repeat([]byte{last[i]}, replica.BlockSize)) {
					errs <- fmt.Errorf("replica %d block %d at the end: read %x..., want %02x...", i, w, buf[:4], last[i])
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	_, opens, closes := replica.FileCacheStats(s)
	t.Logf("file sets opened %d, closed idle %d", opens, closes)
	if closes < rounds/4 {
		t.Errorf("only %d idle replicas were closed: the test did not exercise closing", closes)
	}
}

// TestPinnedAndRebuildingReplicasStayOpen: with room for two replicas, a
// pinned replica and one being rebuilt keep their files open while others
// are used; unpinned and with the rebuild ended, they are closed like any
// idle replica.
func TestPinnedAndRebuildingReplicasStayOpen(t *testing.T) {
	cfg := replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: 10}
	s := openStore(t, cfg)
	defer s.Close()
	pinned, rebuilding := create(t, s, "pinned", 1<<20), create(t, s, "rebuilding", 1<<20)
	unpin := pinned.Pin()
	if err := rebuilding.BeginRebuild(op); err != nil {
		t.Fatal(err)
	}
	useOthers := func(tag string) {
		for i := range 4 {
			r := create(t, s, fmt.Sprintf("%s%d", tag, i), 1<<20)
			if err := r.WriteAt(op, pattern(1), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	useOthers("a")
	if !replica.FilesOpen(pinned) || !replica.FilesOpen(rebuilding) {
		t.Fatalf("files open: pinned %v, rebuilding %v; want both", replica.FilesOpen(pinned), replica.FilesOpen(rebuilding))
	}
	unpin()
	unpin() // a second call is a no-op
	if err := rebuilding.EndRebuild(op); err != nil {
		t.Fatal(err)
	}
	useOthers("b")
	if replica.FilesOpen(pinned) || replica.FilesOpen(rebuilding) {
		t.Errorf("files open once idle: pinned %v, rebuilding %v; want neither", replica.FilesOpen(pinned), replica.FilesOpen(rebuilding))
	}
	if got := readBlock(t, pinned, 0); !bytes.Equal(got, make([]byte, replica.BlockSize)) {
		t.Errorf("pinned replica reads %x..., want zeroes", got[:4])
	}
}

// TestReopenOutOfDescriptorsClosesIdleReplicas: a reopen that hits EMFILE
// (the process's descriptors spent elsewhere, within the cache's budget)
// closes idle replicas and succeeds, instead of failing the request.
func TestReopenOutOfDescriptorsClosesIdleReplicas(t *testing.T) {
	e := newMemEnv(t)
	s, err := replica.OpenStore(replica.Config{Dir: "/stor", FS: e.efs, Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: 15})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 4 {
		r := create(t, s, fmt.Sprintf("r%d", i), 1<<20)
		if err := r.WriteAt(op, pattern(byte(i+1)), 0); err != nil {
			t.Fatal(err)
		}
	}
	r0 := get(t, s, "r0")
	if replica.FilesOpen(r0) {
		t.Fatal("r0 is still open: the test needs it closed")
	}
	_, _, before := replica.FileCacheStats(s)
	rule := e.efs.Add(errorfs.Rule{Path: "/stor/r0/", Ops: errorfs.OpOpen, Times: 1, Err: syscall.EMFILE})
	if got := readBlock(t, r0, 0); !bytes.Equal(got, pattern(1)) {
		t.Errorf("r0 read %x..., want 01...", got[:4])
	}
	_, _, after := replica.FileCacheStats(s)
	if e.efs.Fired(rule) != 1 || after == before {
		t.Errorf("EMFILE fired %d times, idle replicas closed %d → %d: want 1 and more", e.efs.Fired(rule), before, after)
	}
}

// TestOpenStoreOutOfDescriptorsIsNotDamage: a replica whose open at
// OpenStore hits EMFILE once is opened after idle replicas are closed, not
// listed as damaged (which would keep it unserved until a restart).
func TestOpenStoreOutOfDescriptorsIsNotDamage(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	for i := range 4 {
		create(t, s, fmt.Sprintf("r%d", i), 1<<20)
	}
	s.Close()
	rule := e.efs.Add(errorfs.Rule{Path: "/stor/r3/dirty", Ops: errorfs.OpOpen, Times: 1, Err: syscall.EMFILE})
	s = e.open()
	defer s.Close()
	if d := s.Damaged(); len(d) != 0 || e.efs.Fired(rule) != 1 {
		t.Fatalf("damaged %v after one EMFILE (fired %d times)", d, e.efs.Fired(rule))
	}
	if got := readBlock(t, get(t, s, "r3"), 0); !bytes.Equal(got, make([]byte, replica.BlockSize)) {
		t.Errorf("r3 read %x..., want zeroes", got[:4])
	}
}

// pathsFS records the paths opened through it.
type pathsFS struct {
	replica.FS
	mu     sync.Mutex
	opened []string
}

func (p *pathsFS) OpenFile(name string, flag int, perm os.FileMode) (replica.File, error) {
	p.mu.Lock()
	p.opened = append(p.opened, name)
	p.mu.Unlock()
	return p.FS.OpenFile(name, flag, perm)
}

func (p *pathsFS) take() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	o := p.opened
	p.opened = nil
	return o
}

// TestOpenStoreLeavesSnapshotLayersUnread: a restart opens a replica with
// snapshots as one without (doc.go, "Open files"): none of its snapshot
// layers' files is opened by OpenStore, and its files are left closed.
// The first request loads them, and every block reads as before the
// restart, through the head, each snapshot and a snapshot's deletion.
func TestOpenStoreLeavesSnapshotLayersUnread(t *testing.T) {
	mem := errorfs.NewMemFS()
	pfs := &pathsFS{FS: mem}
	cfg := replica.Config{Dir: "/stor", FS: pfs, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r := create(t, s, "r1", 1<<20)
	for i, snap := range []string{"s1", "s2"} {
		if err := r.WriteAt(op, pattern(byte(i+1)), int64(i)*replica.BlockSize); err != nil {
			t.Fatalf("WriteAt: %v", err)
		}
		if err := r.CreateSnapshot(op, snap); err != nil {
			t.Fatalf("CreateSnapshot: %v", err)
		}
	}
	if err := r.WriteAt(op, pattern(3), 2*replica.BlockSize); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	pfs.take()

	s = openStore(t, cfg)
	defer s.Close()
	for _, p := range pfs.take() {
		if strings.Contains(p, "layer-00000001") || strings.Contains(p, "layer-00000002") {
			t.Errorf("OpenStore opened %s, a snapshot layer's file", p)
		}
	}
	r = get(t, s, "r1")
	if replica.FilesOpen(r) {
		t.Errorf("a replica with snapshots was left open by OpenStore")
	}
	if files, _, _ := replica.FileCacheStats(s); files != 0 {
		t.Errorf("the file cache counts %d files open after OpenStore, want 0", files)
	}
	want := [][]byte{pattern(1), pattern(2), pattern(3)}
	for i, w := range want {
		if got := readBlock(t, r, int64(i)*replica.BlockSize); !bytes.Equal(got, w) {
			t.Errorf("block %d: read %x..., want %x...", i, got[:4], w[:4])
		}
	}
	if !replica.FilesOpen(r) {
		t.Errorf("the replica's files are not open after a read")
	}
	if files, _, _ := replica.FileCacheStats(s); files != 3+2*3 {
		t.Errorf("the file cache counts %d files open, want %d", files, 3+2*3)
	}
	snapRead := func(snap string, block int, w []byte) {
		t.Helper()
		got := make([]byte, replica.BlockSize)
		if err := r.ReadSnapshotAt(op, snap, got, int64(block)*replica.BlockSize); err != nil {
			t.Fatalf("ReadSnapshotAt %s: %v", snap, err)
		}
		if !bytes.Equal(got, w) {
			t.Errorf("snapshot %s block %d: read %x..., want %x...", snap, block, got[:4], w[:4])
		}
	}
	zero := make([]byte, replica.BlockSize)
	snapRead("s1", 0, pattern(1))
	snapRead("s1", 1, zero)
	snapRead("s2", 1, pattern(2))
	snapRead("s2", 2, zero)
	// Deleting s1 merges its block into s2's layer.
	if err := r.DeleteSnapshot(op, "s1"); err != nil {
		t.Fatalf("DeleteSnapshot: %v", err)
	}
	snapRead("s2", 0, pattern(1))
	if got := readBlock(t, r, 0); !bytes.Equal(got, pattern(1)) {
		t.Errorf("block 0 after deleting s1: read %x...", got[:4])
	}
}

// TestUnreadSnapshotLayerDamage: a replica whose snapshot layer's file is
// missing is still found damaged by OpenStore; one whose snapshot
// layer's index is unreadable opens, and its first request fails the
// replica (ErrCorrupt), not a read that would skip the layer.
func TestUnreadSnapshotLayerDamage(t *testing.T) {
	mem := errorfs.NewMemFS()
	cfg := replica.Config{Dir: "/stor", FS: mem, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	for _, id := range []string{"missing", "corrupt"} {
		r := create(t, s, id, 1<<20)
		if err := r.WriteAt(op, pattern(1), 0); err != nil {
			t.Fatalf("WriteAt: %v", err)
		}
		if err := r.CreateSnapshot(op, "s1"); err != nil {
			t.Fatalf("CreateSnapshot: %v", err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := mem.Remove("/stor/missing/layer-00000001.data"); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	f, err := mem.OpenFile("/stor/corrupt/layer-00000001.idx", os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("OpenFile: %v", err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xa5}, 64), 0); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	f.Close()

	s, err = replica.OpenStore(cfg)
	if err != nil {
		t.Fatalf("OpenStore: %v", err)
	}
	defer s.Close()
	if len(s.Damaged()) != 1 {
		t.Errorf("damaged: %v, want only the replica missing a file", s.Damaged())
	}
	if err := s.Damaged()["missing"]; !errors.Is(err, replica.ErrCorrupt) {
		t.Errorf("a replica missing a snapshot layer's data file: damaged %v, want ErrCorrupt", err)
	}
	r := get(t, s, "corrupt")
	buf := make([]byte, replica.BlockSize)
	if err := r.ReadAt(op, buf, 0); !errors.Is(err, replica.ErrCorrupt) {
		t.Fatalf("first read of a replica whose snapshot index is unreadable: %v, want ErrCorrupt", err)
	}
	if err := r.ReadAt(op, buf, replica.BlockSize); err == nil {
		t.Fatalf("a later read of the replica succeeded")
	}
	if err := r.WriteAt(op, pattern(2), 0); err == nil {
		t.Fatalf("a write to the replica succeeded")
	}
}

// TestIdleCloseDropsSnapshotIndexes: a replica closed while idle keeps
// only its head's index in memory; its next request reads the snapshot
// layers' indexes again from their journals, and every block, through
// the head and through each snapshot, reads as before. Blocks merged up
// by a snapshot delete, synced by the close, are in the reloaded index.
func TestIdleCloseDropsSnapshotIndexes(t *testing.T) {
	// Room for one replica with two snapshots (3 + 2x3 files), not two.
	cfg := replica.Config{Dir: "/stor", FS: errorfs.NewMemFS(), Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: 12}
	s := openStore(t, cfg)
	defer s.Close()
	a := create(t, s, "a", 1<<20)
	for i, snap := range []string{"s1", "s2", "s3"} {
		if err := a.WriteAt(op, pattern(byte(i+1)), int64(i)*replica.BlockSize); err != nil {
			t.Fatalf("WriteAt: %v", err)
		}
		if err := a.CreateSnapshot(op, snap); err != nil {
			t.Fatalf("CreateSnapshot: %v", err)
		}
	}
	// s2's layer (blocks 1) merges into s3's (which holds block 2).
	if err := a.DeleteSnapshot(op, "s2"); err != nil {
		t.Fatalf("DeleteSnapshot: %v", err)
	}
	if got := replica.LoadedLayers(a); got != 3 {
		t.Fatalf("%d layers loaded, want 3", got)
	}
	closeA := func() {
		t.Helper()
		b := create(t, s, fmt.Sprintf("b%d", time.Now().UnixNano()), 1<<20) // needs a's room
		if err := b.WriteAt(op, pattern(9), 0); err != nil {
			t.Fatalf("WriteAt: %v", err)
		}
		if replica.FilesOpen(a) {
			t.Fatalf("a was not closed to make room")
		}
	}
	closeA()
	if got := replica.LoadedLayers(a); got != 1 {
		t.Errorf("%d layers of an idle replica loaded, want 1 (the head)", got)
	}
	want := []byte{1, 2, 3}
	for i, w := range want {
		if got := readBlock(t, a, int64(i)*replica.BlockSize); !bytes.Equal(got, pattern(w)) {
			t.Errorf("block %d: read %x..., want %02x...", i, got[:4], w)
		}
	}
	if got := replica.LoadedLayers(a); got != 3 {
		t.Errorf("%d layers loaded after a read, want 3", got)
	}
	snapRead := func(snap string, block int, w []byte) {
		t.Helper()
		got := make([]byte, replica.BlockSize)
		if err := a.ReadSnapshotAt(op, snap, got, int64(block)*replica.BlockSize); err != nil {
			t.Fatalf("ReadSnapshotAt %s: %v", snap, err)
		}
		if !bytes.Equal(got, w) {
			t.Errorf("snapshot %s block %d: read %x..., want %x...", snap, block, got[:4], w[:4])
		}
	}
	closeA()
	snapRead("s3", 1, pattern(2)) // merged up from s2
	snapRead("s3", 2, pattern(3))
	snapRead("s1", 1, make([]byte, replica.BlockSize))
	closeA()
	snapRead("s1", 0, pattern(1))
}
