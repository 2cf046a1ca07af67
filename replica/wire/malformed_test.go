package wire

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// rawConn speaks frames by hand to a server.
type rawConn struct {
	t  *testing.T
	nc net.Conn
}

func dialRaw(t *testing.T, addr string) *rawConn {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	return &rawConn{t, nc}
}

func (r *rawConn) send(b []byte) {
	r.t.Helper()
	if _, err := r.nc.Write(b); err != nil {
		r.t.Fatal(err)
	}
}

// reply reads one reply; ok is false if the server closed the connection
// instead.
func (r *rawConn) reply() (h ReplyHeader, payload []byte, ok bool) {
	r.t.Helper()
	r.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	var hb [ReplyHeaderSize]byte
	if _, err := io.ReadFull(r.nc, hb[:]); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			r.t.Fatal("no reply and no close")
		}
		return h, nil, false
	}
	h, err := DecodeReplyHeader(hb[:])
	if err != nil {
		r.t.Fatalf("server sent a bad reply header: %v", err)
	}
	payload = make([]byte, h.PayloadLen)
	if _, err := io.ReadFull(r.nc, payload); err != nil {
		r.t.Fatalf("reply payload: %v", err)
	}
	if Checksum(payload) != h.PayloadCRC {
		r.t.Fatal("reply payload checksum")
	}
	return h, payload, true
}

func (r *rawConn) openR1() uint32 {
	r.t.Helper()
	r.send(AppendRequest(nil, RequestHeader{Op: OpOpen, ID: 1, Epoch: 1}, []byte("r1")))
	h, p, ok := r.reply()
	if !ok || h.Status != StatusOK {
		r.t.Fatalf("open: %v %q", h.Status, p)
	}
	or, err := DecodeOpenReply(p)
	if err != nil {
		r.t.Fatal(err)
	}
	return or.Handle
}

// header returns an encoded request header with a valid checksum after
// f has edited it.
func header(h RequestHeader, f func(b []byte)) []byte {
	b := h.AppendTo(nil)
	f(b)
	binary.BigEndian.PutUint32(b[60:], Checksum(b[:60]))
	return b
}

func TestMalformedFrames(t *testing.T) {
	h := newHarness(t, ServerConfig{})
	ctx := context.Background()
	// A well-behaved client that must be unaffected throughout.
	_, good := h.open("r1", 1)
	data := pattern(5, 4096)
	if err := good.WriteAt(ctx, replica.Op{Epoch: 1}, data, 0); err != nil {
		t.Fatal(err)
	}

	const id = 77
	write := func(f func(b []byte), fixCRC bool) func(uint32) []byte {
		return func(handle uint32) []byte {
			b := AppendRequest(nil, RequestHeader{Op: OpWrite, ID: id, Handle: handle, Epoch: 1, Len: 4096}, make([]byte, 4096))
			f(b)
			if fixCRC {
				binary.BigEndian.PutUint32(b[60:], Checksum(b[:60]))
			}
			return b
		}
	}
	for _, tc := range []struct {
		name  string
		frame func(handle uint32) []byte
		// want is the status of the reply; closed means no reply and a
		// closed connection; then is whether the connection still serves.
		want   Status
		closed bool
		then   bool
	}{
		{"zeroes", func(uint32) []byte { return make([]byte, 64) }, 0, true, false},
		{"bad magic", write(func(b []byte) { copy(b, "GET ") }, true), 0, true, false},
		{"bad header checksum", write(func(b []byte) { b[30] ^= 0x10 }, false), 0, true, false},
		{"bad version", write(func(b []byte) { b[4] = 9 }, true), StatusProtocol, false, false},
		{"huge payload length", func(handle uint32) []byte {
			return header(RequestHeader{Op: OpWrite, ID: id, Handle: handle, Len: 4096}, func(b []byte) {
				binary.BigEndian.PutUint32(b[20:], math.MaxUint32)
			})
		}, StatusProtocol, false, false},
		{"unknown op", func(handle uint32) []byte {
			return AppendRequest(nil, RequestHeader{Op: 99, ID: id, Handle: handle}, []byte("some payload"))
		}, StatusUnknownOp, false, true},
		{"bad payload checksum", write(func(b []byte) { b[RequestHeaderSize+7] ^= 1 }, true), StatusBadChecksum, false, true},
		{"unknown flags", write(func(b []byte) { b[6] = 0x80 }, true), StatusProtocol, false, true},
		{"length != payload", write(func(b []byte) { binary.BigEndian.PutUint64(b[48:], 8192) }, true), StatusProtocol, false, true},
		{"oversized read", func(handle uint32) []byte {
			return AppendRequest(nil, RequestHeader{Op: OpRead, ID: id, Handle: handle, Epoch: 1, Len: 1 << 30}, nil)
		}, StatusInvalid, false, true},
		{"bad handle", func(handle uint32) []byte {
			return AppendRequest(nil, RequestHeader{Op: OpFlush, ID: id, Handle: handle + 1000, Epoch: 1}, nil)
		}, StatusBadHandle, false, true},
		{"stale epoch", func(handle uint32) []byte {
			return AppendRequest(nil, RequestHeader{Op: OpFlush, ID: id, Handle: handle, Epoch: 0}, nil)
		}, StatusStaleEpoch, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dialRaw(t, h.addr)
			handle := r.openR1()
			r.send(tc.frame(handle))
			rh, msg, ok := r.reply()
			switch {
			case tc.closed && ok:
				t.Fatalf("got a %v reply, want the connection closed", rh.Status)
			case tc.closed:
			case !ok:
				t.Fatalf("connection closed, want a %v reply", tc.want)
			case rh.Status != tc.want || rh.ID != id:
				t.Fatalf("reply %v to id %d (%q), want %v to id %d", rh.Status, rh.ID, msg, tc.want, id)
			default:
				t.Logf("reply: %v %q", rh.Status, msg)
			}
			// Afterwards: either the connection serves on, or it is closed.
			r.send(AppendRequest(nil, RequestHeader{Op: OpPing, ID: 2}, nil))
			rh, _, ok = r.reply()
			if tc.then != (ok && rh.Status == StatusOK && rh.ID == 2) {
				t.Fatalf("after the bad frame: reply %v, ok %v; want serving %v", rh.Status, ok, tc.then)
			}
		})
	}

	t.Run("truncated header", func(t *testing.T) {
		r := dialRaw(t, h.addr)
		frame := AppendRequest(nil, RequestHeader{Op: OpPing, ID: 3}, nil)
		r.send(frame[:40])
		r.nc.(*net.TCPConn).CloseWrite()
		if rh, _, ok := r.reply(); ok {
			t.Fatalf("got a %v reply to half a header", rh.Status)
		}
	})
	t.Run("truncated payload", func(t *testing.T) {
		r := dialRaw(t, h.addr)
		handle := r.openR1()
		frame := AppendRequest(nil, RequestHeader{Op: OpWrite, ID: 4, Handle: handle, Epoch: 1, Len: 4096}, make([]byte, 4096))
		r.send(frame[:2000])
		r.nc.(*net.TCPConn).CloseWrite()
		if rh, _, ok := r.reply(); ok {
			t.Fatalf("got a %v reply to half a payload", rh.Status)
		}
	})
	t.Run("replies after half-close", func(t *testing.T) {
		// A client that sends whole requests and then closes its side still
		// gets its replies.
		r := dialRaw(t, h.addr)
		handle := r.openR1()
		var b []byte
		for i := range 8 {
			b = AppendRequest(b, RequestHeader{Op: OpRead, ID: uint64(100 + i), Handle: handle, Epoch: 1, Len: 4096}, nil)
		}
		r.send(b)
		r.nc.(*net.TCPConn).CloseWrite()
		for range 8 {
			rh, p, ok := r.reply()
			if !ok || rh.Status != StatusOK || !bytes.Equal(p, data) {
				t.Fatalf("reply %v ok %v", rh.Status, ok)
			}
		}
	})

	// The well-behaved client never noticed.
	got := make([]byte, 4096)
	if err := good.ReadAt(ctx, replica.Op{Epoch: 1}, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("good client after the bad frames: %v", err)
	}
}

// fakeServer answers each request with whatever reply the test builds.
func fakeServer(t *testing.T, answer func(h RequestHeader) []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, nc := range conns {
			nc.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, nc)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer nc.Close()
				for {
					var hb [RequestHeaderSize]byte
					if _, err := io.ReadFull(nc, hb[:]); err != nil {
						return
					}
					h, err := DecodeRequestHeader(hb[:])
					if err != nil {
						return
					}
					if _, err := io.CopyN(io.Discard, nc, int64(h.PayloadLen)); err != nil {
						return
					}
					if _, err := nc.Write(answer(h)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func TestClientRejectsBadReplies(t *testing.T) {
	ctx := context.Background()
	ok := func(h RequestHeader) []byte { return AppendReply(nil, ReplyHeader{ID: h.ID}, nil) }
	openOK := func(h RequestHeader) []byte {
		r := OpenReply{Handle: 1, Size: 1 << 20, Epoch: 1}
		return AppendReply(nil, ReplyHeader{ID: h.ID}, r.AppendTo(nil))
	}
	// Each server answers PING and OPEN correctly and READ (offset 0) with
	// the reply under test, READ at any other offset correctly.
	serve := func(bad func(h RequestHeader) []byte) func(h RequestHeader) []byte {
		return func(h RequestHeader) []byte {
			switch {
			case h.Op == OpOpen:
				return openOK(h)
			case h.Op == OpRead && h.Off == 0:
				return bad(h)
			case h.Op == OpRead:
				return AppendReply(nil, ReplyHeader{ID: h.ID}, make([]byte, h.Len))
			}
			return ok(h)
		}
	}
	for _, tc := range []struct {
		name  string
		bad   func(h RequestHeader) []byte
		want  error
		broke bool // the connection is broken afterwards
	}{
		{"short data", func(h RequestHeader) []byte { return AppendReply(nil, ReplyHeader{ID: h.ID}, make([]byte, 100)) }, ErrProtocol, false},
		{"data checksum", func(h RequestHeader) []byte {
			b := AppendReply(nil, ReplyHeader{ID: h.ID}, make([]byte, h.Len))
			b[ReplyHeaderSize] = 1
			return b
		}, ErrChecksum, false},
		{"long error text", func(h RequestHeader) []byte {
			return AppendReply(nil, ReplyHeader{ID: h.ID, Status: StatusIO}, make([]byte, MaxMessage+1))
		}, ErrProtocol, false},
		{"unknown status", func(h RequestHeader) []byte {
			return AppendReply(nil, ReplyHeader{ID: h.ID, Status: 250}, []byte("from the future"))
		}, ErrProtocol, false},
		{"bad magic", func(h RequestHeader) []byte {
			b := AppendReply(nil, ReplyHeader{ID: h.ID}, nil)
			b[0] = 0
			return b
		}, ErrDisconnected, true},
		{"huge payload", func(h RequestHeader) []byte {
			b := ReplyHeader{ID: h.ID, PayloadLen: math.MaxUint32}
			return b.AppendTo(nil)
		}, ErrDisconnected, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := fakeServer(t, serve(tc.bad))
			c, err := Dial(ctx, "tcp", addr, ClientConfig{Timeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			hd, err := c.Open(ctx, "x", 1)
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 4096)
			if err := hd.ReadAt(ctx, replica.Op{Epoch: 1}, buf, 0); !errors.Is(err, tc.want) {
				t.Fatalf("ReadAt: %v, want %v", err, tc.want)
			}
			err = hd.ReadAt(ctx, replica.Op{Epoch: 1}, buf, 4096)
			if broke := errors.Is(err, ErrDisconnected); broke != tc.broke || (!broke && err != nil) {
				t.Fatalf("next ReadAt: %v; want broken %v", err, tc.broke)
			}
		})
	}
}

// FuzzServeStream feeds a byte stream to a server connection: the server
// must not panic, must answer only with well-formed replies, and must
// release the connection when the stream ends.
func FuzzServeStream(f *testing.F) {
	var stream []byte
	stream = AppendRequest(stream, RequestHeader{Op: OpOpen, ID: 1, Epoch: 1}, []byte("r1"))
	for _, r := range validRequests()[1:] {
		stream = AppendRequest(stream, r.h, r.payload)
	}
	f.Add(stream, false)
	f.Add(stream[:200], false)
	f.Add(AppendRequest(nil, RequestHeader{Op: OpOpen, ID: 1}, []byte("r1")), true)
	f.Fuzz(func(t *testing.T, b []byte, fixCRC bool) {
		if fixCRC {
			fixRequestCRCs(b)
		}
		fr := newFakeReplica("r1", 1<<20)
		fr.quiet = true
		srv, err := NewServer(fakeBackend{"r1": fr}, ServerConfig{Logger: discardLogger(), MaxInFlightBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		cliSide, srvSide := net.Pipe()
		srv.startConn(srvSide)
		replies := make(chan error, 1)
		go func() { // read replies until the server closes
			var hb [ReplyHeaderSize]byte
			for {
				if _, err := io.ReadFull(cliSide, hb[:]); err != nil {
					replies <- nil
					return
				}
				h, err := DecodeReplyHeader(hb[:])
				if err == nil && h.PayloadLen > MaxPayload {
					err = errors.New("oversized reply")
				}
				if err != nil {
					replies <- err
					return
				}
				if _, err := io.CopyN(io.Discard, cliSide, int64(h.PayloadLen)); err != nil {
					replies <- nil
					return
				}
			}
		}()
		cliSide.SetWriteDeadline(time.Now().Add(5 * time.Second))
		cliSide.Write(b) // the server may close early
		cliSide.SetWriteDeadline(time.Time{})
		// net.Pipe has no half-close: end the stream by closing the server.
		srv.Close()
		if err := <-replies; err != nil {
			t.Fatalf("bad reply: %v", err)
		}
		cliSide.Close()
	})
}
