package nbd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"time"
)

// request is one parsed transmission request.
type request struct {
	flags  uint16
	typ    uint16
	handle uint64
	off    uint64
	length uint32
}

// reply is one answer queued for writing. Whoever writes it releases what
// the request held (its slot, its payload bytes, its buffer) once the
// reply is on the wire.
type reply struct {
	handle uint64
	errno  Errno
	data   []byte  // READ payload (only when errno is 0)
	buf    *[]byte // pooled buffer to give back
	cost   int64   // payload bytes held in the budget
}

// zeroes is written for NBD_CMD_WRITE_ZEROES with NBD_CMD_FLAG_NO_HOLE.
// Never modified.
var zeroes = make([]byte, 1<<20)

// transmit serves requests until the client disconnects or the stream
// breaks. One goroutine (this one) reads requests; each request runs in
// its own goroutine, at most MaxInFlight at once and MaxInFlightBytes of
// payload, and writes its own reply (see send), so replies go out in
// completion order.
func (c *conn) transmit(exp *Export, log *slog.Logger) error {
	t := &transmission{
		c: c, exp: exp, log: log,
		slots: newBudget(int64(c.s.cfg.MaxInFlight)),
		bytes: newBudget(c.s.cfg.MaxInFlightBytes),
	}
	t.werr = c.bw.Flush() // replies bypass bw: nothing of the handshake may stay behind

	err := t.readRequests()
	if err != nil && c.isDraining() && errors.Is(err, os.ErrDeadlineExceeded) {
		err = nil // drained in the middle of a request: dropped unanswered
	}
	// Requests in flight are answered before the connection closes, after
	// NBD_CMD_DISC as after a broken stream (their replies may still
	// reach a client that only half-closed).
	t.workers.Wait() // and so every reply has been written (send)
	if err == nil && t.werr != nil {
		err = t.werr
	}
	return err
}

type transmission struct {
	c   *conn
	exp *Export
	log *slog.Logger

	slots   *budget // requests in flight
	bytes   *budget // payload bytes in flight
	workers sync.WaitGroup

	qmu     sync.Mutex
	queue   []reply // guarded by qmu: replies waiting to be written (send)
	writing bool    // guarded by qmu: a goroutine is writing replies
	spare   []reply // guarded by qmu: the last batch's slice, for reuse

	// Owned by the goroutine writing replies (send).
	werr error       // the first write error
	hdrs []byte      // the batch's reply headers
	iov  net.Buffers // the batch's headers and payloads
}

// readRequests reads requests until NBD_CMD_DISC (nil), a drain (nil), the
// client closing between requests (nil), or a broken stream (error).
func (t *transmission) readRequests() error {
	var hdr [requestHeaderLen]byte
	maxPayload := t.c.s.cfg.MaxPayload
	for {
		if err := t.awaitRequest(); err != nil {
			switch {
			case t.c.isDraining() && errors.Is(err, os.ErrDeadlineExceeded):
				return nil
			case errors.Is(err, io.EOF):
				return nil // closed between requests (a hard disconnect, but a clean one)
			}
			return err
		}
		if _, err := io.ReadFull(t.c.br, hdr[:]); err != nil {
			switch {
			case t.c.isDraining() && errors.Is(err, os.ErrDeadlineExceeded):
				return nil
			case errors.Is(err, io.EOF):
				return nil // closed between requests (a hard disconnect, but a clean one)
			}
			return t.frameErr(err)
		}
		if m := binary.BigEndian.Uint32(hdr[0:]); m != magicRequest {
			return fmt.Errorf("%w: bad request magic %#x", ErrProtocol, m)
		}
		r := request{
			flags:  binary.BigEndian.Uint16(hdr[4:]),
			typ:    binary.BigEndian.Uint16(hdr[6:]),
			handle: binary.BigEndian.Uint64(hdr[8:]),
			off:    binary.BigEndian.Uint64(hdr[16:]),
			length: binary.BigEndian.Uint32(hdr[24:]),
		}

		var cost int64
		var buf *[]byte
		switch {
		case r.typ == cmdDisc:
			return nil
		case r.typ == cmdWrite && r.length > maxPayload:
			// The payload follows whatever we answer: skip it (without
			// holding it) to keep the stream in step, then refuse.
			if _, err := io.CopyN(io.Discard, t.c.br, int64(r.length)); err != nil {
				return t.frameErr(err)
			}
			t.slots.acquire(1)
			t.refuse(reply{handle: r.handle, errno: EINVAL})
			continue
		case r.typ == cmdWrite:
			cost = int64(r.length)
			t.slots.acquire(1)
			t.bytes.acquire(cost)
			if r.length > 0 {
				var err error
				if buf, err = t.readPayload(int(r.length)); err != nil {
					t.bytes.release(cost)
					t.slots.release(1)
					return t.frameErr(err)
				}
			}
		case r.typ == cmdRead && r.length <= maxPayload:
			cost = int64(r.length)
			t.slots.acquire(1)
			t.bytes.acquire(cost)
		default:
			t.slots.acquire(1)
		}

		if errno := t.check(r); errno != 0 {
			t.log.Debug("nbd: request refused", "cmd", cmdName(r.typ), "offset", r.off, "length", r.length, "flags", r.flags, "err", errno)
			t.refuse(reply{handle: r.handle, errno: errno, buf: buf, cost: cost})
			continue
		}
		t.workers.Add(1)
		go func() {
			defer t.workers.Done()
			t.send(t.do(r, buf, cost))
		}()
	}
}

// awaitRequest waits for the first byte of the next request. On a
// connection from Serve it waits at most IdleTimeout (if set) while
// nothing is in flight, and then gives the whole request FrameTimeout to
// arrive.
func (t *transmission) awaitRequest() error {
	cfg := &t.c.s.cfg
	if !t.c.accepted {
		return nil
	}
	for t.c.br.Buffered() == 0 {
		idle := cfg.IdleTimeout > 0 && t.slots.held() == 0
		var deadline time.Time
		if idle {
			deadline = time.Now().Add(cfg.IdleTimeout)
		}
		t.c.setReadDeadline(deadline)
		_, err := t.c.br.Peek(1)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) || t.c.isDraining() {
			return err
		}
		if t.slots.held() == 0 {
			t.log.Info("nbd: idle connection; closing it", "idle", cfg.IdleTimeout)
			return fmt.Errorf("nbd: idle for %v: %w", cfg.IdleTimeout, ErrProtocol)
		}
	}
	if cfg.FrameTimeout > 0 {
		t.c.setReadDeadline(time.Now().Add(cfg.FrameTimeout))
	}
	return nil
}

// frameErr describes a failure to read the rest of a request.
func (t *transmission) frameErr(err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) && !t.c.isDraining() {
		return fmt.Errorf("nbd: request not received within %v: %w", t.c.s.cfg.FrameTimeout, err)
	}
	return err
}

// fillChunk is the step by which a large WRITE payload is received: its
// whole buffer is taken only once half of it has arrived, so a client
// that announces a large write and stalls holds (and costs the server's
// MaxMemory) about what it really sent.
const fillChunk = 256 << 10

// readPayload reads a WRITE's n payload bytes into a buffer of length n
// from the pool, charging MaxMemory for every buffer it holds. Time spent
// waiting for memory does not count against the client's FrameTimeout;
// each wait is bounded by a FrameTimeout of its own (getFrameBuf). On a
// socket pair the payload goes straight into its whole buffer: the peer
// there is the kernel, which sends whole requests, so the chunked fill
// (and its copy of half the payload) would guard against nothing.
func (t *transmission) readPayload(n int) (*[]byte, error) {
	refresh := func() {
		if t.c.accepted && t.c.s.cfg.FrameTimeout > 0 {
			t.c.setReadDeadline(time.Now().Add(t.c.s.cfg.FrameTimeout))
		}
	}
	if n <= fillChunk || !t.c.accepted {
		buf, err := t.getFrameBuf(n)
		if err != nil {
			return nil, err
		}
		refresh()
		if _, err := io.ReadFull(t.c.br, *buf); err != nil {
			t.putBuf(buf)
			return nil, err
		}
		return buf, nil
	}
	var chunks []*[]byte
	defer func() {
		for _, ch := range chunks {
			t.putBuf(ch)
		}
	}()
	have := 0
	for have < n/2 {
		ch, err := t.getFrameBuf(fillChunk)
		if err != nil {
			return nil, err
		}
		chunks = append(chunks, ch)
		refresh()
		k := min(fillChunk, n-have)
		if _, err := io.ReadFull(t.c.br, (*ch)[:k]); err != nil {
			return nil, err
		}
		have += k
	}
	buf, err := t.getFrameBuf(n)
	if err != nil {
		return nil, err
	}
	refresh()
	at := 0
	for _, ch := range chunks {
		at += copy((*buf)[at:have], *ch)
	}
	if _, err := io.ReadFull(t.c.br, (*buf)[have:]); err != nil {
		t.putBuf(buf)
		return nil, err
	}
	return buf, nil
}

// getBuf takes a pooled buffer of length n, waiting for its size in the
// server's MaxMemory; it fails only when the server closes.
func (t *transmission) getBuf(n int) (*[]byte, error) {
	if err := t.c.s.mem.Acquire(t.c.s.ctx, int64(bufSize(n))); err != nil {
		return nil, ErrServerClosed
	}
	return getBuf(n), nil
}

// getFrameBuf is getBuf for the reader, which may already hold part of a
// WRITE: on a connection from Serve it waits at most FrameTimeout, so that
// readers holding chunks and waiting for each other's memory cannot wait
// forever (the one that gives up is dropped and frees what it held).
// Socket pairs wait as long as it takes: their peer, the kernel, sends
// whole requests, so every holder makes progress.
func (t *transmission) getFrameBuf(n int) (*[]byte, error) {
	ctx := t.c.s.ctx
	if t.c.accepted && t.c.s.cfg.FrameTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t.c.s.cfg.FrameTimeout)
		defer cancel()
	}
	if err := t.c.s.mem.Acquire(ctx, int64(bufSize(n))); err != nil {
		if t.c.s.ctx.Err() != nil {
			return nil, ErrServerClosed
		}
		t.log.Warn("nbd: no payload memory within the frame timeout; closing connection", "timeout", t.c.s.cfg.FrameTimeout, "max_memory", t.c.s.cfg.MaxMemory)
		return nil, fmt.Errorf("%w: no payload memory (MaxMemory %d bytes) within %v", ErrServerBusy, t.c.s.cfg.MaxMemory, t.c.s.cfg.FrameTimeout)
	}
	return getBuf(n), nil
}

// putBuf gives back a buffer from t.getBuf and its share of MaxMemory.
func (t *transmission) putBuf(b *[]byte) {
	if b == nil {
		return
	}
	n := cap(*b)
	putBuf(b)
	t.c.s.mem.Release(int64(n))
}

// check validates a request against the export before any device call.
func (t *transmission) check(r request) Errno {
	allowed := cmdFlagFUA // valid on every command (clients set it on all)
	if r.typ == cmdWriteZeroes {
		allowed |= cmdFlagNoHole
	}
	if r.flags&^allowed != 0 {
		return EINVAL
	}
	write := false
	switch r.typ {
	case cmdFlush:
		return 0
	case cmdRead:
		if r.length > t.c.s.cfg.MaxPayload {
			return EINVAL
		}
	case cmdWrite, cmdWriteZeroes, cmdTrim:
		write = r.typ != cmdTrim
		if t.exp.ReadOnly {
			return EPERM
		}
	default:
		// NBD_CMD_CACHE and NBD_CMD_BLOCK_STATUS are not advertised (and
		// BLOCK_STATUS needs structured replies); the protocol asks for
		// EINVAL for commands the server does not know or offer.
		return EINVAL
	}
	bs := uint64(t.exp.MinBlockSize)
	if r.off%bs != 0 || uint64(r.length)%bs != 0 {
		return EINVAL
	}
	size := t.exp.Device.Size()
	if r.off > size || uint64(r.length) > size-r.off {
		if write {
			return ENOSPC // the protocol's choice for writes past the end
		}
		return EINVAL
	}
	return 0
}

// do runs a checked request on the device and returns its reply.
func (t *transmission) do(r request, buf *[]byte, cost int64) reply {
	rep := reply{handle: r.handle, buf: buf, cost: cost}
	ctx := t.c.s.ctx
	dev := t.exp.Device
	off, n := int64(r.off), int64(r.length)
	fua := r.flags&cmdFlagFUA != 0
	var err error
	switch r.typ {
	case cmdRead:
		if n > 0 {
			if rep.buf, err = t.getBuf(int(n)); err == nil {
				if err = dev.ReadAt(ctx, *rep.buf, off); err == nil {
					rep.data = *rep.buf
				}
			}
		}
	case cmdWrite:
		if n > 0 {
			err = dev.WriteAt(ctx, *buf, off, fua)
		}
	case cmdWriteZeroes:
		switch {
		case n == 0:
		case r.flags&cmdFlagNoHole != 0:
			// Allocate: write real zeroes rather than punch a hole.
			for done := int64(0); done < n && err == nil; {
				k := min(n-done, int64(len(zeroes)))
				err = dev.WriteAt(ctx, zeroes[:k], off+done, fua)
				done += k
			}
		default:
			err = dev.WriteZeroes(ctx, off, n, fua)
		}
	case cmdTrim:
		if n > 0 {
			err = dev.Trim(ctx, off, n)
			if err == nil && fua {
				err = dev.Flush(ctx)
			}
		}
	case cmdFlush:
		err = dev.Flush(ctx)
	}
	if err != nil {
		rep.errno = errnoOf(err)
		args := []any{"cmd", cmdName(r.typ), "offset", r.off, "length", r.length, "errno", uint32(rep.errno), "err", err}
		if rep.errno == EINVAL {
			t.log.Debug("nbd: device refused request", args...)
		} else {
			t.c.s.errlog.log(t.log, "nbd: device error", args...)
		}
	}
	return rep
}

// refuse sends the reply to a request the reader refused, from a goroutine
// of its own: the reader must never wait for the client to read a reply
// (it may become the writer in send), since the client may be blocked
// sending it the next request.
func (t *transmission) refuse(rep reply) {
	t.workers.Add(1)
	go func() {
		defer t.workers.Done()
		t.send(rep)
	}()
}

// send writes one reply, batched with the replies of other requests that
// complete at the same time, without a goroutine of its own and without
// ever waiting for another writer: the reply is queued, and the request
// whose reply lands in a queue nobody is writing becomes the writer. When
// other requests are in flight it yields once, so that request goroutines
// already runnable (the completions of one burst of replica replies) can
// queue theirs (alone, at queue depth 1, a yield only costs latency); then
// it writes the whole queue in one system call (writev of every header
// and READ payload), releases what each request held, and goes on while
// more replies were queued meanwhile. So when every goroutine that called
// send has returned, every reply has been written (or the connection has
// failed).
//
// After a write error the connection is closed (so the reader stops) and
// later replies are only released.
func (t *transmission) send(rep reply) {
	t.qmu.Lock()
	t.queue = append(t.queue, rep)
	if t.writing {
		t.qmu.Unlock()
		return
	}
	t.writing = true
	t.qmu.Unlock()
	if t.slots.held() > 1 {
		runtime.Gosched() // let runnable request goroutines join this batch
	}
	for {
		t.qmu.Lock()
		batch := t.queue
		if len(batch) == 0 {
			t.writing = false
			t.qmu.Unlock()
			return
		}
		t.queue, t.spare = t.spare[:0], nil
		t.qmu.Unlock()
		t.write(batch)
	}
}

// write writes a batch of replies and releases what they held; only the
// goroutine that set t.writing calls it.
func (t *transmission) write(batch []reply) {
	if t.werr == nil {
		t.hdrs = t.hdrs[:0]
		for _, rep := range batch {
			t.hdrs = binary.BigEndian.AppendUint32(t.hdrs, magicSimpleReply)
			t.hdrs = binary.BigEndian.AppendUint32(t.hdrs, uint32(rep.errno))
			t.hdrs = binary.BigEndian.AppendUint64(t.hdrs, rep.handle)
		}
		// One buffer per run of headers, each READ payload its own.
		iov, from := t.iov[:0], 0
		for i, rep := range batch {
			if rep.errno == 0 && len(rep.data) > 0 {
				to := (i + 1) * replyHeaderLen
				iov = append(iov, t.hdrs[from:to], rep.data)
				from = to
			}
		}
		if from < len(t.hdrs) {
			iov = append(iov, t.hdrs[from:])
		}
		t.iov = iov
		if _, err := iov.WriteTo(t.c.nc); err != nil {
			t.werr = err
			t.c.nc.Close()
		}
		clear(t.iov[:cap(t.iov)]) // WriteTo consumed iov; drop the payload references
	}
	for i, rep := range batch {
		t.putBuf(rep.buf)
		t.bytes.release(rep.cost)
		t.slots.release(1)
		batch[i] = reply{}
	}
	t.qmu.Lock()
	t.spare = batch[:0]
	t.qmu.Unlock()
}
