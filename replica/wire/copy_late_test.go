package wire

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// slowReplySource is a source replica whose READ is served from its data
// at once but whose reply then takes a while to leave (a slow or congested
// link between the source's and the target's servers).
type slowReplySource struct {
	*fakeReplica
	readDone chan struct{} // closed after the first read has taken its bytes
	release  chan struct{} // the reply leaves once this is closed
	armed    bool
}

func (s *slowReplySource) ReadAt(o replica.Op, p []byte, off int64) error {
	err := s.fakeReplica.ReadAt(o, p, off)
	if s.armed {
		s.armed = false
		close(s.readDone)
		<-s.release
	}
	return err
}

// A REBUILD_COPY that its rebuilder abandoned (its IOTimeout ran out,
// its rebuild was cancelled: the engine released the chunk's hold) still
// runs on the target's server, which reads the source. Across a restart of
// the rebuild (EndRebuild+BeginRebuild, which every attempt with
// ResumeFrom 0 does: every delta, every full rebuild before its first
// checkpoint) what it read used to land, late, and overwrote a newer acknowledged write that a later attempt had already
// copied (found by review). The target's server now applies a copy only to
// the rebuild that was in progress when the copy began
// (replica.RebuildWriteSession). With the relay the same abandon leaves
// nothing behind: the engine's read of the source is cancelled and
// nothing is sent to the target.
func TestAbandonedRebuildCopyNeverLandsInALaterRebuild(t *testing.T) {
	const size = 1 << 20
	ctx := context.Background()

	// The source: a replica holding D0, behind a slow link.
	src := &slowReplySource{fakeReplica: newFakeReplica("src", size), readDone: make(chan struct{}), release: make(chan struct{})}
	d0 := pattern(1, 64<<10)
	copy(src.data, d0)
	srcSrv, err := NewServer(BackendFunc(func(id string) (Replica, error) {
		if id != "src" {
			return nil, replica.ErrNotFound
		}
		return src, nil
	}), ServerConfig{Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	srcLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srcSrv.Serve(srcLn)
	t.Cleanup(func() { srcSrv.Close() })

	// The target: the real store, its REBUILD_COPY reading through Sources.
	sources := &Sources{Resolve: func(context.Context, OpenRequest, string, replica.Op) (string, OpenRequest, error) {
		return srcLn.Addr().String(), OpenRequest{Replica: "src", Volume: "v1", Node: "t", Epoch: 1, Purpose: PurposeRebuildSource}, nil
	}}
	t.Cleanup(sources.Close)
	dstAddr, _ := newStoreServerWith(t, "dst", size, ServerConfig{CopySource: sources})

	// The engine's connections.
	sc, err := Dial(ctx, "tcp", srcLn.Addr().String(), ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	sh, err := sc.Open(ctx, "src", 1)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := Dial(ctx, "tcp", dstAddr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer dc.Close()
	dh, err := dc.Open(ctx, "dst", 1)
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1, Generation: 1}

	// Attempt 1.
	if err := dh.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	src.armed = true
	// The chunk under the engine's hold: LockCopy's IOTimeout (short here)
	// runs out before the target answers; the engine releases the hold.
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err = dh.RebuildCopy(cctx, o, "src", 0, 64<<10, 5*time.Second)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("attempt 1's copy: %v, want the engine's deadline", err)
	}
	<-src.readDone // the source read D0 (under the hold)

	// The hold is released: a write W (D1) is acknowledged by both.
	d1 := pattern(2, 4096)
	if err := sh.WriteAt(ctx, o, d1, 0); err != nil {
		t.Fatal(err)
	}
	if err := dh.WriteAt(ctx, o, d1, 0); err != nil {
		t.Fatal(err)
	}
	// Attempt 1 failed; attempt 2 (ResumeFrom 0) starts its tracking over
	// and copies the chunk (relayed here; a copy does the same), with W.
	if err := dh.EndRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := dh.BeginRebuild(ctx, o); err != nil {
		t.Fatal(err)
	}
	chunk := make([]byte, 64<<10)
	if err := sh.ReadAt(ctx, o, chunk, 0); err != nil {
		t.Fatal(err)
	}
	if err := dh.RebuildWrite(ctx, o, chunk, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if err := dh.ReadAt(ctx, o, got, 0); err != nil || !bytes.Equal(got, d1) {
		t.Fatalf("after attempt 2's copy the target lacks W: %v", err)
	}

	// The slow reply of attempt 1's source read arrives.
	close(src.release)
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if err := dh.ReadAt(ctx, o, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, d1) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !bytes.Equal(got, d1) {
		t.Fatalf("the acknowledged write W was overwritten on the target by attempt 1's abandoned REBUILD_COPY (holds D0: %v)",
			bytes.Equal(got, d0[:4096]))
	}
}
