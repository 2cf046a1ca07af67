package replica_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

var op = replica.Op{Epoch: 1, Generation: 1}

// memEnv is a store on an error-injecting FS over a MemFS.
type memEnv struct {
	t   *testing.T
	mem *errorfs.MemFS
	efs *errorfs.FS
}

func newMemEnv(t *testing.T) *memEnv {
	mem := errorfs.NewMemFS()
	return &memEnv{t: t, mem: mem, efs: errorfs.New(mem, 1)}
}

func (e *memEnv) open() *replica.Store {
	e.t.Helper()
	s, err := replica.OpenStore(replica.Config{Dir: "/stor", FS: e.efs, Logger: replicatest.Logger(e.t), RegionSize: testRegionSize})
	if err != nil {
		e.t.Fatalf("OpenStore: %v", err)
	}
	return s
}

// crash drops the rules, crashes the disk losing everything unsynced, and
// opens the store again.
func (e *memEnv) crash() *replica.Store {
	e.mem = e.mem.CrashLoseAll()
	e.efs = errorfs.New(e.mem, 1)
	return e.open()
}

func create(t *testing.T, s *replica.Store, id string, size uint64) *replica.Replica {
	t.Helper()
	r, err := s.Create(replica.Spec{ID: id, VolumeID: "v", Size: size})
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	return r
}

func get(t *testing.T, s *replica.Store, id string) *replica.Replica {
	t.Helper()
	r, err := s.Get(id)
	if err != nil {
		t.Fatalf("Get(%s): %v", id, err)
	}
	return r
}

func readBlock(t *testing.T, r *replica.Replica, off int64) []byte {
	t.Helper()
	p := make([]byte, replica.BlockSize)
	if err := r.ReadAt(op, p, off); err != nil {
		t.Fatalf("ReadAt(%d): %v", off, err)
	}
	return p
}

func pattern(b byte) []byte { return bytes.Repeat([]byte{b}, replica.BlockSize) }

// TestWriteErrorsMapToSentinels: EIO and ENOSPC from the disk reach the
// caller as ErrIO and ErrNoSpace with the detail kept, and a failed write
// that never reached the data file leaves the old data.
func TestWriteErrorsMapToSentinels(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	defer s.Close()
	r := create(t, s, "r", 1<<20)
	if err := r.WriteAt(op, pattern(1), 0); err != nil {
		t.Fatal(err)
	}
	rule := e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpWrite, Err: syscall.EIO, Times: 1})
	err := r.WriteAt(op, pattern(2), 0)
	if !errors.Is(err, replica.ErrIO) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("write on EIO: %v, want ErrIO wrapping EIO", err)
	}
	if e.efs.Fired(rule) != 1 {
		t.Fatalf("rule fired %d times", e.efs.Fired(rule))
	}
	if got := readBlock(t, r, 0); !bytes.Equal(got, pattern(1)) {
		t.Fatalf("a write that failed changed the block")
	}
	e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpWrite, Err: syscall.ENOSPC, Times: 1})
	err = r.WriteAt(op, pattern(3), 4096)
	if !errors.Is(err, replica.ErrNoSpace) || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write on ENOSPC: %v, want ErrNoSpace wrapping ENOSPC", err)
	}
	// ENOSPC is not fatal: the next write works.
	if err := r.WriteAt(op, pattern(4), 4096); err != nil {
		t.Fatalf("write after ENOSPC cleared: %v", err)
	}
	e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpRead, Err: syscall.EIO, Times: 1})
	if err := r.ReadAt(op, make([]byte, 4096), 0); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("read on EIO: %v, want ErrIO", err)
	}
	e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpPunch, Err: syscall.EIO, Times: 1})
	if err := r.WriteZeroes(op, 0, 4096); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("zeroes on EIO: %v, want ErrIO", err)
	}
	if got := readBlock(t, r, 0); !bytes.Equal(got, pattern(1)) {
		t.Fatalf("zeroes that failed changed the block")
	}
}

// TestDirtyMarkFailsTheWrite: if the dirty bit cannot be made durable, the
// write is refused before it touches the data.
func TestDirtyMarkFailsTheWrite(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	defer s.Close()
	r := create(t, s, "r", 1<<20)
	if err := r.WriteAt(op, pattern(1), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	// Region 2 is clean; its first write must sync the dirty log first.
	e.efs.Add(errorfs.Rule{Path: "/dirty", Ops: errorfs.OpSync, Err: syscall.EIO, Times: 1})
	off := int64(2 * testRegionSize)
	if err := r.WriteAt(op, pattern(9), off); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("write with a failing dirty-log sync: %v, want ErrIO", err)
	}
	if got := readBlock(t, r, off); !bytes.Equal(got, make([]byte, 4096)) {
		t.Fatalf("the write was applied although its dirty mark failed")
	}
	if err := r.WriteAt(op, pattern(9), off); err != nil {
		t.Fatalf("retry: %v", err)
	}
	d, err := r.DirtyRegions(op)
	if err != nil || len(d) == 0 || d[len(d)-1].Off != off {
		t.Fatalf("dirty regions %+v, %v: want region 2 included", d, err)
	}
}

// TestSyncFailureIsSticky: after a failed fsync the replica refuses
// everything (the kernel may have dropped the pages, so a later "good"
// fsync would lie); reopened on a healthy disk, everything flushed before
// the failure is there.
func TestSyncFailureIsSticky(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r", 1<<20)
	if err := r.WriteAt(op, pattern(1), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteAt(op, pattern(2), 4096); err != nil {
		t.Fatal(err)
	}
	e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpSync, Err: syscall.EIO, Times: 1})
	if err := r.Flush(op); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("flush with a failing fsync: %v, want ErrIO", err)
	}
	for name, err := range map[string]error{
		"write": r.WriteAt(op, pattern(3), 8192),
		"read":  r.ReadAt(op, make([]byte, 512), 0),
		"flush": r.Flush(op),
	} {
		if !errors.Is(err, replica.ErrIO) {
			t.Fatalf("%s after a failed fsync: %v, want ErrIO", name, err)
		}
	}
	s = e.crash()
	defer s.Close()
	r = get(t, s, "r")
	if got := readBlock(t, r, 0); !bytes.Equal(got, pattern(1)) {
		t.Fatalf("flushed block lost")
	}
	if got := readBlock(t, r, 4096); !bytes.Equal(got, make([]byte, 4096)) && !bytes.Equal(got, pattern(2)) {
		t.Fatalf("unflushed block is neither old nor new")
	}
}

// TestTornIndexAppend: a crash that tears the index journal's append (the
// flush never returned) leaves a replica that opens, with the data of
// earlier flushes and old-or-new for the rest.
func TestTornIndexAppend(t *testing.T) {
	for _, action := range []errorfs.Action{errorfs.TornFail, errorfs.TornSkip} {
		e := newMemEnv(t)
		s := e.open()
		r := create(t, s, "r", 1<<20)
		for b := range int64(8) {
			if err := r.WriteAt(op, pattern(byte(b+1)), b*8192); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
		for b := range int64(8) {
			if err := r.WriteAt(op, pattern(byte(b+101)), b*8192+4096); err != nil {
				t.Fatal(err)
			}
		}
		e.efs.Add(errorfs.Rule{Path: ".idx", Ops: errorfs.OpWrite, Action: action, TornBytes: 30, Times: 1})
		if action == errorfs.TornSkip {
			// The lie is caught by nothing but the crash: make the sync of
			// the torn append a lie too.
			e.efs.Add(errorfs.Rule{Path: ".idx", Ops: errorfs.OpSync, Action: errorfs.Skip, Times: 1})
		}
		r.Flush(op) // fails or lies; either way it is not durable
		s = e.crash()
		r = get(t, s, "r")
		for b := range int64(8) {
			if got := readBlock(t, r, b*8192); !bytes.Equal(got, pattern(byte(b+1))) {
				t.Fatalf("%v: flushed block %d lost", action, 2*b)
			}
			got := readBlock(t, r, b*8192+4096)
			if !bytes.Equal(got, make([]byte, 4096)) && !bytes.Equal(got, pattern(byte(b+101))) {
				t.Fatalf("%v: unflushed block %d is neither old nor new", action, 2*b+1)
			}
		}
		// And the journal takes appends again.
		if err := r.WriteAt(op, pattern(7), 0); err != nil {
			t.Fatal(err)
		}
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
}

// TestLyingSyncIsCaught shows the crash model has teeth: if the data
// file's fsync lies, a flushed block is lost in a crash, and the check a
// durability test makes (flushed data reads back) fails.
func TestLyingSyncIsCaught(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r", 1<<20)
	e.efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpSync, Action: errorfs.Skip})
	if err := r.WriteAt(op, pattern(5), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	s = e.crash()
	defer s.Close()
	if got := readBlock(t, get(t, s, "r"), 0); bytes.Equal(got, pattern(5)) {
		t.Fatalf("a block survived a crash although its fsync was skipped: the crash model loses nothing")
	}
}

// TestDamagedReplicaIsReportedNotDeleted: a replica whose metadata,
// index or epoch is corrupt is listed by Damaged with ErrCorrupt, Get
// returns that error, Create refuses the id, its files stay; Delete
// removes it. The other replicas open normally.
func TestDamagedReplicaIsReportedNotDeleted(t *testing.T) {
	cases := map[string]func(dir string){
		"meta": func(dir string) { os.WriteFile(filepath.Join(dir, "meta.json"), []byte("{garbage"), 0o644) },
		"epoch": func(dir string) {
			f, _ := os.OpenFile(filepath.Join(dir, "epoch"), os.O_RDWR, 0)
			f.WriteAt(make([]byte, 1024), 0)
			f.Close()
		},
		"index": func(dir string) {
			// Damage the first of two batches.
			path := filepath.Join(dir, "layer-00000001.idx")
			b, _ := os.ReadFile(path)
			b[32+20] ^= 0xff
			os.WriteFile(path, b, 0o644)
		},
		"missing data file": func(dir string) { os.Remove(filepath.Join(dir, "layer-00000001.data")) },
	}
	for name, damage := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t)}
			s := openStore(t, cfg)
			for _, id := range []string{"bad", "good"} {
				r := create(t, s, id, 1<<20)
				for i := range int64(2) {
					r.WriteAt(op, pattern(7), i*8192)
					r.Flush(op)
				}
			}
			s.Close()
			damage(filepath.Join(dir, "bad"))

			s, err := replica.OpenStore(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			dmg := s.Damaged()
			if len(dmg) != 1 || !errors.Is(dmg["bad"], replica.ErrCorrupt) {
				t.Fatalf("Damaged() = %v, want bad: ErrCorrupt", dmg)
			}
			if _, err := s.Get("bad"); !errors.Is(err, replica.ErrCorrupt) {
				t.Fatalf("Get(bad) = %v, want ErrCorrupt", err)
			}
			if _, err := s.Create(replica.Spec{ID: "bad", VolumeID: "v", Size: 1 << 20}); err == nil {
				t.Fatalf("Create over a damaged replica succeeded")
			}
			if _, err := os.Stat(filepath.Join(dir, "bad", "meta.json")); err != nil && name != "meta" {
				t.Fatalf("the damaged replica's files were touched: %v", err)
			}
			if got := readBlock(t, get(t, s, "good"), 0); !bytes.Equal(got, pattern(7)) {
				t.Fatalf("the good replica lost data")
			}
			if err := s.Delete("bad"); err != nil {
				t.Fatalf("Delete(bad): %v", err)
			}
			if _, err := os.Stat(filepath.Join(dir, "bad")); !os.IsNotExist(err) {
				t.Fatalf("Delete left the directory: %v", err)
			}
		})
	}
}

// TestTornEpochWrite: a raise torn by a crash leaves the previous epoch
// (the raise was never acknowledged); the replica opens.
func TestTornEpochWrite(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r", 1<<20)
	if err := r.Fence(5); err != nil {
		t.Fatal(err)
	}
	e.efs.Add(errorfs.Rule{Path: "/epoch", Ops: errorfs.OpWrite, Action: errorfs.TornFail, TornBytes: 20, Times: 1})
	if err := r.Fence(6); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("Fence with a torn write: %v, want ErrIO", err)
	}
	if r.Epoch() != 5 {
		t.Fatalf("epoch %d after a failed raise, want 5", r.Epoch())
	}
	s = e.crash()
	defer s.Close()
	r = get(t, s, "r")
	if r.Epoch() != 5 {
		t.Fatalf("epoch %d after a torn raise and a crash, want 5", r.Epoch())
	}
	if err := r.Fence(6); err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(7); err != nil {
		t.Fatal(err)
	}
}

// TestHistoryLost: a write history that cannot be read is started afresh,
// and WrittenSince refuses generations it cannot vouch for with
// ErrHistoryLost, while tracking new writes.
func TestHistoryLost(t *testing.T) {
	dir := t.TempDir()
	cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r := create(t, s, "r", 4<<20)
	for gen := uint64(1); gen <= 3; gen++ {
		if err := r.WriteAt(replica.Op{Epoch: 1, Generation: gen}, pattern(1), int64(gen)*testRegionSize); err != nil {
			t.Fatal(err)
		}
	}
	s.Close()
	os.WriteFile(filepath.Join(dir, "r", "history"), []byte("not a journal"), 0o644)
	s = openStore(t, cfg)
	defer s.Close()
	r = get(t, s, "r")
	for _, gen := range []uint64{0, 1, 3} {
		if _, err := r.WrittenSince(op, gen); !errors.Is(err, replica.ErrHistoryLost) {
			t.Fatalf("WrittenSince(%d) with a lost history: %v, want ErrHistoryLost", gen, err)
		}
	}
	if err := r.WriteAt(replica.Op{Epoch: 1, Generation: 4}, pattern(2), 0); err != nil {
		t.Fatal(err)
	}
	got, err := r.WrittenSince(op, 4)
	if err != nil || len(got) != 1 || got[0] != (replica.Extent{Off: 0, Len: testRegionSize}) {
		t.Fatalf("WrittenSince(4) = %+v, %v; want region 0", got, err)
	}
}

// TestLeftoversAreCleaned: an interrupted Create or Delete, an orphaned
// layer of an interrupted snapshot cut and temporary files are removed at
// open; nothing else is.
func TestLeftoversAreCleaned(t *testing.T) {
	dir := t.TempDir()
	cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t)}
	s := openStore(t, cfg)
	create(t, s, "r", 1<<20)
	s.Close()
	mk := func(path string) {
		os.MkdirAll(filepath.Dir(path), 0o755)
		os.WriteFile(path, []byte("x"), 0o644)
	}
	leftovers := []string{
		filepath.Join(dir, ".creating-x", "meta.json"),
		filepath.Join(dir, ".deleting-y", "meta.json"),
		filepath.Join(dir, "r", "layer-00000099.data"),
		filepath.Join(dir, "r", "layer-00000099.idx"),
		filepath.Join(dir, "r", "meta.json.tmp"),
	}
	for _, p := range leftovers {
		mk(p)
	}
	keep := filepath.Join(dir, "not a replica", "file")
	mk(keep)
	s = openStore(t, cfg)
	defer s.Close()
	for _, p := range leftovers {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s survived the open: %v", p, err)
		}
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("a foreign directory was touched: %v", err)
	}
	if len(s.List()) != 1 {
		t.Errorf("List: %d replicas", len(s.List()))
	}
}

// TestPunchHoleFreesSpace: on the real filesystem, WriteZeroes and Trim
// deallocate the blocks of the head's data file.
func TestPunchHoleFreesSpace(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, replica.Config{Dir: dir, Logger: replicatest.Logger(t)})
	defer s.Close()
	r := create(t, s, "r", 16<<20)
	data := make([]byte, 8<<20)
	rand.New(rand.NewSource(1)).Read(data)
	if err := r.WriteAt(op, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "r", "layer-00000001.data")
	allocated := func() int64 {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return st.Sys().(*syscall.Stat_t).Blocks * 512
	}
	before := allocated()
	if before < 8<<20 {
		t.Fatalf("%d bytes allocated after writing 8 MiB", before)
	}
	if err := r.Trim(op, 0, 4<<20); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteZeroes(op, 4<<20, 4<<20-4096); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	if after := allocated(); after > 64<<10 {
		t.Fatalf("%d bytes still allocated after zeroing all but 4 KiB (before: %d)", after, before)
	}
	got := make([]byte, 8<<20)
	if err := r.ReadAt(op, got, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 8<<20)
	copy(want[8<<20-4096:], data[8<<20-4096:])
	if !bytes.Equal(got, want) {
		t.Fatalf("contents after punching differ")
	}
}

// TestSnapshotOpsFailingHalfway: a cut or a delete that fails half-way (an
// I/O error, then a crash) changes no view; the snapshot set is as before
// the failed call, and the call can be retried.
func TestSnapshotOpsFailingHalfway(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r", 1<<20)
	rng := rand.New(rand.NewSource(11))
	base := make([]byte, 256<<10)
	rng.Read(base)
	if err := r.WriteAt(op, base, 0); err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(op, "s1"); err != nil {
		t.Fatal(err)
	}
	over := make([]byte, 64<<10)
	rng.Read(over)
	if err := r.WriteAt(op, over, 128<<10); err != nil {
		t.Fatal(err)
	}
	head := make([]byte, 1<<20)
	copy(head, base)
	copy(head[128<<10:], over)
	snap := make([]byte, 1<<20)
	copy(snap, base)
	check := func(what string, r *replica.Replica, snaps string) {
		t.Helper()
		got := make([]byte, 1<<20)
		if err := r.ReadAt(op, got, 0); err != nil || !bytes.Equal(got, head) {
			t.Fatalf("%s: head differs (%v)", what, err)
		}
		if fmtSnaps(r) != snaps {
			t.Fatalf("%s: snapshots %s, want %s", what, fmtSnaps(r), snaps)
		}
		if err := r.ReadSnapshotAt(op, "s1", got, 0); err != nil || !bytes.Equal(got, snap) {
			t.Fatalf("%s: snapshot s1 differs (%v)", what, err)
		}
	}

	// A cut whose meta.json rename fails.
	rule := e.efs.Add(errorfs.Rule{Path: "meta.json", Ops: errorfs.OpRename, Times: 1})
	if err := r.CreateSnapshot(op, "s2"); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("cut with a failing rename: %v", err)
	}
	if e.efs.Fired(rule) != 1 {
		t.Fatalf("rule did not fire")
	}
	check("after a failed cut", r, "[s1]")

	// A delete whose copy into the head fails after some blocks.
	e.efs.Add(errorfs.Rule{Path: "layer-00000002.data", Ops: errorfs.OpWrite, After: 3, Times: 1})
	if err := r.DeleteSnapshot(op, "s1"); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("delete with a failing copy: %v", err)
	}
	check("after a failed delete", r, "[s1]")
	s = e.crash()
	r = get(t, s, "r")
	check("after a failed delete and a crash", r, "[s1]")

	// A delete whose meta.json rename fails, then a crash.
	e.efs.Add(errorfs.Rule{Path: "meta.json", Ops: errorfs.OpRename, Times: 1})
	if err := r.DeleteSnapshot(op, "s1"); !errors.Is(err, replica.ErrIO) {
		t.Fatalf("delete with a failing rename: %v", err)
	}
	check("after a delete that failed at the end", r, "[s1]")
	s = e.crash()
	r = get(t, s, "r")
	check("after that and a crash", r, "[s1]")
	if err := r.DeleteSnapshot(op, "s1"); err != nil {
		t.Fatalf("retried delete: %v", err)
	}
	got := make([]byte, 1<<20)
	if err := r.ReadAt(op, got, 0); err != nil || !bytes.Equal(got, head) {
		t.Fatalf("head after the delete differs (%v)", err)
	}
	s.Close()
}

func fmtSnaps(r *replica.Replica) string { return fmt.Sprint(r.Snapshots()) }

// TestFailedCreateLeavesNothingBehind: a Create that fails after its
// directory was renamed into place (here: the open of the new replica's
// files hits EMFILE, as a server past its open-file limit does) leaves no
// directory that a retried Create refuses or a reopened store serves, and
// the retried Create succeeds.
func TestFailedCreateLeavesNothingBehind(t *testing.T) {
	for _, tc := range []struct {
		name string
		rule errorfs.Rule // fires rule.Times times
	}{
		// Out of descriptors, the store closes idle replicas and tries
		// once more: the second failure fails the create.
		{"open EMFILE", errorfs.Rule{Path: "/stor/r1/epoch", Ops: errorfs.OpOpen, Err: syscall.EMFILE, Times: 2}},
		{"layer open EIO", errorfs.Rule{Path: "/stor/r1/layer-", Ops: errorfs.OpOpen, Times: 1}},
		{"dir sync EIO", errorfs.Rule{Path: "/stor", Ops: errorfs.OpSyncDir, After: 1, Times: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newMemEnv(t)
			s := e.open()
			fired := e.efs.Add(tc.rule)
			_, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v", Size: 1 << 20})
			if err == nil || e.efs.Fired(fired) != tc.rule.Times {
				t.Fatalf("Create with a failing %s: %v (rule fired %d times)", tc.name, err, e.efs.Fired(fired))
			}
			ents, err := e.mem.ReadDir("/stor")
			if err != nil {
				t.Fatal(err)
			}
			for _, ent := range ents {
				t.Errorf("a failed create left %s behind", ent.Name())
			}
			if _, err := s.Get("r1"); !errors.Is(err, replica.ErrNotFound) {
				t.Errorf("Get after a failed create: %v, want ErrNotFound", err)
			}
			r := create(t, s, "r1", 1<<20)
			if err := r.WriteAt(op, pattern(7), 0); err != nil {
				t.Fatalf("WriteAt: %v", err)
			}
			if got := readBlock(t, r, 0); !bytes.Equal(got, pattern(7)) {
				t.Errorf("read back %x..., want 07...", got[:4])
			}
			s.Close()
		})
	}
}

// TestCreateAdoptsWhatAFailedUndoLeft: when a failed Create cannot even
// move its directory away, a retried Create of the same replica adopts it,
// and one for another volume is refused.
func TestCreateAdoptsWhatAFailedUndoLeft(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	defer s.Close()
	e.efs.Add(errorfs.Rule{Path: "/stor/r1/dirty", Ops: errorfs.OpOpen, Times: 2, Err: syscall.EMFILE})
	e.efs.Add(errorfs.Rule{Path: ".deleting-r1", Ops: errorfs.OpRename, Times: 1})
	if _, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v", Size: 1 << 20}); err == nil {
		t.Fatal("Create succeeded with a failing open")
	}
	if _, err := s.Create(replica.Spec{ID: "r1", VolumeID: "other", Size: 1 << 20}); !errors.Is(err, replica.ErrExists) {
		t.Errorf("Create for another volume: %v, want ErrExists", err)
	}
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v", Size: 2 << 20})
	if err != nil {
		t.Fatalf("retried Create: %v", err)
	}
	if r.Size() != 2<<20 {
		t.Errorf("adopted replica has size %d, want %d", r.Size(), 2<<20)
	}
	if err := r.WriteAt(op, pattern(3), 1<<20); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	if got := readBlock(t, r, 1<<20); !bytes.Equal(got, pattern(3)) {
		t.Errorf("read back %x..., want 03...", got[:4])
	}
}

// TestRegionsDirtyAtACrashStayDirtyUntilSettled: a write the replica
// acknowledged but had not flushed is lost in a crash; its region, dirty
// in the log, is the only record of that. The replica comes back faulty
// (its volume's engine lost its connection) and rejoins to be rebuilt,
// and the engine's flushes reach it before the rebuild reads its dirty
// regions. Two flushes used to clear the region, so a delta rebuild left
// the lost write out and the replica was recorded healthy without it.
// Such a region now stays dirty, whatever the flushes, until an
// EndRebuild with FUA (a rebuild or a reconcile that copied it); then
// the usual rule clears it.
func TestRegionsDirtyAtACrashStayDirtyUntilSettled(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r1", 4*testRegionSize)
	if err := r.Flush(op); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteAt(op, pattern(7), testRegionSize); err != nil { // acknowledged, not flushed
		t.Fatal(err)
	}
	s = e.crash()
	defer s.Close()
	r = get(t, s, "r1")
	if got := readBlock(t, r, testRegionSize); !bytes.Equal(got, make([]byte, replica.BlockSize)) {
		t.Fatal("the crash kept the unflushed write: this test needs it lost")
	}
	want := []replica.Extent{{Off: testRegionSize, Len: testRegionSize}}
	dirty := func() []replica.Extent {
		t.Helper()
		d, err := r.DirtyRegions(op)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for i := range 3 { // the engine's flushes, the replica rejoining
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
		if d := dirty(); !slices.Equal(d, want) {
			t.Fatalf("after flush %d the dirty regions are %v; want %v, the region of the write the crash lost", i+1, d, want)
		}
	}
	if err := r.EndRebuild(op); err != nil { // a reset, or a rebuild given up: not settled
		t.Fatal(err)
	}
	for range 2 {
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
	}
	if d := dirty(); !slices.Equal(d, want) {
		t.Fatalf("after an EndRebuild without FUA and two flushes the dirty regions are %v; want %v", d, want)
	}
	settled := op
	settled.FUA = true
	if err := r.EndRebuild(settled); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
	}
	if d := dirty(); len(d) != 0 {
		t.Fatalf("after the settling EndRebuild and two flushes the dirty regions are %v; want none", d)
	}
}
