package servertest

import (
	"context"
	"fmt"
	"net"
	"sync"
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
	flowing chan struct{}
}

// NewNetwork returns a network with no cuts.
func NewNetwork() *Network {
	return &Network{owner: map[string]int{}, cut: map[[2]int]bool{}, ports: map[int]map[string]bool{}, conns: map[[2]int]map[*conn]bool{},
		stalled: map[[2]int]bool{}, flowing: make(chan struct{})}
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
}

// flow waits while key is stalled, until done is closed (false) or the
// stall is lifted (true).
func (n *Network) flow(key [2]int, done <-chan struct{}) bool {
	for {
		n.mu.Lock()
		stalled, wake := n.stalled[key], n.flowing
		n.mu.Unlock()
		if !stalled {
			return true
		}
		select {
		case <-wake:
		case <-done:
			return false
		}
	}
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
		key := [2]int{from, to}
		if known && !n.flow(key, ctx.Done()) {
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
	if len(n.stalled) > 0 {
		clear(n.stalled)
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
}

// Read holds what it read while the pair is stalled.
func (c *conn) Read(p []byte) (int, error) {
	k, err := c.Conn.Read(p)
	if !c.n.flow(c.key, c.done) {
		return 0, net.ErrClosed
	}
	return k, err
}

// Write waits while the pair is stalled.
func (c *conn) Write(p []byte) (int, error) {
	if !c.n.flow(c.key, c.done) {
		return 0, net.ErrClosed
	}
	return c.Conn.Write(p)
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
