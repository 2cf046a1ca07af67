package wire

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stor-io/stor/replica"
)

// ClientConfig tunes a Conn. Zero fields take DefaultClientConfig's
// values.
type ClientConfig struct {
	// Dial opens the connection. Default net.Dialer.DialContext. Tests
	// inject faults here.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Timeout bounds dialing (with the first PING), each frame write (a
	// server that stops reading requests for this long breaks the
	// connection), and how long a cancelled call waits for a reply that
	// is already being received before giving up on the connection.
	// Requests themselves are bounded only by their context. Default 10s.
	Timeout time.Duration
}

// DefaultClientConfig returns the defaults documented on ClientConfig.
func DefaultClientConfig() ClientConfig {
	var d net.Dialer
	return ClientConfig{Dial: d.DialContext, Timeout: 10 * time.Second}
}

func (c *ClientConfig) withDefaults() {
	d := DefaultClientConfig()
	if c.Dial == nil {
		c.Dial = d.Dial
	}
	if c.Timeout == 0 {
		c.Timeout = d.Timeout
	}
}

// Validate reports the first problem with the configuration.
func (c *ClientConfig) Validate() error {
	if c.Timeout < 0 {
		return fmt.Errorf("wire: Timeout %v is negative", c.Timeout)
	}
	return nil
}

// Conn is a client connection to a Server. It is safe for concurrent use:
// requests from many goroutines are pipelined on the one stream and
// replies are matched to callers by request id, in whatever order the
// server sends them.
//
// Once the connection breaks every pending and future call fails with an
// error wrapping ErrDisconnected; a Conn never reconnects.
type Conn struct {
	nc      net.Conn
	timeout time.Duration
	br      *bufio.Reader // owned by the reader goroutine
	nextID  atomic.Uint64

	w *frameWriter // requests

	mu      sync.Mutex
	pending map[uint64]*call // guarded by mu; nil once broken
	err     error            // guarded by mu: why the connection broke

	broken     chan struct{} // closed by fail
	readerDone chan struct{}
}

// call is one request waiting for its reply. The reader claims it by
// removing it from pending; from then on only the reader touches it until
// it signals done.
type call struct {
	op       Opcode
	dst      []byte // READ, SNAPSHOT_READ: the caller's buffer, filled in place
	maxReply int    // the largest success payload the op may get
	reply    []byte // the success payload, for control ops
	err      error
	done     chan struct{} // cap 1
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

func putCall(cl *call) {
	*cl = call{done: cl.done}
	callPool.Put(cl)
}

// Dial connects to a server and checks that it speaks this protocol with a
// PING.
func Dial(ctx context.Context, network, addr string, cfg ClientConfig) (*Conn, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.withDefaults()
	dctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	nc, err := cfg.Dial(dctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("wire: dial %s %s: %w", network, addr, err)
	}
	c := &Conn{
		nc:         nc,
		timeout:    cfg.Timeout,
		br:         bufio.NewReaderSize(nc, 64<<10),
		pending:    make(map[uint64]*call),
		broken:     make(chan struct{}),
		readerDone: make(chan struct{}),
	}
	c.w = newFrameWriter(nc, cfg.Timeout, c.fail)
	go c.readLoop()
	if err := c.Ping(dctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("wire: dial %s %s: %w", network, addr, err)
	}
	return c, nil
}

// Close breaks the connection: pending calls fail with ErrDisconnected.
// It waits for the connection's goroutines. Handles need not be closed
// first: the server forgets them with the connection.
func (c *Conn) Close() error {
	c.fail(errors.New("closed by client"))
	<-c.readerDone
	return nil
}

// Done is closed once the connection has broken or been closed, so an
// owner can redial without waiting for a call to fail.
func (c *Conn) Done() <-chan struct{} { return c.broken }

// Err returns nil while the connection works, and once it has broken an
// error wrapping ErrDisconnected that says why.
func (c *Conn) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Ping round-trips an empty request.
func (c *Conn) Ping(ctx context.Context) error {
	_, err := c.roundTrip(ctx, &RequestHeader{Op: OpPing}, nil, nil, 0)
	return err
}

// Open opens a replica on this connection. A non-zero epoch fences the
// replica first (replica.Replica.Fence): it fails with
// replica.ErrStaleEpoch if the replica has seen a newer one. Epoch 0 opens
// without fencing; every request still carries its own epoch.
//
// Open states no purpose: a server with an Authorizer refuses it (see
// OpenFor).
func (c *Conn) Open(ctx context.Context, replicaID string, epoch uint64) (*Handle, error) {
	return c.OpenFor(ctx, OpenRequest{Replica: replicaID, Epoch: epoch})
}

// OpenFor opens a replica as Open does, stating what the open is for:
// the volume, the node and the purpose that the server's Authorizer
// checks against the cluster's metadata.
func (c *Conn) OpenFor(ctx context.Context, r OpenRequest) (*Handle, error) {
	replicaID, epoch := r.Replica, r.Epoch
	if len(replicaID) == 0 || len(replicaID) > MaxIDLen {
		return nil, fmt.Errorf("wire: open: replica id of %d bytes, want 1..%d: %w", len(replicaID), MaxIDLen, replica.ErrInvalid)
	}
	for _, f := range []string{r.Replica, r.Volume, r.Node, r.Snapshot} {
		if len(f) > MaxIDLen || strings.IndexByte(f, 0) >= 0 {
			return nil, fmt.Errorf("wire: open: field %q: longer than %d bytes or holds a NUL: %w", f, MaxIDLen, replica.ErrInvalid)
		}
	}
	if r.Purpose >= purposeMax {
		return nil, fmt.Errorf("wire: open: %v: %w", r.Purpose, replica.ErrInvalid)
	}
	reply, err := c.roundTrip(ctx, &RequestHeader{Op: OpOpen, Epoch: epoch, Generation: r.Incarnation}, encodeOpen(r), nil, OpenReplySize)
	if err != nil {
		return nil, err
	}
	rep, err := DecodeOpenReply(reply)
	if err != nil {
		return nil, err
	}
	h := &Handle{c: c, id: rep.Handle, replicaID: replicaID, epoch: rep.Epoch}
	h.size.Store(rep.Size)
	return h, nil
}

// roundTrip sends one request and waits for its reply. h's ID, PayloadLen
// and PayloadCRC are filled in here. dst receives the data of a READ-like
// reply; the returned payload is that of any other successful reply, at
// most maxReply bytes.
func (c *Conn) roundTrip(ctx context.Context, h *RequestHeader, payload, dst []byte, maxReply int) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p, err := c.start(h, payload, Checksum(payload), dst, maxReply)
	if err != nil {
		return nil, err
	}
	return p.wait(ctx)
}

// Pending is a request that has been sent and whose reply has not yet
// been collected. Exactly one Wait must follow; the Pending must not be
// used after it.
type Pending struct {
	c  *Conn
	cl *call
	id uint64
	op Opcode
}

// start registers and sends one request without waiting for its reply.
// crc is Checksum(payload). The payload is not retained once start
// returns. An error means the request was not sent (the connection is
// broken).
func (c *Conn) start(h *RequestHeader, payload []byte, crc uint32, dst []byte, maxReply int) (Pending, error) {
	cl := callPool.Get().(*call)
	cl.op, cl.dst, cl.maxReply = h.Op, dst, maxReply
	h.ID = c.nextID.Add(1)
	h.PayloadLen = uint32(len(payload))
	h.PayloadCRC = crc

	c.mu.Lock()
	if c.pending == nil {
		err := c.err
		c.mu.Unlock()
		putCall(cl)
		return Pending{}, err
	}
	c.pending[h.ID] = cl // before sending: the reply may beat us back
	c.mu.Unlock()

	if err := c.send(h, payload); err != nil {
		c.fail(err) // completes cl, unless the reader already has
	}
	return Pending{c: c, cl: cl, id: h.ID, op: h.Op}, nil
}

// Wait waits for the reply of a request sent by a Start method and
// returns its result. A cancelled ctx abandons the wait (the server may
// still apply the request), as for the blocking methods.
func (p Pending) Wait(ctx context.Context) error {
	_, err := p.wait(ctx)
	return err
}

func (p Pending) wait(ctx context.Context) ([]byte, error) {
	c, cl := p.c, p.cl
	select {
	case <-cl.done:
	case <-ctx.Done():
		if c.abandon(p.id) {
			putCall(cl)
			return nil, ctx.Err()
		}
		// The reader has claimed the call and is receiving its reply,
		// perhaps into dst: wait for it, but not for ever.
		t := time.NewTimer(c.timeout)
		select {
		case <-cl.done:
			t.Stop()
		case <-t.C:
			c.fail(fmt.Errorf("reply to %v %d stalled", p.op, p.id))
			<-cl.done
		}
	}
	reply, err := cl.reply, cl.err
	putCall(cl)
	return reply, err
}

// abandon forgets a pending call so its late reply will be dropped. It
// reports false if the reader (or fail) has already claimed the call.
func (c *Conn) abandon(id uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.pending[id]; !ok {
		return false
	}
	delete(c.pending, id)
	return true
}

// send queues one frame for the connection's writer.
func (c *Conn) send(h *RequestHeader, payload []byte) error {
	return c.w.write(frameHeader{req: h}, payload)
}

// fail breaks the connection once: it closes the socket and completes
// every pending call with an error wrapping ErrDisconnected.
func (c *Conn) fail(cause error) {
	c.mu.Lock()
	if c.pending == nil {
		c.mu.Unlock()
		return
	}
	c.err = fmt.Errorf("%w: %v", ErrDisconnected, cause)
	pending := c.pending
	c.pending = nil
	c.mu.Unlock()
	c.nc.Close()
	c.w.close()
	close(c.broken)
	for _, cl := range pending {
		cl.err = c.err
		cl.done <- struct{}{}
	}
}

// readLoop receives replies and completes their calls until the stream
// fails.
func (c *Conn) readLoop() {
	defer close(c.readerDone)
	var hb [ReplyHeaderSize]byte
	for {
		if _, err := io.ReadFull(c.br, hb[:]); err != nil {
			c.fail(err)
			return
		}
		h, err := DecodeReplyHeader(hb[:])
		if err == nil && h.PayloadLen > MaxPayload {
			err = fmt.Errorf("wire: reply payload of %d bytes exceeds %d: %w", h.PayloadLen, MaxPayload, ErrProtocol)
		}
		if err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		cl := c.pending[h.ID]
		delete(c.pending, h.ID)
		c.mu.Unlock()
		if cl == nil { // abandoned by a cancelled caller
			if _, err := c.br.Discard(int(h.PayloadLen)); err != nil {
				c.fail(err)
				return
			}
			continue
		}
		if err := c.receive(cl, &h); err != nil {
			c.fail(err)
			cl.err = c.Err()
			cl.done <- struct{}{}
			return
		}
		cl.done <- struct{}{}
	}
}

// receive reads a claimed call's reply payload and sets its result. It
// returns an error only if the stream failed; a reply that does not fit
// its call fails just that call (its payload is skipped, the stream stays
// in sync).
func (c *Conn) receive(cl *call, h *ReplyHeader) error {
	n := int(h.PayloadLen)
	if h.Status == StatusOK && cl.dst != nil {
		if n != len(cl.dst) {
			cl.err = fmt.Errorf("wire: %v reply of %d bytes, want %d: %w", cl.op, n, len(cl.dst), ErrProtocol)
			_, err := c.br.Discard(n)
			return err
		}
		if _, err := io.ReadFull(c.br, cl.dst); err != nil {
			return err
		}
		if Checksum(cl.dst) != h.PayloadCRC {
			cl.err = fmt.Errorf("wire: %v reply data: %w", cl.op, ErrChecksum)
		}
		return nil
	}
	limit := cl.maxReply
	if h.Status != StatusOK {
		limit = MaxMessage
	}
	if n > limit {
		cl.err = fmt.Errorf("wire: %v reply (%v) of %d bytes exceeds %d: %w", cl.op, h.Status, n, limit, ErrProtocol)
		_, err := c.br.Discard(n)
		return err
	}
	var p []byte
	if n > 0 {
		p = make([]byte, n)
		if _, err := io.ReadFull(c.br, p); err != nil {
			return err
		}
	}
	switch {
	case Checksum(p) != h.PayloadCRC:
		cl.err = fmt.Errorf("wire: %v reply: %w", cl.op, ErrChecksum)
	case h.Status != StatusOK:
		cl.err = &RemoteError{Op: cl.op, Status: h.Status, Msg: string(p)}
	default:
		cl.reply = p
	}
	return nil
}
