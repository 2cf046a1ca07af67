package wire

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc64"
	"slices"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
)

// TestDigestsAreWhatAReadReads: DIGEST of a range of a real store
// answers, per 4096-byte block, the CRC-64/ECMA of what a READ of the
// same range returns (a shorter last block included), and a write
// changes the digests of exactly the blocks it touched.
func TestDigestsAreWhatAReadReads(t *testing.T) {
	addr := newStoreServer(t, 8<<20)
	ctx := context.Background()
	_, hd := dialOpen(t, addr, "r1")
	o := replica.Op{Epoch: 1, Generation: 1}
	if err := hd.WriteAt(ctx, o, pattern(7, 64<<10), 1<<20); err != nil {
		t.Fatal(err)
	}
	const off, n = 1<<20 - 8192, 24<<10 + 512 // unwritten, written, and a 512-byte last block
	read := func() []byte {
		p := make([]byte, n)
		if err := hd.ReadAt(ctx, o, p, off); err != nil {
			t.Fatal(err)
		}
		return p
	}
	before, err := hd.Digests(ctx, o, off, n)
	if err != nil {
		t.Fatal(err)
	}
	data := read()
	if len(before) != 7 {
		t.Fatalf("%d digests of %d bytes, want 7", len(before), n)
	}
	for i, d := range before {
		b := data[i*DigestBlock : min(len(data), (i+1)*DigestBlock)]
		if want := crc64.Checksum(b, crc64.MakeTable(crc64.ECMA)); d != want {
			t.Fatalf("digest %d (%d bytes) = %#x, want the CRC-64/ECMA of the data read, %#x", i, len(b), d, want)
		}
	}
	if before[0] != before[1] || before[2] == before[0] {
		t.Fatalf("two unwritten blocks differ (%#x, %#x) or a written one matches them (%#x)", before[0], before[1], before[2])
	}

	// One sector of the fourth block changes: its digest, no other.
	if err := hd.WriteAt(ctx, o, bytes.Repeat([]byte{0xa5}, 512), off+3*DigestBlock+1024); err != nil {
		t.Fatal(err)
	}
	after, err := hd.Digests(ctx, o, off, n)
	if err != nil {
		t.Fatal(err)
	}
	for i := range after {
		if changed := after[i] != before[i]; changed != (i == 3) {
			t.Errorf("after a write to block 3, digest %d changed: %v", i, changed)
		}
	}
	if got := BlockDigests(nil, read()); !slices.Equal(got, after) {
		t.Fatalf("digests %x, want those of the data read, %x", after, got)
	}

	if ds, err := hd.Digests(ctx, o, 4096, 0); err != nil || len(ds) != 0 {
		t.Fatalf("digests of 0 bytes: %v, %v", ds, err)
	}
	if _, err := hd.Digests(ctx, o, 0, replica.MaxIO+1); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("digests of more than MaxIO: %v, want ErrInvalid", err)
	}
	if _, err := hd.Digests(ctx, o, 8<<20-4096, 8192); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("digests past the end: %v, want the store's ErrInvalid", err)
	}
	if _, err := hd.Digests(ctx, replica.Op{Epoch: 0, Generation: 1}, 0, 4096); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("digests at a stale epoch: %v, want ErrStaleEpoch", err)
	}
}

// denyOp grants every OPEN and refuses requests of one op, recording
// the ops it is asked about.
type denyOp struct {
	op   Opcode
	mu   sync.Mutex
	seen []Opcode
}

func (a *denyOp) Open(context.Context, Peer, OpenRequest) (Grant, error) { return a, nil }

func (a *denyOp) Allow(_ context.Context, r Request) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.seen = append(a.seen, r.Op)
	if r.Op == a.op {
		return fmt.Errorf("test: %v: %w", r.Op, ErrDenied)
	}
	return nil
}

// TestDigestIsPutToTheGrant: a grant's Allow sees DIGEST as its own op
// (internal/server's grants allow it to the purposes that may send any
// op, attach and snapshot-cut, and to no purpose limited to a list that
// does not name it), and a refused one fails with ErrDenied.
func TestDigestIsPutToTheGrant(t *testing.T) {
	a := &denyOp{op: OpDigest}
	addr, _ := newStoreServerWith(t, "r1", 1<<20, ServerConfig{Authorizer: a})
	ctx := context.Background()
	_, hd := dialOpen(t, addr, "r1")
	if _, err := hd.Digests(ctx, replica.Op{Epoch: 1, Generation: 1}, 0, 4096); !errors.Is(err, ErrDenied) {
		t.Fatalf("a DIGEST the grant refuses: %v, want ErrDenied", err)
	}
	if !slices.Equal(a.seen, []Opcode{OpDigest}) {
		t.Fatalf("the grant saw %v, want one DIGEST", a.seen)
	}
}
