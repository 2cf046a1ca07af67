package wire

import (
	"net"
	"runtime"
	"sync"
	"time"
)

// directWrite is the payload size above which a frame is written straight
// to the socket (writev of header and payload) instead of being copied
// into a batch.
const directWrite = 64 << 10

// maxSpare bounds the batch buffer kept for reuse between writes.
const maxSpare = 4 << 20

// frameWriter serialises frames onto a connection and batches them, with
// no goroutine of its own. Small frames are copied into a queue. The
// writer whose frame lands in an empty queue leads the batch: it yields
// once, so that goroutines already runnable (the workers of one burst of
// requests, the callers woken by one burst of replies) can queue theirs,
// then takes the write lock and writes the whole queue in one system
// call. Frames queued while a leader is writing start the next batch.
// Large frames are written directly, between batches.
//
// A frame queued behind a leader is on the wire once the leader's write
// returns; so when every goroutine that called write has returned, every
// frame has been written (or the connection has failed).
//
// The first write error is reported once through onError, which is
// expected to close the connection; every later write fails.
type frameWriter struct {
	nc      net.Conn
	timeout time.Duration
	onError func(error)

	qmu sync.Mutex
	q   []byte // guarded by qmu: frames waiting for their leader
	err error  // guarded by qmu: the first write error, or net.ErrClosed

	wmu     sync.Mutex // serialises writes to nc
	spare   []byte     // guarded by wmu: the last batch's buffer, for reuse
	renewAt time.Time  // guarded by wmu: when to push the write deadline on
	hdr     [RequestHeaderSize]byte
}

func newFrameWriter(nc net.Conn, timeout time.Duration, onError func(error)) *frameWriter {
	return &frameWriter{nc: nc, timeout: timeout, onError: onError}
}

// frameHeader is the header of a frame to write: a request or a reply.
// Headers are encoded straight into the writer's buffers, because the
// checksum would make a caller's stack buffer escape.
type frameHeader struct {
	req *RequestHeader
	rep *ReplyHeader
}

func (f frameHeader) appendTo(b []byte) []byte {
	if f.req != nil {
		return f.req.AppendTo(b)
	}
	return f.rep.AppendTo(b)
}

// close makes every later write fail with net.ErrClosed; queued frames
// are dropped. The caller closes the connection.
func (w *frameWriter) close() {
	w.qmu.Lock()
	if w.err == nil {
		w.err = net.ErrClosed
	}
	w.q = nil
	w.qmu.Unlock()
}

// write sends one frame: hdr then payload. Neither is retained after
// write returns. An error means the connection has failed.
func (w *frameWriter) write(hdr frameHeader, payload []byte) error {
	if len(payload) > directWrite {
		return w.writeDirect(hdr, payload)
	}
	w.qmu.Lock()
	if w.err != nil {
		err := w.err
		w.qmu.Unlock()
		return err
	}
	lead := len(w.q) == 0
	w.q = hdr.appendTo(w.q)
	w.q = append(w.q, payload...)
	w.qmu.Unlock()
	if !lead {
		return nil
	}
	runtime.Gosched() // let runnable writers join this batch
	return w.flush()
}

// flush writes whatever is queued.
func (w *frameWriter) flush() error {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.qmu.Lock()
	batch, err := w.q, w.err
	w.q, w.spare = w.spare[:0], nil
	w.qmu.Unlock()
	if err != nil {
		return err
	}
	if len(batch) == 0 {
		return nil
	}
	if err := w.deadlineLocked(); err != nil {
		return w.fail(err)
	}
	if _, err := w.nc.Write(batch); err != nil {
		return w.fail(err)
	}
	if cap(batch) <= maxSpare {
		w.spare = batch[:0]
	}
	return nil
}

func (w *frameWriter) writeDirect(hdr frameHeader, payload []byte) error {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.qmu.Lock()
	err := w.err
	w.qmu.Unlock()
	if err != nil {
		return err
	}
	bufs := net.Buffers{hdr.appendTo(w.hdr[:0]), payload}
	if err := w.deadlineLocked(); err != nil {
		return w.fail(err)
	}
	if _, err := bufs.WriteTo(w.nc); err != nil {
		return w.fail(err)
	}
	return nil
}

func (w *frameWriter) deadlineLocked() error {
	if now := time.Now(); now.After(w.renewAt) {
		if err := w.nc.SetWriteDeadline(now.Add(w.timeout)); err != nil {
			return err
		}
		w.renewAt = now.Add(w.timeout / 2)
	}
	return nil
}

// fail records the first write error and reports it through onError.
func (w *frameWriter) fail(err error) error {
	w.qmu.Lock()
	first := w.err == nil
	if first {
		w.err = err
	}
	err = w.err
	w.q = nil
	w.qmu.Unlock()
	if first {
		w.onError(err)
	}
	return err
}
