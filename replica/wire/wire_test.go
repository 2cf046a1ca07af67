package wire

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

const testSize = 16 << 20

// harness is a server on loopback TCP over fake replicas.
type harness struct {
	t       testing.TB
	backend fakeBackend
	srv     *Server
	addr    string
	served  chan error // Serve's result
}

func newHarness(t testing.TB, cfg ServerConfig, replicas ...*fakeReplica) *harness {
	t.Helper()
	if len(replicas) == 0 {
		replicas = []*fakeReplica{newFakeReplica("r1", testSize)}
	}
	b := fakeBackend{}
	for _, r := range replicas {
		b[r.id] = r
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	srv, err := NewServer(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, backend: b, srv: srv, addr: ln.Addr().String(), served: make(chan error, 1)}
	go func() { h.served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-h.served; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return h
}

func (h *harness) dial(cfg ClientConfig) *Conn {
	h.t.Helper()
	c, err := Dial(context.Background(), "tcp", h.addr, cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { c.Close() })
	return c
}

func (h *harness) open(id string, epoch uint64) (*Conn, *Handle) {
	h.t.Helper()
	c := h.dial(ClientConfig{})
	hd, err := c.Open(context.Background(), id, epoch)
	if err != nil {
		h.t.Fatal(err)
	}
	return c, hd
}

func pattern(seed uint64, n int) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i < n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8 && i+j < n; j++ {
			p[i+j] = byte(v >> (8 * j))
		}
	}
	return p
}

// waitGoroutines waits for the goroutine count to fall back to base.
func waitGoroutines(t *testing.T, base int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%d goroutines, want at most %d:\n%s", runtime.NumGoroutine(), base, buf)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// gate holds requests in the fake store until opened.
type gate struct {
	open    chan struct{}
	entered chan string
}

func newGate() *gate { return &gate{open: make(chan struct{}), entered: make(chan string, 1024)} }

// hook blocks the ops for which match returns true.
func (g *gate) hook(match func(op string, off int64) bool) func(string, int64) error {
	return func(op string, off int64) error {
		if match(op, off) {
			g.entered <- fmt.Sprintf("%s@%d", op, off)
			<-g.open
		}
		return nil
	}
}

func (g *gate) wait(t *testing.T, n int) {
	t.Helper()
	for range n {
		select {
		case <-g.entered:
		case <-time.After(5 * time.Second):
			t.Fatal("requests did not reach the store")
		}
	}
}

func TestEveryOpRoundTrips(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	f := h.backend["r1"]
	ctx := context.Background()
	c, hd := h.open("r1", 5)
	if hd.Size() != testSize || hd.Epoch() != 5 || hd.ReplicaID() != "r1" {
		t.Fatalf("open: size %d epoch %d id %q", hd.Size(), hd.Epoch(), hd.ReplicaID())
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	// Each call must reach the store with its Op and arguments intact.
	expect := func(what string, o replica.Op, arg string) {
		t.Helper()
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.lastOp != o || f.lastArg != arg {
			t.Fatalf("%s: store saw %+v %q, want %+v %q", what, f.lastOp, f.lastArg, o, arg)
		}
	}
	o := replica.Op{Epoch: 5, Generation: 7}
	fua := replica.Op{Epoch: 5, Generation: 7, FUA: true}

	data := pattern(1, 3*replica.BlockSize)
	if err := hd.WriteAt(ctx, fua, data, 8192); err != nil {
		t.Fatal(err)
	}
	expect("WriteAt", fua, argString("WriteAt", 8192, len(data)))
	got := make([]byte, len(data))
	if err := hd.ReadAt(ctx, o, got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("ReadAt: %v, equal %v", err, bytes.Equal(got, data))
	}
	expect("ReadAt", o, argString("ReadAt", 8192, len(data)))

	if err := hd.CreateSnapshot(ctx, o, "s1"); err != nil {
		t.Fatal(err)
	}
	expect("CreateSnapshot", o, argString("CreateSnapshot", "s1"))

	if err := hd.WriteZeroes(ctx, fua, 8192, 4096); err != nil {
		t.Fatal(err)
	}
	expect("WriteZeroes", fua, argString("WriteZeroes", 8192, 4096))
	if err := hd.Trim(ctx, o, 16384, 4096); err != nil {
		t.Fatal(err)
	}
	expect("Trim", o, argString("Trim", 16384, 4096))
	if err := hd.ReadAt(ctx, o, got, 8192); err != nil {
		t.Fatal(err)
	}
	want := append(make([]byte, 4096), data[4096:8192]...)
	want = append(want, make([]byte, 4096)...)
	if !bytes.Equal(got, want) {
		t.Fatal("head after WriteZeroes and Trim: wrong contents")
	}
	if err := hd.ReadSnapshotAt(ctx, o, "s1", got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("ReadSnapshotAt: %v, equal %v", err, bytes.Equal(got, data))
	}
	expect("ReadSnapshotAt", o, argString("ReadSnapshotAt", "s1", 8192, len(data)))

	es, err := hd.Extents(ctx, o, "", 0, 10)
	if err != nil || !equalExtents(es, []replica.Extent{{Off: 12288, Len: 4096}}) {
		t.Fatalf("Extents(head) = %v, %v", es, err)
	}
	expect("Extents", o, argString("Extents", "", 0, 10))
	es, err = hd.Extents(ctx, o, "s1", 4096, 1)
	if err != nil || !equalExtents(es, []replica.Extent{{Off: 8192, Len: 12288}}) {
		t.Fatalf("Extents(s1) = %v, %v", es, err)
	}
	expect("Extents(s1)", o, argString("Extents", "s1", 4096, 1))

	if err := hd.Flush(ctx, o); err != nil {
		t.Fatal(err)
	}
	expect("Flush", o, "Flush")
	f.mu.Lock()
	flushes := f.flushes
	f.mu.Unlock()
	if flushes != 1 {
		t.Fatalf("flushes = %d", flushes)
	}

	if err := hd.Grow(ctx, o, 2*testSize); err != nil {
		t.Fatal(err)
	}
	expect("Grow", o, argString("Grow", 2*testSize))
	if hd.Size() != 2*testSize || f.Size() != 2*testSize {
		t.Fatalf("size after Grow: handle %d, store %d", hd.Size(), f.Size())
	}

	f.mu.Lock()
	f.dirty = []replica.Extent{{Off: 0, Len: 1 << 20}, {Off: 5 << 20, Len: 2 << 20}}
	f.mu.Unlock()
	es, err = hd.DirtyRegions(ctx, o)
	if err != nil || !equalExtents(es, f.dirty) {
		t.Fatalf("DirtyRegions = %v, %v", es, err)
	}
	expect("DirtyRegions", o, "DirtyRegions")

	o8 := replica.Op{Epoch: 5, Generation: 8}
	if err := hd.WriteAt(ctx, o8, data[:4096], 1<<20); err != nil {
		t.Fatal(err)
	}
	es, err = hd.WrittenSince(ctx, o8, 7)
	if err != nil || !equalExtents(es, []replica.Extent{{Off: 1 << 20, Len: 4096}}) {
		t.Fatalf("WrittenSince = %v, %v", es, err)
	}
	expect("WrittenSince", o8, argString("WrittenSince", 7))

	if err := hd.BeginRebuild(ctx, o8); err != nil {
		t.Fatal(err)
	}
	expect("BeginRebuild", o8, "BeginRebuild")
	if err := hd.RebuildWrite(ctx, o8, data, 2<<20); err != nil {
		t.Fatal(err)
	}
	expect("RebuildWrite", o8, argString("RebuildWrite", 2<<20, len(data)))
	if err := hd.EndRebuild(ctx, o8); err != nil {
		t.Fatal(err)
	}
	expect("EndRebuild", o8, "EndRebuild")
	f.mu.Lock()
	rebuilt := f.rebuilt
	f.mu.Unlock()
	if err := hd.ReadAt(ctx, o8, got, 2<<20); err != nil || !bytes.Equal(got, data) || rebuilt != 1 {
		t.Fatalf("after rebuild: %v, equal %v, rebuilt %d", err, bytes.Equal(got, data), rebuilt)
	}

	if err := hd.DeleteSnapshot(ctx, o8, "s1"); err != nil {
		t.Fatal(err)
	}
	expect("DeleteSnapshot", o8, argString("DeleteSnapshot", "s1"))

	// Empty I/O goes through too; the store decides.
	if err := hd.ReadAt(ctx, o8, nil, 0); err != nil {
		t.Fatal(err)
	}

	if err := hd.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := hd.Flush(ctx, o8); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("Flush on a closed handle: %v, want ErrClosed", err)
	}
	// A second handle on the same connection, to the same replica.
	hd2, err := c.Open(ctx, "r1", 0)
	if err != nil || hd2.Epoch() != 5 || hd2.Size() != 2*testSize {
		t.Fatalf("reopen: %v", err)
	}
	if hd2.id == hd.id {
		t.Fatal("handle ids reused on a connection")
	}
}

func equalExtents(a, b []replica.Extent) bool {
	return len(a) == len(b) && (len(a) == 0 || fmt.Sprint(a) == fmt.Sprint(b))
}

func TestErrorsMapToSentinels(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	f := h.backend["r1"]
	ctx := context.Background()
	c, hd := h.open("r1", 10)
	o := replica.Op{Epoch: 10}
	buf := make([]byte, 4096)

	sentinels := []error{
		replica.ErrStaleEpoch, replica.ErrNotFound, replica.ErrExists, replica.ErrInvalid,
		replica.ErrIO, replica.ErrNoSpace, replica.ErrCorrupt, replica.ErrHistoryLost,
		replica.ErrClosed, ErrBadHandle, ErrUnknownOp, ErrProtocol, ErrChecksum,
		ErrInternal, ErrDisconnected,
	}
	only := func(t *testing.T, err, want error) {
		t.Helper()
		for _, s := range sentinels {
			if got := errors.Is(err, s); got != (s == want) {
				t.Fatalf("error %q: errors.Is(%v) = %v", err, s, got)
			}
		}
	}

	// The store's own errors, produced by the fake's logic.
	natural := []struct {
		name string
		call func() error
		want error
	}{
		{"stale epoch", func() error { return hd.WriteAt(ctx, replica.Op{Epoch: 9}, buf, 0) }, replica.ErrStaleEpoch},
		{"stale open", func() error { _, err := c.Open(ctx, "r1", 3); return err }, replica.ErrStaleEpoch},
		{"unknown replica", func() error { _, err := c.Open(ctx, "nope", 1); return err }, replica.ErrNotFound},
		{"unknown snapshot", func() error { return hd.ReadSnapshotAt(ctx, o, "nope", buf, 0) }, replica.ErrNotFound},
		{"misaligned", func() error { return hd.WriteAt(ctx, o, buf, 100) }, replica.ErrInvalid},
		{"out of range", func() error { return hd.ReadAt(ctx, o, buf, testSize) }, replica.ErrInvalid},
		{"history lost", func() error {
			f.mu.Lock()
			f.historyFloor = 100
			f.mu.Unlock()
			_, err := hd.WrittenSince(ctx, o, 50)
			return err
		}, replica.ErrHistoryLost},
		// Refused by the client before sending.
		{"oversized write", func() error { return hd.WriteAt(ctx, o, make([]byte, replica.MaxIO+512), 0) }, replica.ErrInvalid},
		{"negative offset", func() error { return hd.ReadAt(ctx, o, buf, -4096) }, replica.ErrInvalid},
		{"extents limit", func() error { _, err := hd.Extents(ctx, o, "", 0, 0); return err }, replica.ErrInvalid},
		// Protocol errors.
		{"bad handle", func() error { return (&Handle{c: c, id: 999}).Flush(ctx, o) }, ErrBadHandle},
		{"unknown op", func() error { _, err := c.roundTrip(ctx, &RequestHeader{Op: 200}, nil, nil, 0); return err }, ErrUnknownOp},
		{"nonzero unused field", func() error {
			_, err := c.roundTrip(ctx, &RequestHeader{Op: OpFlush, Handle: hd.id, Epoch: 10, Off: 1}, nil, nil, 0)
			return err
		}, ErrProtocol},
		{"oversized read on the wire", func() error {
			_, err := c.roundTrip(ctx, &RequestHeader{Op: OpRead, Handle: hd.id, Epoch: 10, Len: replica.MaxIO + 1}, nil, nil, 0)
			return err
		}, replica.ErrInvalid},
	}
	for _, tc := range natural {
		t.Run(tc.name, func(t *testing.T) { only(t, tc.call(), tc.want) })
	}

	// Every sentinel the store may return, injected, survives the trip.
	for _, want := range []error{
		replica.ErrStaleEpoch, replica.ErrNotFound, replica.ErrExists, replica.ErrInvalid,
		replica.ErrIO, replica.ErrNoSpace, replica.ErrCorrupt, replica.ErrHistoryLost,
		replica.ErrClosed,
	} {
		t.Run("injected "+want.Error(), func(t *testing.T) {
			f.setHook(func(string, int64) error { return fmt.Errorf("disk says %q: %w", "no", want) })
			defer f.setHook(nil)
			err := hd.Flush(ctx, o)
			only(t, err, want)
			var re *RemoteError
			if !errors.As(err, &re) || !strings.Contains(re.Msg, `disk says "no"`) {
				t.Fatalf("error %q does not carry the server's text", err)
			}
		})
	}
	t.Run("unmapped", func(t *testing.T) {
		f.setHook(func(string, int64) error { return errors.New("something else") })
		defer f.setHook(nil)
		only(t, hd.Flush(ctx, o), ErrInternal)
	})
	// The connection survived all of the above.
	if err := hd.ReadAt(ctx, o, buf, 0); err != nil {
		t.Fatal(err)
	}
}

func TestStatusTable(t *testing.T) {
	seen := map[Status]bool{}
	for _, row := range statusTable {
		if seen[row.status] || row.status == StatusOK {
			t.Fatalf("status %d twice or OK in the table", row.status)
		}
		seen[row.status] = true
		if got := statusOf(fmt.Errorf("x: %w", row.err)); got != row.status {
			t.Errorf("statusOf(%v) = %d, want %d", row.err, got, row.status)
		}
		if row.status.Err() != row.err {
			t.Errorf("Status(%d).Err() = %v, want %v", row.status, row.status.Err(), row.err)
		}
	}
	if statusOf(nil) != StatusOK || StatusOK.Err() != nil {
		t.Error("OK does not map to nil")
	}
	if Status(200).Err() != ErrProtocol {
		t.Error("an unknown status is not a protocol error")
	}
	// Fencing wins over anything else an error wraps.
	if s := statusOf(errors.Join(replica.ErrIO, replica.ErrStaleEpoch)); s != StatusStaleEpoch {
		t.Errorf("joined error maps to %d", s)
	}
}

func TestOutOfOrderReplies(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	f := h.backend["r1"]
	ctx := context.Background()
	_, hd := h.open("r1", 1)
	o := replica.Op{Epoch: 1}
	const n = 32
	for i := range n {
		if err := hd.WriteAt(ctx, o, pattern(uint64(i), 4096), int64(i)*4096); err != nil {
			t.Fatal(err)
		}
	}
	// Reads of blocks 0 and 1 are held in the store.
	g := newGate()
	f.setHook(g.hook(func(op string, off int64) bool { return op == "ReadAt" && off < 2*4096 }))
	type result struct {
		block int
		err   error
		buf   []byte
	}
	slow := make(chan result, 2)
	for i := range 2 {
		go func() {
			buf := make([]byte, 4096)
			slow <- result{i, hd.ReadAt(ctx, o, buf, int64(i)*4096), buf}
		}()
	}
	g.wait(t, 2)

	// Later requests on the same connection complete first, each with its
	// own data.
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 2; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4096)
			if err := hd.ReadAt(ctx, o, buf, int64(i)*4096); err != nil {
				errs <- err
			} else if !bytes.Equal(buf, pattern(uint64(i), 4096)) {
				errs <- fmt.Errorf("block %d: wrong data", i)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	select {
	case r := <-slow:
		t.Fatalf("held read of block %d completed early: %v", r.block, r.err)
	default:
	}
	close(g.open)
	for range 2 {
		r := <-slow
		if r.err != nil || !bytes.Equal(r.buf, pattern(uint64(r.block), 4096)) {
			t.Fatalf("held read of block %d: %v, right data %v", r.block, r.err, bytes.Equal(r.buf, pattern(uint64(r.block), 4096)))
		}
	}
}

func TestConcurrentIO(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	h := newHarness(t, ServerConfig{})
	ctx := context.Background()
	_, hd := h.open("r1", 1)
	o := replica.Op{Epoch: 1}
	const workers, total = 16, 1000
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4096)
			for {
				i := next.Add(1) - 1
				if i >= total {
					return
				}
				// Each write goes to its own block; read it straight back.
				data := pattern(seed+uint64(i), 4096)
				off := i * 4096
				if err := hd.WriteAt(ctx, o, data, off); err != nil {
					errs <- err
					return
				}
				if err := hd.ReadAt(ctx, o, buf, off); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(buf, data) {
					errs <- fmt.Errorf("block %d: read back wrong data", i)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Everything is still there once the dust has settled.
	buf := make([]byte, 4096)
	for i := range int64(total) {
		if err := hd.ReadAt(ctx, o, buf, i*4096); err != nil || !bytes.Equal(buf, pattern(seed+uint64(i), 4096)) {
			t.Fatalf("block %d after the run: %v", i, err)
		}
	}
}

func TestInFlightBound(t *testing.T) {
	h := newHarness(t, ServerConfig{MaxInFlight: 4})
	f := h.backend["r1"]
	ctx := context.Background()
	_, hd := h.open("r1", 1)
	g := newGate()
	var inStore, maxInStore atomic.Int32
	f.setHook(func(op string, off int64) error {
		n := inStore.Add(1)
		for {
			m := maxInStore.Load()
			if n <= m || maxInStore.CompareAndSwap(m, n) {
				break
			}
		}
		g.entered <- op
		<-g.open
		inStore.Add(-1)
		return nil
	})
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := hd.WriteAt(ctx, replica.Op{Epoch: 1}, make([]byte, 4096), int64(i)*4096); err != nil {
				t.Error(err)
			}
		}()
	}
	g.wait(t, 4)
	time.Sleep(100 * time.Millisecond) // give a fifth request the chance to (wrongly) start
	if n := inStore.Load(); n != 4 {
		t.Fatalf("%d requests in the store, want 4", n)
	}
	close(g.open)
	wg.Wait()
	if m := maxInStore.Load(); m != 4 {
		t.Fatalf("at most %d requests were in the store at once, want 4", m)
	}
}

// killableDial records the client's side of each connection so a test can
// break it.
type killableDial struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (k *killableDial) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, addr)
	if err == nil {
		k.mu.Lock()
		k.conns = append(k.conns, nc)
		k.mu.Unlock()
	}
	return nc, err
}

func (k *killableDial) kill() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, nc := range k.conns {
		nc.Close()
	}
}

func TestDisconnectFailsPendingCalls(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	f := h.backend["r1"]
	ctx := context.Background()
	var k killableDial
	c := h.dial(ClientConfig{Dial: k.dial})
	hd, err := c.Open(ctx, "r1", 1)
	if err != nil {
		t.Fatal(err)
	}
	g := newGate()
	defer close(g.open)
	f.setHook(g.hook(func(op string, _ int64) bool { return op == "WriteAt" }))
	const n = 8
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- hd.WriteAt(ctx, replica.Op{Epoch: 1}, make([]byte, 4096), int64(i)*4096) }()
	}
	g.wait(t, n)
	k.kill()
	for range n {
		select {
		case err := <-errs:
			if !errors.Is(err, ErrDisconnected) {
				t.Fatalf("pending call: %v, want ErrDisconnected", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a pending call did not fail")
		}
	}
	if err := hd.Flush(ctx, replica.Op{Epoch: 1}); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("call after the break: %v, want ErrDisconnected", err)
	}
	if err := c.Err(); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("Conn.Err() = %v", err)
	}
	// The server still serves other connections.
	f.setHook(nil)
	_, hd2 := h.open("r1", 1)
	if err := hd2.Flush(ctx, replica.Op{Epoch: 1}); err != nil {
		t.Fatal(err)
	}
}

func TestCancelAbandonsWait(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	f := h.backend["r1"]
	_, hd := h.open("r1", 1)
	o := replica.Op{Epoch: 1}
	data := pattern(7, 4096)
	if err := hd.WriteAt(context.Background(), o, data, 0); err != nil {
		t.Fatal(err)
	}
	g := newGate()
	f.setHook(g.hook(func(op string, off int64) bool { return op == "ReadAt" && off == 0 }))
	ctx, cancel := context.WithCancel(context.Background())
	buf := bytes.Repeat([]byte{0xee}, 4096)
	done := make(chan error, 1)
	go func() { done <- hd.ReadAt(ctx, o, buf, 0) }()
	g.wait(t, 1)
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled read: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("cancel did not abandon the wait")
	}
	close(g.open) // the late reply arrives and must be dropped
	other := make([]byte, 4096)
	if err := hd.ReadAt(context.Background(), o, other, 0); err != nil || !bytes.Equal(other, data) {
		t.Fatalf("read after a cancelled one: %v", err)
	}
	if !bytes.Equal(buf, bytes.Repeat([]byte{0xee}, 4096)) {
		t.Fatal("the late reply was written into the abandoned buffer")
	}
	// An already-cancelled context sends nothing.
	if err := hd.Flush(ctx, o); !errors.Is(err, context.Canceled) {
		t.Fatalf("Flush with a cancelled context: %v", err)
	}
}

func TestServerCloseWithRequestsInFlight(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		f := newFakeReplica("r1", testSize)
		srv, err := NewServer(fakeBackend{"r1": f}, ServerConfig{Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- srv.Serve(ln) }()
		ctx := context.Background()
		c, err := Dial(ctx, "tcp", ln.Addr().String(), ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		hd, err := c.Open(ctx, "r1", 1)
		if err != nil {
			t.Fatal(err)
		}
		g := newGate()
		f.setHook(g.hook(func(op string, _ int64) bool { return op == "WriteAt" }))
		const n = 10
		errs := make(chan error, n)
		for i := range n {
			go func() { errs <- hd.WriteAt(ctx, replica.Op{Epoch: 1}, make([]byte, 4096), int64(i)*4096) }()
		}
		g.wait(t, n)

		closed := make(chan struct{})
		go func() { srv.Close(); close(closed) }()
		for range n {
			if err := <-errs; !errors.Is(err, ErrDisconnected) {
				t.Errorf("in-flight call: %v, want ErrDisconnected", err)
			}
		}
		select {
		case <-closed:
			t.Fatal("Close returned while requests were still in the store")
		case <-time.After(100 * time.Millisecond):
		}
		close(g.open)
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("Close did not return")
		}
		if err := <-served; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
		if _, err := Dial(ctx, "tcp", ln.Addr().String(), ClientConfig{Timeout: time.Second}); err == nil {
			t.Error("dialled a closed server")
		}
		if err := srv.Serve(ln); !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve after Close: %v", err)
		}
		srv.Close() // idempotent
	}()
	waitGoroutines(t, base)
}

func TestDialRefusesOtherProtocols(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() {
		defer wg.Done()
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		nc.Write([]byte("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + strings.Repeat("x", 64)))
		time.Sleep(100 * time.Millisecond)
	}()
	_, err = Dial(context.Background(), "tcp", ln.Addr().String(), ClientConfig{Timeout: 2 * time.Second})
	if !errors.Is(err, ErrDisconnected) || !strings.Contains(err.Error(), "magic") {
		t.Fatalf("Dial to an HTTP server: %v", err)
	}
}

func TestUnixSocket(t *testing.T) {
	f := newFakeReplica("r1", testSize)
	srv, err := NewServer(fakeBackend{"r1": f}, ServerConfig{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	path := t.TempDir() + "/wire.sock"
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() { srv.Close(); <-served }()
	c, err := Dial(context.Background(), "unix", path, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hd, err := c.Open(context.Background(), "r1", 1)
	if err != nil {
		t.Fatal(err)
	}
	data := pattern(3, 1<<20)
	got := make([]byte, len(data))
	if err := hd.WriteAt(context.Background(), replica.Op{Epoch: 1}, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := hd.ReadAt(context.Background(), replica.Op{Epoch: 1}, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("1 MiB over a unix socket: %v", err)
	}
}

func TestMaxIO(t *testing.T) {
	h := newHarness(t, ServerConfig{MaxInFlightBytes: 1 << 20}) // smaller than one request: it must still run
	_, hd := h.open("r1", 1)
	ctx := context.Background()
	data := pattern(9, replica.MaxIO)
	got := make([]byte, len(data))
	if err := hd.WriteAt(ctx, replica.Op{Epoch: 1}, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := hd.ReadAt(ctx, replica.Op{Epoch: 1}, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("MaxIO read: %v", err)
	}
}

func TestCancelDuringStalledReply(t *testing.T) {
	// The server sends the header of a READ reply and half its data, then
	// stalls: a cancelled caller must not wait for ever, and the
	// connection, now out of step, must break.
	addr := fakeServer(t, func(h RequestHeader) []byte {
		switch h.Op {
		case OpOpen:
			r := OpenReply{Handle: 1, Size: 1 << 20, Epoch: 1}
			return AppendReply(nil, ReplyHeader{ID: h.ID}, r.AppendTo(nil))
		case OpRead:
			return AppendReply(nil, ReplyHeader{ID: h.ID}, make([]byte, h.Len))[:ReplyHeaderSize+100]
		}
		return AppendReply(nil, ReplyHeader{ID: h.ID}, nil)
	})
	c, err := Dial(context.Background(), "tcp", addr, ClientConfig{Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hd, err := c.Open(context.Background(), "x", 1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = hd.ReadAt(ctx, replica.Op{Epoch: 1}, make([]byte, 4096), 0)
	if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrDisconnected) {
		t.Fatalf("ReadAt: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("ReadAt took %v", d)
	}
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the connection did not break")
	}
	if !errors.Is(c.Err(), ErrDisconnected) {
		t.Fatalf("Err() = %v", c.Err())
	}
}

func TestBrokenConnLeavesNoGoroutines(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	base := runtime.NumGoroutine()
	c, err := Dial(context.Background(), "tcp", h.addr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Open(context.Background(), "r1", 1); err != nil {
		t.Fatal(err)
	}
	// The server goes away; the client notices without being closed.
	h.srv.Close()
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the client did not notice the server closing")
	}
	if err := c.Ping(context.Background()); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("Ping after the server closed: %v", err)
	}
	waitGoroutines(t, base-1) // the server's Serve goroutine has returned too
	c.Close()
	c.Close() // idempotent
}

func TestMaxHandles(t *testing.T) {
	h := newHarness(t, ServerConfig{MaxHandles: 2})
	ctx := context.Background()
	c := h.dial(ClientConfig{})
	var hs []*Handle
	for range 2 {
		hd, err := c.Open(ctx, "r1", 1)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, hd)
	}
	if _, err := c.Open(ctx, "r1", 2); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("third open: %v, want ErrInvalid", err)
	}
	if e := h.backend["r1"].Epoch(); e != 1 {
		t.Fatalf("a refused open fenced the replica to epoch %d", e)
	}
	if err := hs[0].Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Open(ctx, "r1", 2); err != nil {
		t.Fatalf("open after a close: %v", err)
	}
	// Handles are per connection: another connection has its own.
	if _, err := h.dial(ClientConfig{}).Open(ctx, "r1", 2); err != nil {
		t.Fatal(err)
	}
}

// TestStartWriteAtThenWait sends writes to two replicas from one goroutine
// before waiting for either (what the engine's fan-out does), reads them
// back, and checks that a wrong checksum is refused and that a broken
// connection fails a started write.
func TestStartWriteAtThenWait(t *testing.T) {
	h := newHarness(t, ServerConfig{}, newFakeReplica("a", testSize), newFakeReplica("b", testSize))
	ctx := context.Background()
	o := replica.Op{Epoch: 1}
	_, ha := h.open("a", 1)
	var k killableDial
	cb := h.dial(ClientConfig{Dial: k.dial})
	hb, err := cb.Open(ctx, "b", 1)
	if err != nil {
		t.Fatal(err)
	}
	const n = 16
	var pend []Pending
	for i := range n {
		p := pattern(uint64(i), 4096)
		for _, hd := range []*Handle{ha, hb} {
			pd, err := hd.StartWriteAt(o, p, Checksum(p), int64(i)*4096)
			if err != nil {
				t.Fatal(err)
			}
			pend = append(pend, pd)
		}
		clear(p) // not retained once StartWriteAt returned
	}
	for _, pd := range pend {
		if err := pd.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, 4096)
	for i := range n {
		for _, hd := range []*Handle{ha, hb} {
			if err := hd.ReadAt(ctx, o, got, int64(i)*4096); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, pattern(uint64(i), 4096)) {
				t.Fatalf("replica %s block %d: not what was written", hd.ReplicaID(), i)
			}
		}
	}

	p := pattern(99, 4096)
	pd, err := ha.StartWriteAt(o, p, Checksum(p)+1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := pd.Wait(ctx); !errors.Is(err, ErrChecksum) {
		t.Fatalf("write with a wrong checksum: %v, want ErrChecksum", err)
	}
	if err := ha.ReadAt(ctx, o, got, 0); err != nil || !bytes.Equal(got, pattern(0, 4096)) {
		t.Fatalf("block 0 after the refused write: err %v, changed %v", err, !bytes.Equal(got, pattern(0, 4096)))
	}

	g := newGate()
	defer close(g.open)
	h.backend["b"].setHook(g.hook(func(op string, _ int64) bool { return op == "WriteAt" }))
	pd, err = hb.StartWriteAt(o, p, Checksum(p), 0)
	if err != nil {
		t.Fatal(err)
	}
	g.wait(t, 1)
	k.kill()
	if err := pd.Wait(ctx); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("started write on a broken connection: %v, want ErrDisconnected", err)
	}
	if _, err := hb.StartWriteAt(o, p, Checksum(p), 0); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("StartWriteAt after the break: %v, want ErrDisconnected", err)
	}
}

// TestHandlesPinTheirReplica: a replica is pinned once per open handle,
// unpinned by CLOSE and by the connection's end, and an OPEN refused for
// too many handles leaves no pin.
func TestHandlesPinTheirReplica(t *testing.T) {
	h := newHarness(t, ServerConfig{MaxHandles: 2})
	r := h.backend["r1"]
	ctx := context.Background()
	c := h.dial(ClientConfig{})
	var hs []*Handle
	for range 2 {
		hd, err := c.Open(ctx, "r1", 1)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, hd)
	}
	if _, err := c.Open(ctx, "r1", 1); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("third open: %v, want ErrInvalid", err)
	}
	if n := r.pins.Load(); n != 2 {
		t.Fatalf("%d pins with two handles open", n)
	}
	if err := hs[0].Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := r.pins.Load(); n != 1 {
		t.Fatalf("%d pins after closing one of two handles", n)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for r.pins.Load() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := r.pins.Load(); n != 0 {
		t.Fatalf("%d pins left after the connection closed", n)
	}
}
