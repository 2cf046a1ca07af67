package wire

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
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
	open := func(inc uint64) *Handle {
		t.Helper()
		hd, err := h.dial(ClientConfig{}).OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 3, Purpose: PurposeAttach, Incarnation: inc})
		if err != nil {
			t.Fatal(err)
		}
		return hd
	}
	o := replica.Op{Epoch: 3, Generation: 4}
	block := func(b byte) []byte { return bytes.Repeat([]byte{b}, 4096) }
	var reader *Handle // opened first: a read of any incarnation is served
	readEpoch := uint64(3)
	holds := func(want byte) {
		t.Helper()
		got := make([]byte, 4096)
		if err := reader.ReadAt(ctx, replica.Op{Epoch: readEpoch}, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, block(want)) {
			t.Fatalf("block 0 holds %d; want %d", got[0], want)
		}
	}

	reader = open(0)
	old := open(4)
	if err := old.WriteAt(ctx, o, block(1), 0); err != nil {
		t.Fatal(err)
	}
	cur := open(6) // the replica came back: a later generation
	if err := cur.WriteAt(ctx, o, block(2), 0); err != nil {
		t.Fatal(err)
	}
	// The late write of the old incarnation is refused, and changes
	// nothing; so is every other change through it.
	if err := old.WriteAt(ctx, o, block(1), 0); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a write of the older incarnation after a newer OPEN: %v, want replica.ErrClosed", err)
	}
	holds(2)
	if err := old.Flush(ctx, o); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a flush of the older incarnation: %v, want replica.ErrClosed", err)
	}
	if err := old.BeginRebuild(ctx, o); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a rebuild begun on the older incarnation: %v, want replica.ErrClosed", err)
	}
	// An OPEN of the same incarnation (the engine's duplicate) or of an
	// older one (an OPEN its client gave up on, served late) takes
	// nothing over, also once every newer handle is closed.
	dup := open(6)
	if err := cur.WriteAt(ctx, o, block(3), 0); err != nil {
		t.Fatalf("the newest incarnation after a duplicate OPEN: %v", err)
	}
	if err := dup.WriteAt(ctx, o, block(4), 0); err != nil {
		t.Fatalf("a duplicate OPEN of the newest incarnation: %v", err)
	}
	if err := cur.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := dup.Close(ctx); err != nil {
		t.Fatal(err)
	}
	late := open(5)
	if err := late.WriteAt(ctx, o, block(5), 0); !errors.Is(err, replica.ErrClosed) {
		t.Fatalf("a write of an OPEN older than a closed newer one: %v, want replica.ErrClosed", err)
	}
	holds(4)
	// A newer epoch outranks any incarnation, and says so.
	e3 := open(9)
	next, err := h.dial(ClientConfig{}).OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n2", Epoch: 4, Purpose: PurposeAttach, Incarnation: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := next.WriteAt(ctx, replica.Op{Epoch: 4, Generation: 5}, block(6), 0); err != nil {
		t.Fatalf("an attach handle of a newer epoch: %v", err)
	}
	if err := e3.WriteAt(ctx, o, block(7), 0); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("a write of an older epoch's attach handle: %v, want replica.ErrStaleEpoch", err)
	}
	readEpoch = 4
	holds(6)
	// Handles of other purposes are not ordered.
	insp, err := h.dial(ClientConfig{}).OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n3", Epoch: 4, Purpose: PurposeInspect})
	if err != nil {
		t.Fatal(err)
	}
	if err := next.WriteAt(ctx, replica.Op{Epoch: 4, Generation: 5}, block(8), 0); err != nil {
		t.Fatalf("the newest attach handle after an inspect OPEN: %v", err)
	}
	got := make([]byte, 4096)
	if err := insp.ReadAt(ctx, replica.Op{Epoch: 4}, got, 0); err != nil || got[0] != 8 {
		t.Fatalf("an inspect handle's read: %v, block 0 holds %d; want 8", err, got[0])
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
	open := OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 3, Purpose: PurposeAttach, Incarnation: 4}
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
	open.Incarnation = 6
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

// deletableBackend is a backend whose replicas can be deleted while it
// serves.
type deletableBackend struct {
	mu sync.Mutex
	m  map[string]*fakeReplica
}

func (b *deletableBackend) Replica(id string) (Replica, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if r, ok := b.m[id]; ok {
		return r, nil
	}
	return nil, fmt.Errorf("replica %q: %w", id, replica.ErrNotFound)
}

// An attach OPEN that found its replica and then waited (here in its
// fence) while the replica was deleted and its order forgotten must not
// bring the order back: nothing would forget it again.
func TestAnAttachOpenRacingTheReplicasDeletionLeavesNoOrder(t *testing.T) {
	f := newFakeReplica("r1", testSize)
	b := &deletableBackend{m: map[string]*fakeReplica{"r1": f}}
	srv, err := NewServer(b, ServerConfig{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	defer srv.Close()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	f.setHook(func(op string, _ int64) error {
		if op == "Fence" {
			entered <- struct{}{}
			<-release
		}
		return nil
	})
	ctx := context.Background()
	conn, err := Dial(ctx, "tcp", ln.Addr().String(), ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	opened := make(chan error, 1)
	go func() {
		_, err := conn.OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 2, Purpose: PurposeAttach, Incarnation: 1})
		opened <- err
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the OPEN never reached the replica's fence")
	}
	b.mu.Lock()
	delete(b.m, "r1")
	b.mu.Unlock()
	srv.Forget("r1")
	close(release)
	select {
	case err := <-opened:
		if !errors.Is(err, replica.ErrNotFound) {
			t.Errorf("the OPEN of a replica deleted meanwhile: %v, want replica.ErrNotFound", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the OPEN did not return")
	}
	if n := srv.Stats().AttachOrders; n != 0 {
		t.Errorf("after the replica was deleted and forgotten the server orders %d replicas' attach handles; want 0", n)
	}
}
