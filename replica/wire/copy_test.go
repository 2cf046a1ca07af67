package wire

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// copySourceFunc adapts a function to CopySource.
type copySourceFunc func(ctx context.Context, target OpenRequest, source string, o replica.Op, p []byte, off int64) error

func (f copySourceFunc) ReadSource(ctx context.Context, target OpenRequest, source string, o replica.Op, p []byte, off int64) error {
	return f(ctx, target, source, o, p, off)
}

// copyPair is a source server holding replica "src" (filled with a
// pattern) and a target server holding "dst", whose REBUILD_COPY requests
// read the source through a Sources; resolves counts its Resolve calls.
type copyPair struct {
	src, dst *fakeReplica
	srcH     *harness
	dstH     *harness
	sources  *Sources
	resolves atomic.Int64
}

func newCopyPair(t *testing.T, idle time.Duration) *copyPair {
	p := &copyPair{src: newFakeReplica("src", testSize), dst: newFakeReplica("dst", testSize)}
	copy(p.src.data, pattern(1, testSize))
	p.srcH = newHarness(t, ServerConfig{}, p.src)
	p.sources = &Sources{
		Idle: idle,
		Resolve: func(ctx context.Context, target OpenRequest, source string, o replica.Op) (string, OpenRequest, error) {
			p.resolves.Add(1)
			return p.srcH.addr, OpenRequest{Replica: source, Volume: target.Volume, Node: "target", Epoch: o.Epoch, Purpose: PurposeRebuildSource}, nil
		},
	}
	t.Cleanup(p.sources.Close)
	p.dstH = newHarness(t, ServerConfig{CopySource: p.sources}, p.dst)
	return p
}

// openTarget opens dst at epoch 1 and begins its rebuild.
func (p *copyPair) openTarget(t *testing.T) *Handle {
	t.Helper()
	_, h := p.dstH.open("dst", 1)
	if err := h.BeginRebuild(context.Background(), replica.Op{Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	return h
}

func (p *copyPair) dstData(off, n int64) []byte {
	p.dst.mu.Lock()
	defer p.dst.mu.Unlock()
	return append([]byte(nil), p.dst.data[off:off+n]...)
}

// REBUILD_COPY puts the source's bytes on the target through RebuildWrite;
// many copies at once share one connection and one OPEN of the source;
// the source is closed once it has been idle.
func TestRebuildCopyCopiesFromTheSource(t *testing.T) {
	p := newCopyPair(t, 100*time.Millisecond)
	h := p.openTarget(t)
	o := replica.Op{Epoch: 1, Generation: 1}
	const chunk = 1 << 20
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range int64(16) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- h.RebuildCopy(context.Background(), o, "src", i*chunk, chunk, time.Second)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got, want := p.dstData(0, testSize), pattern(1, testSize); !bytes.Equal(got, want) {
		t.Fatal("the target does not hold the source's bytes")
	}
	p.dst.mu.Lock()
	rebuilt := p.dst.rebuilt
	p.dst.mu.Unlock()
	if rebuilt != 16 {
		t.Fatalf("%d rebuild writes on the target, want 16", rebuilt)
	}
	if n := p.srcH.srv.Stats().Accepted; n != 1 {
		t.Fatalf("the source's server accepted %d connections for 16 copies, want 1", n)
	}
	if n := p.resolves.Load(); n != 16 {
		t.Fatalf("Resolve asked %d times, want once per copy (16)", n)
	}
	waitFor(t, "the idle source closed", func() bool { return p.sources.openCount() == 0 && p.srcH.srv.Stats().Conns == 0 })
	// A later copy opens it again.
	if err := h.RebuildCopy(context.Background(), o, "src", 0, 4096, 0); err != nil {
		t.Fatal(err)
	}
	if n := p.srcH.srv.Stats().Accepted; n != 2 {
		t.Fatalf("the source's server accepted %d connections, want 2", n)
	}
}

// A source that cannot be read is ErrCopySource, whatever the source said
// (a stale epoch there is not the target's), and nothing is written; the
// failed source is not used again.
func TestRebuildCopySourceFailures(t *testing.T) {
	p := newCopyPair(t, time.Minute)
	h := p.openTarget(t)
	ctx := context.Background()
	o := replica.Op{Epoch: 1, Generation: 1}
	if err := h.RebuildCopy(ctx, o, "src", 0, 4096, time.Second); err != nil {
		t.Fatal(err)
	}
	before := p.dstData(0, testSize)

	// The source is fenced above the copy's epoch.
	if err := p.src.Fence(5); err != nil {
		t.Fatal(err)
	}
	err := h.RebuildCopy(ctx, o, "src", 8192, 4096, time.Second)
	if !errors.Is(err, ErrCopySource) || errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("copy from a source at a higher epoch: %v; want ErrCopySource and not the target's stale epoch", err)
	}
	if p.sources.openCount() != 0 {
		t.Fatal("a source that failed is still open for the next copy")
	}
	// A replica the source's server does not have.
	if err := h.RebuildCopy(ctx, o, "nope", 8192, 4096, time.Second); !errors.Is(err, ErrCopySource) || errors.Is(err, replica.ErrNotFound) {
		t.Fatalf("copy from a replica that does not exist: %v; want ErrCopySource", err)
	}
	// The source's server is gone.
	p.srcH.srv.Close()
	if err := h.RebuildCopy(ctx, replica.Op{Epoch: 1}, "src", 8192, 4096, time.Second); !errors.Is(err, ErrCopySource) {
		t.Fatalf("copy from a closed server: %v; want ErrCopySource", err)
	}
	if !bytes.Equal(p.dstData(0, testSize), before) {
		t.Fatal("a failed copy changed the target")
	}
	p.dst.mu.Lock()
	rebuilt := p.dst.rebuilt
	p.dst.mu.Unlock()
	if rebuilt != 1 {
		t.Fatalf("%d rebuild writes on the target, want only the first copy's", rebuilt)
	}
}

// The target spends at most the request's budget on the source, and then
// says so; the connection goes on.
func TestRebuildCopyBudget(t *testing.T) {
	var calls atomic.Int64
	stall := copySourceFunc(func(ctx context.Context, _ OpenRequest, _ string, _ replica.Op, _ []byte, _ int64) error {
		calls.Add(1)
		<-ctx.Done()
		return ctx.Err()
	})
	hs := newHarness(t, ServerConfig{CopySource: stall})
	_, h := hs.open("r1", 1)
	ctx := context.Background()
	o := replica.Op{Epoch: 1}
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := h.RebuildCopy(ctx, o, "src", 0, 4096, 150*time.Millisecond)
	took := time.Since(start)
	if !errors.Is(err, ErrCopySource) {
		t.Fatalf("copy from a stalled source: %v, want ErrCopySource", err)
	}
	if took < 150*time.Millisecond || took > 3*time.Second {
		t.Fatalf("a copy with a budget of 150ms answered after %v", took)
	}
	if err := h.ReadAt(ctx, o, make([]byte, 4096), 0); err != nil {
		t.Fatalf("the connection after a copy's budget ran out: %v", err)
	}
	if calls.Load() != 1 {
		t.Fatalf("%d reads of the source", calls.Load())
	}
	// The budget on the wire: 0 is the default, and it is capped.
	for _, c := range []struct{ in, want time.Duration }{
		{0, DefaultCopyBudget}, {time.Microsecond, time.Millisecond}, {2 * time.Second, 2 * time.Second}, {time.Hour, MaxCopyBudget},
	} {
		if _, got := decodeCopyRequest(appendCopyRequest(nil, "s", c.in)); got != c.want {
			t.Errorf("budget %v travels as %v, want %v", c.in, got, c.want)
		}
	}
}

// A server with no CopySource answers REBUILD_COPY with ErrUnknownOp, as
// one from before REBUILD_COPY does, and writes nothing.
func TestRebuildCopyWithoutACopySource(t *testing.T) {
	hs := newHarness(t, ServerConfig{})
	_, h := hs.open("r1", 1)
	o := replica.Op{Epoch: 1}
	if err := h.BeginRebuild(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if err := h.RebuildCopy(context.Background(), o, "src", 0, 4096, 0); !errors.Is(err, ErrUnknownOp) {
		t.Fatalf("REBUILD_COPY without a CopySource: %v, want ErrUnknownOp", err)
	}
	if n := hs.backend["r1"].rebuilt; n != 0 {
		t.Fatalf("%d rebuild writes", n)
	}
}

// A REBUILD_COPY is a rebuild write: refused without a rebuild in
// progress, and put to the handle's Grant with its source, which can
// refuse it before the source is read.
func TestRebuildCopyIsARebuildWrite(t *testing.T) {
	var reads atomic.Int64
	src := copySourceFunc(func(context.Context, OpenRequest, string, replica.Op, []byte, int64) error {
		reads.Add(1)
		return nil
	})
	auth := &copyAuth{}
	hs := newHarness(t, ServerConfig{CopySource: src, Authorizer: auth})
	c := hs.dial(ClientConfig{})
	ctx := context.Background()
	h, err := c.OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v", Node: "n1", Epoch: 1, Purpose: PurposeAttach})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1}
	if err := h.RebuildCopy(ctx, o, "src", 0, 4096, 0); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("REBUILD_COPY with no rebuild in progress: %v, want the store's ErrInvalid", err)
	}
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := h.RebuildCopy(ctx, o, "forbidden", 0, 4096, 0); !errors.Is(err, ErrDenied) {
		t.Fatalf("REBUILD_COPY the grant refuses: %v, want ErrDenied", err)
	}
	if n := reads.Load(); n != 1 {
		t.Fatalf("%d reads of a source, want 1 (the refused copy must not read)", n)
	}
	if err := h.RebuildCopy(ctx, o, "src", 0, 4096, 0); err != nil {
		t.Fatal(err)
	}
	if got := auth.sources(); fmt.Sprint(got) != "[src forbidden src]" {
		t.Fatalf("the grant was asked about the sources %q", got)
	}
}

// copyAuth grants every OPEN; its grant refuses REBUILD_COPY from the
// source "forbidden", and records the sources it was asked about.
type copyAuth struct {
	mu  sync.Mutex
	ids []string
}

func (a *copyAuth) Open(context.Context, Peer, OpenRequest) (Grant, error) { return a, nil }

func (a *copyAuth) Allow(_ context.Context, r Request) error {
	if r.Op != OpRebuildCopy {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.ids = append(a.ids, r.ID)
	if r.ID == "forbidden" {
		return fmt.Errorf("test: copy from %s: %w", r.ID, ErrDenied)
	}
	return nil
}

func (a *copyAuth) sources() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.ids...)
}

// Close fails the reads in flight and refuses later ones; a source being
// opened when Close runs is closed, not kept.
func TestSourcesClose(t *testing.T) {
	p := newCopyPair(t, time.Minute)
	o := replica.Op{Epoch: 1}
	buf := make([]byte, 4096)
	if err := p.sources.ReadSource(context.Background(), OpenRequest{Replica: "dst"}, "src", o, buf, 0); err != nil {
		t.Fatal(err)
	}
	if p.sources.openCount() != 1 || p.srcH.srv.Stats().Conns != 1 {
		t.Fatalf("%d sources open, %d connections", p.sources.openCount(), p.srcH.srv.Stats().Conns)
	}
	p.sources.Close()
	waitFor(t, "the source's connection closed", func() bool { return p.srcH.srv.Stats().Conns == 0 })
	if err := p.sources.ReadSource(context.Background(), OpenRequest{Replica: "dst"}, "src", o, buf, 0); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a read after Close: %v, want ErrClosed", err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
