package localread_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/localread"
	"github.com/stor-io/stor/replica/replicatest"
	"github.com/stor-io/stor/replica/wire"
)

type env struct {
	store  *replica.Store
	srv    *localread.Server
	client *localread.Client
	sock   string
}

func newEnv(t *testing.T) *env { return newEnvFS(t, nil) }

// newEnvFS is newEnv with the store on fsys (nil: the OS's).
func newEnvFS(t *testing.T, fsys replica.FS) *env {
	t.Helper()
	store, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), FS: fsys, Logger: replicatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	// Unix socket paths are short (108 bytes): not under t.TempDir().
	dir, err := os.MkdirTemp("", "lr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	ln, err := localread.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := localread.NewServer(store, "server-1", replicatest.Logger(t))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := localread.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	return &env{store: store, srv: srv, client: c, sock: sock}
}

func (e *env) open(t *testing.T, replicaID, volume string, epoch uint64) (*localread.View, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return e.client.Open(ctx, wire.OpenRequest{Replica: replicaID, Volume: volume, Epoch: epoch})
}

// TestAFailedWriteLeavesNothingADirectReadSees: a write to the head that
// fails after some of its bytes reached the file (a short write, then
// ENOSPC) leaves blocks the head's index does not hold. A read through the
// server skips them (zeroes, or an older layer's data); a view of a
// one-layer replica reads every block from the head file, and read the
// failed write's bytes there, so the same replica answered a read two
// ways. The failed write now punches them.
func TestAFailedWriteLeavesNothingADirectReadSees(t *testing.T) {
	efs := errorfs.New(replica.OS(), 1)
	e := newEnvFS(t, efs)
	r, err := e.store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1}
	if err := r.Fence(1); err != nil {
		t.Fatal(err)
	}
	// A partial block first: it is copied up, and its write fails too.
	for _, w := range []struct {
		off, n int64
	}{{0, 3 * 4096}, {5*4096 + 100, 200}} {
		efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpWrite, Action: errorfs.TornFail, TornBytes: 4096, Times: 1, Err: syscall.ENOSPC})
		if err := r.WriteAt(o, bytes.Repeat([]byte{0x5a}, int(w.n)), w.off); err == nil {
			t.Fatalf("the write of %d bytes at %d did not fail", w.n, w.off)
		}
	}
	if err := r.Failed(); err != nil {
		t.Fatalf("the replica failed: %v", err)
	}
	v, err := e.open(t, "r1", "v1", 1)
	if err != nil {
		t.Fatalf("no view: %v", err)
	}
	defer v.Close()
	for b := int64(0); b < 8; b++ {
		viaServer, direct := make([]byte, 4096), make([]byte, 4096)
		if err := r.ReadAt(o, viaServer, b*4096); err != nil {
			t.Fatal(err)
		}
		if err := v.ReadAt(direct, b*4096); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(direct, viaServer) {
			t.Fatalf("block %d after a failed write: the view reads %x..., the server %x...", b, direct[:4], viaServer[:4])
		}
	}
}

// TestViewReadsAndGoesStale: a View reads what the server's replica
// holds (later writes through the server included, zeroes where nothing
// was written), and fails with ErrStale once a newer epoch, a snapshot or
// the replica's close moved the read generation; opening is refused for
// an old epoch, a snapshot chain, another volume and an unknown replica.
func TestViewReadsAndGoesStale(t *testing.T) {
	e := newEnv(t)
	if got := e.client.ServerID(); got != "server-1" {
		t.Fatalf("ServerID %q", got)
	}
	r, err := e.store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 5, Generation: 1}
	a := bytes.Repeat([]byte{1}, 65536)
	if err := r.WriteAt(o, a, 1<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := e.open(t, "r1", "v1", 4); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("open at an old epoch: %v, want ErrStaleEpoch", err)
	}
	if _, err := e.open(t, "r1", "v2", 5); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("open for another volume: %v, want ErrInvalid", err)
	}
	if _, err := e.open(t, "nope", "v1", 5); !errors.Is(err, replica.ErrNotFound) {
		t.Fatalf("open of an unknown replica: %v, want ErrNotFound", err)
	}
	v, err := e.open(t, "r1", "v1", 5)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()

	check := func(off int64, want []byte) {
		t.Helper()
		got := bytes.Repeat([]byte{0xee}, len(want))
		if err := v.ReadAt(got, off); err != nil {
			t.Fatalf("ReadAt %d: %v", off, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("ReadAt %d: not what the replica holds", off)
		}
	}
	check(1<<20, a)
	check(0, make([]byte, 8192))      // never written
	check(3<<20, make([]byte, 65536)) // past the data file's end
	b := bytes.Repeat([]byte{2}, 4096)
	if err := r.WriteAt(o, b, 1<<20); err != nil {
		t.Fatal(err)
	}
	check(1<<20, append(b, a[4096:]...)) // a write through the server is seen
	if err := r.WriteZeroes(o, 1<<20, 4096); err != nil {
		t.Fatal(err)
	}
	check(1<<20, append(make([]byte, 4096), a[4096:]...))

	// A newer attach fences: the View goes stale.
	if err := r.Fence(6); err != nil {
		t.Fatal(err)
	}
	if err := v.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
		t.Fatalf("read after a newer epoch: %v, want ErrStale", err)
	}
	o.Epoch = 6
	v2, err := e.open(t, "r1", "v1", 6)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(o, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := v2.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
		t.Fatalf("read after a snapshot: %v, want ErrStale", err)
	}
	v2.Close()
	// With the snapshot layer: blocks come from the snapshot's layer until
	// a write the View was told of (Track) puts them in the head.
	vs, err := e.open(t, "r1", "v1", 6)
	if err != nil {
		t.Fatalf("open with a snapshot layer: %v", err)
	}
	v = vs
	check(1<<20, append(make([]byte, 4096), a[4096:]...))
	c := bytes.Repeat([]byte{3}, 8192)
	if !vs.Track(1<<20+4096, 8192) {
		t.Fatal("Track refused two blocks")
	}
	if err := r.WriteAt(o, c, 1<<20+4096); err != nil {
		t.Fatal(err)
	}
	want := append(append(make([]byte, 4096), c...), a[12288:]...)
	check(1<<20, want)
	if !vs.Track(1<<20+16384, 4096) {
		t.Fatal("Track refused a block")
	}
	if err := r.WriteZeroes(o, 1<<20+16384, 4096); err != nil {
		t.Fatal(err)
	}
	copy(want[16384:20480], make([]byte, 4096))
	check(1<<20, want) // zeroed in the head: the snapshot's data is masked
	vs.Close()
	if err := r.DeleteSnapshot(o, "s1"); err != nil {
		t.Fatal(err)
	}
	v3, err := e.open(t, "r1", "v1", 6)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.store.Delete("r1"); err != nil {
		t.Fatal(err)
	}
	if err := v3.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
		t.Fatalf("read after the replica was deleted: %v, want ErrStale", err)
	}
	v3.Close()
	if err := v3.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
		t.Fatalf("read on a closed View: %v, want ErrStale", err)
	}
}

// TestListenReplacesOnlySockets: a stale socket is replaced, any other
// file is left alone, and the socket is private.
func TestListenReplacesOnlySockets(t *testing.T) {
	dir, err := os.MkdirTemp("", "lr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	ln, err := localread.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	ln, err = localread.Listen(sock)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer ln.Close()
	if _, err := localread.Listen(sock); err == nil {
		t.Fatal("Listen took over a socket another listener serves")
	}
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want 0600", fi.Mode().Perm())
	}
	plain := filepath.Join(dir, "f")
	if err := os.WriteFile(plain, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := localread.Listen(plain); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("the regular file is gone: %v", err)
	}
}

// TestViewEndsWithTheServer: a View is stale once the server that opened
// it is gone, though nothing advanced the read generation (a server
// process that dies cannot): it must not go on reading a replica no
// server guards any more, which a newer attach may have fenced elsewhere.
func TestViewEndsWithTheServer(t *testing.T) {
	e := newEnv(t)
	r, err := e.store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(1); err != nil {
		t.Fatal(err)
	}
	v, err := e.open(t, "r1", "v1", 1)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if err := v.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("read: %v", err)
	}
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := v.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
		t.Fatalf("read after the server closed: %v, want ErrStale", err)
	}
}

// TestAViewEndsWhenItsReplicaCannotAdvanceItsReadGeneration: a replica
// that fails, or closes, advances its read generation so that open views
// go stale. When that cannot be done (the readgen file cannot be opened
// or written: EMFILE, or EROFS after ext4 remounted read-only), the
// server ends the views by closing their connections instead. Before,
// such a view stayed valid and went on reading a failed replica's files,
// or a deleted replica's.
func TestAViewEndsWhenItsReplicaCannotAdvanceItsReadGeneration(t *testing.T) {
	failFlush := func(e *env, efs *errorfs.FS, r *replica.Replica) {
		efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpSync})
		if err := r.Flush(replica.Op{Epoch: 1}); err == nil {
			t.Fatal("the flush did not fail")
		}
		if r.Failed() == nil {
			t.Fatal("the replica did not fail")
		}
	}
	for _, tc := range []struct {
		name   string
		ops    errorfs.Op
		err    error
		change func(e *env, efs *errorfs.FS, r *replica.Replica)
	}{
		{"failed, readgen not writable", errorfs.OpWrite, syscall.EROFS, failFlush},
		{"failed, readgen not openable", errorfs.OpOpen, syscall.EMFILE, failFlush},
		{"deleted, readgen not writable", errorfs.OpWrite, syscall.EROFS, func(e *env, efs *errorfs.FS, r *replica.Replica) {
			if err := e.store.Delete("r1"); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			efs := errorfs.New(replica.OS(), 1)
			e := newEnvFS(t, efs)
			r, err := e.store.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			o := replica.Op{Epoch: 1}
			if err := r.WriteAt(o, bytes.Repeat([]byte{7}, 4096), 0); err != nil {
				t.Fatal(err)
			}
			v, err := e.open(t, "r1", "v1", 1)
			if err != nil {
				t.Fatal(err)
			}
			defer v.Close()
			if err := v.ReadAt(make([]byte, 4096), 0); err != nil {
				t.Fatalf("read before the change: %v", err)
			}
			efs.Add(errorfs.Rule{Path: "readgen", Ops: tc.ops, Err: tc.err})
			tc.change(e, efs, r)
			if err := v.ReadAt(make([]byte, 4096), 0); !errors.Is(err, localread.ErrStale) {
				t.Fatalf("read after the change, the read generation not advanced: %v, want ErrStale", err)
			}
		})
	}
}
