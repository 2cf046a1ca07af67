package wire

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
)

func TestOpenRequestRoundTrips(t *testing.T) {
	for _, r := range []OpenRequest{
		{Replica: "r1", Epoch: 3},
		{Replica: "vol-1.r0", Volume: "vol-1", Node: "node-a", Epoch: 7, Purpose: PurposeAttach},
		{Replica: "r", Volume: "v", Node: "stor-2", Snapshot: "snap-9", Epoch: 1, Purpose: PurposeCloneCopy},
		{Replica: "r", Volume: "v", Epoch: 1<<64 - 1, Purpose: PurposeInspect},
	} {
		got, err := decodeOpen(encodeOpen(r), r.Epoch)
		if err != nil || got != r {
			t.Errorf("decodeOpen(encodeOpen(%+v)) = %+v, %v", r, got, err)
		}
	}
}

func TestOpenRequestRejects(t *testing.T) {
	long := strings.Repeat("x", MaxIDLen+1)
	for _, tc := range []struct {
		name    string
		payload string
	}{
		{"empty replica", "\x00attach\x00v\x00n\x00"},
		{"unknown purpose", "r\x00steal\x00v\x00n\x00"},
		{"too many fields", "r\x00attach\x00v\x00n\x00s\x00x"},
		{"long field", "r\x00attach\x00" + long + "\x00n\x00"},
	} {
		if _, err := decodeOpen([]byte(tc.payload), 1); !errors.Is(err, replica.ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", tc.name, err)
		}
	}
}

// recordingAuth refuses every OPEN but of replica "r1" for PurposeAttach
// by node "n1", and lets its grants do everything but GROW. It records
// what it was asked.
type recordingAuth struct {
	mu       sync.Mutex
	opens    []OpenRequest
	peers    []Peer
	requests []Request
}

func (a *recordingAuth) Open(ctx context.Context, p Peer, r OpenRequest) (Grant, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.opens = append(a.opens, r)
	a.peers = append(a.peers, p)
	if r.Replica != "r1" || r.Purpose != PurposeAttach || r.Node != "n1" {
		return nil, fmt.Errorf("test: %+v: %w", r, ErrDenied)
	}
	return a, nil
}

func (a *recordingAuth) Allow(ctx context.Context, r Request) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.requests = append(a.requests, r)
	if r.Op == OpGrow {
		return fmt.Errorf("test: %v: %w", r.Op, ErrDenied)
	}
	return nil
}

// TestAuthorizerDecidesOpensAndRequests: with an Authorizer, an OPEN it
// refuses never reaches the replica (no fence), its refusal arrives as
// ErrDenied, the peer's Identity comes from Identify, and every request
// on a granted handle is put to the Grant, which can refuse it.
func TestAuthorizerDecidesOpensAndRequests(t *testing.T) {
	auth := &recordingAuth{}
	id := Identity{Verified: true, Role: "csi-node", Name: "n1"}
	h := newHarness(t, ServerConfig{Authorizer: auth, Identify: func(net.Conn) Identity { return id }})
	r := h.backend["r1"]
	ctx := context.Background()
	c := h.dial(ClientConfig{})

	if _, err := c.Open(ctx, "r1", 1<<64-1); !errors.Is(err, ErrDenied) {
		t.Fatalf("open without a purpose: %v, want ErrDenied", err)
	}
	if _, err := c.OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n2", Epoch: 9, Purpose: PurposeAttach}); !errors.Is(err, ErrDenied) {
		t.Fatalf("open by another node: %v, want ErrDenied", err)
	}
	if e := r.Epoch(); e != 0 {
		t.Fatalf("refused opens fenced the replica to epoch %d", e)
	}
	hd, err := c.OpenFor(ctx, OpenRequest{Replica: "r1", Volume: "v1", Node: "n1", Epoch: 4, Purpose: PurposeAttach})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 4, Generation: 1}
	if err := hd.WriteAt(ctx, o, make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := hd.CreateSnapshot(ctx, o, "s_e4"); err != nil {
		t.Fatal(err)
	}
	if err := hd.Grow(ctx, o, 2*testSize); !errors.Is(err, ErrDenied) {
		t.Fatalf("grow the grant refuses: %v, want ErrDenied", err)
	}
	if r.Size() != testSize {
		t.Fatalf("a refused grow changed the size to %d", r.Size())
	}

	auth.mu.Lock()
	defer auth.mu.Unlock()
	want := []Request{
		{Op: OpWrite, Epoch: 4, Generation: 1},
		{Op: OpSnapshotCreate, Epoch: 4, Generation: 1, ID: "s_e4"},
		{Op: OpGrow, Epoch: 4, Generation: 1, Len: 2 * testSize},
	}
	if fmt.Sprint(auth.requests) != fmt.Sprint(want) {
		t.Fatalf("grant asked %v, want %v", auth.requests, want)
	}
	if len(auth.opens) != 3 || auth.opens[0].Purpose != PurposeNone || auth.opens[0].Epoch != 1<<64-1 || auth.opens[2].Node != "n1" {
		t.Fatalf("authorizer asked %+v", auth.opens)
	}
	for _, p := range auth.peers {
		if p.Identity != id || p.Addr == nil {
			t.Fatalf("peer %+v, want identity %+v and an address", p, id)
		}
	}
}
