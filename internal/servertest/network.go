package servertest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Network is the fault seam between in-process servers: every
// server-to-server connection is dialed through it, so it can refuse new
// connections across a cut and close the ones that exist. Connections from
// test clients do not pass through it.
type Network struct {
	mu    sync.Mutex
	owner map[string]int            // listen address -> node index
	cut   map[[2]int]bool           // {from, to} -> no traffic
	ports map[int]map[string]bool   // from -> listen addresses it cannot reach
	conns map[[2]int]map[*conn]bool // open connections per direction
	// stalled pairs pass nothing but stay open (Stall); flowing is
	// closed, and replaced, whenever a stall is lifted.
	stalled map[[2]int]bool
	// stalledPorts are the listen addresses, per dialing node, whose
	// connections pass nothing (StallPort).
	stalledPorts map[int]map[string]bool
	flowing      chan struct{}
	// anyStall is set while stalled or stalledPorts has entries: the
	// common case, no stall, costs a read and a write no lock.
	anyStall atomic.Bool
	// stopped are the nodes not running (SetStopped).
	stopped map[int]bool
}

// NewNetwork returns a network with no cuts.
func NewNetwork() *Network {
	return &Network{owner: map[string]int{}, cut: map[[2]int]bool{}, ports: map[int]map[string]bool{}, conns: map[[2]int]map[*conn]bool{},
		stalled: map[[2]int]bool{}, stalledPorts: map[int]map[string]bool{}, flowing: make(chan struct{}), stopped: map[int]bool{}}
}

// SetStopped says whether node is stopped. A dial to a stopped node's
// addresses is refused here, as the kernel refuses it, without reaching
// the network: the ports a stopped node released may be another
// process's by then (another test binary's server, which would take this
// cluster's requests).
func (n *Network) SetStopped(node int, stopped bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.stopped[node] = stopped
}

// refusedIfStopped is the error of a dial to addr while its node is
// stopped, or nil.
func (n *Network) refusedIfStopped(network, addr string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if to, known := n.owner[addr]; known && n.stopped[to] {
		return &net.OpError{Op: "dial", Net: network, Err: fmt.Errorf("servertest: node %d is stopped: %w", to, syscall.ECONNREFUSED)}
	}
	return nil
}

// Stall stops all traffic between a and b, both ways, without closing
// anything, as a network that drops packets does: the connections open
// between them stay open and pass nothing (their reads and writes wait),
// and a new one waits in its dial, until Heal.
func (n *Network) Stall(a, b int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.stalled[[2]int{a, b}] = true
	n.stalled[[2]int{b, a}] = true
	n.anyStall.Store(true)
}

// StallPort stops the traffic on the connections from node from to the
// listener at addr (one port of another node: its control port, say)
// without closing them, as Stall does for every port of a pair; the
// other ports of both nodes pass traffic. Heal lifts it. addr must be
// Registered: connections to other addresses pass through untouched.
func (n *Network) StallPort(from int, addr string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stalledPorts[from] == nil {
		n.stalledPorts[from] = map[string]bool{}
	}
	n.stalledPorts[from][addr] = true
	n.anyStall.Store(true)
}

// flow waits while key, or its connection to addr, is stalled: until the stall is lifted (nil), done
// is closed (net.ErrClosed) or the deadline passes (os.ErrDeadlineExceeded),
// as a connection that passes nothing does. deadline, if not nil, returns
// the deadline now (UnixNano, 0 for none) and a channel closed when it is
// next set: a deadline set while flow waits applies, as net.Conn's do.
func (n *Network) flow(key [2]int, addr string, done <-chan struct{}, deadline func() (int64, <-chan struct{})) error {
	for n.anyStall.Load() {
		n.mu.Lock()
		stalled, wake := n.stalled[key] || n.stalledPorts[key[0]][addr], n.flowing
		n.mu.Unlock()
		if !stalled {
			return nil
		}
		var expire <-chan time.Time
		var changed <-chan struct{}
		var timer *time.Timer
		if deadline != nil {
			var at int64
			at, changed = deadline()
			if at != 0 {
				d := time.Until(time.Unix(0, at))
				if d <= 0 {
					return os.ErrDeadlineExceeded
				}
				timer = time.NewTimer(d)
				expire = timer.C
			}
		}
		var err error
		select {
		case <-wake:
		case <-changed:
		case <-done:
			err = net.ErrClosed
		case <-expire:
			err = os.ErrDeadlineExceeded
		}
		if timer != nil {
			timer.Stop()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// isStalled reports whether key, or its connection to addr, is stalled
// now.
func (n *Network) isStalled(key [2]int, addr string) bool {
	if !n.anyStall.Load() {
		return false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stalled[key] || n.stalledPorts[key[0]][addr]
}

// Register says which node listens on addr.
func (n *Network) Register(addr string, node int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.owner[addr] = node
}

// Dialer returns the dial function for node from.
func (n *Network) Dialer(from int) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		n.mu.Lock()
		to, known := n.owner[addr]
		blocked := known && (n.cut[[2]int{from, to}] || n.ports[from][addr])
		n.mu.Unlock()
		if blocked {
			return nil, fmt.Errorf("servertest: %d -> %d is partitioned", from, to)
		}
		if err := n.refusedIfStopped(network, addr); err != nil {
			return nil, err
		}
		key := [2]int{from, to}
		if known && n.flow(key, addr, ctx.Done(), nil) != nil {
			return nil, fmt.Errorf("servertest: %d -> %d is stalled: %w", from, to, ctx.Err())
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil || !known {
			return c, err
		}
		tc := &conn{Conn: c, n: n, key: key, addr: addr, done: make(chan struct{})}
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.cut[key] || n.ports[from][addr] { // cut while dialing
			c.Close()
			return nil, fmt.Errorf("servertest: %d -> %d is partitioned", from, to)
		}
		if n.conns[key] == nil {
			n.conns[key] = map[*conn]bool{}
		}
		n.conns[key][tc] = true
		return tc, nil
	}
}

// Cut stops all traffic between a and b, both ways.
func (n *Network) Cut(a, b int) {
	n.mu.Lock()
	var victims []*conn
	for _, key := range [][2]int{{a, b}, {b, a}} {
		n.cut[key] = true
		for c := range n.conns[key] {
			victims = append(victims, c)
		}
	}
	n.mu.Unlock()
	for _, c := range victims {
		c.Close()
	}
}

// CutPort stops the traffic from node from to the listener at addr (one
// port of another node: its data port, say), leaving that node's other
// ports reachable. Heal lifts it.
func (n *Network) CutPort(from int, addr string) {
	n.mu.Lock()
	if n.ports[from] == nil {
		n.ports[from] = map[string]bool{}
	}
	n.ports[from][addr] = true
	var victims []*conn
	if to, ok := n.owner[addr]; ok {
		for c := range n.conns[[2]int{from, to}] {
			if c.addr == addr {
				victims = append(victims, c)
			}
		}
	}
	n.mu.Unlock()
	for _, c := range victims {
		c.Close()
	}
}

// Isolate cuts node i off from every node in others.
func (n *Network) Isolate(i int, others []int) {
	for _, j := range others {
		if j != i {
			n.Cut(i, j)
		}
	}
}

// Heal removes every cut and stall.
func (n *Network) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.cut)
	clear(n.ports)
	if n.anyStall.Load() {
		clear(n.stalled)
		clear(n.stalledPorts)
		n.anyStall.Store(false)
		close(n.flowing)
		n.flowing = make(chan struct{})
	}
}

type conn struct {
	net.Conn
	n    *Network
	key  [2]int
	addr string // dialed
	once sync.Once
	done chan struct{} // closed by Close
	// rdl and wdl are the read and write deadlines (UnixNano, 0: none),
	// which a stalled Read or Write keeps; dlSet is closed, and replaced,
	// whenever one is set.
	rdl, wdl atomic.Int64
	dmu      sync.Mutex
	dlSet    chan struct{} // guarded by dmu
	rmu      sync.Mutex    // serialises Reads, for held
	held     *heldRead     // what a read got as a stall began
}

// deadline returns flow's view of the read or write deadline.
func (c *conn) deadline(dl *atomic.Int64) func() (int64, <-chan struct{}) {
	return func() (int64, <-chan struct{}) {
		c.dmu.Lock()
		if c.dlSet == nil {
			c.dlSet = make(chan struct{})
		}
		set := c.dlSet
		c.dmu.Unlock()
		return dl.Load(), set // the channel first: a later set closes it
	}
}

// deadlineSet wakes the reads and writes waiting in flow.
func (c *conn) deadlineSet() {
	c.dmu.Lock()
	if c.dlSet != nil {
		close(c.dlSet)
		c.dlSet = nil
	}
	c.dmu.Unlock()
}

// heldRead is what a conn read from its socket while its pair stalled.
type heldRead struct {
	data []byte
	err  error
}

// Read waits while the pair is stalled (until its deadline), and holds
// what it read when a stall began during the read, for the first read
// after the stall.
func (c *conn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.held == nil {
		if err := c.n.flow(c.key, c.addr, c.done, c.deadline(&c.rdl)); err != nil {
			return 0, err
		}
		k, err := c.Conn.Read(p)
		var ne net.Error
		if !c.n.isStalled(c.key, c.addr) || (k == 0 && errors.As(err, &ne) && ne.Timeout()) {
			return k, err // nothing to hold back (the socket's own deadline passed)
		}
		c.held = &heldRead{data: append([]byte(nil), p[:k]...), err: err}
	}
	if err := c.n.flow(c.key, c.addr, c.done, c.deadline(&c.rdl)); err != nil {
		return 0, err
	}
	h := c.held
	k := copy(p, h.data)
	if h.data = h.data[k:]; len(h.data) > 0 {
		return k, nil
	}
	c.held = nil
	return k, h.err
}

// Write waits while the pair is stalled (until its deadline).
func (c *conn) Write(p []byte) (int, error) {
	if err := c.n.flow(c.key, c.addr, c.done, c.deadline(&c.wdl)); err != nil {
		return 0, err
	}
	return c.Conn.Write(p)
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func (c *conn) SetDeadline(t time.Time) error {
	c.rdl.Store(unixNano(t))
	c.wdl.Store(unixNano(t))
	c.deadlineSet()
	return c.Conn.SetDeadline(t)
}

func (c *conn) SetReadDeadline(t time.Time) error {
	c.rdl.Store(unixNano(t))
	c.deadlineSet()
	return c.Conn.SetReadDeadline(t)
}

func (c *conn) SetWriteDeadline(t time.Time) error {
	c.wdl.Store(unixNano(t))
	c.deadlineSet()
	return c.Conn.SetWriteDeadline(t)
}

func (c *conn) Close() error {
	c.once.Do(func() {
		c.n.mu.Lock()
		delete(c.n.conns[c.key], c)
		c.n.mu.Unlock()
		close(c.done)
	})
	return c.Conn.Close()
}
