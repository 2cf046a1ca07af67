package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"testing"
	"time"
)

// The fuzz targets feed arbitrary client bytes to ServeConn and check that
// the server never panics or hangs, that what it writes back is a
// well-formed stream, and that its memory follows the number of messages,
// never the lengths the client declares.

// fuzzMaxPayload keeps the per-request allocation bound small.
const fuzzMaxPayload = 64 << 10

// fuzzDevice is shared by every fuzz input (its content does not matter).
var fuzzDevice = func() *memDevice {
	d := newMemDevice(1 << 20)
	d.noLog = true
	return d
}()

func fuzzServer(t testing.TB) *Server {
	s, err := NewServer(Config{
		Exports:          []Export{{Name: "mem", Device: fuzzDevice}},
		MaxPayload:       fuzzMaxPayload,
		MaxInFlight:      8,
		HandshakeTimeout: 5 * time.Second,
		Logger:           slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// fuzzConn is a net.Conn whose reads come from a fixed input and whose
// writes go to w. Reads past the input return io.EOF, as a client that
// sent its bytes and hung up.
type fuzzConn struct {
	r *bytes.Reader
	w io.Writer
}

func (c *fuzzConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *fuzzConn) Write(p []byte) (int, error)      { return c.w.Write(p) }
func (c *fuzzConn) Close() error                     { return nil }
func (c *fuzzConn) LocalAddr() net.Addr              { return fuzzAddr{} }
func (c *fuzzConn) RemoteAddr() net.Addr             { return fuzzAddr{} }
func (c *fuzzConn) SetDeadline(time.Time) error      { return nil }
func (c *fuzzConn) SetReadDeadline(time.Time) error  { return nil }
func (c *fuzzConn) SetWriteDeadline(time.Time) error { return nil }

type fuzzAddr struct{}

func (fuzzAddr) Network() string { return "fuzz" }
func (fuzzAddr) String() string  { return "fuzz" }

// serveFuzz serves input and returns ServeConn's error; it fails the test
// if the server hangs or allocates more than the messages in the input
// can justify.
func serveFuzz(t *testing.T, input []byte, out io.Writer) error {
	s := fuzzServer(t)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	done := make(chan error, 1)
	go func() { done <- s.ServeConn(context.Background(), &fuzzConn{r: bytes.NewReader(input), w: out}) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("ServeConn did not return within 10s for input %x\n%s", input, buf)
	}
	runtime.ReadMemStats(&after)
	s.Close()
	// Every option header is 16 bytes and every request header 28; each
	// may justify one payload buffer (MaxPayload or the option limit),
	// plus fixed per-connection buffers.
	messages := uint64(len(input)/optionHeaderLen + 2)
	limit := 4<<20 + messages*(fuzzMaxPayload+maxOptionLen+4096)
	if used := after.TotalAlloc - before.TotalAlloc; used > limit {
		t.Fatalf("serving %d input bytes allocated %d bytes (limit %d)", len(input), used, limit)
	}
	return err
}

// ---------------------------------------------------------------- handshake

func option(opt uint32, data []byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, magicOption)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

var clientFlags = binary.BigEndian.AppendUint32(nil, clientFlagFixedNewstyle|clientFlagNoZeroes)

func FuzzHandshake(f *testing.F) {
	f.Add(cat(clientFlags, option(optGo, goData("mem", infoBlockSize))))
	f.Add(cat(clientFlags, option(optInfo, goData("", infoName, infoDescription, infoBlockSize)), option(optGo, goData("mem"))))
	f.Add(cat(clientFlags, option(optList, nil), option(optAbort, nil)))
	f.Add(cat(clientFlags, option(optStructuredReply, nil), option(optExportName, []byte("mem"))))
	f.Add(cat(binary.BigEndian.AppendUint32(nil, 0), option(optExportName, nil)))
	f.Add(cat(clientFlags, option(optGo, []byte{0xff, 0xff, 0xff, 0xff, 0, 0})))
	f.Add(cat(clientFlags, option(optInfo, goData("mem", 1, 2, 3))[:20]))
	f.Add(cat(clientFlags, binary.BigEndian.AppendUint64(nil, magicOption), []byte{0, 0, 0, 7, 0xff, 0xff, 0xff, 0xff}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, input []byte) {
		// The option replies are small; what follows a successful GO (the
		// fuzzer's bytes taken as requests) may be large and is dropped.
		out := &headWriter{max: 1 << 20}
		err := serveFuzz(t, input, out)
		if len(out.b) < 18 || !bytes.Equal(out.b[:8], []byte("NBDMAGIC")) {
			t.Fatalf("server output does not start with the greeting: % x", head(out.b))
		}
		checkOptionReplies(t, input, out.b[18:], err)
	})
}

// checkOptionReplies parses the server's option replies: each carries the
// reply magic and answers the option the client sent, in order, until the
// handshake ended.
func checkOptionReplies(t *testing.T, input, out []byte, serveErr error) {
	if len(input) < 4 {
		return // the client hung up before its flags
	}
	if binary.BigEndian.Uint32(input)&^clientFlagsKnown != 0 {
		if len(out) != 0 || serveErr == nil {
			t.Fatalf("unknown client flags: server wrote %d bytes and ServeConn returned %v; want a hard disconnect", len(out), serveErr)
		}
		return
	}
	in := input[4:]
	for i := 0; i < maxOptions && len(in) >= optionHeaderLen && binary.BigEndian.Uint64(in) == magicOption; i++ {
		opt := binary.BigEndian.Uint32(in[8:])
		n := binary.BigEndian.Uint32(in[12:])
		if uint64(len(in)-optionHeaderLen) < uint64(n) {
			return // the client hung up inside the option
		}
		in = in[optionHeaderLen+int(n):]
		if opt == optExportName {
			return // transmission (or a hard disconnect) follows
		}
		// Replies to this option: zero or more INFO/SERVER, then a final one.
		for {
			if len(out) < optReplyHdrLen {
				t.Fatalf("option %d (#%d): reply truncated or missing: % x (ServeConn: %v)", opt, i, out, serveErr)
			}
			if m := binary.BigEndian.Uint64(out); m != magicOptionReply {
				t.Fatalf("option reply magic %#x", m)
			}
			if got := binary.BigEndian.Uint32(out[8:]); got != opt {
				t.Fatalf("reply to option %d, expected a reply to %d", got, opt)
			}
			typ := binary.BigEndian.Uint32(out[12:])
			rn := binary.BigEndian.Uint32(out[16:])
			if uint64(len(out)-optReplyHdrLen) < uint64(rn) {
				t.Fatalf("option reply of %d bytes truncated", rn)
			}
			out = out[optReplyHdrLen+int(rn):]
			if typ == repInfo || typ == repServer {
				continue
			}
			if (opt == optGo && typ == repAck) || opt == optAbort {
				return // transmission follows, or the session ended
			}
			break
		}
	}
}

// ---------------------------------------------------------------- requests

// handshakeGo is the client's side of a successful handshake, and
// handshakeReplyLen the length of the server's answer to it (greeting,
// NBD_INFO_EXPORT, NBD_INFO_BLOCK_SIZE, ACK).
var (
	handshakeGo       = cat(clientFlags, option(optGo, goData("mem", infoBlockSize)))
	handshakeReplyLen = 18 + (optReplyHdrLen + 12) + (optReplyHdrLen + 14) + optReplyHdrLen
)

func req(typ, flags uint16, off uint64, length uint32, payload []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, magicRequest)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, 0) // handle: numbered by the harness
	b = binary.BigEndian.AppendUint64(b, off)
	b = binary.BigEndian.AppendUint32(b, length)
	return append(b, payload...)
}

func FuzzRequests(f *testing.F) {
	f.Add(cat(req(cmdWrite, 0, 0, 512, make([]byte, 512)), req(cmdRead, 0, 0, 4096, nil), req(cmdFlush, 0, 0, 0, nil), req(cmdDisc, 0, 0, 0, nil)))
	f.Add(cat(req(cmdWrite, cmdFlagFUA, 4096, 4096, make([]byte, 4096)), req(cmdTrim, cmdFlagFUA, 0, 8192, nil), req(cmdWriteZeroes, cmdFlagNoHole, 0, 1<<20, nil)))
	f.Add(cat(req(cmdRead, 0, 1<<20, 512, nil), req(cmdRead, 0, 3, 512, nil), req(cmdWrite, 0, 0, 1<<30, nil)))
	f.Add(cat(req(cmdWrite, 0, 0, fuzzMaxPayload+512, make([]byte, fuzzMaxPayload+512)), req(cmdRead, 0, 0, fuzzMaxPayload, nil)))
	f.Add(cat(req(cmdBlockStatus, 0, 0, 512, nil), req(99, 0xffff, ^uint64(0), ^uint32(0), nil)))
	f.Add(cat(req(cmdRead, 0, 0, 512, nil), []byte("garbage that is not a request")))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, stream []byte) {
		stream = bytes.Clone(stream)
		rc := &replyChecker{skip: handshakeReplyLen, want: numberRequests(stream)}
		serveErr := serveFuzz(t, cat(handshakeGo, stream), rc)
		rc.finish(t, serveErr)
	})
}

// numberRequests parses a request stream as the server must, gives every
// request a unique handle (so replies can be matched without ambiguity)
// and returns, per handle, the payload length its successful reply
// carries (READ) or -1, for every request the server must answer.
func numberRequests(stream []byte) map[uint64]int {
	want := map[uint64]int{}
	for h := uint64(1); len(stream) >= requestHeaderLen; h++ {
		if binary.BigEndian.Uint32(stream) != magicRequest {
			break
		}
		binary.BigEndian.PutUint64(stream[8:], h)
		typ := binary.BigEndian.Uint16(stream[6:])
		n := binary.BigEndian.Uint32(stream[24:])
		stream = stream[requestHeaderLen:]
		switch typ {
		case cmdDisc:
			return want
		case cmdWrite:
			if uint64(len(stream)) < uint64(n) {
				return want // payload cut short: the request is never answered
			}
			stream = stream[n:]
			want[h] = -1
		case cmdRead:
			want[h] = int(n)
		default:
			want[h] = -1
		}
	}
	return want
}

// replyChecker is the client's side of the stream: it parses the
// server's replies as they are written (never holding them) and records
// the first thing wrong: a reply for a handle not asked or answered
// twice, a bad magic, a READ reply without its data.
type replyChecker struct {
	skip int            // handshake bytes still to skip
	want map[uint64]int // handle -> READ length, or -1; deleted when answered
	hdr  []byte         // partial reply header
	data int            // READ payload bytes still to skip
	err  error
}

func (c *replyChecker) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 && c.err == nil {
		switch {
		case c.skip > 0:
			k := min(c.skip, len(p))
			c.skip -= k
			p = p[k:]
		case c.data > 0:
			k := min(c.data, len(p))
			c.data -= k
			p = p[k:]
		default:
			k := min(replyHeaderLen-len(c.hdr), len(p))
			c.hdr = append(c.hdr, p[:k]...)
			p = p[k:]
			if len(c.hdr) < replyHeaderLen {
				continue
			}
			c.reply(c.hdr)
			c.hdr = c.hdr[:0]
		}
	}
	if c.err != nil {
		return 0, c.err
	}
	return n, nil
}

func (c *replyChecker) reply(b []byte) {
	if m := binary.BigEndian.Uint32(b); m != magicSimpleReply {
		c.err = fmt.Errorf("reply magic %#x", m)
		return
	}
	errno := binary.BigEndian.Uint32(b[4:])
	h := binary.BigEndian.Uint64(b[8:])
	n, ok := c.want[h]
	if !ok {
		c.err = fmt.Errorf("reply for handle %d, which was not asked (or was answered already)", h)
		return
	}
	delete(c.want, h)
	if n > 0 && errno == 0 {
		c.data = n
	}
}

func (c *replyChecker) finish(t *testing.T, serveErr error) {
	switch {
	case c.err != nil:
		t.Fatalf("server output: %v (ServeConn: %v)", c.err, serveErr)
	case c.skip > 0:
		t.Fatalf("handshake reply %d bytes short (ServeConn: %v)", c.skip, serveErr)
	case len(c.hdr) > 0 || c.data > 0:
		t.Fatalf("server output ends inside a reply (ServeConn: %v)", serveErr)
	case len(c.want) > 0:
		t.Fatalf("%d requests never answered (ServeConn: %v)", len(c.want), serveErr)
	}
}

// headWriter keeps the first max bytes written and drops the rest.
type headWriter struct {
	b   []byte
	max int
}

func (w *headWriter) Write(p []byte) (int, error) {
	if room := w.max - len(w.b); room > 0 {
		w.b = append(w.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}
