package nbd

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// serveTCP serves s on a loopback listener and returns its address.
func serveTCP(t *testing.T, s *Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(ln)
	return ln.Addr().String()
}

func dialTCP(t *testing.T, addr string) *rawClient {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	return newRawClient(t, nc)
}

// writeHeader is an NBD_CMD_WRITE request header announcing n bytes.
func writeHeader(handle uint64, n uint32) []byte {
	var hdr [28]byte
	binary.BigEndian.PutUint32(hdr[0:], magicRequest)
	binary.BigEndian.PutUint16(hdr[6:], cmdWrite)
	binary.BigEndian.PutUint64(hdr[8:], handle)
	binary.BigEndian.PutUint32(hdr[24:], n)
	return hdr[:]
}

// closedWithin reports whether the server closes c within d (reading
// nothing but the end of the stream).
func closedWithin(c *rawClient, d time.Duration) bool {
	c.nc.SetReadDeadline(time.Now().Add(d))
	_, err := c.br.ReadByte()
	return err == io.EOF
}

// TestStalledWritesHoldLittleMemory: 200 clients each send the header of an
// 8 MiB WRITE and 4 KiB of it, then stall. The server used to allocate
// each announced payload up front (1.6 GiB of heap); now it holds about
// what was sent, and a well-behaved client still writes and reads 8 MiB.
func TestStalledWritesHoldLittleMemory(t *testing.T) {
	const conns, n, sent = 200, 8 << 20, 4 << 10
	dev := newMemDevice(16 << 20)
	s := newTestServer(t, dev, func(c *Config) {
		c.MaxConns = conns + 1
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	})
	addr := serveTCP(t, s)
	frame := append(writeHeader(1, n), make([]byte, sent)...)

	runtime.GC()
	var base runtime.MemStats
	runtime.ReadMemStats(&base)
	for range conns {
		c := dialTCP(t, addr)
		c.handshake("mem")
		c.must(func() error { _, err := c.nc.Write(frame); return err }())
	}
	var peak uint64
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		peak = max(peak, ms.HeapInuse)
	}
	growth := int64(peak) - int64(base.HeapInuse)
	t.Logf("%d stalled 8 MiB writes: heap in use grew by %d MiB", conns, growth>>20)
	if growth > 128<<20 {
		t.Errorf("the stalled writes cost the server %d MiB of heap, want under 128 MiB", growth>>20)
	}

	c := dialTCP(t, addr)
	c.handshake("mem")
	data := bytes.Repeat([]byte("stor"), n/4)
	if e := c.write(0, data, 0); e != 0 {
		t.Fatalf("a well-behaved write beside the stalled ones: errno %d", e)
	}
	got, e := c.read(0, n)
	if e != 0 || !bytes.Equal(got, data) {
		t.Fatalf("a well-behaved read: errno %d, data equal %v", e, bytes.Equal(got, data))
	}
}

// TestStalledWritesRSSBounded: 200 clients each send an 8 MiB WRITE but its
// last 4 KiB, then stall. Without a server-wide budget the server held all
// of it resident (1.6 GiB); with the default MaxMemory (256 MiB) the rest
// waits in the clients' sockets.
func TestStalledWritesRSSBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("sends 1.6 GiB over loopback")
	}
	if raceEnabled {
		t.Skip("RSS under -race is the race detector's, not the server's")
	}
	const conns, n = 200, 8 << 20
	s := newTestServer(t, newMemDevice(16<<20), func(c *Config) {
		c.MaxConns = conns + 1
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	})
	addr := serveTCP(t, s)
	frame := append(writeHeader(1, n), make([]byte, n-4096)...)
	runtime.GC()
	baseRSS := vmRSS(t)
	for range conns {
		c := dialTCP(t, addr)
		c.handshake("mem")
		go c.nc.Write(frame) // blocks once the server stops reading
	}
	var peakRSS uint64
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		peakRSS = max(peakRSS, vmRSS(t))
	}
	growth := int64(peakRSS) - int64(baseRSS)
	t.Logf("%d stalled 8 MiB writes, all but 4 KiB sent: RSS grew by %d MiB (peak %d MiB)", conns, growth>>20, peakRSS>>20)
	if growth > 768<<20 {
		t.Errorf("RSS grew by %d MiB; want under 768 MiB (MaxMemory is 256 MiB)", growth>>20)
	}
}

// vmRSS reads this process's resident set size from /proc/self/status.
func vmRSS(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseUint(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// TestFrameTimeout: a client from Serve that sends part of a request and
// stalls is dropped after FrameTimeout; a socket pair is not.
func TestFrameTimeout(t *testing.T) {
	s := newTestServer(t, nil, func(c *Config) { c.FrameTimeout = 200 * time.Millisecond })
	c := dialTCP(t, serveTCP(t, s))
	c.handshake("mem")
	c.nc.Write(append(writeHeader(1, 64<<10), make([]byte, 100)...))
	if !closedWithin(c, 3*time.Second) {
		t.Fatal("a stalled write was not dropped")
	}
	c = dialTCP(t, serveTCP(t, s))
	c.handshake("mem")
	c.nc.Write(writeHeader(1, 4096)[:10])
	if !closedWithin(c, 3*time.Second) {
		t.Fatal("a stalled half header was not dropped")
	}

	nc, _ := pipe(t, s)
	p := newRawClient(t, nc)
	p.handshake("mem")
	done := make(chan struct{})
	go func() { // net.Pipe writes block until read
		defer close(done)
		p.nc.Write(append(writeHeader(1, 4096), make([]byte, 100)...))
	}()
	<-done
	time.Sleep(500 * time.Millisecond)
	go p.nc.Write(make([]byte, 4096-100))
	r, err := p.recv()
	if err != nil || r.errno != 0 {
		t.Fatalf("a slow write over a socket pair: errno %d, err %v", r.errno, err)
	}
}

// TestIdleTimeout: with IdleTimeout set, a client from Serve that sends
// nothing is dropped; a socket pair never is.
func TestIdleTimeout(t *testing.T) {
	s := newTestServer(t, nil, func(c *Config) { c.IdleTimeout = 200 * time.Millisecond })
	c := dialTCP(t, serveTCP(t, s))
	c.handshake("mem")
	if !closedWithin(c, 3*time.Second) {
		t.Fatal("an idle client was not dropped")
	}
	nc, _ := pipe(t, s)
	p := newRawClient(t, nc)
	p.handshake("mem")
	time.Sleep(600 * time.Millisecond)
	if e := p.write(0, make([]byte, 4096), 0); e != 0 {
		t.Fatalf("a socket pair after idling: errno %d", e)
	}
}

// TestMaxConns: Serve closes a connection beyond MaxConns at once; socket
// pairs are not counted.
func TestMaxConns(t *testing.T) {
	s := newTestServer(t, nil, func(c *Config) { c.MaxConns = 1 })
	addr := serveTCP(t, s)
	a := dialTCP(t, addr)
	a.handshake("mem")
	b := dialTCP(t, addr)
	if !closedWithin(b, 3*time.Second) {
		t.Fatal("a second connection was served with MaxConns 1")
	}
	nc, _ := pipe(t, s)
	p := newRawClient(t, nc)
	p.handshake("mem")
	if e := p.write(0, make([]byte, 4096), 0); e != 0 {
		t.Fatalf("a socket pair beside a full listener: errno %d", e)
	}
	if e := a.write(0, make([]byte, 4096), 0); e != 0 {
		t.Fatalf("the first connection: errno %d", e)
	}
}

// TestMemoryBudgetIsServerWide: clients that send most of a large write
// and stall spend MaxMemory; the server does not allocate past it, and a
// well-behaved write goes through once FrameTimeout drops them.
func TestMemoryBudgetIsServerWide(t *testing.T) {
	const n = 8 << 20
	s := newTestServer(t, newMemDevice(16<<20), func(c *Config) {
		c.MaxPayload = n
		c.MaxMemory = minMaxMemory(n)
		c.FrameTimeout = 500 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	})
	addr := serveTCP(t, s)
	frame := append(writeHeader(1, n), make([]byte, n-4096)...)
	runtime.GC()
	var base runtime.MemStats
	runtime.ReadMemStats(&base)
	for range 8 { // 8 x 8 MiB: four times the budget
		c := dialTCP(t, addr)
		c.handshake("mem")
		go c.nc.Write(frame) // blocks once the server stops reading
	}
	var peak uint64
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		peak = max(peak, ms.HeapInuse)
	}
	if g := int64(peak) - int64(base.HeapInuse); g > 2*minMaxMemory(n) {
		t.Errorf("the stalled clients grew the heap by %d MiB, over MaxMemory %d MiB", g>>20, minMaxMemory(n)>>20)
	}
	// A well-behaved write either waits its turn or, if the memory stays
	// spent for its own FrameTimeout, is dropped with the connection (a
	// clear error, in bounded time); once the stalled clients are gone,
	// writes go through.
	for attempt := 1; ; attempt++ {
		c := dialTCP(t, addr)
		c.handshake("mem")
		start := time.Now()
		_, err := c.nc.Write(append(writeHeader(7, n), make([]byte, n)...))
		var r simpleReply
		if err == nil {
			r, err = c.recv()
		}
		if err == nil && r.errno == 0 && r.handle == 7 {
			t.Logf("attempt %d: the well-behaved write took %v", attempt, time.Since(start))
			break
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("attempt %d failed only after %v: %v errno %d", attempt, d, err, r.errno)
		}
		if attempt == 3 {
			t.Fatalf("no well-behaved write after %d attempts: %v errno %d", attempt, err, r.errno)
		}
		t.Logf("attempt %d: dropped after %v (%v); retrying", attempt, time.Since(start), err)
	}
}
