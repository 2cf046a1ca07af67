package wire

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/stor-io/stor/replica"
)

// ServerConfig tunes a Server. Zero fields take DefaultServerConfig's
// values.
type ServerConfig struct {
	// Logger receives connection and protocol-error logs. Default
	// slog.Default().
	Logger *slog.Logger
	// MaxInFlight bounds the requests one connection has being served at
	// once. When it is reached the server stops reading that connection
	// until a reply has been written. Default 128.
	MaxInFlight int
	// MaxInFlightBytes bounds the payload bytes (write data in, read data
	// out) one connection's in-flight requests hold. A single request
	// larger than this is still served, alone. Default 64 MiB.
	MaxInFlightBytes int64
	// MaxHandles bounds the handles open on one connection. Default 1024.
	MaxHandles int
	// WriteTimeout drops a connection whose peer stops reading replies
	// for this long. Default 30s.
	WriteTimeout time.Duration
	// Authorizer decides each OPEN and each request on the handle it
	// grants (doc.go, "Authorisation"). Default nil: every OPEN is
	// accepted and a handle may do anything, which only tests of the
	// protocol itself and of the engine use.
	Authorizer Authorizer
	// Identify tells who the peer of a new connection is, for the
	// Authorizer. Default nil: every peer is unverified (the zero
	// Identity); the TLS layer sets it from the peer certificate.
	Identify func(net.Conn) Identity
	// MaxConns bounds the connections the server serves at once; one
	// accepted beyond it is closed at once. Every replica an engine or a
	// rebuild has open here is one connection, so this is also how many
	// replicas can be in use on this server at once. Default 4096 (each
	// costs a 64 KiB read buffer: 256 MiB at the cap, beside MaxMemory).
	MaxConns int
	// MaxMemory bounds the payload buffers (request data read in, reply
	// data read out of the store) all connections together hold. A
	// connection that needs more waits until others release theirs. At
	// least 2*MaxPayload. Default 512 MiB (deploy/ gives stor-server 2 GiB).
	MaxMemory int64
	// FrameTimeout drops a connection that starts a request frame and
	// does not finish sending it within this long (a stalled peer must not
	// hold its partial frame forever). Default 30s.
	FrameTimeout time.Duration
	// CopySource reads the sources of the REBUILD_COPY requests this
	// server serves (copy.go). Default nil: REBUILD_COPY is answered
	// with ErrUnknownOp, and rebuilders copy through themselves.
	CopySource CopySource
	// IdleTimeout drops a connection that has no replica open and sends
	// nothing for this long. A connection with a replica open is a
	// volume engine's, idle as long as its volume is, and is never dropped
	// for idleness. Default 5m.
	IdleTimeout time.Duration
	// UnsafeStaleIncarnations lets every attach handle of a replica
	// serve, not only the newest (doc.go, "Incarnations"), as before the
	// gate: for the jepsen harness's broken mode "stale-incarnations"
	// only, which shows its checkers catch what the gate prevents.
	UnsafeStaleIncarnations bool
}

// DefaultServerConfig returns the defaults documented on ServerConfig.
func DefaultServerConfig() ServerConfig {
	return ServerConfig{
		Logger:           slog.Default(),
		MaxInFlight:      128,
		MaxInFlightBytes: 64 << 20,
		MaxHandles:       1024,
		WriteTimeout:     30 * time.Second,
		MaxConns:         4096,
		MaxMemory:        512 << 20,
		FrameTimeout:     30 * time.Second,
		IdleTimeout:      5 * time.Minute,
	}
}

func (c *ServerConfig) withDefaults() {
	d := DefaultServerConfig()
	if c.Logger == nil {
		c.Logger = d.Logger
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = d.MaxInFlightBytes
	}
	if c.MaxHandles == 0 {
		c.MaxHandles = d.MaxHandles
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = d.WriteTimeout
	}
	if c.MaxConns == 0 {
		c.MaxConns = d.MaxConns
	}
	if c.MaxMemory == 0 {
		c.MaxMemory = d.MaxMemory
	}
	if c.FrameTimeout == 0 {
		c.FrameTimeout = d.FrameTimeout
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = d.IdleTimeout
	}
}

// Validate reports the first problem with the configuration.
func (c *ServerConfig) Validate() error {
	switch {
	case c.MaxInFlight < 0:
		return fmt.Errorf("wire: MaxInFlight %d is negative", c.MaxInFlight)
	case c.MaxInFlightBytes < 0:
		return fmt.Errorf("wire: MaxInFlightBytes %d is negative", c.MaxInFlightBytes)
	case c.MaxHandles < 0:
		return fmt.Errorf("wire: MaxHandles %d is negative", c.MaxHandles)
	case c.WriteTimeout < 0:
		return fmt.Errorf("wire: WriteTimeout %v is negative", c.WriteTimeout)
	case c.MaxConns < 0:
		return fmt.Errorf("wire: MaxConns %d is negative", c.MaxConns)
	case c.MaxMemory != 0 && c.MaxMemory < minMaxMemory:
		return fmt.Errorf("wire: MaxMemory %d is below %d (two of the largest payload buffers)", c.MaxMemory, minMaxMemory)
	case c.FrameTimeout < 0:
		return fmt.Errorf("wire: FrameTimeout %v is negative", c.FrameTimeout)
	case c.IdleTimeout < 0:
		return fmt.Errorf("wire: IdleTimeout %v is negative", c.IdleTimeout)
	}
	return nil
}

// Server serves the replica data protocol for the replicas of a Backend.
// Serve may be called on several listeners; Close stops them all.
type Server struct {
	backend Backend
	cfg     ServerConfig
	log     *slog.Logger
	done    chan struct{} // closed by Close
	ctx     context.Context
	cancel  context.CancelFunc  // by Close: ends Authorizer waits
	mem     *semaphore.Weighted // MaxMemory: payload buffer bytes held

	mu        sync.Mutex
	closed    bool
	listeners map[net.Listener]struct{}
	conns     map[*serverConn]struct{}
	wg        sync.WaitGroup // Serve loops and connections; Add under mu

	// attachMu guards attaches.
	attachMu sync.Mutex
	attaches map[string]*attachGate // replica id -> its gate (attachGate)

	// Counters for Stats.
	accepted atomic.Uint64
	refused  atomic.Uint64
	failed   [256]atomic.Uint64 // requests answered with each error Status
}

// Stats is a snapshot of a Server's connections and failed requests, for
// metrics.
type Stats struct {
	// Conns is the connections served now.
	Conns int
	// AttachOrders is the replicas whose attach handles the server
	// orders (doc.go, "Incarnations"): those attached since it started
	// and not deleted since.
	AttachOrders int
	// Accepted counts the connections served since the server started;
	// Refused those closed at once because MaxConns were being served.
	Accepted, Refused uint64
	// Failed counts the requests answered with an error, by status
	// (refused for a stale epoch, denied by the authorizer, invalid, I/O
	// errors...). Statuses never seen are absent.
	Failed map[Status]uint64
}

// Stats returns the server's counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	st := Stats{Conns: len(s.conns)}
	s.mu.Unlock()
	s.attachMu.Lock()
	st.AttachOrders = len(s.attaches)
	s.attachMu.Unlock()
	st.Accepted, st.Refused = s.accepted.Load(), s.refused.Load()
	st.Failed = map[Status]uint64{}
	for i := range s.failed {
		if n := s.failed[i].Load(); n > 0 {
			st.Failed[Status(i)] = n
		}
	}
	return st
}

// NewServer returns a server of b's replicas. It does nothing until Serve.
func NewServer(b Backend, cfg ServerConfig) (*Server, error) {
	if b == nil {
		return nil, errors.New("wire: nil backend")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{
		ctx:       ctx,
		cancel:    cancel,
		backend:   b,
		cfg:       cfg,
		log:       cfg.Logger,
		done:      make(chan struct{}),
		mem:       semaphore.NewWeighted(cfg.MaxMemory),
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*serverConn]struct{}),
		attaches:  make(map[string]*attachGate),
	}, nil
}

// incarnation is an attach handle's place among its replica's: its
// epoch, then the OPEN's Incarnation.
type incarnation struct{ epoch, n uint64 }

func (a incarnation) before(b incarnation) bool {
	return a.epoch < b.epoch || (a.epoch == b.epoch && a.n < b.n)
}

// attachGate orders the attach handles (PurposeAttach) of one replica:
// only those of the newest incarnation may change it (doc.go,
// "Incarnations"). mu is held shared by every changing request on an
// attach handle from its check to its last effect, and exclusively by an
// attach OPEN while it makes its incarnation the newest: once that OPEN
// returns, no changing request of an older incarnation is still applying
// anything, and none will. A gate lives until its replica is deleted
// (Forget), not only while handles hold it: an OPEN that comes late,
// after every newer handle was closed, is still older.
type attachGate struct {
	mu     sync.RWMutex
	latest incarnation // guarded by mu
}

// takeAttach enters an attach handle of replica id at incarnation inc:
// if inc is newer than the replica's newest, it becomes the newest, once
// every changing request of an older one has finished. An older or equal
// one changes nothing (a duplicate OPEN, or one its client gave up on).
func (s *Server) takeAttach(id string, inc incarnation) *attachGate {
	s.attachMu.Lock()
	g := s.attaches[id]
	if g == nil {
		g = &attachGate{}
		s.attaches[id] = g
	}
	s.attachMu.Unlock()
	g.mu.RLock()
	newer := g.latest.before(inc)
	g.mu.RUnlock()
	if newer {
		g.mu.Lock()
		if g.latest.before(inc) {
			g.latest = inc
		}
		g.mu.Unlock()
	}
	return g
}

// HasHandle reports whether a connection this server serves now, its
// client still there, holds an attach handle (PurposeAttach) of replica
// id opened at epoch, of the replica's newest incarnation: the engine
// attached at that epoch is this server process's client for that
// replica. Handles of other purposes do not count: a rebuild's copy
// source or an inspection opened at the same epoch says nothing of the
// engine's connection.
// The short-circuit read service vouches for a replica's files only to
// such an engine (replica/localread): an engine whose connection died with
// an earlier process of this server (a crash loses the writes acknowledged
// since the replica's last flush) must learn of it through that
// connection, by its next request failing, not read the restarted replica
// directly.
func (s *Server) HasHandle(id string, epoch uint64) bool {
	s.mu.Lock()
	conns := make([]*serverConn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		if c.readDone.Load() {
			continue
		}
		c.hmu.Lock()
		var found []handle
		for _, hd := range c.handles {
			if hd.open.Replica == id && hd.open.Epoch == epoch && hd.open.Purpose == PurposeAttach {
				found = append(found, hd)
			}
		}
		c.hmu.Unlock()
		for _, hd := range found {
			if hd.gate == nil {
				return true // UnsafeStaleIncarnations: no order kept
			}
			hd.gate.mu.RLock()
			newest := !hd.inc.before(hd.gate.latest)
			hd.gate.mu.RUnlock()
			if newest {
				return true
			}
		}
	}
	return false
}

// Forget drops the order of replica id's attach handles (attachGate):
// the caller deleted the replica, and replica ids are never used again.
// Without it the server would keep the order of every replica ever
// attached for as long as it runs. Handles still open on the deleted
// replica keep their gate, and the deleted replica refuses them.
func (s *Server) Forget(id string) {
	s.attachMu.Lock()
	delete(s.attaches, id)
	s.attachMu.Unlock()
}

// Serve accepts connections on ln and serves each until it breaks or the
// server is closed. It closes ln, and returns ErrServerClosed after Close
// or the error that stopped accepting.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		ln.Close()
		return ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		ln.Close()
	}()

	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.isClosed() {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Out of file descriptors and the like: back off, as net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("wire: accept failed; retrying", "err", err, "backoff", backoff)
			select {
			case <-time.After(backoff):
			case <-s.done:
				return ErrServerClosed
			}
			continue
		}
		backoff = 0
		s.startConn(nc)
	}
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Server) startConn(nc net.Conn) {
	c := newServerConn(s, nc)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		nc.Close()
		return
	}
	if len(s.conns) >= s.cfg.MaxConns {
		s.mu.Unlock()
		s.refused.Add(1)
		s.log.Warn("wire: connection limit reached; refusing a connection", "remote", nc.RemoteAddr().String(), "limit", s.cfg.MaxConns)
		nc.Close()
		return
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	s.accepted.Add(1)
	go func() {
		defer s.wg.Done()
		c.run()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
}

// Close stops accepting, closes every connection and waits for every
// goroutine the server started, including the requests being served
// (whose replies are dropped) and the Serve loops. It is idempotent.
func (s *Server) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.done)
		s.cancel()
		for ln := range s.listeners {
			ln.Close()
		}
		for c := range s.conns {
			c.shutdown(ErrServerClosed)
		}
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// serverConn is one client connection. Its reader (run) parses requests
// and starts a worker goroutine for each, within budget; workers queue
// their replies on the frameWriter, so replies go out in completion
// order, batched.
type serverConn struct {
	s      *Server
	nc     net.Conn
	br     *bufio.Reader
	log    *slog.Logger
	budget budget

	closeOnce sync.Once
	closing   chan struct{}   // closed by shutdown
	readDone  atomic.Bool     // the reader has stopped: the client closed its side, or the stream broke
	ctx       context.Context // done once closing is closed; for waits on s.mem
	cancel    context.CancelFunc

	workers sync.WaitGroup // Add only in run

	w *frameWriter // replies

	peer Peer // who the peer is (ServerConfig.Identify), for the Authorizer

	hmu        sync.Mutex
	handles    map[uint32]handle // guarded by hmu
	nextHandle uint32            // guarded by hmu
}

// handle is an open replica, the OPEN that opened it, what the
// Authorizer granted it (nil: no Authorizer), and how to unpin it (nil:
// the replica has no Pin).
type handle struct {
	r     Replica
	open  OpenRequest
	grant Grant
	unpin func()
	// rebuild names the rebuild this handle's last served REBUILD_BEGIN
	// left in progress (0: none yet, or the replica's rebuilds are not
	// named). A REBUILD_WRITE or REBUILD_COPY takes it when it is read off
	// the connection, before anything can hold it up, and is applied to
	// that rebuild only: a write its sender gave up on must not land in a
	// rebuild begun after it, whose tracking no longer knows the newer
	// writes it would overwrite.
	rebuild *atomic.Uint64
	// gate and inc: an attach handle's place among its replica's
	// (attachGate); gate is nil for other purposes.
	gate *attachGate
	inc  incarnation
}

// Pinner is implemented by a Replica whose files the store may close while
// it is idle (*replica.Replica): the server pins it for as long as a
// handle has it open, so that an attached volume never pays a reopen.
type Pinner interface {
	Pin() (unpin func())
}

func (h handle) release() {
	if h.unpin != nil {
		h.unpin()
	}
}

func newServerConn(s *Server, nc net.Conn) *serverConn {
	c := &serverConn{
		s:       s,
		nc:      nc,
		br:      bufio.NewReaderSize(nc, 64<<10),
		log:     s.log.With("remote", nc.RemoteAddr().String()),
		budget:  newBudget(s.cfg.MaxInFlight, s.cfg.MaxInFlightBytes),
		closing: make(chan struct{}),
		handles: make(map[uint32]handle),
		peer:    Peer{Addr: nc.RemoteAddr()},
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.w = newFrameWriter(nc, s.cfg.WriteTimeout, c.shutdown)
	return c
}

// shutdown closes the connection, unblocking the reader; idempotent.
func (c *serverConn) shutdown(cause error) {
	c.closeOnce.Do(func() {
		c.log.Debug("wire: closing connection", "cause", cause)
		close(c.closing)
		c.cancel()
		c.nc.Close()
	})
}

// run serves the connection until it breaks, then waits for its workers.
func (c *serverConn) run() {
	c.log.Debug("wire: connection opened")
	// Identify may complete a TLS handshake: here, in the connection's own
	// goroutine, not in the accept loop a slow peer would stall.
	if c.s.cfg.Identify != nil {
		c.peer.Identity = c.s.cfg.Identify(c.nc)
	}
	graceful, err := c.readLoop()
	c.readDone.Store(true)
	if graceful {
		// The client closed its side between frames, or was told why it is
		// being dropped: let the requests already read finish and every
		// reply go out before closing.
		c.workers.Wait() // and so every reply has been written
	}
	c.shutdown(err)
	c.workers.Wait()
	c.w.close()
	// No request runs any more: the handles die with the connection.
	c.hmu.Lock()
	for id, hd := range c.handles {
		hd.release()
		delete(c.handles, id)
	}
	c.hmu.Unlock()
}

// readLoop reads requests until the stream fails or cannot be trusted.
// graceful is true when the connection should close only after the
// replies already due have been written: the client closed its side
// between frames, or it has been sent an error reply saying why it is
// being dropped.
func (c *serverConn) readLoop() (bool, error) {
	var hb [RequestHeaderSize]byte
	for {
		if err := c.awaitFrame(); err != nil {
			return err == io.EOF, err
		}
		if _, err := io.ReadFull(c.br, hb[:]); err != nil {
			return false, c.frameErr(err)
		}
		h, err := DecodeRequestHeader(hb[:])
		if err != nil {
			c.log.Warn("wire: bad request header; closing connection", "err", err)
			var he *headerError
			if errors.As(err, &he) && he.inSync {
				c.writeReply(h.ID, h.Op, err, nil)
				return true, err
			}
			return false, err
		}
		if h.PayloadLen > MaxPayload {
			err := fmt.Errorf("wire: %v: payload of %d bytes exceeds %d: %w", h.Op, h.PayloadLen, MaxPayload, ErrProtocol)
			c.log.Warn("wire: oversized request; closing connection", "err", err)
			c.writeReply(h.ID, h.Op, err, nil)
			return true, err
		}
		weight := int64(h.PayloadLen)
		if (h.Op.replyData() || h.Op == OpRebuildCopy || h.Op == OpDigest) && h.Len <= replica.MaxIO {
			weight += int64(h.Len)
		}
		if !c.budget.acquire(weight, c.closing) {
			return false, net.ErrClosed
		}
		var buf *[]byte
		var payload []byte
		if h.PayloadLen > 0 {
			buf, err = c.readPayload(int(h.PayloadLen))
			if err != nil {
				c.budget.release(weight)
				return false, c.frameErr(err)
			}
			payload = (*buf)[:h.PayloadLen]
		}
		if Checksum(payload) != h.PayloadCRC {
			err = fmt.Errorf("wire: %v request payload: %w", h.Op, ErrChecksum)
		} else {
			err = h.Validate()
		}
		if err != nil {
			c.log.Debug("wire: refusing request", "op", h.Op, "id", h.ID, "err", err)
			c.putBuf(buf)
			c.writeReply(h.ID, h.Op, err, nil)
			c.budget.release(weight)
			continue
		}
		var session uint64
		if h.Op == OpRebuildWrite || h.Op == OpRebuildCopy {
			session = c.rebuildSession(h.Handle)
		}
		c.workers.Add(1)
		go c.serve(h, session, payload, buf, weight)
	}
}

// changes reports whether op may change a replica (what the attach gate
// orders); reads of an older incarnation are harmless and served.
func changes(op Opcode) bool {
	switch op {
	case OpRead, OpSnapshotRead, OpExtents, OpDigest, OpDirtyRegions, OpWrittenSince:
		return false
	}
	return true
}

// rebuildSession is the rebuild a REBUILD_WRITE or REBUILD_COPY on handle
// hid read now belongs to (0: not named).
func (c *serverConn) rebuildSession(hid uint32) uint64 {
	c.hmu.Lock()
	hd, ok := c.handles[hid]
	c.hmu.Unlock()
	if !ok {
		return 0 // exec refuses the handle
	}
	return hd.rebuild.Load()
}

// awaitFrame waits for the first byte of the next request, for at most
// IdleTimeout while the connection is idle (no replica open, no request
// in flight), then gives the whole frame FrameTimeout to arrive.
func (c *serverConn) awaitFrame() error {
	for c.br.Buffered() == 0 {
		var deadline time.Time
		if c.idle() {
			deadline = time.Now().Add(c.s.cfg.IdleTimeout)
		}
		c.nc.SetReadDeadline(deadline)
		_, err := c.br.Peek(1)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		if c.idle() {
			c.log.Info("wire: idle connection with no replica open; closing it", "idle", c.s.cfg.IdleTimeout)
			return fmt.Errorf("wire: idle for %v: %w", c.s.cfg.IdleTimeout, err)
		}
		// A replica was opened or a request is still being served: not idle.
	}
	c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.FrameTimeout))
	return nil
}

// idle reports whether the connection has no replica open and no request
// in flight.
func (c *serverConn) idle() bool {
	c.hmu.Lock()
	handles := len(c.handles)
	c.hmu.Unlock()
	c.budget.mu.Lock()
	n := c.budget.n
	c.budget.mu.Unlock()
	return handles == 0 && n == 0
}

// frameErr describes a failure to read the rest of a frame.
func (c *serverConn) frameErr(err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.log.Warn("wire: request frame not received in time; closing connection", "timeout", c.s.cfg.FrameTimeout)
		return fmt.Errorf("wire: request frame not received within %v: %w", c.s.cfg.FrameTimeout, err)
	}
	return err
}

// fillChunk is the step by which a large request payload is received: the
// buffer for all of it is taken only once half of it has arrived, so a
// peer that announces a large frame and stalls holds (and costs the
// server's MaxMemory) about what it really sent.
const fillChunk = 256 << 10

// minMaxMemory is the smallest MaxMemory: room for the largest payload
// buffer and the chunks that fill it.
const minMaxMemory = 2 * (16 << 20)

// readPayload reads n payload bytes into a buffer from the pool, charging
// s.mem for every buffer it holds; give the buffer back with c.putBuf.
// The time spent waiting for memory does not count against the peer's
// FrameTimeout; each wait is bounded by FrameTimeout of its own.
func (c *serverConn) readPayload(n int) (*[]byte, error) {
	if n <= fillChunk {
		buf, err := c.getFrameBuf(n)
		if err != nil {
			return nil, err
		}
		c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.FrameTimeout))
		if _, err := io.ReadFull(c.br, (*buf)[:n]); err != nil {
			c.putBuf(buf)
			return nil, err
		}
		return buf, nil
	}
	var chunks []*[]byte
	defer func() {
		for _, ch := range chunks {
			c.putBuf(ch)
		}
	}()
	have := 0
	for have < n/2 {
		ch, err := c.getFrameBuf(fillChunk)
		if err != nil {
			return nil, err
		}
		chunks = append(chunks, ch)
		c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.FrameTimeout))
		k := min(fillChunk, n-have)
		if _, err := io.ReadFull(c.br, (*ch)[:k]); err != nil {
			return nil, err
		}
		have += k
	}
	buf, err := c.getFrameBuf(n)
	if err != nil {
		return nil, err
	}
	c.nc.SetReadDeadline(time.Now().Add(c.s.cfg.FrameTimeout))
	p := (*buf)[:n]
	at := 0
	for _, ch := range chunks {
		at += copy(p[at:have], *ch)
	}
	if _, err := io.ReadFull(c.br, p[have:]); err != nil {
		c.putBuf(buf)
		return nil, err
	}
	return buf, nil
}

// getBuf takes a pooled buffer of at least n bytes, waiting for its size
// in the server's MaxMemory; it fails only when the connection closes.
func (c *serverConn) getBuf(n int) (*[]byte, error) {
	if err := c.s.mem.Acquire(c.ctx, int64(bufSize(n))); err != nil {
		return nil, fmt.Errorf("wire: waiting for payload memory: %w", net.ErrClosed)
	}
	return getBuf(n), nil
}

// getBufCtx is getBuf waiting at most until ctx (derived from the
// connection's) ends.
func (c *serverConn) getBufCtx(ctx context.Context, n int) (*[]byte, error) {
	if err := c.s.mem.Acquire(ctx, int64(bufSize(n))); err != nil {
		return nil, fmt.Errorf("wire: waiting for payload memory: %w", err)
	}
	return getBuf(n), nil
}

// getFrameBuf is getBuf for the reader, which may already hold part of a
// frame: it waits at most FrameTimeout, so that readers holding chunks and
// waiting for each other's memory cannot wait forever (the one that gives
// up is dropped and frees what it held).
func (c *serverConn) getFrameBuf(n int) (*[]byte, error) {
	ctx, cancel := context.WithTimeout(c.ctx, c.s.cfg.FrameTimeout)
	defer cancel()
	if err := c.s.mem.Acquire(ctx, int64(bufSize(n))); err != nil {
		if c.ctx.Err() != nil {
			return nil, fmt.Errorf("wire: waiting for payload memory: %w", net.ErrClosed)
		}
		c.log.Warn("wire: no payload memory within the frame timeout; closing connection", "timeout", c.s.cfg.FrameTimeout, "max_memory", c.s.cfg.MaxMemory)
		return nil, fmt.Errorf("wire: no payload memory (MaxMemory %d bytes) within %v: %w", c.s.cfg.MaxMemory, c.s.cfg.FrameTimeout, ErrServerBusy)
	}
	return getBuf(n), nil
}

// putBuf gives back a buffer from c.getBuf and its share of MaxMemory.
func (c *serverConn) putBuf(b *[]byte) {
	if b == nil {
		return
	}
	n := cap(*b)
	putBuf(b)
	c.s.mem.Release(int64(n))
}

// serve runs one request and writes its reply. session is a
// REBUILD_WRITE's or REBUILD_COPY's rebuild (rebuildSession).
func (c *serverConn) serve(h RequestHeader, session uint64, payload []byte, buf *[]byte, weight int64) {
	defer c.workers.Done()
	reply, rbuf, err := c.exec(&h, session, payload)
	c.putBuf(buf)
	c.writeReply(h.ID, h.Op, err, reply)
	c.putBuf(rbuf)
	c.budget.release(weight)
}

// exec runs a validated request against the backend. A reply payload
// from the pool comes back with its buffer, to be put back once written.
func (c *serverConn) exec(h *RequestHeader, session uint64, payload []byte) (reply []byte, rbuf *[]byte, err error) {
	o := replica.Op{Epoch: h.Epoch, Generation: h.Generation, FUA: h.Flags&FlagFUA != 0}
	switch h.Op {
	case OpPing:
		return nil, nil, nil
	case OpOpen:
		req, err := decodeOpen(payload, h.Epoch)
		if err != nil {
			return nil, nil, err
		}
		req.Incarnation = h.Generation
		return c.open(req)
	case OpClose:
		c.hmu.Lock()
		hd, ok := c.handles[h.Handle]
		delete(c.handles, h.Handle)
		c.hmu.Unlock()
		hd.release()
		if !ok {
			return nil, nil, fmt.Errorf("wire: CLOSE handle %d: %w", h.Handle, ErrBadHandle)
		}
		return nil, nil, nil
	}

	c.hmu.Lock()
	hd := c.handles[h.Handle]
	c.hmu.Unlock()
	r := hd.r
	if r == nil {
		return nil, nil, fmt.Errorf("wire: %v handle %d: %w", h.Op, h.Handle, ErrBadHandle)
	}
	if hd.grant != nil {
		req := Request{Op: h.Op, Epoch: h.Epoch, Generation: h.Generation}
		switch h.Op {
		case OpGrow:
			req.Len = h.Len
		case OpSnapshotCreate, OpSnapshotDelete, OpSnapshotRead, OpExtents:
			req.ID = string(payload)
		case OpRebuildCopy:
			req.ID, _ = decodeCopyRequest(payload)
		}
		if err := hd.grant.Allow(c.s.ctx, req); err != nil {
			return nil, nil, err
		}
	}
	// After the grant, which may wait: nothing stands between the check
	// and the replica (a changing request's payload is already read).
	if g := hd.gate; g != nil && changes(h.Op) {
		g.mu.RLock()
		defer g.mu.RUnlock()
		if latest := g.latest; hd.inc.before(latest) {
			err := replica.ErrClosed
			if hd.inc.epoch < latest.epoch {
				err = replica.ErrStaleEpoch
			}
			return nil, nil, fmt.Errorf("wire: %v on replica %s: an attach handle of a newer incarnation (epoch %d, %d) was opened: %w",
				h.Op, hd.open.Replica, latest.epoch, latest.n, err)
		}
	}
	off, n := int64(h.Off), int64(h.Len) // in range: Validate
	switch h.Op {
	case OpRead, OpSnapshotRead:
		rbuf, err = c.getBuf(int(n))
		if err != nil {
			return nil, nil, err
		}
		p := (*rbuf)[:n]
		if h.Op == OpRead {
			err = r.ReadAt(o, p, off)
		} else {
			err = r.ReadSnapshotAt(o, string(payload), p, off)
		}
		if err != nil {
			c.putBuf(rbuf)
			return nil, nil, err
		}
		return p, rbuf, nil
	case OpDigest:
		return c.digest(r, o, off, n)
	case OpWrite:
		return nil, nil, r.WriteAt(o, payload, off)
	case OpRebuildWrite:
		if sr, named := r.(sessionRebuilder); named && session != 0 {
			return nil, nil, sr.RebuildWriteSession(session, o, payload, off)
		}
		return nil, nil, r.RebuildWrite(o, payload, off)
	case OpRebuildCopy:
		return nil, nil, c.rebuildCopy(hd, session, o, payload, off, n)
	case OpWriteZeroes:
		return nil, nil, r.WriteZeroes(o, off, n)
	case OpTrim:
		return nil, nil, r.Trim(o, off, n)
	case OpFlush:
		return nil, nil, r.Flush(o)
	case OpGrow:
		return nil, nil, r.Grow(o, h.Len)
	case OpSnapshotCreate:
		return nil, nil, r.CreateSnapshot(o, string(payload))
	case OpSnapshotDelete:
		return nil, nil, r.DeleteSnapshot(o, string(payload))
	case OpRebuildBegin, OpRebuildEnd:
		if c.readDone.Load() {
			// Its sender has closed the connection, or lost it: it
			// awaits no answer, and a rebuild begun or ended this late
			// may be a later rebuilder's (one on another connection
			// ended the rebuild, or began its own, since).
			return nil, nil, fmt.Errorf("wire: %v on a connection its client has left: %w", h.Op, replica.ErrClosed)
		}
		if h.Op == OpRebuildEnd {
			return nil, nil, r.EndRebuild(o)
		}
		sr, named := r.(sessionRebuilder)
		if !named {
			return nil, nil, r.BeginRebuild(o)
		}
		session, err := sr.BeginRebuildSession(o)
		if err != nil {
			return nil, nil, err
		}
		hd.rebuild.Store(session) // before the reply: the rebuilder's writes follow it
		return nil, nil, nil
	case OpExtents:
		es, err := r.Extents(o, string(payload), off, int(n))
		if len(es) > int(n) {
			es = es[:n] // the store promised at most limit
		}
		return c.extentsReply(es, err)
	case OpDirtyRegions:
		return c.extentsReply(r.DirtyRegions(o))
	case OpWrittenSince:
		return c.extentsReply(r.WrittenSince(o, h.Off))
	}
	return nil, nil, fmt.Errorf("wire: %v: %w", h.Op, ErrUnknownOp) // unreachable: Validate
}

func (c *serverConn) open(req OpenRequest) ([]byte, *[]byte, error) {
	id, epoch := req.Replica, req.Epoch
	if err := c.checkHandles(id); err != nil { // before fencing anything
		return nil, nil, err
	}
	var grant Grant
	if a := c.s.cfg.Authorizer; a != nil { // before touching the replica
		g, err := a.Open(c.s.ctx, c.peer, req)
		if err != nil {
			c.log.Info("wire: OPEN refused", "replica", id, "volume", req.Volume, "epoch", epoch,
				"purpose", req.Purpose, "node", req.Node, "err", err)
			return nil, nil, err
		}
		if g == nil {
			return nil, nil, fmt.Errorf("wire: OPEN %q: authorizer granted nothing: %w", id, ErrDenied)
		}
		grant = g
	}
	r, err := c.s.backend.Replica(id)
	if err != nil {
		return nil, nil, err
	}
	if r == nil {
		return nil, nil, fmt.Errorf("wire: OPEN %q: backend returned no replica: %w", id, replica.ErrNotFound)
	}
	if epoch != 0 {
		if err := r.Fence(epoch); err != nil {
			return nil, nil, err
		}
	}
	hd := handle{r: r, open: req, grant: grant, rebuild: new(atomic.Uint64)}
	if p, ok := r.(Pinner); ok {
		hd.unpin = p.Pin()
	}
	if req.Purpose == PurposeAttach && !c.s.cfg.UnsafeStaleIncarnations {
		// After the fence: an OPEN of an older epoch takes nothing over.
		hd.inc = incarnation{epoch, req.Incarnation}
		hd.gate = c.s.takeAttach(id, hd.inc)
		// The replica may have been deleted, and its order forgotten,
		// since the lookup above: takeAttach made it a new one, which
		// nothing would forget again.
		if _, err := c.s.backend.Replica(id); errors.Is(err, replica.ErrNotFound) {
			hd.release()
			c.s.Forget(id)
			return nil, nil, err
		}
	}
	c.hmu.Lock()
	if err := c.checkHandlesLocked(id); err != nil {
		c.hmu.Unlock()
		hd.release()
		return nil, nil, err
	}
	c.nextHandle++
	if c.nextHandle == 0 {
		c.nextHandle = 1
	}
	hid := c.nextHandle
	c.handles[hid] = hd
	c.hmu.Unlock()
	rep := OpenReply{Handle: hid, Size: r.Size(), Epoch: r.Epoch()}
	return rep.AppendTo(make([]byte, 0, OpenReplySize)), nil, nil
}

func (c *serverConn) checkHandles(id string) error {
	c.hmu.Lock()
	defer c.hmu.Unlock()
	return c.checkHandlesLocked(id)
}

func (c *serverConn) checkHandlesLocked(id string) error {
	if len(c.handles) >= c.s.cfg.MaxHandles {
		return fmt.Errorf("wire: OPEN %q: %d handles already open on this connection: %w", id, len(c.handles), replica.ErrInvalid)
	}
	return nil
}

func (c *serverConn) extentsReply(es []replica.Extent, err error) ([]byte, *[]byte, error) {
	if err != nil {
		return nil, nil, err
	}
	if len(es) > MaxExtents {
		return nil, nil, fmt.Errorf("wire: %d extents do not fit one reply (at most %d): %w", len(es), MaxExtents, ErrInternal)
	}
	if len(es) == 0 {
		return nil, nil, nil
	}
	buf, err := c.getBuf(len(es) * ExtentSize)
	if err != nil {
		return nil, nil, err
	}
	return AppendExtents((*buf)[:0], es), buf, nil
}

// writeReply queues one reply: the payload for a success, the error's
// text for a failure. A write error shuts the connection down.
func (c *serverConn) writeReply(id uint64, op Opcode, err error, payload []byte) {
	status := statusOf(err)
	if err != nil {
		c.s.failed[status].Add(1)
		msg := err.Error()
		if len(msg) > MaxMessage {
			msg = msg[:MaxMessage]
		}
		payload = []byte(msg)
		if status == StatusInternal {
			c.log.Warn("wire: request failed with an unmapped error", "op", op, "id", id, "err", err)
		}
	}
	rh := ReplyHeader{Status: status, ID: id, PayloadLen: uint32(len(payload)), PayloadCRC: Checksum(payload)}
	c.w.write(frameHeader{rep: &rh}, payload) // an error has shut the connection down
}

// budget bounds a connection's in-flight requests and bytes. Only the
// connection's reader acquires, so one wake-up channel suffices.
type budget struct {
	maxN     int
	maxBytes int64
	wake     chan struct{}

	mu    sync.Mutex
	n     int   // guarded by mu
	bytes int64 // guarded by mu
}

func newBudget(maxN int, maxBytes int64) budget {
	return budget{maxN: maxN, maxBytes: maxBytes, wake: make(chan struct{}, 1)}
}

// acquire takes one request slot and w bytes, waiting while the budget is
// spent; a request bigger than the whole byte budget runs alone. It
// returns false if done is closed first.
func (b *budget) acquire(w int64, done <-chan struct{}) bool {
	for {
		b.mu.Lock()
		if b.n < b.maxN && (b.bytes+w <= b.maxBytes || b.n == 0) {
			b.n++
			b.bytes += w
			b.mu.Unlock()
			return true
		}
		b.mu.Unlock()
		select {
		case <-b.wake:
		case <-done:
			return false
		}
	}
}

func (b *budget) release(w int64) {
	b.mu.Lock()
	b.n--
	b.bytes -= w
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
}
