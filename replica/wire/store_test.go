package wire

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"

	"github.com/stor-io/stor/replica"
)

// The real store satisfies the server's interface.
var _ Replica = (*replica.Replica)(nil)

// storeBackend serves a real replica store, as stor-server will.
func storeBackend(s *replica.Store) Backend {
	return BackendFunc(func(id string) (Replica, error) {
		r, err := s.Get(id)
		if err != nil {
			return nil, err
		}
		return r, nil
	})
}

func newStoreServer(tb testing.TB, size uint64) string {
	tb.Helper()
	addr, _ := newStoreServerWith(tb, "r1", size, ServerConfig{})
	return addr
}

// newStoreServerWith serves a real store holding one replica, id, of
// volume v1, with cfg (its Logger discards when unset); it returns the
// server's address and the store.
func newStoreServerWith(tb testing.TB, id string, size uint64, cfg ServerConfig) (string, *replica.Store) {
	tb.Helper()
	scfg := replica.DefaultConfig()
	scfg.Dir = tb.TempDir()
	scfg.Logger = discardLogger()
	st, err := replica.OpenStore(scfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { st.Close() })
	if _, err := st.Create(replica.Spec{ID: id, VolumeID: "v1", Size: size}); err != nil {
		tb.Fatal(err)
	}
	if cfg.Logger == nil {
		cfg.Logger = discardLogger()
	}
	srv, err := NewServer(storeBackend(st), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	go srv.Serve(ln)
	tb.Cleanup(func() { srv.Close() })
	return ln.Addr().String(), st
}

// TestRealStore runs the data path over the wire against the on-disk
// store: data survives the trip, and the store's errors keep their
// identity.
func TestRealStore(t *testing.T) {
	addr := newStoreServer(t, 8<<20)
	ctx := context.Background()
	c, err := Dial(ctx, "tcp", addr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Open(ctx, "nope", 1); !errors.Is(err, replica.ErrNotFound) {
		t.Fatalf("open of a missing replica: %v", err)
	}
	hd, err := c.Open(ctx, "r1", 3)
	if err != nil {
		t.Fatal(err)
	}
	if hd.Epoch() != 3 || hd.Size() != 8<<20 {
		t.Fatalf("open: epoch %d size %d", hd.Epoch(), hd.Size())
	}
	o := replica.Op{Epoch: 3, Generation: 1}
	data := pattern(11, 64<<10)
	if err := hd.WriteAt(ctx, replica.Op{Epoch: 3, Generation: 1, FUA: true}, data, 1<<20); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := hd.ReadAt(ctx, o, got, 1<<20); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if err := hd.CreateSnapshot(ctx, o, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := hd.WriteZeroes(ctx, o, 1<<20, 64<<10); err != nil {
		t.Fatal(err)
	}
	if err := hd.ReadSnapshotAt(ctx, o, "s1", got, 1<<20); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("snapshot read: %v", err)
	}
	es, err := hd.Extents(ctx, o, "s1", 0, 16)
	if err != nil || len(es) != 1 || es[0] != (replica.Extent{Off: 1 << 20, Len: 64 << 10}) {
		t.Fatalf("snapshot extents: %v %v", es, err)
	}
	if err := hd.Flush(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := hd.WriteAt(ctx, o, data[:4096], 100); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("misaligned write: %v", err)
	}
	// A newer attach fences this one, through another connection.
	c2, err := Dial(ctx, "tcp", addr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := c2.Open(ctx, "r1", 4); err != nil {
		t.Fatal(err)
	}
	if err := hd.WriteAt(ctx, o, data[:4096], 0); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("write after a newer open: %v, want ErrStaleEpoch", err)
	}
	if _, err := c.Open(ctx, "r1", 3); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("reopen at the old epoch: %v, want ErrStaleEpoch", err)
	}
}

// BenchmarkRealStoreWrite4K: pipelined 4 KiB writes (QD 32) to the
// on-disk store, page cache only (no FUA, no flush).
func BenchmarkRealStoreWrite4K(b *testing.B) {
	addr := newStoreServer(b, benchSize)
	c, err := Dial(context.Background(), "tcp", addr, ClientConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	hd, err := c.Open(context.Background(), "r1", 1)
	if err != nil {
		b.Fatal(err)
	}
	runIO(b, 32, 4096, writeOp(hd))
}
