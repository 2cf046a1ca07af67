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
	conns map[[2]int]map[*conn]bool // open connections per direction
}

// NewNetwork returns a network with no cuts.
func NewNetwork() *Network {
	return &Network{owner: map[string]int{}, cut: map[[2]int]bool{}, conns: map[[2]int]map[*conn]bool{}}
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
		blocked := known && n.cut[[2]int{from, to}]
		n.mu.Unlock()
		if blocked {
			return nil, fmt.Errorf("servertest: %d -> %d is partitioned", from, to)
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil || !known {
			return c, err
		}
		key := [2]int{from, to}
		tc := &conn{Conn: c, n: n, key: key}
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.cut[key] { // cut while dialing
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

// Isolate cuts node i off from every node in others.
func (n *Network) Isolate(i int, others []int) {
	for _, j := range others {
		if j != i {
			n.Cut(i, j)
		}
	}
}

// Heal removes every cut.
func (n *Network) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.cut)
}

type conn struct {
	net.Conn
	n    *Network
	key  [2]int
	once sync.Once
}

func (c *conn) Close() error {
	c.once.Do(func() {
		c.n.mu.Lock()
		delete(c.n.conns[c.key], c)
		c.n.mu.Unlock()
	})
	return c.Conn.Close()
}
