package nbd

import (
	"context"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// socketPair returns both ends of a unix stream socket pair, as the
// kernel attach uses: the server's end and the "kernel's" end.
func socketPair(t testing.TB) (server, client net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	t.Cleanup(func() { conns[1].Close() })
	return conns[0], conns[1]
}

// serveTransmission serves one end of a socket pair with
// ServeTransmission and returns a raw client on the other end, already in
// transmission.
func serveTransmission(t testing.TB, ctx context.Context, s *Server, export string) (*rawClient, <-chan error) {
	t.Helper()
	ss, cs := socketPair(t)
	done := make(chan error, 1)
	go func() { done <- s.ServeTransmission(ctx, ss, export) }()
	return newRawClient(t, cs), done
}

// The kernel's view: no greeting, requests at once, and the commands it
// sends (READ, WRITE with and without FUA, FLUSH, TRIM, DISC) answered.
func TestServeTransmission(t *testing.T) {
	dev := newMemDevice(1 << 20)
	s := newTestServer(t, dev, nil)
	c, done := serveTransmission(t, context.Background(), s, "mem")

	// The server says nothing until asked: a handshake greeting here would
	// be read by the kernel as a garbage reply.
	c.nc.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := c.br.Read(make([]byte, 1)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("server sent %d bytes before any request (err %v)", n, err)
	}
	c.nc.SetDeadline(time.Now().Add(20 * time.Second))

	p := pattern(8192, 3)
	if e := c.write(4096, p, 0); e != 0 {
		t.Fatalf("write: %v", e)
	}
	got, e := c.read(4096, uint32(len(p)))
	if e != 0 {
		t.Fatalf("read: %v", e)
	}
	mustEqual(t, "read after write", got, p)
	if r := c.do(cmdFlush, 0, 0, 0, nil); r.errno != 0 {
		t.Fatalf("flush: %v", r.errno)
	}
	mustEqual(t, "durable after flush", dev.durableAt(4096, len(p)), p)
	q := pattern(4096, 11)
	if e := c.write(0, q, cmdFlagFUA); e != 0 {
		t.Fatalf("fua write: %v", e)
	}
	mustEqual(t, "durable after FUA write", dev.durableAt(0, 4096), q)
	if r := c.do(cmdTrim, 0, 4096, 4096, nil); r.errno != 0 {
		t.Fatalf("trim: %v", r.errno)
	}
	got, _ = c.read(4096, 4096)
	mustEqual(t, "read after trim", got, make([]byte, 4096))
	// Errors are replies, as after a handshake.
	if e := c.write(1<<20, q, 0); e != ENOSPC {
		t.Fatalf("write past the end: %v, want ENOSPC", e)
	}

	// A replayed write (the kernel resends what was in flight after a
	// reconnect) is just another write.
	if e := c.write(0, q, cmdFlagFUA); e != 0 {
		t.Fatalf("replayed write: %v", e)
	}

	c.send(cmdDisc, 0, 0, 0, nil)
	c.expectEOF()
	if err := <-done; err != nil {
		t.Fatalf("ServeTransmission after DISC: %v", err)
	}
}

// The kernel closing its end between requests (the device being torn
// down) is a clean end; an unknown export is refused without reading.
func TestServeTransmissionEnds(t *testing.T) {
	s := newTestServer(t, nil, nil)
	c, done := serveTransmission(t, context.Background(), s, "mem")
	if e := c.write(0, pattern(512, 1), 0); e != 0 {
		t.Fatal(e)
	}
	c.nc.Close()
	if err := <-done; err != nil {
		t.Fatalf("ServeTransmission after the client closed: %v", err)
	}

	ss, _ := socketPair(t)
	if err := s.ServeTransmission(context.Background(), ss, "nope"); !errors.Is(err, ErrUnknownExport) {
		t.Fatalf("unknown export: %v, want ErrUnknownExport", err)
	}
}

// Ending the context drains the connection: a request in flight is
// answered, then the connection closes. This is how a stopping attach
// hands the kernel back requests it has not read: they stay unanswered,
// and the kernel resends them on the next socket.
func TestServeTransmissionContext(t *testing.T) {
	dev := newMemDevice(1 << 20)
	release := make(chan struct{})
	dev.hold = map[int64]chan struct{}{0: release}
	s := newTestServer(t, dev, nil)
	ctx, cancel := context.WithCancel(context.Background())
	c, done := serveTransmission(t, ctx, s, "mem")

	held := c.send(cmdRead, 0, 0, 4096, nil)
	<-dev.started
	cancel()
	select {
	case err := <-done:
		t.Fatalf("ServeTransmission returned (%v) with a read in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	r, err := c.recv()
	if err != nil || r.handle != held || r.errno != 0 {
		t.Fatalf("held read after the context ended: %+v %v", r, err)
	}
	c.expectEOF()
	if err := <-done; err != nil {
		t.Fatalf("ServeTransmission after its context ended: %v", err)
	}

	// A closed server refuses.
	s.Close()
	ss, _ := socketPair(t)
	if err := s.ServeTransmission(context.Background(), ss, "mem"); !errors.Is(err, ErrServerClosed) {
		t.Fatalf("ServeTransmission on a closed server: %v", err)
	}
}

// ExportInfo tells what the handshake tells.
func TestExportInfo(t *testing.T) {
	for _, ro := range []bool{false, true} {
		s := newTestServer(t, newMemDevice(2<<20), func(c *Config) {
			c.Exports[0].ReadOnly = ro
			c.Exports[0].MinBlockSize = 4096
		})
		nc, _ := pipe(t, s)
		hs := newRawClient(t, nc).handshake("mem")
		info, err := s.ExportInfo("")
		if err != nil {
			t.Fatal(err)
		}
		want := ExportInfo{Name: "mem", Size: hs.size, Flags: hs.flags,
			MinBlockSize: hs.minBS, PreferredBlockSize: hs.prefBS, MaxPayload: hs.maxBS}
		if info != want {
			t.Fatalf("read-only %v: ExportInfo %+v, handshake said %+v", ro, info, want)
		}
		if ro != (info.Flags&tflagReadOnly != 0) {
			t.Fatalf("read-only %v: flags %#x", ro, info.Flags)
		}
		if _, err := s.ExportInfo("nope"); !errors.Is(err, ErrUnknownExport) {
			t.Fatalf("ExportInfo of an unknown export: %v", err)
		}
	}
}
