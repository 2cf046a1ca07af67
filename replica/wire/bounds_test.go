package wire

import (
	"context"
	"errors"
	"runtime"
	"testing"

	"github.com/stor-io/stor/replica"
)

// TestZeroesOverTheCapAreRefused: a WRITE_ZEROES or TRIM naming more than
// replica.MaxZeroes bytes gets an invalid-argument reply from the server,
// which allocates nothing in proportion to the length (a 4 TiB TRIM
// frame used to cost the server 221 MiB); the connection serves on, a
// request at the cap is served, and the client refuses to send one over it.
func TestZeroesOverTheCapAreRefused(t *testing.T) {
	const size = 4 << 40
	addr := newStoreServer(t, size)
	r := dialRaw(t, addr)
	handle := r.openR1()
	for _, tc := range []struct {
		name string
		h    RequestHeader
		want Status
	}{
		{"trim of the whole volume", RequestHeader{Op: OpTrim, ID: 10, Handle: handle, Epoch: 1, Len: size}, StatusInvalid},
		{"zeroes one sector over the cap", RequestHeader{Op: OpWriteZeroes, ID: 11, Handle: handle, Epoch: 1, Len: replica.MaxZeroes + replica.SectorSize}, StatusInvalid},
		{"trim at the cap", RequestHeader{Op: OpTrim, ID: 12, Handle: handle, Epoch: 1, Off: size - replica.MaxZeroes, Len: replica.MaxZeroes}, StatusOK},
		{"zeroes at the cap", RequestHeader{Op: OpWriteZeroes, ID: 13, Handle: handle, Epoch: 1, Len: replica.MaxZeroes}, StatusOK},
	} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		r.send(AppendRequest(nil, tc.h, nil))
		rh, msg, ok := r.reply()
		runtime.ReadMemStats(&after)
		if !ok || rh.Status != tc.want || rh.ID != tc.h.ID {
			t.Fatalf("%s: reply %v to id %d (%q, ok %v), want %v", tc.name, rh.Status, rh.ID, msg, ok, tc.want)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > 8<<20 {
			t.Fatalf("%s: the server allocated %d bytes", tc.name, n)
		}
	}
	r.send(AppendRequest(nil, RequestHeader{Op: OpPing, ID: 2}, nil))
	if rh, _, ok := r.reply(); !ok || rh.Status != StatusOK || rh.ID != 2 {
		t.Fatalf("after the refused requests: reply %v ok %v, want the connection serving", rh.Status, ok)
	}

	ctx := context.Background()
	c, err := Dial(ctx, "tcp", addr, ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err := c.Open(ctx, "r1", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Trim(ctx, replica.Op{Epoch: 1}, 0, replica.MaxZeroes+replica.SectorSize); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("client trim over the cap: %v, want ErrInvalid", err)
	}
	if err := h.WriteZeroes(ctx, replica.Op{Epoch: 1}, 0, replica.MaxZeroes); err != nil {
		t.Fatalf("client zeroes at the cap: %v", err)
	}
}

// TestZeroesCapIsInTheOpTable: the server refuses an over-cap WRITE_ZEROES
// or TRIM when it validates the header, before any backend sees it.
func TestZeroesCapIsInTheOpTable(t *testing.T) {
	for _, op := range []Opcode{OpWriteZeroes, OpTrim} {
		h := RequestHeader{Op: op, ID: 1, Handle: 1, Epoch: 1, Len: replica.MaxZeroes}
		if err := h.Validate(); err != nil {
			t.Fatalf("%v at the cap: %v", op, err)
		}
		h.Len += replica.SectorSize
		if err := h.Validate(); !errors.Is(err, replica.ErrInvalid) {
			t.Fatalf("%v over the cap: %v, want ErrInvalid", op, err)
		}
	}
}
