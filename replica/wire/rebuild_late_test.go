package wire

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// heldRequest is an Authorizer whose grant holds up the first request of
// op it is asked about until release is closed: anything between reading
// a request off the connection and applying it (the grant's wait for this
// server to catch up with the control plane, a worker not yet scheduled,
// a wait for memory) that outlasts the sender's timeout.
type heldRequest struct {
	op      Opcode
	held    chan struct{} // closed when the first such request is held
	release chan struct{}
	armed   atomic.Bool
}

func (a *heldRequest) Open(context.Context, Peer, OpenRequest) (Grant, error) { return a, nil }

func (a *heldRequest) Allow(_ context.Context, r Request) error {
	if r.Op == a.op && a.armed.CompareAndSwap(true, false) {
		close(a.held)
		<-a.release
	}
	return nil
}

// newHeldServer serves a real store holding replica "dst" (1 MiB) behind
// a grant that holds up the first request of op, with copy source cs
// (nil: none).
func newHeldServer(t *testing.T, op Opcode, cs CopySource) (string, *replica.Store, *heldRequest) {
	t.Helper()
	auth := &heldRequest{op: op, held: make(chan struct{}), release: make(chan struct{})}
	auth.armed.Store(true)
	addr, st := newStoreServerWith(t, "dst", 1<<20, ServerConfig{Authorizer: auth, CopySource: cs})
	return addr, st, auth
}

// dialOpen dials addr and opens replica id at epoch 1; the connection
// closes when the test ends.
func dialOpen(t *testing.T, addr, id string) (*Conn, *Handle) {
	t.Helper()
	ctx := context.Background()
	conn, err := Dial(ctx, "tcp", addr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h, err := conn.Open(ctx, id, 1)
	if err != nil {
		t.Fatal(err)
	}
	return conn, h
}

// A relayed REBUILD_WRITE that its rebuilder abandoned (its IOTimeout ran
// out; the engine released the chunk's hold and its rebuild failed) is
// still on the target's server, read but not applied. The rebuild starts
// over (EndRebuild+BeginRebuild) and copies the chunk again after a newer
// acknowledged write W; then the abandoned write is applied. It used to
// land in the new rebuild, whose tracking does not know W, and overwrite
// W with the older bytes (noticed after the same defect of REBUILD_COPY).
// The server now applies a REBUILD_WRITE only to the rebuild its handle's
// REBUILD_BEGIN named when the write was read off the connection.
func TestAbandonedRebuildWriteNeverLandsInALaterRebuild(t *testing.T) {
	ctx := context.Background()
	addr, _, auth := newHeldServer(t, OpRebuildWrite, nil)
	_, h := dialOpen(t, addr, "dst")
	o := replica.Op{Epoch: 1, Generation: 1}

	// Attempt 1 relays D0 (read from the source under the chunk's hold);
	// the engine's time runs out before the target applies it.
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	d0 := pattern(1, 64<<10)
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := h.RebuildWrite(cctx, o, d0, 0)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("attempt 1's rebuild write: %v, want the engine's deadline", err)
	}
	<-auth.held

	// The hold is released: a write W (D1) is acknowledged.
	d1 := pattern(2, 4096)
	if err := h.WriteAt(ctx, o, d1, 0); err != nil {
		t.Fatal(err)
	}
	// Attempt 2 (ResumeFrom 0) starts its tracking over and copies the
	// chunk again, with W.
	if err := h.EndRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Clone(d0)
	copy(chunk, d1)
	if err := h.RebuildWrite(ctx, o, chunk, 0); err != nil {
		t.Fatal(err)
	}

	// Attempt 1's write goes on.
	close(auth.release)
	got := make([]byte, 4096)
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if err := h.ReadAt(ctx, o, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, d1) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !bytes.Equal(got, d1) {
		t.Fatalf("the acknowledged write W was overwritten on the target by attempt 1's abandoned REBUILD_WRITE (holds D0: %v)",
			bytes.Equal(got, d0[:4096]))
	}
}

// countingSource is a CopySource that counts its reads and reads zeroes.
type countingSource struct{ reads atomic.Int64 }

func (s *countingSource) ReadSource(_ context.Context, _ OpenRequest, _ string, _ replica.Op, p []byte, _ int64) error {
	s.reads.Add(1)
	clear(p)
	return nil
}

// A REBUILD_COPY held up on the target's server across a restart of its
// rebuild (REBUILD_END, REBUILD_BEGIN) is refused as the target's
// ErrInvalid when the server comes to it, before it reads the source, and
// writes nothing.
func TestHeldRebuildCopyIsRefusedAfterItsRebuildStartedOver(t *testing.T) {
	ctx := context.Background()
	src := &countingSource{}
	addr, _, auth := newHeldServer(t, OpRebuildCopy, src)
	_, h := dialOpen(t, addr, "dst")
	o := replica.Op{Epoch: 1, Generation: 1}
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	copied := make(chan error, 1)
	go func() { copied <- h.RebuildCopy(ctx, o, "src", 0, 64<<10, 5*time.Second) }()
	<-auth.held
	if err := h.EndRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := h.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	close(auth.release)
	if err := <-copied; !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("the held copy: %v, want ErrInvalid (its rebuild has ended)", err)
	}
	if n := src.reads.Load(); n != 0 {
		t.Fatalf("the held copy read its source %d times, want 0", n)
	}
}

// A REBUILD_END or REBUILD_BEGIN held up on the target's server while its
// client left (closed the connection; it is the engine's only way to give
// up on one) used to run after a later rebuilder, on a new connection, had
// begun its own rebuild: a late END ended it, and that rebuilder's next
// write failed with "no rebuild in progress" and blamed a healthy target;
// a late BEGIN, after the later rebuild had ended, began a rebuild nobody
// ends (found by review). A REBUILD_BEGIN or REBUILD_END whose
// connection's reader has stopped is now refused.
func TestLateRebuildBeginOrEndFromALeftConnectionTouchesNoLaterRebuild(t *testing.T) {
	for _, op := range []Opcode{OpRebuildEnd, OpRebuildBegin} {
		t.Run(op.String(), func(t *testing.T) { testLateRebuildControl(t, op) })
	}
}

func testLateRebuildControl(t *testing.T, op Opcode) {
	ctx := context.Background()
	addr, st, auth := newHeldServer(t, op, nil)
	o := replica.Op{Epoch: 1, Generation: 1}

	// Attempt 1 on connection A: its END (a reset, or the end; after a
	// BEGIN) or its BEGIN is held up, and the engine gives up on A.
	connA, hA := dialOpen(t, addr, "dst")
	if op == OpRebuildEnd {
		if err := hA.BeginRebuild(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	answered := make(chan error, 1)
	go func() {
		if op == OpRebuildEnd {
			answered <- hA.EndRebuild(ctx, o)
		} else {
			answered <- hA.BeginRebuild(ctx, o)
		}
	}()
	<-auth.held
	connA.Close()
	if err := <-answered; err == nil {
		t.Fatalf("attempt 1's %v answered on a closed connection", op)
	}
	// The server's reader on A sees the close.
	time.Sleep(100 * time.Millisecond)

	// Attempt 2 on connection B starts over, and for a late BEGIN, ends.
	_, hB := dialOpen(t, addr, "dst")
	if err := hB.EndRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := hB.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if op == OpRebuildBegin {
		if err := hB.EndRebuild(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	close(auth.release) // A's request goes on
	r, err := st.Get("dst")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		_, serr := r.RebuildSession(o)
		switch {
		case op == OpRebuildEnd && serr != nil:
			t.Fatalf("attempt 1's late END ended attempt 2's rebuild: %v", serr)
		case op == OpRebuildBegin && serr == nil:
			t.Fatal("attempt 1's late BEGIN began a rebuild after attempt 2 had ended its own")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
