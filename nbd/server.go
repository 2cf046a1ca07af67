package nbd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"
)

// Device is the block device behind an export. *engine.Engine implements
// it. Offsets and lengths the server passes are multiples of the export's
// MinBlockSize and inside Size(); Device methods are called concurrently,
// from many connections at once, and must be safe for that.
//
// A write acknowledged by WriteAt, WriteZeroes or Trim must be visible to
// every later ReadAt, and Flush must make durable every write acknowledged
// before it was called, whichever connection sent it: the server
// advertises NBD_FLAG_CAN_MULTI_CONN on that promise (see the package
// documentation).
type Device interface {
	ReadAt(ctx context.Context, p []byte, off int64) error
	WriteAt(ctx context.Context, p []byte, off int64, fua bool) error
	WriteZeroes(ctx context.Context, off, n int64, fua bool) error
	Trim(ctx context.Context, off, n int64) error
	Flush(ctx context.Context) error
	Size() uint64
}

// Export is one named device the server offers.
type Export struct {
	// Name is what clients ask for (at most 4096 bytes).
	Name string
	// Description is shown by NBD_OPT_LIST and NBD_INFO_DESCRIPTION.
	// Optional.
	Description string
	// Device serves the data; required.
	Device Device
	// ReadOnly advertises NBD_FLAG_READ_ONLY and answers every write,
	// write-zeroes and trim with EPERM.
	ReadOnly bool
	// MinBlockSize is the smallest addressable unit: every offset and
	// length must be a multiple of it (else EINVAL). A power of two from
	// 512 to 65536. Default 512 (replica.SectorSize). The preferred block
	// size advertised is max(4096, MinBlockSize).
	MinBlockSize uint32
}

// Config configures a Server. Zero fields take the defaults noted.
type Config struct {
	// Exports are the devices served; at least one, names unique.
	Exports []Export
	// DefaultExport names the export a client gets when it asks for the
	// empty name. Default: the only export when there is exactly one,
	// otherwise no default.
	DefaultExport string
	// MaxPayload is the largest READ or WRITE the server accepts, and the
	// maximum block size it advertises. A multiple of every export's
	// MinBlockSize. Default 32 MiB (what the protocol says every client
	// may send without asking).
	MaxPayload uint32
	// MaxInFlight bounds the requests one connection may have in flight
	// (read but not yet answered). Default 128 (the kernel's queue depth).
	MaxInFlight int
	// MaxInFlightBytes bounds the READ and WRITE payload bytes one
	// connection may hold in flight; it must be at least MaxPayload.
	// Default 2*MaxPayload. Together with MaxInFlight it bounds a
	// connection's memory.
	MaxInFlightBytes int64
	// HandshakeTimeout bounds the whole handshake (option haggling) of a
	// connection. Default 30s.
	HandshakeTimeout time.Duration
	// MaxMemory bounds the READ and WRITE payload buffers all connections
	// together hold; a connection that needs more waits for others to
	// release theirs. At least twice the buffer MaxPayload takes (64 MiB
	// at the default MaxPayload). Default 256 MiB, or that minimum if
	// larger.
	MaxMemory int64
	// MaxConns bounds the connections Serve serves at once (network and
	// unix listeners); one accepted beyond it is closed at once.
	// ServeConn's connections (socket pairs the caller made) are not
	// counted. Default 64.
	MaxConns int
	// FrameTimeout drops a connection from Serve that starts a request
	// and does not finish sending it within this long. Socket pairs
	// (ServeConn) have no frame timeout: their peer is the kernel.
	// Default 30s.
	FrameTimeout time.Duration
	// IdleTimeout drops a connection from Serve that has no request in
	// flight and sends nothing for this long. Zero (the default) keeps
	// idle connections: NBD has no keepalive, and a client with a device
	// attached but unused is idle for as long as it likes. Connections
	// from ServeConn never idle out.
	IdleTimeout time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultMaxPayload       = 32 << 20
	DefaultMaxInFlight      = 128
	DefaultHandshakeTimeout = 30 * time.Second
	DefaultMinBlockSize     = 512
	DefaultMaxMemory        = 256 << 20
	DefaultMaxConns         = 64
	DefaultFrameTimeout     = 30 * time.Second
)

// minMaxMemory is the smallest MaxMemory for a MaxPayload: room for the
// largest payload buffer and the chunks that fill it.
func minMaxMemory(maxPayload uint32) int64 {
	return 2 * int64(bufSize(int(maxPayload)))
}

// DefaultConfig returns a Config with every default filled in and no
// exports.
func DefaultConfig() Config {
	return Config{
		MaxPayload:       DefaultMaxPayload,
		MaxInFlight:      DefaultMaxInFlight,
		MaxInFlightBytes: 2 * DefaultMaxPayload,
		HandshakeTimeout: DefaultHandshakeTimeout,
		MaxMemory:        DefaultMaxMemory,
		MaxConns:         DefaultMaxConns,
		FrameTimeout:     DefaultFrameTimeout,
	}
}

// maxOptions bounds how many options one connection may send before it
// enters transmission; a client that haggles for longer is cut off.
const maxOptions = 1024

// maxOptionLen is the largest option payload read into memory; larger
// options are skipped and answered NBD_REP_ERR_TOO_BIG. The largest valid
// one (NBD_OPT_GO) is 4+4096+2+2*n bytes.
const maxOptionLen = 16 << 10

// withDefaults returns a copy of c with defaults applied.
func (c Config) withDefaults() Config {
	if c.MaxPayload == 0 {
		c.MaxPayload = DefaultMaxPayload
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = 2 * int64(c.MaxPayload)
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.MaxMemory == 0 {
		c.MaxMemory = max(DefaultMaxMemory, minMaxMemory(c.MaxPayload))
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.FrameTimeout == 0 {
		c.FrameTimeout = DefaultFrameTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.DefaultExport == "" && len(c.Exports) == 1 {
		c.DefaultExport = c.Exports[0].Name
	}
	c.Exports = append([]Export(nil), c.Exports...)
	for i := range c.Exports {
		if c.Exports[i].MinBlockSize == 0 {
			c.Exports[i].MinBlockSize = DefaultMinBlockSize
		}
	}
	return c
}

// Validate reports the first problem with the configuration (after
// defaults are applied).
func (c Config) Validate() error {
	c = c.withDefaults()
	if len(c.Exports) == 0 {
		return errors.New("nbd: config: no exports")
	}
	names := map[string]bool{}
	for _, e := range c.Exports {
		switch {
		case len(e.Name) > maxStringLen:
			return fmt.Errorf("nbd: config: export name longer than %d bytes", maxStringLen)
		case names[e.Name]:
			return fmt.Errorf("nbd: config: export %q given twice", e.Name)
		case e.Device == nil:
			return fmt.Errorf("nbd: config: export %q has no device", e.Name)
		case e.MinBlockSize < 512 || e.MinBlockSize > 65536 || e.MinBlockSize&(e.MinBlockSize-1) != 0:
			return fmt.Errorf("nbd: config: export %q: MinBlockSize %d is not a power of two from 512 to 65536", e.Name, e.MinBlockSize)
		case c.MaxPayload%e.MinBlockSize != 0:
			return fmt.Errorf("nbd: config: MaxPayload %d is not a multiple of export %q's MinBlockSize %d", c.MaxPayload, e.Name, e.MinBlockSize)
		case len(e.Description) > maxStringLen:
			return fmt.Errorf("nbd: config: export %q: description longer than %d bytes", e.Name, maxStringLen)
		}
		names[e.Name] = true
	}
	switch {
	case c.DefaultExport != "" && !names[c.DefaultExport]:
		return fmt.Errorf("nbd: config: default export %q is not an export", c.DefaultExport)
	case c.MaxInFlight < 1:
		return errors.New("nbd: config: MaxInFlight must be positive")
	case c.MaxInFlightBytes < int64(c.MaxPayload):
		return fmt.Errorf("nbd: config: MaxInFlightBytes %d is less than MaxPayload %d", c.MaxInFlightBytes, c.MaxPayload)
	case c.HandshakeTimeout < 0:
		return errors.New("nbd: config: HandshakeTimeout must not be negative")
	case c.MaxMemory < minMaxMemory(c.MaxPayload):
		return fmt.Errorf("nbd: config: MaxMemory %d is less than %d (twice MaxPayload's buffer)", c.MaxMemory, minMaxMemory(c.MaxPayload))
	case c.MaxConns < 0:
		return errors.New("nbd: config: MaxConns must not be negative")
	case c.FrameTimeout < 0 || c.IdleTimeout < 0:
		return errors.New("nbd: config: FrameTimeout and IdleTimeout must not be negative")
	}
	return nil
}

// Server serves exports over NBD. Create it with NewServer; serve
// listeners with Serve and single connections with ServeConn; stop it
// with Shutdown (graceful) or Close. All methods are safe for concurrent
// use.
type Server struct {
	cfg     Config
	logger  *slog.Logger
	exports map[string]*Export
	names   []string // sorted, for NBD_OPT_LIST

	// ctx is the context of every device call; Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	errlog errorLog

	mem *semaphore.Weighted // MaxMemory: payload buffer bytes held

	// mu guards the fields below. wg counts connection goroutines; it is
	// only added to under mu while closed is false.
	mu        sync.Mutex
	closed    bool
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	accepted  int // conns from Serve, bounded by MaxConns
	wg        sync.WaitGroup
}

// NewServer validates cfg and returns a server that serves nothing until
// Serve or ServeConn is called.
func NewServer(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Server{
		cfg:       cfg,
		logger:    cfg.Logger,
		exports:   map[string]*Export{},
		listeners: map[net.Listener]struct{}{},
		conns:     map[*conn]struct{}{},
	}
	for i := range cfg.Exports {
		e := &cfg.Exports[i]
		s.exports[e.Name] = e
		s.names = append(s.names, e.Name)
	}
	sort.Strings(s.names)
	s.mem = semaphore.NewWeighted(cfg.MaxMemory)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// lookup returns the export for a name asked by a client ("" is the
// default export), or nil.
func (s *Server) lookup(name string) *Export {
	if name == "" {
		name = s.cfg.DefaultExport
		if name == "" {
			return nil
		}
	}
	return s.exports[name]
}

// Serve accepts connections on ln and serves each in its own goroutine
// until ln fails or the server is shut down; it then returns
// ErrServerClosed (or the accept error). Serve closes ln.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		ln.Close()
		return ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		ln.Close()
	}()

	backoff := 5 * time.Millisecond
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.isClosed() {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("nbd: accept on %s: %w", ln.Addr(), err)
			}
			// Transient (EMFILE, ECONNABORTED): back off and retry
			// rather than spin or give up.
			s.logger.Warn("nbd: accept failed; retrying", "err", err, "in", backoff)
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		c, ok := s.track(nc, true)
		if !ok {
			nc.Close()
			if s.isClosed() {
				return ErrServerClosed
			}
			s.logger.Warn("nbd: connection limit reached; refusing a connection", "remote", remote(nc), "limit", s.cfg.MaxConns)
			continue
		}
		go func() {
			defer s.untrack(c)
			if err := c.serve(); err != nil {
				s.logger.Warn("nbd: connection ended with an error", "remote", remote(nc), "err", err)
			}
		}()
	}
}

// ServeConn serves one already-connected client (a socket pair handed to
// the kernel, a test pipe) and returns when the connection ends: nil after
// a clean end (NBD_CMD_DISC, NBD_OPT_ABORT, the client closing between
// requests), an error otherwise. When ctx ends, the connection is drained
// as by Shutdown: no new requests are read, requests in flight are
// answered, and the connection is closed. ServeConn closes nc.
func (s *Server) ServeConn(ctx context.Context, nc net.Conn) error {
	c, ok := s.track(nc, false)
	if !ok {
		nc.Close()
		return ErrServerClosed
	}
	defer s.untrack(c)
	stop := context.AfterFunc(ctx, c.drain)
	defer stop()
	return c.serve()
}

// track registers a connection; one from a listener (accepted) counts
// against MaxConns. It fails when the server is closed or full.
func (s *Server) track(nc net.Conn, accepted bool) (*conn, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || (accepted && s.accepted >= s.cfg.MaxConns) {
		return nil, false
	}
	c := newConn(s, nc)
	c.accepted = accepted
	if accepted {
		s.accepted++
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	return c, true
}

// Conns is the number of connections served now (accepted from a
// listener or given to ServeConn), for metrics.
func (s *Server) Conns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *Server) untrack(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	if c.accepted {
		s.accepted--
	}
	s.mu.Unlock()
	s.wg.Done()
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// stopAccepting marks the server closed, closes its listeners and returns
// the connections open at that moment.
func (s *Server) stopAccepting() []*conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for ln := range s.listeners {
		ln.Close()
	}
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	return conns
}

// Shutdown stops the server gracefully: it stops accepting, ends option
// haggling in progress, stops reading new requests on every connection,
// lets the requests in flight finish and their replies be written, and
// closes the connections. It returns when all of that is done, or when ctx
// ends: then it closes everything as Close does and returns ctx's error.
// A request whose header or payload was only partly read when Shutdown
// began is dropped unanswered, so the client never takes it as done.
func (s *Server) Shutdown(ctx context.Context) error {
	for _, c := range s.stopAccepting() {
		c.drain()
	}
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		s.cancel()
		return nil
	case <-ctx.Done():
		s.Close()
		<-done
		return ctx.Err()
	}
}

// Close stops the server at once: listeners and connections are closed,
// device calls in flight see their context cancelled, and Close returns
// when every connection goroutine has finished.
func (s *Server) Close() error {
	conns := s.stopAccepting()
	s.cancel()
	for _, c := range conns {
		c.nc.Close()
	}
	s.wg.Wait()
	return nil
}

func remote(nc net.Conn) string {
	a := nc.RemoteAddr()
	switch {
	case a == nil:
		return "local"
	case a.String() == "" || a.String() == "@":
		return a.Network() // an unnamed unix socket peer
	}
	return a.String()
}

// errorLog rate-limits the logging of device errors: a fenced or broken
// volume fails every request, and one line a second says as much as a
// thousand.
type errorLog struct {
	mu         sync.Mutex
	last       time.Time
	suppressed int
}

func (l *errorLog) log(logger *slog.Logger, msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if now.Sub(l.last) < time.Second {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := l.suppressed
	l.last, l.suppressed = now, 0
	l.mu.Unlock()
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	logger.Error(msg, args...)
}
