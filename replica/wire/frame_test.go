package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// validRequests is one well-formed request per op, the fuzz seeds.
func validRequests() []struct {
	h       RequestHeader
	payload []byte
} {
	data := bytes.Repeat([]byte{0xab}, 4096)
	type req = struct {
		h       RequestHeader
		payload []byte
	}
	return []req{
		{RequestHeader{Op: OpOpen, ID: 1, Epoch: 3}, []byte("vol-1.r0")},
		{RequestHeader{Op: OpClose, ID: 2, Handle: 1}, nil},
		{RequestHeader{Op: OpPing, ID: 3}, nil},
		{RequestHeader{Op: OpRead, ID: 4, Handle: 1, Epoch: 3, Generation: 2, Off: 4096, Len: 4096}, nil},
		{RequestHeader{Op: OpWrite, ID: 5, Handle: 1, Flags: FlagFUA, Epoch: 3, Generation: 2, Off: 8192, Len: 4096}, data},
		{RequestHeader{Op: OpWriteZeroes, ID: 6, Handle: 1, Off: 0, Len: replica.MaxZeroes}, nil},
		{RequestHeader{Op: OpTrim, ID: 7, Handle: 1, Off: 1 << 20, Len: 1 << 20}, nil},
		{RequestHeader{Op: OpFlush, ID: 8, Handle: 1, Epoch: math.MaxUint64}, nil},
		{RequestHeader{Op: OpGrow, ID: 9, Handle: 1, Len: math.MaxUint64}, nil},
		{RequestHeader{Op: OpSnapshotCreate, ID: 10, Handle: 1}, []byte("snap-1")},
		{RequestHeader{Op: OpSnapshotDelete, ID: 11, Handle: 1}, []byte("snap-1")},
		{RequestHeader{Op: OpSnapshotRead, ID: 12, Handle: 1, Off: 0, Len: replica.MaxIO}, []byte("snap-1")},
		{RequestHeader{Op: OpExtents, ID: 13, Handle: 1, Off: 0, Len: MaxExtents}, nil},
		{RequestHeader{Op: OpExtents, ID: 14, Handle: 1, Off: 4096, Len: 1}, []byte("snap-1")},
		{RequestHeader{Op: OpDirtyRegions, ID: 15, Handle: 1}, nil},
		{RequestHeader{Op: OpWrittenSince, ID: 16, Handle: 1, Off: math.MaxUint64}, nil},
		{RequestHeader{Op: OpRebuildBegin, ID: 17, Handle: 1}, nil},
		{RequestHeader{Op: OpRebuildWrite, ID: 18, Handle: 1, Off: 0, Len: 4096}, data},
		{RequestHeader{Op: OpRebuildEnd, ID: math.MaxUint64, Handle: math.MaxUint32}, nil},
		{RequestHeader{Op: OpRebuildCopy, ID: 19, Handle: 1, Epoch: 3, Generation: 2, Off: 1 << 20, Len: replica.MaxIO}, appendCopyRequest(nil, "vol-1.r1", time.Second)},
	}
}

func TestRequestRoundTrip(t *testing.T) {
	for _, r := range validRequests() {
		frame := AppendRequest([]byte("prefix"), r.h, r.payload)[len("prefix"):]
		if len(frame) != RequestHeaderSize+len(r.payload) {
			t.Fatalf("%v: frame of %d bytes", r.h.Op, len(frame))
		}
		h, p, n, err := DecodeRequest(append(frame, "trailing"...))
		if err != nil {
			t.Fatalf("%v: %v", r.h.Op, err)
		}
		want := r.h
		want.PayloadLen, want.PayloadCRC = uint32(len(r.payload)), Checksum(r.payload)
		if h != want || !bytes.Equal(p, r.payload) || n != len(frame) {
			t.Fatalf("%v: decoded %+v (%d bytes), want %+v", r.h.Op, h, n, want)
		}
	}
}

func TestReplyRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		h       ReplyHeader
		payload []byte
	}{
		{ReplyHeader{Status: StatusOK, ID: 1}, nil},
		{ReplyHeader{Status: StatusOK, ID: 2}, bytes.Repeat([]byte{1}, 4096)},
		{ReplyHeader{Status: StatusStaleEpoch, ID: math.MaxUint64}, []byte("replica: stale epoch")},
	} {
		frame := AppendReply(nil, tc.h, tc.payload)
		h, p, n, err := DecodeReply(frame)
		want := tc.h
		want.PayloadLen, want.PayloadCRC = uint32(len(tc.payload)), Checksum(tc.payload)
		if err != nil || h != want || !bytes.Equal(p, tc.payload) || n != len(frame) {
			t.Fatalf("%+v: got %+v %v", tc.h, h, err)
		}
	}
	op := OpenReply{Handle: 7, Size: 1 << 30, Epoch: 9}
	if got, err := DecodeOpenReply(op.AppendTo(nil)); err != nil || got != op {
		t.Fatalf("open reply: %+v %v", got, err)
	}
	es := []replica.Extent{{Off: 0, Len: 4096}, {Off: math.MaxInt64, Len: math.MaxInt64}}
	if got, err := DecodeExtents(AppendExtents(nil, es)); err != nil || !equalExtents(got, es) {
		t.Fatalf("extents: %v %v", got, err)
	}
}

// mutate returns a copy of the valid WRITE frame changed by f, with the
// header checksum recomputed unless keepCRC.
func mutate(f func(b []byte), fixCRC bool) []byte {
	r := validRequests()[4]
	b := AppendRequest(nil, r.h, r.payload)
	f(b)
	if fixCRC {
		binary.BigEndian.PutUint32(b[60:], Checksum(b[:60]))
	}
	return b
}

func TestDecodeRequestRejects(t *testing.T) {
	for _, tc := range []struct {
		name   string
		frame  []byte
		want   error
		inSync bool // the header error leaves the id usable
	}{
		{"empty", nil, ErrProtocol, false},
		{"short header", mutate(func([]byte) {}, true)[:63], ErrProtocol, false},
		{"bad magic", mutate(func(b []byte) { b[0] = 'X' }, true), ErrProtocol, false},
		{"bad header crc", mutate(func(b []byte) { b[9] ^= 1 }, false), ErrProtocol, false},
		{"version", mutate(func(b []byte) { b[4] = Version + 1 }, true), ErrProtocol, true},
		{"version 1", mutate(func(b []byte) { b[4] = 1 }, true), ErrProtocol, true}, // OPEN stated no purpose then
		{"unknown op", mutate(func(b []byte) { b[5] = 0 }, true), ErrUnknownOp, false},
		{"unknown op 255", mutate(func(b []byte) { b[5] = 255 }, true), ErrUnknownOp, false},
		{"unknown flag", mutate(func(b []byte) { b[7] |= 2 }, true), ErrProtocol, false},
		{"huge payload", mutate(func(b []byte) { binary.BigEndian.PutUint32(b[20:], math.MaxUint32) }, true), ErrProtocol, false},
		{"truncated payload", mutate(func([]byte) {}, true)[:100], ErrProtocol, false},
		{"payload crc", mutate(func(b []byte) { b[RequestHeaderSize] ^= 1 }, true), ErrChecksum, false},
		{"len != payload", mutate(func(b []byte) { binary.BigEndian.PutUint64(b[48:], 512) }, true), ErrProtocol, false},
		{"offset > MaxInt64", mutate(func(b []byte) { binary.BigEndian.PutUint64(b[40:], 1<<63) }, true), replica.ErrInvalid, false},
		{"read > MaxIO", func() []byte {
			h := RequestHeader{Op: OpRead, Handle: 1, Len: replica.MaxIO + 1}
			return AppendRequest(nil, h, nil)
		}(), replica.ErrInvalid, false},
		{"flush with payload", AppendRequest(nil, RequestHeader{Op: OpFlush, Handle: 1}, []byte("x")), ErrProtocol, false},
		{"flush with offset", AppendRequest(nil, RequestHeader{Op: OpFlush, Handle: 1, Off: 1}, nil), ErrProtocol, false},
		{"open without id", AppendRequest(nil, RequestHeader{Op: OpOpen}, nil), replica.ErrInvalid, false},
		{"open request too long", AppendRequest(nil, RequestHeader{Op: OpOpen}, make([]byte, MaxOpenPayload+1)), replica.ErrInvalid, false},
		{"extents limit 0", AppendRequest(nil, RequestHeader{Op: OpExtents, Handle: 1}, nil), replica.ErrInvalid, false},
		{"rebuild copy without a source", AppendRequest(nil, RequestHeader{Op: OpRebuildCopy, Handle: 1, Len: 4096}, appendCopyRequest(nil, "", 0)), replica.ErrInvalid, false},
		{"rebuild copy without a budget", AppendRequest(nil, RequestHeader{Op: OpRebuildCopy, Handle: 1, Len: 4096}, []byte("r1")), replica.ErrInvalid, false},
		{"rebuild copy source too long", AppendRequest(nil, RequestHeader{Op: OpRebuildCopy, Handle: 1, Len: 4096}, appendCopyRequest(nil, string(make([]byte, MaxIDLen+1)), 0)), replica.ErrInvalid, false},
		{"rebuild copy > MaxIO", AppendRequest(nil, RequestHeader{Op: OpRebuildCopy, Handle: 1, Len: replica.MaxIO + 1}, appendCopyRequest(nil, "r1", 0)), replica.ErrInvalid, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := DecodeRequest(tc.frame)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			var he *headerError
			if got := errors.As(err, &he) && he.inSync; got != tc.inSync {
				t.Fatalf("in sync = %v, want %v", got, tc.inSync)
			}
		})
	}
}

func TestBufPool(t *testing.T) {
	for _, n := range []int{0, 1, 512, 4096, 4097, 1 << 20, replica.MaxIO, replica.MaxIO + 1, MaxPayload} {
		b := getBuf(n)
		if len(*b) < n {
			t.Fatalf("getBuf(%d) = %d bytes", n, len(*b))
		}
		putBuf(b)
	}
	putBuf(nil)
	if testing.AllocsPerRun(100, func() { putBuf(getBuf(4096)) }) > 0 {
		t.Error("a pooled 4 KiB buffer allocates")
	}
}

func TestEncodeAllocs(t *testing.T) {
	h := RequestHeader{Op: OpWrite, Len: 4096}
	buf := make([]byte, 0, RequestHeaderSize)
	if n := testing.AllocsPerRun(100, func() { _ = h.AppendTo(buf[:0]) }); n > 0 {
		t.Errorf("RequestHeader.AppendTo: %v allocs", n)
	}
	frame := h.AppendTo(nil)
	if n := testing.AllocsPerRun(100, func() { _, _ = DecodeRequestHeader(frame) }); n > 0 {
		t.Errorf("DecodeRequestHeader: %v allocs", n)
	}
}

// fixRequestCRCs rewrites the checksums of the request frames in b, as
// far as they are whole, so that fuzzing reaches the checks behind them.
func fixRequestCRCs(b []byte) {
	for len(b) >= RequestHeaderSize {
		n := int(binary.BigEndian.Uint32(b[20:]))
		if n <= len(b)-RequestHeaderSize {
			binary.BigEndian.PutUint32(b[56:], Checksum(b[RequestHeaderSize:RequestHeaderSize+n]))
		}
		binary.BigEndian.PutUint32(b[60:], Checksum(b[:60]))
		if n > len(b)-RequestHeaderSize {
			return
		}
		b = b[RequestHeaderSize+n:]
	}
}

func FuzzDecodeRequest(f *testing.F) {
	for _, r := range validRequests() {
		f.Add(AppendRequest(nil, r.h, r.payload), false)
	}
	f.Add(mutate(func(b []byte) { b[5] = 99 }, true), true)
	f.Add(mutate(func(b []byte) { binary.BigEndian.PutUint32(b[20:], math.MaxUint32) }, true), true)
	f.Fuzz(func(t *testing.T, b []byte, fixCRC bool) {
		if fixCRC {
			fixRequestCRCs(b)
		}
		h, payload, n, err := DecodeRequest(b)
		if err != nil {
			return
		}
		if n > len(b) || len(payload) != int(h.PayloadLen) || len(payload) > MaxPayload {
			t.Fatalf("n %d of %d bytes, payload %d", n, len(b), len(payload))
		}
		if again := AppendRequest(nil, h, payload); !bytes.Equal(again, b[:n]) {
			t.Fatalf("re-encoding differs:\n%x\n%x", again, b[:n])
		}
	})
}

func FuzzDecodeReply(f *testing.F) {
	f.Add(AppendReply(nil, ReplyHeader{ID: 1}, nil), false)
	f.Add(AppendReply(nil, ReplyHeader{ID: 2, Status: StatusInvalid}, []byte("replica: invalid request")), false)
	open := OpenReply{Handle: 1, Size: 4096, Epoch: 2}
	f.Add(AppendReply(nil, ReplyHeader{ID: 3}, open.AppendTo(nil)), false)
	f.Add(AppendReply(nil, ReplyHeader{ID: 4}, AppendExtents(nil, []replica.Extent{{Off: 0, Len: 4096}})), false)
	f.Fuzz(func(t *testing.T, b []byte, fixCRC bool) {
		if fixCRC && len(b) >= ReplyHeaderSize {
			if n := int(binary.BigEndian.Uint32(b[16:])); n <= len(b)-ReplyHeaderSize {
				binary.BigEndian.PutUint32(b[20:], Checksum(b[ReplyHeaderSize:ReplyHeaderSize+n]))
			}
			binary.BigEndian.PutUint32(b[28:], Checksum(b[:28]))
		}
		h, payload, n, err := DecodeReply(b)
		if err != nil {
			return
		}
		if n > len(b) || len(payload) != int(h.PayloadLen) {
			t.Fatalf("n %d of %d bytes, payload %d", n, len(b), len(payload))
		}
		if again := AppendReply(nil, h, payload); !bytes.Equal(again, b[:n]) {
			t.Fatalf("re-encoding differs:\n%x\n%x", again, b[:n])
		}
		// The payload decoders never panic, and round-trip what they accept.
		if r, err := DecodeOpenReply(payload); err == nil && !bytes.Equal(r.AppendTo(nil), payload) {
			t.Fatal("open reply does not round-trip")
		}
		if es, err := DecodeExtents(payload); err == nil && !bytes.Equal(AppendExtents(nil, es), payload) {
			t.Fatal("extents do not round-trip")
		}
		_ = h.Status.Err()
	})
}
