package jepsen

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"github.com/stor-io/stor/nbd"
	"github.com/stor-io/stor/replica/engine"
)

// Several connections with concurrent flushes, as a multi-conn NBD client
// (the kernel's nbd driver with several sockets, qemu-nbd) drives a
// volume: the client process serves its engine as an NBD export, as
// stor-ctl nbd serve does (nbd.Server, which advertises
// NBD_FLAG_CAN_MULTI_CONN), over NBDConns connections of its own (socket
// pairs in the process, the transmission phase only: ServeTransmission).
// A request with Conn n > 0 goes over connection n as an NBD command; the
// server runs each connection's commands concurrently, so the engine sees
// several flushes in flight at once, from different connections, with
// writes between them. The workers call the engine directly; the
// flush-storm nemesis drives the NBD connections.

// NBDConns is the number of NBD connections each client process serves
// its engine over.
const NBDConns = 4

const nbdExport = "jepsen"

// NBD transmission wire (NetworkBlockDevice/nbd doc/proto.md).
const (
	nbdRequestMagic = 0x25609513
	nbdReplyMagic   = 0x67446698
	nbdCmdRead      = 0
	nbdCmdWrite     = 1
	nbdCmdFlush     = 3
)

// nbdConns are the NBD connections of one engine.
type nbdConns struct {
	srv   *nbd.Server
	conns []*nbdConn
}

// serveNBD serves d (the engine) over NBDConns in-process connections.
func serveNBD(d nbd.Device, log *slog.Logger) (*nbdConns, error) {
	srv, err := nbd.NewServer(nbd.Config{Exports: []nbd.Export{{Name: nbdExport, Device: d}}, Logger: log})
	if err != nil {
		return nil, err
	}
	out := &nbdConns{srv: srv}
	for range NBDConns {
		client, server := net.Pipe()
		go func() { _ = srv.ServeTransmission(context.Background(), server, nbdExport) }()
		out.conns = append(out.conns, newNBDConn(client))
	}
	return out, nil
}

// close ends every connection (requests in flight are answered first, as
// by nbd.Server.Close).
func (c *nbdConns) close() {
	if c == nil {
		return
	}
	_ = c.srv.Close()
	for _, n := range c.conns {
		n.nc.Close()
	}
}

// call sends req (write, read or flush) over connection req.Conn and
// returns a read's data.
func (c *nbdConns) call(ctx context.Context, req Request) ([]byte, error) {
	if c == nil || req.Conn < 1 || req.Conn > len(c.conns) {
		return nil, fmt.Errorf("client: no NBD connection %d", req.Conn)
	}
	n := c.conns[req.Conn-1]
	switch req.Op {
	case "write":
		_, err := n.do(ctx, nbdCmdWrite, req.Off, uint32(len(req.Data)), req.Data)
		return nil, err
	case "read":
		return n.do(ctx, nbdCmdRead, req.Off, uint32(req.Len), nil)
	case "flush":
		_, err := n.do(ctx, nbdCmdFlush, 0, 0, nil)
		return nil, err
	}
	return nil, fmt.Errorf("client: op %q does not go over NBD", req.Op)
}

// nbdConn is the client end of one NBD connection: requests are sent
// under wmu and answered in any order, matched by handle.
type nbdConn struct {
	nc  net.Conn
	wmu sync.Mutex

	mu     sync.Mutex // guards the fields below
	next   uint64
	pend   map[uint64]*nbdPending
	broken error
}

type nbdPending struct {
	readLen uint32
	done    chan nbdReply
}

type nbdReply struct {
	errno uint32
	data  []byte
	err   error
}

var errNBDClosed = errors.New("jepsen: NBD connection closed")

func newNBDConn(nc net.Conn) *nbdConn {
	c := &nbdConn{nc: nc, pend: map[uint64]*nbdPending{}}
	go c.readReplies()
	return c
}

func (c *nbdConn) readReplies() {
	var hdr [16]byte
	fail := func(err error) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.broken = err
		for h, p := range c.pend {
			p.done <- nbdReply{err: err}
			delete(c.pend, h)
		}
	}
	for {
		if _, err := io.ReadFull(c.nc, hdr[:]); err != nil {
			fail(fmt.Errorf("%w: %v", errNBDClosed, err))
			return
		}
		if binary.BigEndian.Uint32(hdr[0:]) != nbdReplyMagic {
			fail(fmt.Errorf("jepsen: bad NBD reply magic %#x", binary.BigEndian.Uint32(hdr[0:])))
			return
		}
		errno, handle := binary.BigEndian.Uint32(hdr[4:]), binary.BigEndian.Uint64(hdr[8:])
		c.mu.Lock()
		p := c.pend[handle]
		delete(c.pend, handle)
		c.mu.Unlock()
		if p == nil {
			fail(fmt.Errorf("jepsen: NBD reply to unknown handle %d", handle))
			return
		}
		r := nbdReply{errno: errno}
		if errno == 0 && p.readLen > 0 {
			r.data = make([]byte, p.readLen)
			if _, err := io.ReadFull(c.nc, r.data); err != nil {
				p.done <- nbdReply{err: err}
				fail(fmt.Errorf("%w: %v", errNBDClosed, err))
				return
			}
		}
		p.done <- r
	}
}

// do sends one command and waits for its reply or ctx. A command whose
// reply never comes (ctx ended) stays pending until the connection ends.
func (c *nbdConn) do(ctx context.Context, cmd uint16, off int64, length uint32, data []byte) ([]byte, error) {
	p := &nbdPending{done: make(chan nbdReply, 1)}
	if cmd == nbdCmdRead {
		p.readLen = length
	}
	c.mu.Lock()
	if c.broken != nil {
		err := c.broken
		c.mu.Unlock()
		return nil, err
	}
	c.next++
	handle := c.next
	c.pend[handle] = p
	c.mu.Unlock()
	msg := make([]byte, 28, 28+len(data))
	binary.BigEndian.PutUint32(msg[0:], nbdRequestMagic)
	binary.BigEndian.PutUint16(msg[6:], cmd)
	binary.BigEndian.PutUint64(msg[8:], handle)
	binary.BigEndian.PutUint64(msg[16:], uint64(off))
	binary.BigEndian.PutUint32(msg[24:], length)
	msg = append(msg, data...)
	c.wmu.Lock()
	_ = c.nc.SetWriteDeadline(time.Now().Add(10 * time.Second))
	_, err := c.nc.Write(msg)
	c.wmu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errNBDClosed, err)
	}
	select {
	case r := <-p.done:
		switch {
		case r.err != nil:
			return nil, r.err
		case r.errno != 0:
			return nil, fmt.Errorf("nbd: errno %d", r.errno)
		}
		return r.data, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// fill writes n bytes of filler at off (a pattern that is never zero, so
// that the replicas allocate it), 1 MiB at a time.
func fill(ctx context.Context, e *engine.Engine, off int64, n int) error {
	buf := make([]byte, min(n, 1<<20))
	for i := range buf {
		buf[i] = byte(i%251) + 1
	}
	for n > 0 {
		l := min(n, len(buf))
		if err := e.WriteAt(ctx, buf[:l], off, false); err != nil {
			return err
		}
		off, n = off+int64(l), n-l
	}
	return e.Flush(ctx)
}

// flushStorm is the multi-conn workload as a fault: for a few seconds
// every NBD connection of the active engine writes a register and
// flushes, back to back, so that several flushes are in flight at once
// with writes between them (each recorded like a worker's operation;
// half of them to the cold registers); in
// one storm of two the engine is killed with SIGKILL in the middle of it,
// flushes in flight, while one server's link lags, and what that link
// holds at the kill is cut (an unclean stop: a flush that cleared a dirty
// region on some replicas while a write to it never reached another is
// what reconcile must not miss). Heal reopens the engine if it was killed.
type flushStorm struct{}

func (flushStorm) Name() string { return "flush-storm" }

func (flushStorm) Inject(ctx context.Context, r *runner, rng *rand.Rand) (string, error) {
	ch := r.active()
	if s, _ := ch.Session(); s == nil {
		return "", errors.New("no client process")
	}
	dur := time.Duration(2000+rng.IntN(2000)) * time.Millisecond
	kill := rng.IntN(2) == 0
	killAfter := time.Duration(500+rng.IntN(int(dur/time.Millisecond)-500)) * time.Millisecond
	// In a storm that ends in a kill, one server's link lags, so that
	// writes are in flight on it alone when the engine dies: what the
	// others hold and a flush cleared is then what reconcile must find.
	var slow *Server
	if kill {
		slow = r.c.Servers[rng.IntN(len(r.c.Servers))]
		if err := slow.ProxyCommand("delay 20 30"); err != nil {
			return "", err
		}
		defer func() { _ = slow.ProxyCommand("ok") }()
	}
	sctx, cancel := context.WithTimeout(ctx, dur)
	defer cancel()
	seeds := make([]uint64, NBDConns)
	for i := range seeds {
		seeds[i] = rng.Uint64()
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	flushes, inFlight, maxInFlight := 0, 0, 0
	coldSince := make([]time.Time, NBDConns) // per connection: when its cold write in flight was called (zero: none)
	for i := range NBDConns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wrng := rand.New(rand.NewPCG(seeds[i], 0))
			client := r.cfg.Workers + 2 + i
			for sctx.Err() == nil {
				// Half the writes go to the cold registers, where a
				// replica left without one after the kill stays different
				// from the others (a hot register is soon written again).
				b := wrng.IntN(int(r.blocks.Load()))
				if r.cfg.ColdBlocks > 0 && wrng.IntN(2) == 0 {
					b = r.cfg.Blocks - 1 - wrng.IntN(r.cfg.ColdBlocks)
				}
				if r.cold(b) {
					mu.Lock()
					coldSince[i] = time.Now()
					mu.Unlock()
				}
				r.doConn(sctx, client, ch, "write", b, i+1)
				mu.Lock()
				coldSince[i] = time.Time{}
				inFlight++
				maxInFlight = max(maxInFlight, inFlight)
				mu.Unlock()
				o := r.doConn(sctx, client, ch, "flush", 0, i+1)
				mu.Lock()
				inFlight--
				if o.OK {
					flushes++
				}
				mu.Unlock()
				if !o.OK {
					sleep(sctx, 100*time.Millisecond)
				}
			}
		}()
	}
	desc := ""
	var killedEpoch uint64 // the epoch of the engine killed
	if kill {
		sleep(sctx, killAfter)
		// Stop when a cold write has been in flight for 8-18 ms (up to a
		// second): on the fast replicas by then, and still held by the
		// slow link (20-50 ms). That is the write the cut keeps from
		// one replica, in a register nothing writes until the look after
		// the reconcile.
		held := false
		for wait := time.Now().Add(time.Second); !held && time.Now().Before(wait) && sctx.Err() == nil; {
			mu.Lock()
			for _, since := range coldSince {
				age := time.Since(since)
				held = held || (!since.IsZero() && age >= 8*time.Millisecond && age <= 18*time.Millisecond)
			}
			mu.Unlock()
			if !held {
				time.Sleep(time.Millisecond)
			}
		}
		mu.Lock()
		n := inFlight
		mu.Unlock()
		// What the slow link holds of the engine's writes is cut, not
		// delivered late: those writes reached the other replicas and
		// never reach this one (a delay alone delivers them before the
		// next engine fences it, and the replicas end the same). The
		// engine is stopped (SIGSTOP) first, so that it cannot see its
		// connection drop and record the replica faulty, and killed
		// after. The cut drops only the connections open now (the Raft
		// ones reconnect; the next engine's are slow, as before).
		_, killedEpoch = ch.Session()
		if err := ch.Proc.Pause(); err != nil {
			return "", err
		}
		if err := slow.ProxyCommand("cut"); err != nil {
			r.c.KillClient(ch) // never left stopped
			return "", err
		}
		r.c.KillClient(ch)
		// The storm ends with the kill: writes after it would cover what
		// the kill left in the cold registers before the look at the
		// replicas after the reconcile (checkColdAfterReconcile).
		cancel()
		if n > 1 {
			r.hit("flush-storm: engine killed with several flushes in flight")
		}
		if held {
			r.hit("flush-storm: engine killed with a cold write held by the slow link")
		}
		desc = fmt.Sprintf("; the engine stopped after %v with %d flushes in flight (a cold write 8-18 ms in flight: %v), what %s's link (delayed 20-50 ms) held of its writes cut, and the engine killed -9", killAfter, n, held, slow.ID)
	}
	wg.Wait()
	if maxInFlight > 1 {
		r.hit("flush-storm: several flushes in flight")
	}
	if kill {
		desc += r.checkColdAfterReconcile(ctx, ch, killedEpoch)
	}
	return fmt.Sprintf("%d NBD connections on %s wrote and flushed for %v: %d flushes acknowledged, up to %d in flight at once%s",
		NBDConns, ch.Host.Name, dur, flushes, maxInFlight, desc), nil
}

func (flushStorm) Heal(ctx context.Context, r *runner) error { return killClient{}.Heal(ctx, r) }

// reconcileLook bounds the wait for the engine to reopen after a kill.
const reconcileLook = 30 * time.Second

// checkColdAfterReconcile waits (up to reconcileLook) for an engine
// opened on ch after the one killed at epoch killed: ch's epoch is set
// only once an open returned, its reconcile done (a session alone is not
// enough: a process is started before its open, and stays after one that
// failed). Then it reads the cold registers from every HEALTHY replica
// (ops "reconcile-read" of a new Round, checkReconciledReplicasAgree):
// the storm is over, and nothing else writes them now. It returns what it
// did, for the fault's description.
func (r *runner) checkColdAfterReconcile(ctx context.Context, ch *ClientHost, killed uint64) string {
	deadline := time.Now().Add(reconcileLook)
	for {
		if s, epoch := ch.Session(); s != nil && epoch > killed {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Sprintf("; no engine opened after the kill within %v: replicas not compared", reconcileLook)
		}
		if err := (killClient{}).Heal(ctx, r); err != nil {
			sleep(ctx, time.Second)
		}
		sleep(ctx, 100*time.Millisecond)
	}
	v, err := r.volume(ctx)
	if err != nil {
		return fmt.Sprintf("; replicas not compared: %v", err)
	}
	r.looks++
	round := r.looks
	if err := r.readHealthyReplicas(ctx, v, "reconcile-read", round, r.cold); err != nil {
		return fmt.Sprintf("; cold registers not read after the reconcile: %v", err)
	}
	r.hit("flush-storm: replicas compared after the reconcile")
	return fmt.Sprintf("; the cold registers read from the %d HEALTHY replicas after the reopen (look %d)", len(healthy(v)), round)
}
