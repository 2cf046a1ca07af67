package wire

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// stallConn lets allow more bytes through once armed (allow >= 0), then
// blocks its reads until it is closed: a link that stops mid-reply (a
// partition starting while a chunk is on the wire).
type stallConn struct {
	net.Conn
	mu    sync.Mutex
	allow int // -1: no limit
	gate  chan struct{}
	once  sync.Once
}

func (c *stallConn) arm(n int) {
	c.mu.Lock()
	c.allow = n
	c.mu.Unlock()
}

func (c *stallConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	allow := c.allow
	c.mu.Unlock()
	if allow == 0 {
		<-c.gate
		return 0, net.ErrClosed
	}
	if allow > 0 && len(p) > allow {
		p = p[:allow]
	}
	n, err := c.Conn.Read(p)
	if allow > 0 {
		c.mu.Lock()
		c.allow -= n
		c.mu.Unlock()
	}
	return n, err
}

func (c *stallConn) Close() error {
	c.once.Do(func() { close(c.gate) })
	return c.Conn.Close()
}

// The target answers a copy whose source it cannot read about within the
// budget with ErrCopySource, so that the rebuilder has the rest of its
// time to relay and blames no one wrongly. When the link to the source
// stopped mid-reply, the read used to outlive the budget by up to the
// client's Timeout (a call whose reply is being received is waited for,
// 10 s by default), so the rebuilder's own deadline passed first: it saw
// context.DeadlineExceeded, then taken for the target's failure, and
// recorded a healthy target faulty (found by review). A read still stuck
// stallGrace after its budget now cuts the source's connection.
func TestRebuildCopyAnswersWithinItsBudgetWhenTheSourceStallsMidReply(t *testing.T) {
	p := &copyPair{src: newFakeReplica("src", testSize), dst: newFakeReplica("dst", testSize)}
	copy(p.src.data, pattern(1, testSize))
	p.srcH = newHarness(t, ServerConfig{}, p.src)
	var (
		mu    sync.Mutex
		conns []*stallConn
	)
	var d net.Dialer
	p.sources = &Sources{
		Idle: time.Minute,
		Client: ClientConfig{Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			sc := &stallConn{Conn: c, allow: -1, gate: make(chan struct{})}
			mu.Lock()
			conns = append(conns, sc)
			mu.Unlock()
			return sc, nil
		}},
		Resolve: func(ctx context.Context, target OpenRequest, source string, o replica.Op) (string, OpenRequest, error) {
			return p.srcH.addr, OpenRequest{Replica: source, Volume: target.Volume, Node: "target", Epoch: o.Epoch, Purpose: PurposeRebuildSource}, nil
		},
	}
	t.Cleanup(p.sources.Close)
	p.dstH = newHarness(t, ServerConfig{CopySource: p.sources}, p.dst)
	h := p.openTarget(t)
	o := replica.Op{Epoch: 1, Generation: 1}
	if err := h.RebuildCopy(context.Background(), o, "src", 0, 4096, time.Second); err != nil {
		t.Fatal(err) // opens the source
	}
	mu.Lock()
	conns[0].arm(ReplyHeaderSize + 100) // the next reply stops after 100 bytes of data
	mu.Unlock()

	const budget = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 2*budget+stallGrace+time.Second)
	defer cancel()
	start := time.Now()
	err := h.RebuildCopy(ctx, o, "src", 0, 1<<20, budget)
	took := time.Since(start)
	if !errors.Is(err, ErrCopySource) {
		t.Fatalf("copy from a source whose link stalled mid-reply: %v after %v (budget %v); want ErrCopySource within the budget", err, took.Round(time.Millisecond), budget)
	}
	if took > budget+stallGrace+700*time.Millisecond {
		t.Fatalf("ErrCopySource after %v, budget %v", took.Round(time.Millisecond), budget)
	}
	// The stalled connection is out of service; the next copy opens another.
	if err := h.RebuildCopy(context.Background(), o, "src", 0, 4096, time.Second); err != nil {
		t.Fatalf("a copy after the stall: %v", err)
	}
	mu.Lock()
	n := len(conns)
	mu.Unlock()
	if n != 2 {
		t.Fatalf("%d connections to the source, want 2", n)
	}
}
