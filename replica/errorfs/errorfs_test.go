package errorfs_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"syscall"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
)

func mustOpen(t *testing.T, fsys replica.FS, name string, flag int) replica.File {
	t.Helper()
	f, err := fsys.OpenFile(name, flag, 0o644)
	if err != nil {
		t.Fatalf("open %s: %v", name, err)
	}
	return f
}

func content(t *testing.T, fsys replica.FS, name string) []byte {
	t.Helper()
	f, err := fsys.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	st, _ := f.Stat()
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	return b
}

// TestMemFSCrashKeepsOnlySynced: CrashLoseAll keeps exactly what Sync and
// SyncDir made durable.
func TestMemFSCrashKeepsOnlySynced(t *testing.T) {
	m := errorfs.NewMemFS()
	m.MkdirAll("/d", 0o755)
	m.SyncDir("/")
	f := mustOpen(t, m, "/d/a", os.O_RDWR|os.O_CREATE)
	f.WriteAt(bytes.Repeat([]byte{1}, 5000), 0)
	f.Sync()
	m.SyncDir("/d")
	f.WriteAt(bytes.Repeat([]byte{2}, 100), 4096) // unsynced, second page
	f.WriteAt([]byte{3}, 9000)                    // unsynced extension
	g := mustOpen(t, m, "/d/b", os.O_RDWR|os.O_CREATE)
	g.WriteAt([]byte("x"), 0)
	g.Sync() // synced data, but the name is not

	c := m.CrashLoseAll()
	if got := content(t, c, "/d/a"); !bytes.Equal(got, bytes.Repeat([]byte{1}, 5000)) {
		t.Fatalf("a after a crash: %d bytes, want the synced 5000 bytes of 1", len(got))
	}
	if _, err := c.Stat("/d/b"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("b's name was never synced but survived: %v", err)
	}
	// The original is untouched.
	if got := content(t, m, "/d/a"); len(got) != 9001 || got[4096] != 2 {
		t.Fatalf("the crashed-from FS changed")
	}
}

// TestMemFSCrashTearsPages: Crash keeps or reverts each unsynced page on
// its own, and never invents content.
func TestMemFSCrashTearsPages(t *testing.T) {
	m := errorfs.NewMemFS()
	f := mustOpen(t, m, "/f", os.O_RDWR|os.O_CREATE)
	f.WriteAt(make([]byte, 8*errorfs.PageSize), 0)
	f.Sync()
	m.SyncDir("/")
	f.WriteAt(bytes.Repeat([]byte{9}, 8*errorfs.PageSize), 0)
	seen := map[string]bool{}
	for seed := range int64(20) {
		got := content(t, m.Crash(seed), "/f")
		var pattern []byte
		for p := range 8 {
			page := got[p*errorfs.PageSize : (p+1)*errorfs.PageSize]
			switch {
			case bytes.Equal(page, make([]byte, errorfs.PageSize)):
				pattern = append(pattern, '0')
			case bytes.Equal(page, bytes.Repeat([]byte{9}, errorfs.PageSize)):
				pattern = append(pattern, '9')
			default:
				t.Fatalf("seed %d: page %d is torn inside", seed, p)
			}
		}
		seen[string(pattern)] = true
	}
	if len(seen) < 5 {
		t.Fatalf("crashes produced only %d page patterns: %v", len(seen), seen)
	}
}

// TestMemFSRenameAndPunch: rename replaces its target; punched ranges
// read as zeroes and a punch past the end does not grow the file.
func TestMemFSRenameAndPunch(t *testing.T) {
	m := errorfs.NewMemFS()
	f := mustOpen(t, m, "/a", os.O_RDWR|os.O_CREATE)
	f.WriteAt(bytes.Repeat([]byte{5}, 3*errorfs.PageSize), 0)
	if err := f.PunchHole(100, errorfs.PageSize*2); err != nil {
		t.Fatal(err)
	}
	if err := f.PunchHole(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	st, _ := f.Stat()
	if st.Size() != 3*errorfs.PageSize {
		t.Fatalf("size %d after punching, want %d", st.Size(), 3*errorfs.PageSize)
	}
	if got := content(t, m, "/a"); !bytes.Equal(got, make([]byte, 3*errorfs.PageSize)) {
		t.Fatalf("punched file is not zeroes")
	}
	g := mustOpen(t, m, "/b", os.O_RDWR|os.O_CREATE)
	g.WriteAt([]byte("new"), 0)
	if err := m.Rename("/b", "/a"); err != nil {
		t.Fatal(err)
	}
	if got := content(t, m, "/a"); string(got) != "new" {
		t.Fatalf("after rename: %q", got)
	}
	if _, err := m.Stat("/b"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("old name survived a rename: %v", err)
	}
	if _, err := m.OpenFile("/a", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0); !errors.Is(err, os.ErrExist) {
		t.Fatalf("O_EXCL on an existing file: %v", err)
	}
}

// TestRules: path and op selection, After, Times, torn writes and skipped
// syncs do what they say.
func TestRules(t *testing.T) {
	m := errorfs.NewMemFS()
	fsys := errorfs.New(m, 1)
	f := mustOpen(t, fsys, "/data", os.O_RDWR|os.O_CREATE)
	other := mustOpen(t, fsys, "/other", os.O_RDWR|os.O_CREATE)

	r := fsys.Add(errorfs.Rule{Path: "data", Ops: errorfs.OpWrite, After: 2, Times: 1, Err: syscall.ENOSPC})
	for i := range 4 {
		_, err := f.WriteAt([]byte("x"), int64(i))
		if (i == 2) != (err != nil) {
			t.Fatalf("write %d: %v", i, err)
		}
		if i == 2 && !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("write %d: %v, want ENOSPC", i, err)
		}
		if _, err := other.WriteAt([]byte("x"), 0); err != nil {
			t.Fatalf("a rule for data fired on other: %v", err)
		}
	}
	if fsys.Fired(r) != 1 {
		t.Fatalf("fired %d times", fsys.Fired(r))
	}
	fsys.Drop(r)

	fsys.Add(errorfs.Rule{Ops: errorfs.OpWrite, Action: errorfs.TornFail, TornBytes: 512, Times: 1})
	n, err := f.WriteAt(bytes.Repeat([]byte{7}, 2048), 0)
	if n != 512 || !errors.Is(err, syscall.EIO) {
		t.Fatalf("torn write: %d, %v; want 512 bytes and EIO", n, err)
	}
	fsys.Add(errorfs.Rule{Ops: errorfs.OpWrite, Action: errorfs.TornSkip, TornBytes: 1024, Times: 1})
	n, err = f.WriteAt(bytes.Repeat([]byte{8}, 2048), 4096)
	if n != 2048 || err != nil {
		t.Fatalf("lying torn write: %d, %v; want a claimed success", n, err)
	}
	got := content(t, m, "/data")
	if got[511] != 7 || got[512] == 7 || got[4096+1023] != 8 || len(got) != 4096+1024 {
		t.Fatalf("torn writes applied the wrong prefix")
	}

	fsys.Add(errorfs.Rule{Ops: errorfs.OpSync, Action: errorfs.Skip})
	if err := f.Sync(); err != nil {
		t.Fatalf("skipped sync: %v", err)
	}
	m.SyncDir("/")
	if c := content(t, m.CrashLoseAll(), "/data"); len(c) != 0 {
		t.Fatalf("a skipped sync made %d bytes durable", len(c))
	}

	// Probabilistic rules are reproducible from the seed.
	fires := func() []bool {
		fsys := errorfs.New(errorfs.NewMemFS(), 42)
		fsys.Add(errorfs.Rule{Ops: errorfs.OpMkdir, Prob: 0.5})
		var out []bool
		for range 32 {
			out = append(out, fsys.MkdirAll("/x", 0o755) != nil)
		}
		return out
	}
	a, b := fires(), fires()
	hits := 0
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("same seed, different faults")
		}
		if a[i] {
			hits++
		}
	}
	if hits == 0 || hits == len(a) {
		t.Fatalf("probability 0.5 fired %d of %d times", hits, len(a))
	}
}
