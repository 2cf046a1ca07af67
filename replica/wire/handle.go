package wire

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/stor-io/stor/replica"
)

// Handle is a replica opened on a Conn. Its methods mirror
// replica.Replica's with a context first; they are safe for concurrent use
// and pipeline on the connection. Errors wrap replica's sentinels (the
// server's, or a local ErrInvalid for arguments that cannot be sent) or
// this package's (ErrDisconnected and the protocol errors). A cancelled
// context abandons the wait, not the request: the server may still apply
// it.
type Handle struct {
	c         *Conn
	id        uint32
	replicaID string
	epoch     uint64
	size      atomic.Uint64
	closed    atomic.Bool
}

// ReplicaID is the id the handle was opened with.
func (h *Handle) ReplicaID() string { return h.replicaID }

// Size is the replica's size at open, or after the last successful Grow
// through this handle.
func (h *Handle) Size() uint64 { return h.size.Load() }

// Epoch is the replica's epoch when the handle was opened.
func (h *Handle) Epoch() uint64 { return h.epoch }

// Close closes the handle on the server. Further calls fail with
// replica.ErrClosed.
func (h *Handle) Close(ctx context.Context) error {
	if h.closed.Swap(true) {
		return nil
	}
	_, err := h.c.roundTrip(ctx, &RequestHeader{Op: OpClose, Handle: h.id}, nil, nil, 0)
	return err
}

// do sends one request on the handle.
func (h *Handle) do(ctx context.Context, op Opcode, o replica.Op, off, n uint64, payload, dst []byte, maxReply int) ([]byte, error) {
	if h.closed.Load() {
		return nil, fmt.Errorf("wire: %v on closed handle for %s: %w", op, h.replicaID, replica.ErrClosed)
	}
	rh := h.header(op, o, off, n)
	return h.c.roundTrip(ctx, &rh, payload, dst, maxReply)
}

func (h *Handle) header(op Opcode, o replica.Op, off, n uint64) RequestHeader {
	rh := RequestHeader{
		Op:         op,
		Handle:     h.id,
		Epoch:      o.Epoch,
		Generation: o.Generation,
		Off:        off,
		Len:        n,
	}
	if o.FUA {
		rh.Flags |= FlagFUA
	}
	return rh
}

func checkIO(op Opcode, n int, off int64) error {
	if off < 0 {
		return fmt.Errorf("wire: %v at %d: negative offset: %w", op, off, replica.ErrInvalid)
	}
	if n > replica.MaxIO {
		return fmt.Errorf("wire: %v at %d: %d bytes exceeds %d: %w", op, off, n, replica.MaxIO, replica.ErrInvalid)
	}
	return nil
}

func checkRange(op Opcode, off, n int64) error {
	if off < 0 || n < 0 {
		return fmt.Errorf("wire: %v at %d length %d: negative: %w", op, off, n, replica.ErrInvalid)
	}
	if n > replica.MaxZeroes {
		return fmt.Errorf("wire: %v of %d bytes exceeds %d: %w", op, n, replica.MaxZeroes, replica.ErrInvalid)
	}
	return nil
}

func checkID(op Opcode, id string, optional bool) error {
	if len(id) > MaxIDLen || (len(id) == 0 && !optional) {
		return fmt.Errorf("wire: %v: id of %d bytes, want 1..%d: %w", op, len(id), MaxIDLen, replica.ErrInvalid)
	}
	return nil
}

// ReadAt reads len(p) bytes at off into p.
func (h *Handle) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := checkIO(OpRead, len(p), off); err != nil {
		return err
	}
	_, err := h.do(ctx, OpRead, o, uint64(off), uint64(len(p)), nil, p, 0)
	return err
}

// WriteAt writes p at off.
func (h *Handle) WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := checkIO(OpWrite, len(p), off); err != nil {
		return err
	}
	_, err := h.do(ctx, OpWrite, o, uint64(off), uint64(len(p)), p, nil, 0)
	return err
}

// StartWriteAt sends a write of p at off and returns without waiting for
// its reply; p may be reused as soon as it returns. The caller must Wait
// on the result. This lets one goroutine send a write to several replicas
// and then wait for all of them, instead of a goroutine per replica. crc
// must be Checksum(p) (computed once for all replicas; a wrong one makes
// the server refuse the write with a checksum error).
func (h *Handle) StartWriteAt(o replica.Op, p []byte, crc uint32, off int64) (Pending, error) {
	if err := checkIO(OpWrite, len(p), off); err != nil {
		return Pending{}, err
	}
	if h.closed.Load() {
		return Pending{}, fmt.Errorf("wire: %v on closed handle for %s: %w", OpWrite, h.replicaID, replica.ErrClosed)
	}
	rh := h.header(OpWrite, o, uint64(off), uint64(len(p)))
	return h.c.start(&rh, p, crc, nil, 0)
}

// WriteZeroes zeroes n bytes at off.
func (h *Handle) WriteZeroes(ctx context.Context, o replica.Op, off, n int64) error {
	if err := checkRange(OpWriteZeroes, off, n); err != nil {
		return err
	}
	_, err := h.do(ctx, OpWriteZeroes, o, uint64(off), uint64(n), nil, nil, 0)
	return err
}

// Trim discards n bytes at off.
func (h *Handle) Trim(ctx context.Context, o replica.Op, off, n int64) error {
	if err := checkRange(OpTrim, off, n); err != nil {
		return err
	}
	_, err := h.do(ctx, OpTrim, o, uint64(off), uint64(n), nil, nil, 0)
	return err
}

// Flush makes every write that completed before it durable.
func (h *Handle) Flush(ctx context.Context, o replica.Op) error {
	_, err := h.do(ctx, OpFlush, o, 0, 0, nil, nil, 0)
	return err
}

// Grow grows the replica to size bytes.
func (h *Handle) Grow(ctx context.Context, o replica.Op, size uint64) error {
	if _, err := h.do(ctx, OpGrow, o, 0, size, nil, nil, 0); err != nil {
		return err
	}
	for { // concurrent Grows: keep the largest
		cur := h.size.Load()
		if cur >= size || h.size.CompareAndSwap(cur, size) {
			return nil
		}
	}
}

// CreateSnapshot cuts snapshot id.
func (h *Handle) CreateSnapshot(ctx context.Context, o replica.Op, id string) error {
	if err := checkID(OpSnapshotCreate, id, false); err != nil {
		return err
	}
	_, err := h.do(ctx, OpSnapshotCreate, o, 0, 0, []byte(id), nil, 0)
	return err
}

// DeleteSnapshot deletes snapshot id.
func (h *Handle) DeleteSnapshot(ctx context.Context, o replica.Op, id string) error {
	if err := checkID(OpSnapshotDelete, id, false); err != nil {
		return err
	}
	_, err := h.do(ctx, OpSnapshotDelete, o, 0, 0, []byte(id), nil, 0)
	return err
}

// ReadSnapshotAt reads len(p) bytes at off of snapshot id into p.
func (h *Handle) ReadSnapshotAt(ctx context.Context, o replica.Op, id string, p []byte, off int64) error {
	if err := checkID(OpSnapshotRead, id, false); err != nil {
		return err
	}
	if err := checkIO(OpSnapshotRead, len(p), off); err != nil {
		return err
	}
	_, err := h.do(ctx, OpSnapshotRead, o, uint64(off), uint64(len(p)), []byte(id), p, 0)
	return err
}

// Extents lists at most limit (1..MaxExtents) allocated extents of the
// head (snapshotID "") or of a snapshot, from offset from on.
func (h *Handle) Extents(ctx context.Context, o replica.Op, snapshotID string, from int64, limit int) ([]replica.Extent, error) {
	if err := checkID(OpExtents, snapshotID, true); err != nil {
		return nil, err
	}
	if from < 0 || limit < 1 || limit > MaxExtents {
		return nil, fmt.Errorf("wire: EXTENTS from %d limit %d: want from >= 0, limit 1..%d: %w", from, limit, MaxExtents, replica.ErrInvalid)
	}
	reply, err := h.do(ctx, OpExtents, o, uint64(from), uint64(limit), []byte(snapshotID), nil, limit*ExtentSize)
	if err != nil {
		return nil, err
	}
	return DecodeExtents(reply)
}

// DirtyRegions lists the regions that may differ between replicas.
func (h *Handle) DirtyRegions(ctx context.Context, o replica.Op) ([]replica.Extent, error) {
	reply, err := h.do(ctx, OpDirtyRegions, o, 0, 0, nil, nil, MaxExtents*ExtentSize)
	if err != nil {
		return nil, err
	}
	return DecodeExtents(reply)
}

// WrittenSince lists the regions written under a generation after
// generation.
func (h *Handle) WrittenSince(ctx context.Context, o replica.Op, generation uint64) ([]replica.Extent, error) {
	reply, err := h.do(ctx, OpWrittenSince, o, generation, 0, nil, nil, MaxExtents*ExtentSize)
	if err != nil {
		return nil, err
	}
	return DecodeExtents(reply)
}

// BeginRebuild starts a rebuild of this replica.
func (h *Handle) BeginRebuild(ctx context.Context, o replica.Op) error {
	_, err := h.do(ctx, OpRebuildBegin, o, 0, 0, nil, nil, 0)
	return err
}

// RebuildWrite writes rebuild data p at off, never over a newer write.
func (h *Handle) RebuildWrite(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := checkIO(OpRebuildWrite, len(p), off); err != nil {
		return err
	}
	_, err := h.do(ctx, OpRebuildWrite, o, uint64(off), uint64(len(p)), p, nil, 0)
	return err
}

// EndRebuild ends the rebuild.
func (h *Handle) EndRebuild(ctx context.Context, o replica.Op) error {
	_, err := h.do(ctx, OpRebuildEnd, o, 0, 0, nil, nil, 0)
	return err
}
