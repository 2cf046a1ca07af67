package wire

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"

	"github.com/stor-io/stor/replica"
)

// Frame constants; doc.go lays the frames out byte by byte.
const (
	// RequestMagic opens every request frame ("STRQ").
	RequestMagic uint32 = 0x53545251
	// ReplyMagic opens every reply frame ("STRP").
	ReplyMagic uint32 = 0x53545250
	// Version is the protocol version this package speaks.
	Version = 2

	// RequestHeaderSize and ReplyHeaderSize are the fixed header lengths.
	RequestHeaderSize = 64
	ReplyHeaderSize   = 32

	// MaxControl is the allowance, on top of replica.MaxIO, for the
	// control part of a payload.
	MaxControl = 64 << 10
	// MaxPayload bounds every payload length field. A frame that declares
	// more is never read: the connection is closed.
	MaxPayload = replica.MaxIO + MaxControl
	// MaxIDLen bounds replica and snapshot ids.
	MaxIDLen = 256
	// MaxMessage bounds the error text of a failed reply.
	MaxMessage = 1024
	// ExtentSize is the encoded size of one extent (offset, length).
	ExtentSize = 16
	// MaxExtents bounds the extents in one reply (EXTENTS limit,
	// DIRTY_REGIONS, WRITTEN_SINCE).
	MaxExtents = replica.MaxIO / ExtentSize
	// OpenReplySize is the payload size of a successful OPEN reply.
	OpenReplySize = 24
)

// Opcode names a request.
type Opcode uint8

// The opcodes. 0 is never valid, so a zeroed header is rejected.
const (
	OpOpen Opcode = iota + 1
	OpClose
	OpPing
	OpRead
	OpWrite
	OpWriteZeroes
	OpTrim
	OpFlush
	OpGrow
	OpSnapshotCreate
	OpSnapshotDelete
	OpSnapshotRead
	OpExtents
	OpDirtyRegions
	OpWrittenSince
	OpRebuildBegin
	OpRebuildWrite
	OpRebuildEnd
	OpRebuildCopy
	OpDigest
	opMax // one past the last opcode
)

// Flags modify a request.
type Flags uint16

// FlagFUA makes a write durable before its reply (replica.Op.FUA).
const FlagFUA Flags = 1 << 0

const knownFlags = FlagFUA

// payloadKind says what a request's payload holds.
type payloadKind uint8

const (
	payloadNone  payloadKind = iota // PayloadLen must be 0
	payloadData                     // 0..MaxIO bytes of data; Len == PayloadLen
	payloadID                       // an id, 1..MaxIDLen bytes
	payloadOptID                    // an id, 0..MaxIDLen bytes (empty: the head)
	payloadOpen                     // an OPEN request, 1..MaxOpenPayload bytes (open.go)
	payloadCopy                     // a REBUILD_COPY request, 5..MaxCopyPayload bytes (copy.go)
)

// argKind says what the Off or Len field holds.
type argKind uint8

const (
	argZero    argKind = iota // must be 0
	argInt                    // an int64: 0..MaxInt64
	argIOLen                  // an I/O length: 0..replica.MaxIO
	argZeroLen                // a WRITE_ZEROES or TRIM length: 0..replica.MaxZeroes
	argLimit                  // an extent count: 1..MaxExtents
	argAny                    // any uint64
)

// opSpec is one row of the table that both the server's validation and
// doc.go describe.
type opSpec struct {
	name    string
	handle  bool // needs an open handle
	payload payloadKind
	off     argKind
	len     argKind
}

var opSpecs = [opMax]opSpec{
	OpOpen:           {"OPEN", false, payloadOpen, argZero, argZero},
	OpClose:          {"CLOSE", true, payloadNone, argZero, argZero},
	OpPing:           {"PING", false, payloadNone, argZero, argZero},
	OpRead:           {"READ", true, payloadNone, argInt, argIOLen},
	OpWrite:          {"WRITE", true, payloadData, argInt, argIOLen},
	OpWriteZeroes:    {"WRITE_ZEROES", true, payloadNone, argInt, argZeroLen},
	OpTrim:           {"TRIM", true, payloadNone, argInt, argZeroLen},
	OpFlush:          {"FLUSH", true, payloadNone, argZero, argZero},
	OpGrow:           {"GROW", true, payloadNone, argZero, argAny},
	OpSnapshotCreate: {"SNAPSHOT_CREATE", true, payloadID, argZero, argZero},
	OpSnapshotDelete: {"SNAPSHOT_DELETE", true, payloadID, argZero, argZero},
	OpSnapshotRead:   {"SNAPSHOT_READ", true, payloadID, argInt, argIOLen},
	OpExtents:        {"EXTENTS", true, payloadOptID, argInt, argLimit},
	OpDirtyRegions:   {"DIRTY_REGIONS", true, payloadNone, argZero, argZero},
	OpWrittenSince:   {"WRITTEN_SINCE", true, payloadNone, argAny, argZero},
	OpRebuildBegin:   {"REBUILD_BEGIN", true, payloadNone, argZero, argZero},
	OpRebuildWrite:   {"REBUILD_WRITE", true, payloadData, argInt, argIOLen},
	OpRebuildEnd:     {"REBUILD_END", true, payloadNone, argZero, argZero},
	OpRebuildCopy:    {"REBUILD_COPY", true, payloadCopy, argInt, argIOLen},
	OpDigest:         {"DIGEST", true, payloadNone, argInt, argIOLen},
}

func (op Opcode) valid() bool { return op > 0 && op < opMax }

func (op Opcode) String() string {
	if op.valid() {
		return opSpecs[op].name
	}
	return fmt.Sprintf("OP_%d", uint8(op))
}

// replyData reports whether a successful reply to op carries data read
// into the caller's buffer (READ, SNAPSHOT_READ).
func (op Opcode) replyData() bool { return op == OpRead || op == OpSnapshotRead }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC-32C (Castagnoli) the frames carry.
func Checksum(p []byte) uint32 { return crc32.Checksum(p, castagnoli) }

// RequestHeader is a decoded request header. Off and Len are the two
// operation arguments; see the table in doc.go for their meaning per op.
type RequestHeader struct {
	Op         Opcode
	Flags      Flags
	ID         uint64
	Handle     uint32
	PayloadLen uint32
	Epoch      uint64
	Generation uint64
	Off        uint64
	Len        uint64
	PayloadCRC uint32
}

// AppendTo appends the 64-byte encoding of h, header checksum included.
func (h *RequestHeader) AppendTo(b []byte) []byte {
	start := len(b)
	b = binary.BigEndian.AppendUint32(b, RequestMagic)
	b = append(b, Version, byte(h.Op))
	b = binary.BigEndian.AppendUint16(b, uint16(h.Flags))
	b = binary.BigEndian.AppendUint64(b, h.ID)
	b = binary.BigEndian.AppendUint32(b, h.Handle)
	b = binary.BigEndian.AppendUint32(b, h.PayloadLen)
	b = binary.BigEndian.AppendUint64(b, h.Epoch)
	b = binary.BigEndian.AppendUint64(b, h.Generation)
	b = binary.BigEndian.AppendUint64(b, h.Off)
	b = binary.BigEndian.AppendUint64(b, h.Len)
	b = binary.BigEndian.AppendUint32(b, h.PayloadCRC)
	return binary.BigEndian.AppendUint32(b, Checksum(b[start:]))
}

// headerError is a header that could not be decoded. InSync reports
// whether the header checksum held, so that its request id (and for a
// request, its payload length) can be trusted: the peer may be told what
// was wrong before the connection is closed.
type headerError struct {
	msg    string
	inSync bool
}

func (e *headerError) Error() string { return "wire: " + e.msg }
func (e *headerError) Unwrap() error { return ErrProtocol }

// DecodeRequestHeader decodes the first RequestHeaderSize bytes of b. It
// checks the magic, the header checksum and the version; it does not check
// the op or its arguments (see Validate). On a version mismatch h.ID is
// set and the error is an in-sync *headerError.
func DecodeRequestHeader(b []byte) (h RequestHeader, err error) {
	if len(b) < RequestHeaderSize {
		return h, &headerError{msg: "short request header"}
	}
	b = b[:RequestHeaderSize]
	if m := binary.BigEndian.Uint32(b[0:]); m != RequestMagic {
		return h, &headerError{msg: fmt.Sprintf("bad request magic %#08x", m)}
	}
	if got, want := binary.BigEndian.Uint32(b[60:]), Checksum(b[:60]); got != want {
		return h, &headerError{msg: fmt.Sprintf("request header checksum %#08x, computed %#08x", got, want)}
	}
	h = RequestHeader{
		Op:         Opcode(b[5]),
		Flags:      Flags(binary.BigEndian.Uint16(b[6:])),
		ID:         binary.BigEndian.Uint64(b[8:]),
		Handle:     binary.BigEndian.Uint32(b[16:]),
		PayloadLen: binary.BigEndian.Uint32(b[20:]),
		Epoch:      binary.BigEndian.Uint64(b[24:]),
		Generation: binary.BigEndian.Uint64(b[32:]),
		Off:        binary.BigEndian.Uint64(b[40:]),
		Len:        binary.BigEndian.Uint64(b[48:]),
		PayloadCRC: binary.BigEndian.Uint32(b[56:]),
	}
	if v := b[4]; v != Version {
		return h, &headerError{msg: fmt.Sprintf("unsupported version %d (want %d)", v, Version), inSync: true}
	}
	return h, nil
}

// Validate checks a decoded request against its op: the op is known, the
// flags are known, the payload and the Off and Len arguments are in range.
// The error wraps ErrUnknownOp, ErrProtocol (fields that must be zero, or
// a payload the op does not take) or replica.ErrInvalid (values out of
// range, such as an oversized I/O).
func (h *RequestHeader) Validate() error {
	if !h.Op.valid() {
		return fmt.Errorf("wire: opcode %d: %w", h.Op, ErrUnknownOp)
	}
	if h.Flags&^knownFlags != 0 {
		return fmt.Errorf("wire: %v: unknown flags %#04x: %w", h.Op, uint16(h.Flags&^knownFlags), ErrProtocol)
	}
	spec := &opSpecs[h.Op]
	if err := checkArg(h.Op, "offset", spec.off, h.Off); err != nil {
		return err
	}
	if err := checkArg(h.Op, "length", spec.len, h.Len); err != nil {
		return err
	}
	n := h.PayloadLen
	switch spec.payload {
	case payloadNone:
		if n != 0 {
			return fmt.Errorf("wire: %v takes no payload, got %d bytes: %w", h.Op, n, ErrProtocol)
		}
	case payloadData:
		if uint64(n) != h.Len {
			return fmt.Errorf("wire: %v: payload %d bytes but length %d: %w", h.Op, n, h.Len, ErrProtocol)
		}
	case payloadID:
		if n == 0 || n > MaxIDLen {
			return fmt.Errorf("wire: %v: id of %d bytes, want 1..%d: %w", h.Op, n, MaxIDLen, replica.ErrInvalid)
		}
	case payloadOpen:
		if n == 0 || n > MaxOpenPayload {
			return fmt.Errorf("wire: %v: request of %d bytes, want 1..%d: %w", h.Op, n, MaxOpenPayload, replica.ErrInvalid)
		}
	case payloadOptID:
		if n > MaxIDLen {
			return fmt.Errorf("wire: %v: id of %d bytes, want at most %d: %w", h.Op, n, MaxIDLen, replica.ErrInvalid)
		}
	case payloadCopy:
		if n <= copyBudgetSize || n > MaxCopyPayload {
			return fmt.Errorf("wire: %v: request of %d bytes, want %d..%d: %w", h.Op, n, copyBudgetSize+1, MaxCopyPayload, replica.ErrInvalid)
		}
	}
	return nil
}

func checkArg(op Opcode, name string, k argKind, v uint64) error {
	switch k {
	case argZero:
		if v != 0 {
			return fmt.Errorf("wire: %v: %s %d must be 0: %w", op, name, v, ErrProtocol)
		}
	case argInt:
		if v > math.MaxInt64 {
			return fmt.Errorf("wire: %v: %s %d out of range: %w", op, name, v, replica.ErrInvalid)
		}
	case argIOLen:
		if v > replica.MaxIO {
			return fmt.Errorf("wire: %v: %s %d exceeds %d: %w", op, name, v, replica.MaxIO, replica.ErrInvalid)
		}
	case argZeroLen:
		if v > replica.MaxZeroes {
			return fmt.Errorf("wire: %v: %s %d exceeds %d: %w", op, name, v, replica.MaxZeroes, replica.ErrInvalid)
		}
	case argLimit:
		if v == 0 || v > MaxExtents {
			return fmt.Errorf("wire: %v: limit %d, want 1..%d: %w", op, v, MaxExtents, replica.ErrInvalid)
		}
	}
	return nil
}

// ReplyHeader is a decoded reply header.
type ReplyHeader struct {
	Status     Status
	ID         uint64
	PayloadLen uint32
	PayloadCRC uint32
}

// AppendTo appends the 32-byte encoding of h, header checksum included.
func (h *ReplyHeader) AppendTo(b []byte) []byte {
	start := len(b)
	b = binary.BigEndian.AppendUint32(b, ReplyMagic)
	b = append(b, Version, byte(h.Status), 0, 0)
	b = binary.BigEndian.AppendUint64(b, h.ID)
	b = binary.BigEndian.AppendUint32(b, h.PayloadLen)
	b = binary.BigEndian.AppendUint32(b, h.PayloadCRC)
	b = binary.BigEndian.AppendUint32(b, 0)
	return binary.BigEndian.AppendUint32(b, Checksum(b[start:]))
}

// DecodeReplyHeader decodes the first ReplyHeaderSize bytes of b, checking
// the magic, the header checksum, the version and the reserved fields.
func DecodeReplyHeader(b []byte) (h ReplyHeader, err error) {
	if len(b) < ReplyHeaderSize {
		return h, &headerError{msg: "short reply header"}
	}
	b = b[:ReplyHeaderSize]
	if m := binary.BigEndian.Uint32(b[0:]); m != ReplyMagic {
		return h, &headerError{msg: fmt.Sprintf("bad reply magic %#08x", m)}
	}
	if got, want := binary.BigEndian.Uint32(b[28:]), Checksum(b[:28]); got != want {
		return h, &headerError{msg: fmt.Sprintf("reply header checksum %#08x, computed %#08x", got, want)}
	}
	h = ReplyHeader{
		Status:     Status(b[5]),
		ID:         binary.BigEndian.Uint64(b[8:]),
		PayloadLen: binary.BigEndian.Uint32(b[16:]),
		PayloadCRC: binary.BigEndian.Uint32(b[20:]),
	}
	if v := b[4]; v != Version {
		return h, &headerError{msg: fmt.Sprintf("unsupported version %d (want %d)", v, Version), inSync: true}
	}
	if binary.BigEndian.Uint16(b[6:]) != 0 || binary.BigEndian.Uint32(b[24:]) != 0 {
		return h, &headerError{msg: "reserved reply fields are not zero", inSync: true}
	}
	return h, nil
}

// AppendRequest appends a whole request frame: h (with PayloadLen and
// PayloadCRC set from payload) followed by payload.
func AppendRequest(b []byte, h RequestHeader, payload []byte) []byte {
	h.PayloadLen = uint32(len(payload))
	h.PayloadCRC = Checksum(payload)
	return append(h.AppendTo(b), payload...)
}

// AppendReply appends a whole reply frame: h (with PayloadLen and
// PayloadCRC set from payload) followed by payload.
func AppendReply(b []byte, h ReplyHeader, payload []byte) []byte {
	h.PayloadLen = uint32(len(payload))
	h.PayloadCRC = Checksum(payload)
	return append(h.AppendTo(b), payload...)
}

// DecodeRequest decodes the request frame at the start of b as a server
// does: header, payload length limit, payload checksum, Validate. payload
// aliases b; n is the frame's length. A truncated frame is an error
// wrapping ErrProtocol.
func DecodeRequest(b []byte) (h RequestHeader, payload []byte, n int, err error) {
	h, err = DecodeRequestHeader(b)
	if err != nil {
		return h, nil, 0, err
	}
	if h.PayloadLen > MaxPayload {
		return h, nil, 0, fmt.Errorf("wire: request payload of %d bytes exceeds %d: %w", h.PayloadLen, MaxPayload, ErrProtocol)
	}
	n = RequestHeaderSize + int(h.PayloadLen)
	if len(b) < n {
		return h, nil, 0, fmt.Errorf("wire: truncated request: %d of %d bytes: %w", len(b), n, ErrProtocol)
	}
	payload = b[RequestHeaderSize:n]
	if Checksum(payload) != h.PayloadCRC {
		return h, nil, 0, fmt.Errorf("wire: request payload: %w", ErrChecksum)
	}
	if err := h.Validate(); err != nil {
		return h, nil, 0, err
	}
	return h, payload, n, nil
}

// DecodeReply decodes the reply frame at the start of b: header, payload
// length limit and payload checksum. payload aliases b.
func DecodeReply(b []byte) (h ReplyHeader, payload []byte, n int, err error) {
	h, err = DecodeReplyHeader(b)
	if err != nil {
		return h, nil, 0, err
	}
	if h.PayloadLen > MaxPayload {
		return h, nil, 0, fmt.Errorf("wire: reply payload of %d bytes exceeds %d: %w", h.PayloadLen, MaxPayload, ErrProtocol)
	}
	n = ReplyHeaderSize + int(h.PayloadLen)
	if len(b) < n {
		return h, nil, 0, fmt.Errorf("wire: truncated reply: %d of %d bytes: %w", len(b), n, ErrProtocol)
	}
	payload = b[ReplyHeaderSize:n]
	if Checksum(payload) != h.PayloadCRC {
		return h, nil, 0, fmt.Errorf("wire: reply payload: %w", ErrChecksum)
	}
	return h, payload, n, nil
}

// OpenReply is the payload of a successful OPEN reply.
type OpenReply struct {
	Handle uint32
	Size   uint64
	Epoch  uint64
}

// AppendTo appends the 24-byte encoding of r.
func (r *OpenReply) AppendTo(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, r.Handle)
	b = binary.BigEndian.AppendUint32(b, 0)
	b = binary.BigEndian.AppendUint64(b, r.Size)
	return binary.BigEndian.AppendUint64(b, r.Epoch)
}

// DecodeOpenReply decodes an OPEN reply payload.
func DecodeOpenReply(p []byte) (r OpenReply, err error) {
	if len(p) != OpenReplySize {
		return r, fmt.Errorf("wire: OPEN reply of %d bytes, want %d: %w", len(p), OpenReplySize, ErrProtocol)
	}
	if binary.BigEndian.Uint32(p[4:]) != 0 {
		return r, fmt.Errorf("wire: OPEN reply reserved field not zero: %w", ErrProtocol)
	}
	if binary.BigEndian.Uint32(p[0:]) == 0 {
		return r, fmt.Errorf("wire: OPEN reply with handle 0: %w", ErrProtocol)
	}
	return OpenReply{
		Handle: binary.BigEndian.Uint32(p[0:]),
		Size:   binary.BigEndian.Uint64(p[8:]),
		Epoch:  binary.BigEndian.Uint64(p[16:]),
	}, nil
}

// AppendExtents appends the encoding of es: per extent, Off then Len, as
// big-endian uint64s.
func AppendExtents(b []byte, es []replica.Extent) []byte {
	for _, e := range es {
		b = binary.BigEndian.AppendUint64(b, uint64(e.Off))
		b = binary.BigEndian.AppendUint64(b, uint64(e.Len))
	}
	return b
}

// DecodeExtents decodes an extent list. Offsets and lengths above
// MaxInt64 are rejected.
func DecodeExtents(p []byte) ([]replica.Extent, error) {
	if len(p)%ExtentSize != 0 || len(p)/ExtentSize > MaxExtents {
		return nil, fmt.Errorf("wire: extent list of %d bytes: %w", len(p), ErrProtocol)
	}
	es := make([]replica.Extent, len(p)/ExtentSize)
	for i := range es {
		off := binary.BigEndian.Uint64(p[i*ExtentSize:])
		n := binary.BigEndian.Uint64(p[i*ExtentSize+8:])
		if off > math.MaxInt64 || n > math.MaxInt64 {
			return nil, fmt.Errorf("wire: extent %d (%d, %d) out of range: %w", i, off, n, ErrProtocol)
		}
		es[i] = replica.Extent{Off: int64(off), Len: int64(n)}
	}
	return es, nil
}
