package wire

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// An engine that gave a replica up and opened it again (a new attach
// handle, at the same epoch) must not have the old handle's requests
// applied after the new OPEN: a write its connection still carried when
// the engine closed it (TCP delivers what was queued once a partition
// heals) would overwrite what the new incarnation's rebuild and writes
// put there. Found by the jepsen harness: seed 5501, rebuild-source, a
// cut of the source past the engine's I/O timeout; 2 s after the cut
// healed, a read served by the rebuilt replica returned a write older
// than nine acknowledged since.
func TestAnOlderAttachHandleIsRefusedOnceANewerOpened(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	ctx := context.Background()
	open := OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 3, Purpose: PurposeAttach}
	o := replica.Op{Epoch: 3, Generation: 4}
	block := func(b byte) []byte { return bytes.Repeat([]byte{b}, 4096) }

	old, err := h.dial(ClientConfig{}).OpenFor(ctx, open)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.WriteAt(ctx, o, block(1), 0); err != nil {
		t.Fatal(err)
	}
	cur, err := h.dial(ClientConfig{}).OpenFor(ctx, open)
	if err != nil {
		t.Fatal(err)
	}
	if err := cur.WriteAt(ctx, o, block(2), 0); err != nil {
		t.Fatal(err)
	}
	// The late write of the old handle is refused, and changes nothing.
	if err := old.WriteAt(ctx, o, block(1), 0); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a write of the older attach handle after a newer OPEN: %v, want replica.ErrClosed", err)
	}
	got := make([]byte, 4096)
	if err := cur.ReadAt(ctx, o, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, block(2)) {
		t.Fatalf("block 0 holds %d after the older handle's late write; want the newer handle's 2", got[0])
	}
	// So is every other request of the old handle.
	if err := old.Flush(ctx, o); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a flush of the older attach handle: %v, want replica.ErrClosed", err)
	}
	if err := old.BeginRebuild(ctx, o); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a rebuild begun on the older attach handle: %v, want replica.ErrClosed", err)
	}
	// Handles of other purposes are not attach handles: they neither
	// take the replica over nor lose it.
	insp, err := h.dial(ClientConfig{}).OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n2", Purpose: PurposeInspect})
	if err != nil {
		t.Fatal(err)
	}
	if err := cur.WriteAt(ctx, o, block(3), 0); err != nil {
		t.Fatalf("the newest attach handle after an inspect OPEN: %v", err)
	}
	if err := insp.ReadAt(ctx, o, got, 0); err != nil || got[0] != 3 {
		t.Fatalf("an inspect handle's read: %v, block 0 holds %d; want 3", err, got[0])
	}
	// Closed, the newest leaves the replica's gate; the next OPEN makes a
	// new one and serves.
	if err := cur.Close(ctx); err != nil {
		t.Fatal(err)
	}
	next, err := h.dial(ClientConfig{}).OpenFor(ctx, open)
	if err != nil {
		t.Fatal(err)
	}
	if err := next.WriteAt(ctx, o, block(4), 0); err != nil {
		t.Fatalf("an attach handle opened after the last one closed: %v", err)
	}
}

// A newer attach OPEN returns only once every request of an older attach
// handle that passed its check has finished: a write still being applied
// when the new incarnation opened could otherwise land after that
// incarnation's rebuild began, as a "normal write" its copy then keeps.
func TestANewerAttachOpenWaitsForTheOlderHandlesRequests(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	r := h.backend["r1"]
	ctx := context.Background()
	open := OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 3, Purpose: PurposeAttach}
	o := replica.Op{Epoch: 3, Generation: 4}
	old, err := h.dial(ClientConfig{}).OpenFor(ctx, open)
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the harness's: the server's Close waits for the write
	r.setHook(func(op string, off int64) error {
		if op == "WriteAt" && off == 8192 {
			entered <- struct{}{}
			<-release
		}
		return nil
	})
	wrote := make(chan error, 1)
	go func() { wrote <- old.WriteAt(ctx, o, make([]byte, 4096), 8192) }()
	<-entered
	opened := make(chan error, 1)
	go func() {
		_, err := h.dial(ClientConfig{}).OpenFor(ctx, open)
		opened <- err
	}()
	select {
	case err := <-opened:
		t.Fatalf("the newer attach OPEN returned (%v) while a write of the older handle was still being applied", err)
	case <-time.After(300 * time.Millisecond):
	}
	free()
	for what, ch := range map[string]chan error{"the older handle's write": wrote, "the newer OPEN": opened} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s did not return", what)
		}
	}
}
