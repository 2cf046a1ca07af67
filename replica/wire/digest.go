package wire

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc64"

	"github.com/stor-io/stor/replica"
)

// DIGEST (doc.go, "Operations") answers, for a range of the head, what a
// READ of it would return, in a digest per DigestBlock bytes instead of
// the data: the engine's reconcile compares them across replicas and
// copies only the blocks where they differ (package engine, reconcile).
//
// The digest is CRC-64/ECMA (hash/crc64). It tells blocks apart that
// differ at random with a probability of 1 - 2^-64 per block, and every
// difference confined to 64 consecutive bits; it is not a cryptographic
// hash, and a client who writes two crafted versions of a block could
// make them collide (a CRC is linear: that is easy). What a collision
// costs is bounded by where digests are used: reconcile compares only
// blocks an unclean stop may have left different, with writes that were
// never acknowledged, so a crafted collision can keep two versions of the
// writer's own unacknowledged write on different replicas of its own
// volume (and so in what is cut or rebuilt from them later), and nothing
// of another volume.
// Cheap over strong on purpose: a reconcile reads every dirty byte on
// every replica, before the restarted engine serves any I/O.
const (
	// DigestBlock is the span of one digest: a DIGEST of n bytes has
	// ceil(n / DigestBlock) of them, the last covering what remains.
	DigestBlock = replica.BlockSize
	// DigestSize is the encoded size of one digest (a u64).
	DigestSize = 8
)

var crc64Table = crc64.MakeTable(crc64.ECMA)

// BlockDigests appends to dst the digest of each DigestBlock-byte piece
// of p, the last possibly shorter, as a DIGEST reply lists them.
func BlockDigests(dst []uint64, p []byte) []uint64 {
	for len(p) > 0 {
		k := min(len(p), DigestBlock)
		dst = append(dst, crc64.Checksum(p[:k], crc64Table))
		p = p[k:]
	}
	return dst
}

// digestCount is the number of digests of n bytes.
func digestCount(n int64) int { return int((n + DigestBlock - 1) / DigestBlock) }

// Digests returns the digest (BlockDigests) of each DigestBlock of the
// n bytes at off of the head, as a READ at o would read them. A server
// older than DIGEST answers ErrUnknownOp.
func (h *Handle) Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error) {
	if err := checkIO(OpDigest, n, off); err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, fmt.Errorf("wire: %v at %d: negative length %d: %w", OpDigest, off, n, replica.ErrInvalid)
	}
	want := digestCount(int64(n))
	reply, err := h.do(ctx, OpDigest, o, uint64(off), uint64(n), nil, nil, want*DigestSize)
	if err != nil {
		return nil, err
	}
	if len(reply) != want*DigestSize {
		return nil, fmt.Errorf("wire: %v of %d bytes at %d: a reply of %d bytes, want %d: %w", OpDigest, n, off, len(reply), want*DigestSize, ErrProtocol)
	}
	ds := make([]uint64, want)
	for i := range ds {
		ds[i] = binary.BigEndian.Uint64(reply[i*DigestSize:])
	}
	return ds, nil
}

// digest serves a DIGEST: it reads [off, off+n) of r's head into a
// pooled buffer, digests it, and answers the digests. The data buffer is
// given back before the reply's is taken, so a DIGEST never holds one
// while it waits for the other.
func (c *serverConn) digest(r Replica, o replica.Op, off, n int64) ([]byte, *[]byte, error) {
	if n == 0 {
		return nil, nil, nil
	}
	data, err := c.getBuf(int(n))
	if err != nil {
		return nil, nil, err
	}
	p := (*data)[:n]
	err = r.ReadAt(o, p, off)
	var ds [replica.MaxIO / DigestBlock]uint64
	digests := BlockDigests(ds[:0], p)
	c.putBuf(data)
	if err != nil {
		return nil, nil, err
	}
	buf, err := c.getBuf(len(digests) * DigestSize)
	if err != nil {
		return nil, nil, err
	}
	out := (*buf)[:0]
	for _, d := range digests {
		out = binary.BigEndian.AppendUint64(out, d)
	}
	return out, buf, nil
}
