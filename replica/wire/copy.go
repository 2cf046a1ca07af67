package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stor-io/stor/replica"
)

// REBUILD_COPY is a rebuild's copy of one chunk made by the target's
// server: the rebuilder (the engine of an attached volume, or a server
// rebuilding a detached one) holds the chunk's range against writes, as for
// a copy it makes itself, and asks the target to copy it; the target's
// server reads the chunk from the source replica over this protocol
// (ServerConfig.CopySource) and applies it with RebuildWrite, exactly as a
// REBUILD_WRITE of the same bytes would be applied. The data crosses one
// connection (source → target) instead of two (source → rebuilder →
// target), and is checksummed twice instead of four times.
//
// The request's offset and length are REBUILD_WRITE's; its payload is a
// budget, a u32 of milliseconds (0: DefaultCopyBudget; at most
// MaxCopyBudget), then the source replica's id. The target spends at most
// the budget reading the source; a source it cannot read in that time, or
// that refuses or fails, is answered with ErrCopySource and nothing is
// written. ErrCopySource says nothing of the source's health as the
// rebuilder sees it (the two servers may only be cut off from each other),
// so a rebuilder given it reads the chunk itself and blames whichever
// replica then fails, as it would have without REBUILD_COPY; the budget
// leaves it the time to. Every other failure is the target's.

const (
	// copyBudgetSize is the budget field's size in a REBUILD_COPY payload.
	copyBudgetSize = 4
	// MaxCopyPayload bounds a REBUILD_COPY payload: the budget and an id.
	MaxCopyPayload = copyBudgetSize + MaxIDLen
	// DefaultCopyBudget is the budget of a REBUILD_COPY that states 0.
	DefaultCopyBudget = 5 * time.Second
	// MaxCopyBudget caps a REBUILD_COPY's budget.
	MaxCopyBudget = time.Minute
)

// CopySource reads a rebuild's source for the REBUILD_COPY requests a
// Server serves (ServerConfig.CopySource). *Sources is the implementation
// over this protocol.
type CopySource interface {
	// ReadSource reads len(p) bytes at off of replica source into p, for
	// a rebuild of the replica the handle target opened (its volume, epoch
	// and purpose say which rebuild), with o's epoch and generation. It
	// returns when ctx (the request's budget) ends.
	ReadSource(ctx context.Context, target OpenRequest, source string, o replica.Op, p []byte, off int64) error
}

// appendCopyRequest appends a REBUILD_COPY payload.
func appendCopyRequest(b []byte, source string, budget time.Duration) []byte {
	ms := uint32(0)
	if budget > 0 {
		ms = uint32(max(min(budget, MaxCopyBudget).Milliseconds(), 1))
	}
	b = binary.BigEndian.AppendUint32(b, ms)
	return append(b, source...)
}

// decodeCopyRequest decodes a REBUILD_COPY payload that Validate passed
// (its length is copyBudgetSize+1 .. MaxCopyPayload).
func decodeCopyRequest(p []byte) (source string, budget time.Duration) {
	budget = time.Duration(binary.BigEndian.Uint32(p)) * time.Millisecond
	switch {
	case budget == 0:
		budget = DefaultCopyBudget
	case budget > MaxCopyBudget:
		budget = MaxCopyBudget
	}
	return string(p[copyBudgetSize:]), budget
}

// sessionRebuilder is a Replica whose rebuilds are named
// (*replica.Replica): a copy, or a rebuild write, is applied only to the
// rebuild it was made for.
type sessionRebuilder interface {
	BeginRebuildSession(o replica.Op) (uint64, error)
	RebuildSession(o replica.Op) (uint64, error)
	RebuildWriteSession(session uint64, o replica.Op, p []byte, off int64) error
}

// rebuildCopy serves a REBUILD_COPY on handle hd (a validated request).
// The budget runs from here: the wait for payload memory counts. What it
// read is written only within the budget, and, on a replica whose
// rebuilds are named, only to the rebuild in progress when the request
// was read off the connection (session, from the handle's REBUILD_BEGIN)
// or, on a handle that began none, when it began here: the rebuilder may
// have given up on this copy (its own time ran out, its rebuild failed
// and started over, resetting the tracking that keeps a copy off newer
// writes) while the source was being read.
func (c *serverConn) rebuildCopy(hd handle, session uint64, o replica.Op, payload []byte, off, n int64) error {
	source, budget := decodeCopyRequest(payload)
	cs := c.s.cfg.CopySource
	if cs == nil {
		return fmt.Errorf("wire: %v: this server copies from no source: %w", OpRebuildCopy, ErrUnknownOp)
	}
	ctx, cancel := context.WithTimeout(c.ctx, budget)
	defer cancel()
	sr, named := hd.r.(sessionRebuilder)
	if named {
		current, err := sr.RebuildSession(o)
		switch {
		case err != nil:
			return err // no rebuild in progress, a stale epoch: the target's own
		case session == 0:
			session = current
		case session != current:
			return fmt.Errorf("wire: %v: rebuild session %d has ended (now %d): %w", OpRebuildCopy, session, current, replica.ErrInvalid)
		}
	}
	buf, err := c.getBufCtx(ctx, int(n))
	if err != nil {
		return fmt.Errorf("wire: %v of %d bytes at %d from %s: %v: %w", OpRebuildCopy, n, off, source, err, ErrCopySource)
	}
	defer c.putBuf(buf)
	p := (*buf)[:n]
	err = cs.ReadSource(ctx, hd.open, source, o, p, off)
	if err == nil && ctx.Err() != nil {
		err = ctx.Err() // read, but too late to be written
	}
	if err != nil {
		// %v, not %w: whatever the source said (a stale epoch, say) is not
		// the target's status.
		return fmt.Errorf("wire: %v of %d bytes at %d from %s: %v: %w", OpRebuildCopy, n, off, source, err, ErrCopySource)
	}
	if named {
		return sr.RebuildWriteSession(session, o, p, off)
	}
	return hd.r.RebuildWrite(o, p, off)
}

// RebuildCopy has the replica's server copy n bytes at off from replica
// source (of the same volume) into this replica, as RebuildWrite would
// write them. budget bounds the server's read of the source (0:
// DefaultCopyBudget). A source the server could not read is ErrCopySource;
// a server that copies from no source answers ErrUnknownOp.
func (h *Handle) RebuildCopy(ctx context.Context, o replica.Op, source string, off, n int64, budget time.Duration) error {
	if err := checkIO(OpRebuildCopy, int(min(n, replica.MaxIO+1)), off); err != nil {
		return err
	}
	if n < 0 {
		return fmt.Errorf("wire: %v at %d: negative length %d: %w", OpRebuildCopy, off, n, replica.ErrInvalid)
	}
	if err := checkID(OpRebuildCopy, source, false); err != nil {
		return err
	}
	_, err := h.do(ctx, OpRebuildCopy, o, uint64(off), uint64(n), appendCopyRequest(nil, source, budget), nil, 0)
	return err
}

// Sources is a CopySource over this protocol. It opens each source on the
// server Resolve names, with the OPEN Resolve states (whose purpose the
// source's server authorises), and keeps it open while copies use it, so a
// rebuild's chunks share one connection and one OPEN. A source is opened
// in the background, within the client's Timeout, not within the budget
// of the read that asked first (the others wait for it within theirs); a
// read still receiving its reply stallGrace after its budget ended cuts
// the source's connection, so that it answers about in time; a source
// whose link or replica failed is never used again, and one unused for
// Idle is closed.
// Its methods are safe for concurrent use; Close waits for the opens it
// started.
type Sources struct {
	// Resolve says where source is and how to open it, for a rebuild of
	// the replica target opened, at o's epoch. It is asked on every read,
	// so a source the metadata no longer allows is refused at once.
	Resolve func(ctx context.Context, target OpenRequest, source string, o replica.Op) (addr string, open OpenRequest, err error)
	// Client is the configuration of the connections to sources.
	Client ClientConfig
	// Idle is how long an unused source stays open. Default 30s.
	Idle time.Duration

	mu     sync.Mutex
	open   map[sourceKey]*sourceConn // guarded by mu
	closed bool                      // guarded by mu
	ctx    context.Context           // of the opens; cancelled by Close
	cancel context.CancelFunc
	opens  sync.WaitGroup // the opens in the background
}

type sourceKey struct {
	addr string
	open OpenRequest
}

// sourceConn is one source, opened in the background once: ready is
// closed when the open is done, with conn and h set or err.
type sourceConn struct {
	ready chan struct{}
	conn  *Conn
	h     *Handle
	err   error

	// Guarded by Sources.mu.
	users  int  // reads using it or waiting for it
	broken bool // out of the map; closed once it is open and unused
	idle   *time.Timer
}

// ReadSource implements CopySource.
func (s *Sources) ReadSource(ctx context.Context, target OpenRequest, source string, o replica.Op, p []byte, off int64) error {
	if s.Resolve == nil {
		return errors.New("wire: Sources without Resolve")
	}
	addr, open, err := s.Resolve(ctx, target, source, o)
	if err != nil {
		return err
	}
	key := sourceKey{addr, open}
	sc, err := s.acquire(ctx, key)
	if err != nil {
		return err
	}
	// A read whose budget ends returns at once, unless its reply is
	// already coming in: then it is waited for (up to the client's
	// Timeout). One still stuck stallGrace after its budget has a stalled
	// link: cut it, so that the copy answers in time; the other reads on
	// it would stall as well.
	done := make(chan struct{})
	var cut atomic.Bool
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(stallGrace)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			cut.Store(true)
			sc.conn.Close()
		}
	})
	err = sc.h.ReadAt(ctx, o, p, off)
	close(done)
	stop()
	s.release(key, sc, cut.Load() || sourceFailed(err))
	return err
}

// stallGrace is how long past its budget a source read may still be
// receiving its reply before its connection is cut.
const stallGrace = 500 * time.Millisecond

// sourceFailed reports whether a read's failure takes its source out of
// service: its link or its replica failed, not the request (a budget that
// ended first, an offset out of range).
func sourceFailed(err error) bool {
	switch {
	case err == nil, errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded), errors.Is(err, replica.ErrInvalid):
		return false
	}
	return true
}

// acquire returns the open source for key with one more user, starting
// its open if there is none, and waiting for it within ctx.
func (s *Sources) acquire(ctx context.Context, key sourceKey) (*sourceConn, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("wire: copy sources closed: %w", replica.ErrClosed)
	}
	if s.open == nil {
		s.open = map[sourceKey]*sourceConn{}
		s.ctx, s.cancel = context.WithCancel(context.Background())
	}
	sc := s.open[key]
	if sc == nil {
		sc = &sourceConn{ready: make(chan struct{})}
		s.open[key] = sc
		s.opens.Add(1)
		go s.openSource(key, sc)
	}
	sc.users++
	if sc.idle != nil {
		sc.idle.Stop()
	}
	s.mu.Unlock()
	select {
	case <-sc.ready:
	case <-ctx.Done():
		s.release(key, sc, false)
		return nil, ctx.Err()
	}
	if sc.err != nil {
		s.release(key, sc, true)
		return nil, sc.err
	}
	s.mu.Lock()
	broken := sc.broken // Close ran, or a read failed, while it was being opened
	s.mu.Unlock()
	if broken {
		s.release(key, sc, false)
		return nil, fmt.Errorf("wire: copy source %s on %s: out of service: %w", key.open.Replica, key.addr, ErrDisconnected)
	}
	return sc, nil
}

// openSource opens sc, within the client's Timeout (dial and OPEN each)
// or until Close.
func (s *Sources) openSource(key sourceKey, sc *sourceConn) {
	defer s.opens.Done()
	timeout := s.Client.Timeout
	if timeout <= 0 {
		timeout = DefaultClientConfig().Timeout
	}
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	var conn *Conn
	var h *Handle
	conn, err := Dial(ctx, "tcp", key.addr, s.Client)
	if err == nil {
		if h, err = conn.OpenFor(ctx, key.open); err != nil {
			conn.Close()
			conn = nil
		}
	}
	s.mu.Lock()
	sc.conn, sc.h, sc.err = conn, h, err
	close(sc.ready)
	if err != nil {
		s.breakLocked(key, sc)
	}
	closeNow := s.settleLocked(key, sc)
	s.mu.Unlock()
	if closeNow {
		sc.close()
	}
}

// release ends one use of sc; a failed use takes it out of service.
func (s *Sources) release(key sourceKey, sc *sourceConn, failed bool) {
	s.mu.Lock()
	sc.users--
	if failed {
		s.breakLocked(key, sc)
	}
	closeNow := s.settleLocked(key, sc)
	s.mu.Unlock()
	if closeNow {
		sc.close()
	}
}

// settleLocked decides what becomes of sc once it is open and unused:
// closed now if it is out of service (true: the caller closes it, off
// the lock), else closed after Idle unless used again.
func (s *Sources) settleLocked(key sourceKey, sc *sourceConn) bool {
	select {
	case <-sc.ready:
	default:
		return false // its open settles it
	}
	if sc.users > 0 {
		return false
	}
	if sc.broken {
		return true
	}
	idle := s.Idle
	if idle <= 0 {
		idle = 30 * time.Second
	}
	if sc.idle == nil {
		sc.idle = time.AfterFunc(idle, func() { s.reap(key, sc) })
	} else {
		sc.idle.Reset(idle)
	}
	return false
}

// breakLocked takes sc out of service.
func (s *Sources) breakLocked(key sourceKey, sc *sourceConn) {
	sc.broken = true
	if s.open[key] == sc {
		delete(s.open, key)
	}
	if sc.idle != nil {
		sc.idle.Stop()
	}
}

// reap closes sc if nothing has used it since its timer was set.
func (s *Sources) reap(key sourceKey, sc *sourceConn) {
	s.mu.Lock()
	if sc.users > 0 || sc.broken {
		s.mu.Unlock()
		return
	}
	s.breakLocked(key, sc)
	s.mu.Unlock()
	sc.close()
}

// close closes an opened source's connection, which closes its handle on
// the source's server. Closing twice does nothing more.
func (sc *sourceConn) close() {
	if sc.conn != nil {
		sc.conn.Close()
	}
}

// openCount reports how many sources are open or being opened.
func (s *Sources) openCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.open)
}

// Close closes every source: reads in flight fail, later ones are
// refused, opens under way stop; it returns once they have.
func (s *Sources) Close() {
	s.mu.Lock()
	s.closed = true
	if s.cancel != nil {
		s.cancel()
	}
	var opened []*sourceConn
	for key, sc := range s.open {
		s.breakLocked(key, sc)
		select {
		case <-sc.ready:
			opened = append(opened, sc)
		default: // being opened: its open closes it
		}
	}
	s.mu.Unlock()
	// Closing fails the reads in flight; the last of them closes it again,
	// which does nothing.
	for _, sc := range opened {
		sc.close()
	}
	s.opens.Wait()
}
