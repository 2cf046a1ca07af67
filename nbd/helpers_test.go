package nbd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica/engine"
)

// The volume engine is a Device.
var _ Device = (*engine.Engine)(nil)

// ---------------------------------------------------------------- memory device

// memDevice is an in-memory Device. It keeps what a flush made durable
// apart from what was written, records the calls it gets, and can hold
// reads at chosen offsets or fail requests.
type memDevice struct {
	mu      sync.Mutex
	data    []byte
	durable []byte
	calls   []string // "write 0 4096 fua", "zeroes ...", "trim ...", "flush"

	// hold, when set, makes a read at off wait until the channel is
	// closed. Set before serving.
	hold map[int64]chan struct{}
	// fail, when set, decides an error for each request (op is "read",
	// "write", "zeroes", "trim", "flush"). Set before serving.
	fail func(op string, off int64) error

	active, maxActive int // reads in flight
	started           chan int64
	noLog             bool // keep no call log (fuzzing: it would grow forever)
}

func newMemDevice(size int) *memDevice {
	return &memDevice{data: make([]byte, size), durable: make([]byte, size), started: make(chan int64, 1024)}
}

func (d *memDevice) record(format string, args ...any) {
	if d.noLog {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls = append(d.calls, fmt.Sprintf(format, args...))
}

func (d *memDevice) callLog() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.calls...)
}

func (d *memDevice) check(op string, off, n int64) error {
	if d.fail != nil {
		if err := d.fail(op, off); err != nil {
			return err
		}
	}
	if off < 0 || n < 0 || off+n > int64(len(d.data)) {
		return fmt.Errorf("memDevice: %s of %d at %d out of range", op, n, off)
	}
	return nil
}

func (d *memDevice) ReadAt(ctx context.Context, p []byte, off int64) error {
	d.mu.Lock()
	d.active++
	d.maxActive = max(d.maxActive, d.active)
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.active--
		d.mu.Unlock()
	}()
	select {
	case d.started <- off:
	default:
	}
	if ch := d.hold[off]; ch != nil {
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := d.check("read", off, int64(len(p))); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	copy(p, d.data[off:])
	return nil
}

func (d *memDevice) WriteAt(_ context.Context, p []byte, off int64, fua bool) error {
	if err := d.check("write", off, int64(len(p))); err != nil {
		return err
	}
	d.mu.Lock()
	copy(d.data[off:], p)
	if fua {
		copy(d.durable[off:], p)
	}
	d.mu.Unlock()
	d.record("write %d %d fua=%v", off, len(p), fua)
	return nil
}

func (d *memDevice) WriteZeroes(_ context.Context, off, n int64, fua bool) error {
	if err := d.check("zeroes", off, n); err != nil {
		return err
	}
	d.mu.Lock()
	clear(d.data[off : off+n])
	if fua {
		clear(d.durable[off : off+n])
	}
	d.mu.Unlock()
	d.record("zeroes %d %d fua=%v", off, n, fua)
	return nil
}

func (d *memDevice) Trim(_ context.Context, off, n int64) error {
	if err := d.check("trim", off, n); err != nil {
		return err
	}
	d.mu.Lock()
	clear(d.data[off : off+n])
	d.mu.Unlock()
	d.record("trim %d %d", off, n)
	return nil
}

func (d *memDevice) Flush(context.Context) error {
	if err := d.check("flush", 0, 0); err != nil {
		return err
	}
	d.mu.Lock()
	copy(d.durable, d.data)
	d.mu.Unlock()
	d.record("flush")
	return nil
}

func (d *memDevice) Size() uint64 { return uint64(len(d.data)) }

func (d *memDevice) durableAt(off, n int) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]byte(nil), d.durable[off:off+n]...)
}

// ---------------------------------------------------------------- server harness

// testLogger routes the server's logs to t.Log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// newTestServer returns a server with one export "mem" of dev (nil: a new
// 1 MiB device); edit adjusts the config. Closed in t.Cleanup.
func newTestServer(t testing.TB, dev Device, edit func(*Config)) *Server {
	t.Helper()
	if dev == nil {
		dev = newMemDevice(1 << 20)
	}
	cfg := Config{
		Exports: []Export{{Name: "mem", Description: "a memory device", Device: dev}},
		Logger:  testLogger(t),
	}
	if edit != nil {
		edit(&cfg)
	}
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// pipe connects a client to s over net.Pipe and returns the client side
// and a channel with ServeConn's result.
func pipe(t *testing.T, s *Server) (net.Conn, <-chan error) {
	t.Helper()
	cs, ss := net.Pipe()
	done := make(chan error, 1)
	go func() { done <- s.ServeConn(context.Background(), ss) }()
	t.Cleanup(func() { cs.Close() })
	return cs, done
}

// ---------------------------------------------------------------- client

// rawClient speaks the protocol byte by byte for tests.
type rawClient struct {
	t  testing.TB
	nc net.Conn
	br *bufio.Reader

	mu    sync.Mutex
	reads map[uint64]uint32 // handle -> length, for READs awaiting a reply
	next  uint64
}

func newRawClient(t testing.TB, nc net.Conn) *rawClient {
	nc.SetDeadline(time.Now().Add(20 * time.Second))
	return &rawClient{t: t, nc: nc, br: bufio.NewReader(nc), reads: map[uint64]uint32{}, next: 1}
}

func (c *rawClient) readFull(n int) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(c.br, b)
	return b, err
}

func (c *rawClient) must(err error) {
	c.t.Helper()
	if err != nil {
		c.t.Fatal(err)
	}
}

// greet reads the server's greeting and sends the client flags.
func (c *rawClient) greet(clientFlags uint32) {
	c.t.Helper()
	b, err := c.readFull(18)
	c.must(err)
	if binary.BigEndian.Uint64(b) != magicInit || binary.BigEndian.Uint64(b[8:]) != magicOption {
		c.t.Fatalf("bad greeting % x", b)
	}
	if f := binary.BigEndian.Uint16(b[16:]); f != flagFixedNewstyle|flagNoZeroes {
		c.t.Fatalf("handshake flags %#x, want FIXED_NEWSTYLE|NO_ZEROES", f)
	}
	c.must(binary.Write(c.nc, binary.BigEndian, clientFlags))
}

func (c *rawClient) sendOption(opt uint32, data []byte) {
	c.t.Helper()
	var hdr [16]byte
	binary.BigEndian.PutUint64(hdr[0:], magicOption)
	binary.BigEndian.PutUint32(hdr[8:], opt)
	binary.BigEndian.PutUint32(hdr[12:], uint32(len(data)))
	_, err := c.nc.Write(append(hdr[:], data...))
	c.must(err)
}

type optReply struct {
	opt, typ uint32
	data     []byte
}

func (c *rawClient) readOptReply() (optReply, error) {
	b, err := c.readFull(20)
	if err != nil {
		return optReply{}, err
	}
	if m := binary.BigEndian.Uint64(b); m != magicOptionReply {
		return optReply{}, fmt.Errorf("bad option reply magic %#x", m)
	}
	r := optReply{opt: binary.BigEndian.Uint32(b[8:]), typ: binary.BigEndian.Uint32(b[12:])}
	r.data, err = c.readFull(int(binary.BigEndian.Uint32(b[16:])))
	return r, err
}

// goData encodes the payload of NBD_OPT_GO / NBD_OPT_INFO.
func goData(name string, infos ...uint16) []byte {
	d := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	d = append(d, name...)
	d = binary.BigEndian.AppendUint16(d, uint16(len(infos)))
	for _, i := range infos {
		d = binary.BigEndian.AppendUint16(d, i)
	}
	return d
}

// exportInfo is what NBD_OPT_GO/INFO told the client.
type exportInfo struct {
	size                  uint64
	flags                 uint16
	minBS, prefBS, maxBS  uint32
	name, description     string
	hasBlockSize, hasName bool
}

// infoReplies reads the replies to GO/INFO up to the final one, which it
// returns with what the INFO replies said.
func (c *rawClient) infoReplies(opt uint32) (exportInfo, optReply) {
	c.t.Helper()
	var info exportInfo
	for {
		r, err := c.readOptReply()
		c.must(err)
		if r.opt != opt {
			c.t.Fatalf("reply to option %d, want %d", r.opt, opt)
		}
		if r.typ != repInfo {
			return info, r
		}
		switch binary.BigEndian.Uint16(r.data) {
		case infoExport:
			info.size = binary.BigEndian.Uint64(r.data[2:])
			info.flags = binary.BigEndian.Uint16(r.data[10:])
		case infoBlockSize:
			info.hasBlockSize = true
			info.minBS = binary.BigEndian.Uint32(r.data[2:])
			info.prefBS = binary.BigEndian.Uint32(r.data[6:])
			info.maxBS = binary.BigEndian.Uint32(r.data[10:])
		case infoName:
			info.hasName, info.name = true, string(r.data[2:])
		case infoDescription:
			info.description = string(r.data[2:])
		}
	}
}

// handshake runs greeting and NBD_OPT_GO for export and fails the test
// unless the server accepts.
func (c *rawClient) handshake(export string) exportInfo {
	c.t.Helper()
	c.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)
	c.sendOption(optGo, goData(export, infoBlockSize))
	info, final := c.infoReplies(optGo)
	if final.typ != repAck {
		c.t.Fatalf("NBD_OPT_GO %q: reply %#x %q", export, final.typ, final.data)
	}
	return info
}

// send writes one request and returns its handle.
func (c *rawClient) send(typ, flags uint16, off uint64, length uint32, payload []byte) uint64 {
	c.t.Helper()
	c.mu.Lock()
	h := c.next
	c.next++
	if typ == cmdRead {
		c.reads[h] = length
	}
	c.mu.Unlock()
	c.sendHandle(h, typ, flags, off, length, payload)
	return h
}

func (c *rawClient) sendHandle(h uint64, typ, flags uint16, off uint64, length uint32, payload []byte) {
	c.t.Helper()
	var hdr [28]byte
	binary.BigEndian.PutUint32(hdr[0:], magicRequest)
	binary.BigEndian.PutUint16(hdr[4:], flags)
	binary.BigEndian.PutUint16(hdr[6:], typ)
	binary.BigEndian.PutUint64(hdr[8:], h)
	binary.BigEndian.PutUint64(hdr[16:], off)
	binary.BigEndian.PutUint32(hdr[24:], length)
	_, err := c.nc.Write(append(hdr[:], payload...))
	c.must(err)
}

type simpleReply struct {
	handle uint64
	errno  Errno
	data   []byte
}

// recv reads one reply (with its payload when it answers a READ without
// error).
func (c *rawClient) recv() (simpleReply, error) {
	b, err := c.readFull(16)
	if err != nil {
		return simpleReply{}, err
	}
	if m := binary.BigEndian.Uint32(b); m != magicSimpleReply {
		return simpleReply{}, fmt.Errorf("bad reply magic %#x", m)
	}
	r := simpleReply{errno: Errno(binary.BigEndian.Uint32(b[4:])), handle: binary.BigEndian.Uint64(b[8:])}
	c.mu.Lock()
	n, isRead := c.reads[r.handle]
	delete(c.reads, r.handle)
	c.mu.Unlock()
	if isRead && r.errno == 0 {
		r.data, err = c.readFull(int(n))
	}
	return r, err
}

// do sends one request and waits for its reply (no other in flight).
func (c *rawClient) do(typ, flags uint16, off uint64, length uint32, payload []byte) simpleReply {
	c.t.Helper()
	h := c.send(typ, flags, off, length, payload)
	r, err := c.recv()
	c.must(err)
	if r.handle != h {
		c.t.Fatalf("reply for handle %d, want %d", r.handle, h)
	}
	return r
}

func (c *rawClient) write(off uint64, p []byte, flags uint16) Errno {
	c.t.Helper()
	return c.do(cmdWrite, flags, off, uint32(len(p)), p).errno
}

func (c *rawClient) read(off uint64, n uint32) ([]byte, Errno) {
	c.t.Helper()
	r := c.do(cmdRead, 0, off, n, nil)
	return r.data, r.errno
}

// expectEOF asserts the server closes the connection.
func (c *rawClient) expectEOF() {
	c.t.Helper()
	c.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 1)
	n, err := c.br.Read(b)
	if err == nil || n > 0 {
		c.t.Fatalf("expected the server to close the connection; read %d bytes, err %v", n, err)
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrClosedPipe) && !errors.Is(err, net.ErrClosed) {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			c.t.Fatalf("server did not close the connection: %v", err)
		}
	}
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func mustEqual(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: got %d bytes (% x...), want %d bytes (% x...)", what, len(got), head(got), len(want), head(want))
	}
}

func head(b []byte) []byte { return b[:min(len(b), 16)] }
