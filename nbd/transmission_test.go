package nbd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
)

// connect returns a client in transmission with export "mem" of dev.
func connect(t *testing.T, s *Server) (*rawClient, <-chan error) {
	t.Helper()
	nc, done := pipe(t, s)
	c := newRawClient(t, nc)
	c.handshake("mem")
	return c, done
}

func TestCommands(t *testing.T) {
	dev := newMemDevice(2 << 20)
	s := newTestServer(t, dev, nil)
	c, _ := connect(t, s)

	// WRITE, READ.
	p := pattern(64<<10, 5)
	if e := c.write(8192, p, 0); e != 0 {
		t.Fatalf("write: %v", e)
	}
	got, e := c.read(8192, uint32(len(p)))
	if e != 0 {
		t.Fatalf("read: %v", e)
	}
	mustEqual(t, "read after write", got, p)
	mustEqual(t, "durable before flush", dev.durableAt(8192, 512), make([]byte, 512))

	// FLUSH makes it durable.
	if r := c.do(cmdFlush, 0, 0, 0, nil); r.errno != 0 {
		t.Fatalf("flush: %v", r.errno)
	}
	mustEqual(t, "durable after flush", dev.durableAt(8192, len(p)), p)

	// WRITE with FUA reaches the device as FUA.
	q := pattern(4096, 9)
	if e := c.write(0, q, cmdFlagFUA); e != 0 {
		t.Fatalf("fua write: %v", e)
	}
	mustEqual(t, "durable after FUA write", dev.durableAt(0, 4096), q)

	// TRIM reads back as zeroes; TRIM with FUA flushes.
	if r := c.do(cmdTrim, 0, 8192, 4096, nil); r.errno != 0 {
		t.Fatalf("trim: %v", r.errno)
	}
	got, _ = c.read(8192, 4096)
	mustEqual(t, "read after trim", got, make([]byte, 4096))
	if r := c.do(cmdTrim, cmdFlagFUA, 12288, 4096, nil); r.errno != 0 {
		t.Fatalf("trim fua: %v", r.errno)
	}

	// WRITE_ZEROES punches a hole; with NO_HOLE it writes zeroes; FUA is
	// passed on.
	if r := c.do(cmdWriteZeroes, cmdFlagFUA, 16384, 8192, nil); r.errno != 0 {
		t.Fatalf("write zeroes: %v", r.errno)
	}
	big := uint32(1536 << 10) // more than one zero buffer
	if r := c.do(cmdWriteZeroes, cmdFlagNoHole, 0, big, nil); r.errno != 0 {
		t.Fatalf("write zeroes no-hole: %v", r.errno)
	}
	got, _ = c.read(0, 64<<10)
	mustEqual(t, "read after write zeroes", got, make([]byte, 64<<10))

	// Zero-length requests succeed without reaching the device.
	for _, typ := range []uint16{cmdRead, cmdWrite, cmdTrim, cmdWriteZeroes} {
		if r := c.do(typ, 0, 4096, 0, nil); r.errno != 0 || len(r.data) != 0 {
			t.Fatalf("zero-length %s: %v", cmdName(typ), r.errno)
		}
	}

	want := []string{
		"write 8192 65536 fua=false",
		"flush",
		"write 0 4096 fua=true",
		"trim 8192 4096",
		"trim 12288 4096",
		"flush",
		"zeroes 16384 8192 fua=true",
		"write 0 1048576 fua=false",
		"write 1048576 524288 fua=false",
	}
	if got := dev.callLog(); !slices.Equal(got, want) {
		t.Fatalf("device calls:\n%q\nwant\n%q", got, want)
	}
}

func TestRequestErrors(t *testing.T) {
	fenced := fmt.Errorf("engine: write: %w", engine.ErrFenced)
	dev := newMemDevice(1 << 20)
	dev.fail = func(op string, off int64) error {
		switch off {
		case 1 << 19:
			return fenced
		case 1<<19 + 4096:
			return fmt.Errorf("%w: volume v has no healthy replica", engine.ErrIO)
		case 1<<19 + 8192:
			return fmt.Errorf("replica: %w", replica.ErrNoSpace)
		case 1<<19 + 12288:
			return fmt.Errorf("%w: bad", replica.ErrInvalid)
		case 1<<19 + 16384:
			return EOVERFLOW
		case 1<<19 + 20480:
			return errors.New("something nobody mapped")
		case 1<<19 + 24576:
			return engine.ErrClosed
		}
		return nil
	}
	s := newTestServer(t, dev, func(cfg *Config) { cfg.MaxPayload = 1 << 20 })
	c, _ := connect(t, s)
	const end = 1 << 20
	cases := []struct {
		name    string
		typ     uint16
		flags   uint16
		off     uint64
		length  uint32
		payload bool
		want    Errno
	}{
		{"misaligned read offset", cmdRead, 0, 100, 512, false, EINVAL},
		{"misaligned read length", cmdRead, 0, 0, 100, false, EINVAL},
		{"misaligned write", cmdWrite, 0, 512 + 1, 512, true, EINVAL},
		{"misaligned trim", cmdTrim, 0, 0, 513, false, EINVAL},
		{"read past the end", cmdRead, 0, end - 512, 1024, false, EINVAL},
		{"read far past the end", cmdRead, 0, 1 << 62, 512, false, EINVAL},
		{"read with offset overflow", cmdRead, 0, ^uint64(0) - 511, 1024, false, EINVAL},
		{"trim past the end", cmdTrim, 0, end, 512, false, EINVAL},
		{"write past the end", cmdWrite, 0, end - 512, 1024, true, ENOSPC},
		{"write zeroes past the end", cmdWriteZeroes, 0, end, 4096, false, ENOSPC},
		{"read larger than MaxPayload", cmdRead, 0, 0, 2 << 20, false, EINVAL},
		{"write larger than MaxPayload", cmdWrite, 0, 0, 2 << 20, true, EINVAL},
		{"cache (not offered)", cmdCache, 0, 0, 512, false, EINVAL},
		{"block status (not negotiated)", cmdBlockStatus, 0, 0, 512, false, EINVAL},
		{"unknown command", 42, 0, 0, 512, false, EINVAL},
		{"unknown flag", cmdRead, 1 << 9, 0, 512, false, EINVAL},
		{"NO_HOLE on a write", cmdWrite, cmdFlagNoHole, 0, 512, true, EINVAL},
		{"FUA on a read is accepted", cmdRead, cmdFlagFUA, 0, 512, false, 0},
		{"FUA on a flush is accepted", cmdFlush, cmdFlagFUA, 0, 0, false, 0},
		{"fenced engine", cmdWrite, 0, 1 << 19, 4096, true, EIO},
		{"fenced engine, write zeroes", cmdWriteZeroes, 0, 1 << 19, 4096, false, EIO},
		{"no healthy replica", cmdRead, 0, 1<<19 + 4096, 4096, false, EIO},
		{"no space", cmdWrite, 0, 1<<19 + 8192, 4096, true, ENOSPC},
		{"device says invalid", cmdTrim, 0, 1<<19 + 12288, 4096, false, EINVAL},
		{"device chooses an errno", cmdRead, 0, 1<<19 + 16384, 4096, false, EOVERFLOW},
		{"unmapped device error", cmdWrite, cmdFlagFUA, 1<<19 + 20480, 4096, true, EIO},
		{"closed engine", cmdRead, 0, 1<<19 + 24576, 4096, false, ESHUTDOWN},
	}
	for _, tc := range cases {
		var payload []byte
		if tc.payload {
			payload = pattern(int(tc.length), 1)
		}
		r := c.do(tc.typ, tc.flags, tc.off, tc.length, payload)
		if r.errno != tc.want {
			t.Errorf("%s: errno %d (%v), want %d (%v)", tc.name, r.errno, r.errno, tc.want, tc.want)
		}
		// The connection survives every refusal: a normal request after
		// each one works.
		if e := c.write(0, pattern(512, byte(len(tc.name))), 0); e != 0 {
			t.Fatalf("after %s: write failed with %v", tc.name, e)
		}
	}
}

func TestReadOnlyExport(t *testing.T) {
	dev := newMemDevice(1 << 20)
	copy(dev.data, pattern(4096, 7))
	s := newTestServer(t, nil, func(cfg *Config) {
		cfg.Exports = []Export{{Name: "mem", Device: dev, ReadOnly: true}}
	})
	nc, _ := pipe(t, s)
	c := newRawClient(t, nc)
	info := c.handshake("mem")
	if want := tflagHasFlags | tflagReadOnly | tflagSendFlush | tflagCanMultiConn; info.flags != want {
		t.Fatalf("read-only flags %#x, want %#x", info.flags, want)
	}
	for _, typ := range []uint16{cmdWrite, cmdTrim, cmdWriteZeroes} {
		var p []byte
		if typ == cmdWrite {
			p = pattern(4096, 1)
		}
		if r := c.do(typ, 0, 0, 4096, p); r.errno != EPERM {
			t.Errorf("%s on a read-only export: %v, want EPERM", cmdName(typ), r.errno)
		}
	}
	got, e := c.read(0, 4096)
	if e != 0 {
		t.Fatal(e)
	}
	mustEqual(t, "read-only read", got, pattern(4096, 7))
	if r := c.do(cmdFlush, 0, 0, 0, nil); r.errno != 0 {
		t.Fatalf("flush on a read-only export: %v", r.errno)
	}
	if calls := dev.callLog(); !slices.Equal(calls, []string{"flush"}) {
		t.Fatalf("device calls %q: a refused write reached the device", calls)
	}
}

// A slow read does not hold up the requests behind it: their replies come
// first.
func TestOutOfOrderReplies(t *testing.T) {
	dev := newMemDevice(1 << 20)
	release := make(chan struct{})
	dev.hold = map[int64]chan struct{}{0: release}
	s := newTestServer(t, dev, nil)
	c, _ := connect(t, s)

	slow := c.send(cmdRead, 0, 0, 4096, nil)
	<-dev.started // the slow read reached the device
	fast := []uint64{
		c.send(cmdRead, 0, 4096, 4096, nil),
		c.send(cmdWrite, 0, 8192, 4096, pattern(4096, 2)),
		c.send(cmdFlush, 0, 0, 0, nil),
	}
	var order []uint64
	for range fast {
		r, err := c.recv()
		if err != nil || r.errno != 0 {
			t.Fatalf("reply: %+v %v", r, err)
		}
		order = append(order, r.handle)
	}
	slices.Sort(order)
	if !slices.Equal(order, fast) {
		t.Fatalf("first replies for %v, want %v (the held read %d must come last)", order, fast, slow)
	}
	close(release)
	r, err := c.recv()
	if err != nil || r.handle != slow || r.errno != 0 || len(r.data) != 4096 {
		t.Fatalf("held read reply: %+v %v", r, err)
	}
}

// At most MaxInFlight requests reach the device at once; the rest wait
// for a slot.
func TestMaxInFlight(t *testing.T) {
	dev := newMemDevice(1 << 20)
	release := make(chan struct{})
	dev.hold = map[int64]chan struct{}{}
	for i := range 16 {
		dev.hold[int64(i)*4096] = release
	}
	s := newTestServer(t, dev, func(cfg *Config) { cfg.MaxInFlight = 4 })
	c, _ := connect(t, s)
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		for i := range 16 {
			c.send(cmdRead, 0, uint64(i)*4096, 4096, nil)
		}
	}()
	for range 4 {
		<-dev.started
	}
	select {
	case off := <-dev.started:
		t.Fatalf("a fifth read (at %d) started with MaxInFlight 4", off)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	for range 16 {
		if r, err := c.recv(); err != nil || r.errno != 0 {
			t.Fatalf("reply: %+v %v", r, err)
		}
	}
	<-sent
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if dev.maxActive > 4 {
		t.Fatalf("%d reads in flight at once, MaxInFlight 4", dev.maxActive)
	}
}

// NBD_CMD_DISC: requests in flight are answered, then the connection
// closes and ServeConn returns nil.
func TestDiscWithRequestsInFlight(t *testing.T) {
	dev := newMemDevice(1 << 20)
	release := make(chan struct{})
	dev.hold = map[int64]chan struct{}{0: release}
	s := newTestServer(t, dev, nil)
	c, done := connect(t, s)

	held := c.send(cmdRead, 0, 0, 4096, nil)
	<-dev.started
	w := c.send(cmdWrite, 0, 4096, 4096, pattern(4096, 4))
	c.send(cmdDisc, 0, 0, 0, nil)
	// The write completes while the read is held.
	r, err := c.recv()
	if err != nil || r.handle != w || r.errno != 0 {
		t.Fatalf("write reply: %+v %v", r, err)
	}
	select {
	case err := <-done:
		t.Fatalf("ServeConn returned (%v) with a read in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	r, err = c.recv()
	if err != nil || r.handle != held || r.errno != 0 {
		t.Fatalf("held read reply after DISC: %+v %v", r, err)
	}
	c.expectEOF()
	if err := <-done; err != nil {
		t.Fatalf("ServeConn after DISC: %v", err)
	}
}

// Several connections share one device: writes from all of them land, and
// a flush on one makes durable what the others had acknowledged.
func TestConcurrentConnections(t *testing.T) {
	const conns, perConn, block = 4, 32, 4096
	dev := newMemDevice(conns * perConn * block)
	s := newTestServer(t, dev, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveDone := make(chan error, 1)
	go func() { serveDone <- s.Serve(ln) }()

	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	clients := make([]*rawClient, conns)
	for i := range clients {
		nc, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		clients[i] = newRawClient(t, nc)
		clients[i].handshake("mem")
	}
	want := make([]byte, len(dev.data))
	var wg sync.WaitGroup
	for i, c := range clients {
		rng := rand.New(rand.NewPCG(uint64(seed), uint64(i)))
		for j := range perConn {
			off := (i*perConn + j) * block
			for k := off; k < off+block; k++ {
				want[k] = byte(rng.Uint32())
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Pipelined: every write sent before the first reply is read.
			handles := map[uint64]bool{}
			for j := range perConn {
				off := (i*perConn + j) * block
				handles[c.send(cmdWrite, 0, uint64(off), block, want[off:off+block])] = true
			}
			for range perConn {
				r, err := c.recv()
				if err != nil || r.errno != 0 || !handles[r.handle] {
					t.Errorf("conn %d: reply %+v %v", i, r, err)
					return
				}
				delete(handles, r.handle)
			}
		}()
	}
	wg.Wait()
	// One flush, on the last connection, covers all of them.
	if r := clients[conns-1].do(cmdFlush, 0, 0, 0, nil); r.errno != 0 {
		t.Fatalf("flush: %v", r.errno)
	}
	mustEqual(t, "durable after one flush", dev.durableAt(0, len(want)), want)
	// And every connection reads every other's writes.
	for i, c := range clients {
		off := ((i + 1) % conns) * perConn * block
		got, e := c.read(uint64(off), perConn*block)
		if e != 0 {
			t.Fatal(e)
		}
		mustEqual(t, fmt.Sprintf("conn %d reading conn %d's blocks", i, (i+1)%conns), got, want[off:off+perConn*block])
	}
	s.Close()
	if err := <-serveDone; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve after Close: %v", err)
	}
}

// Shutdown answers what is in flight before closing, and refuses new
// connections.
func TestShutdownDrains(t *testing.T) {
	dev := newMemDevice(1 << 20)
	release := make(chan struct{})
	dev.hold = map[int64]chan struct{}{0: release}
	s := newTestServer(t, dev, nil)
	c, done := connect(t, s)
	held := c.send(cmdRead, 0, 0, 4096, nil)
	<-dev.started

	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(context.Background()) }()
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) with a request in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	// New connections are refused.
	cs, ss := net.Pipe()
	defer cs.Close()
	if err := s.ServeConn(context.Background(), ss); !errors.Is(err, ErrServerClosed) {
		t.Fatalf("ServeConn during Shutdown: %v", err)
	}
	close(release)
	r, err := c.recv()
	if err != nil || r.handle != held || r.errno != 0 || len(r.data) != 4096 {
		t.Fatalf("held read during Shutdown: %+v %v", r, err)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("ServeConn after Shutdown: %v", err)
	}
	c.expectEOF()
}

// A Shutdown whose context ends closes everything: device calls see their
// context cancelled.
func TestShutdownTimeout(t *testing.T) {
	dev := newMemDevice(1 << 20)
	dev.hold = map[int64]chan struct{}{0: make(chan struct{})} // never released
	s := newTestServer(t, dev, nil)
	c, _ := connect(t, s)
	c.send(cmdRead, 0, 0, 4096, nil)
	<-dev.started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := s.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v, want DeadlineExceeded", err)
	}
}

// ServeConn's context drains that connection only.
func TestServeConnContext(t *testing.T) {
	s := newTestServer(t, nil, nil)
	cs, ss := net.Pipe()
	defer cs.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.ServeConn(ctx, ss) }()
	c := newRawClient(t, cs)
	c.handshake("mem")
	if e := c.write(0, pattern(512, 1), 0); e != 0 {
		t.Fatal(e)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("ServeConn after its context ended: %v", err)
	}
	// The server still serves others.
	c2, _ := connect(t, s)
	got, e := c2.read(0, 512)
	if e != 0 {
		t.Fatalf("read on another connection: %v", e)
	}
	mustEqual(t, "read on another connection", got, pattern(512, 1))
}

func TestBadRequestMagicEndsConnection(t *testing.T) {
	s := newTestServer(t, nil, nil)
	c, done := connect(t, s)
	c.nc.Write(make([]byte, 28))
	c.expectEOF()
	if err := <-done; !errors.Is(err, ErrProtocol) {
		t.Fatalf("ServeConn: %v, want ErrProtocol", err)
	}
}

// Device errors other than EINVAL are logged, at most one line a second:
// a fenced volume fails every request and must not flood the log.
func TestDeviceErrorsLogged(t *testing.T) {
	dev := newMemDevice(1 << 20)
	dev.fail = func(op string, off int64) error {
		if op == "write" {
			return fmt.Errorf("engine: write: %w", engine.ErrFenced)
		}
		return nil
	}
	var logs syncLog
	s := newTestServer(t, dev, func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	})
	c, _ := connect(t, s)
	for range 5 {
		if e := c.write(0, pattern(4096, 1), 0); e != EIO {
			t.Fatalf("write to a fenced device: %v, want EIO", e)
		}
	}
	if r := c.do(cmdRead, 0, 3, 512, nil); r.errno != EINVAL {
		t.Fatalf("misaligned read: %v", r.errno)
	}
	out := logs.String()
	if n := strings.Count(out, "nbd: device error"); n != 1 {
		t.Fatalf("%d device error lines for 5 errors within a second, want 1:\n%s", n, out)
	}
	for _, want := range []string{"level=ERROR", "cmd=write", "errno=5", `err="engine: write: engine: fenced by a newer attach"`} {
		if !strings.Contains(out, want) {
			t.Errorf("device error log lacks %s:\n%s", want, out)
		}
	}
}

type syncLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// The reader never waits for the client to read a reply: a client may send
// a run of requests, some refused, before it reads any reply. Over
// net.Pipe (no buffering) a reader that wrote a refusal itself would block
// until the client read it, while the client blocks sending the next
// request to that reader.
func TestRefusalsDoNotBlockTheReader(t *testing.T) {
	dev := newMemDevice(1 << 20)
	s := newTestServer(t, dev, nil)
	c, _ := connect(t, s)
	c.nc.SetDeadline(time.Now().Add(5 * time.Second))

	want := map[uint64]Errno{}
	for i := range 6 {
		want[c.send(cmdRead, 0, 3, 512, nil)] = EINVAL // unaligned: refused by the reader
		want[c.send(cmdWrite, 0, uint64(i)*4096, 4096, pattern(4096, byte(i)))] = 0
		want[c.send(99, 0, 0, 0, nil)] = EINVAL // unknown command
	}
	for range len(want) {
		r, err := c.recv()
		if err != nil {
			t.Fatalf("reply: %v (the reader blocked writing a refusal?)", err)
		}
		e, ok := want[r.handle]
		if !ok {
			t.Fatalf("reply for handle %d, not asked or answered twice", r.handle)
		}
		if r.errno != e {
			t.Errorf("handle %d: errno %d, want %d", r.handle, r.errno, e)
		}
		delete(want, r.handle)
	}
	for i := range 6 {
		got, e := c.read(uint64(i)*4096, 4096)
		if e != 0 {
			t.Fatalf("read back %d: errno %d", i, e)
		}
		mustEqual(t, "read back", got, pattern(4096, byte(i)))
	}
}
