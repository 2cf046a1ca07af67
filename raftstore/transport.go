package raftstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// streamLayer is raft.StreamLayer over a listener, dialing through the
// Config.Dial seam so tests can cut links.
//
// It also closes, when closed, the connections it accepted: raft's
// NetworkTransport closes only its listener, and each accepted
// connection's goroutine reads on until the peer hangs up, so a closed
// store's peers kept talking to it (in a test binary, every closed
// cluster's connections stayed; internal/server's
// TestClosedClusterLeavesNoRaftConnections).
type streamLayer struct {
	net.Listener
	advertise net.Addr
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
	// check is the cluster check of the connections dialed and accepted;
	// nil checks nothing.
	check *clusterCheck

	mu       sync.Mutex
	closed   bool
	accepted map[net.Conn]struct{}
}

func (s *streamLayer) Addr() net.Addr { return s.advertise }

// Accept accepts a peer's connection and keeps it until it is closed.
func (s *streamLayer) Accept() (net.Conn, error) {
	c, err := s.Listener.Accept()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, net.ErrClosed
	}
	if s.accepted == nil {
		s.accepted = map[net.Conn]struct{}{}
	}
	tc := &trackedConn{Conn: c, s: s}
	s.accepted[tc] = struct{}{}
	if s.check != nil {
		return &checkedConn{trackedConn: tc, check: s.check}, nil
	}
	return tc, nil
}

// Close closes the listener and every connection it accepted.
func (s *streamLayer) Close() error {
	err := s.Listener.Close()
	s.mu.Lock()
	s.closed = true
	conns := s.accepted
	s.accepted = nil
	s.mu.Unlock()
	for c := range conns {
		c.(*trackedConn).Conn.Close()
	}
	return err
}

// trackedConn is an accepted connection, forgotten by its stream layer
// once closed.
type trackedConn struct {
	net.Conn
	s    *streamLayer
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.accepted, c)
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}

func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := s.dial(ctx, "tcp", string(address))
	if err != nil || s.check == nil {
		return c, err
	}
	id := s.check.cluster()
	if id == "" || !s.check.speaks(address) {
		return c, nil // no hello of no cluster: it would be refused
	}
	if err := sayHello(c, id, timeout); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// clusterCheck keeps a Raft peer of another cluster out. Raft's RPCs
// name no cluster, and every stor cluster names its servers alike
// (stor-0, stor-1, ... in Kubernetes; s1, s2, ... in tests): a leader
// whose follower's address came to be another cluster's server's (a pod
// IP given again, a port reused on one host) replicated its log to that
// server, which stepped down, took the entries, and became a member of
// both (internal/server tests of two binaries on one host did; the
// second cluster's records then named other data dirs and refused all
// its servers). So each connection a store dials starts with a hello
// naming its cluster, and a store reads the hello of each connection it
// accepts before Raft reads anything: a hello of another cluster, or one
// that comes to a store of no cluster yet, closes the connection.
//
// A store dials its hello only to a server whose record says it checks
// one (storpb.Server.raft_cluster_check): a server of an older version
// would take it for a Raft request and hang up. A connection that starts
// with no hello (such a server dialing) is heard as before.
type clusterCheck struct {
	// cluster is the id of the store's cluster, or the one it is joining
	// ("" for a store of no cluster yet).
	cluster func() string
	// speaks reports whether the server at a Raft address checks a hello.
	speaks func(raft.ServerAddress) bool
	// refused is told of each connection refused.
	refused func(remote net.Addr, theirs, ours string)
}

// The hello: helloMagic, one byte of length, then the cluster id. Its
// first byte is no Raft RPC type (raft's NetworkTransport starts each
// request with a type byte from 0), which tells it from a connection
// that starts with none.
const (
	helloMagic   = "\xf5stor-raft-cluster\x01"
	helloTimeout = 10 * time.Second
)

// errOtherCluster is what Raft reads from a connection of another cluster.
var errOtherCluster = errors.New("raftstore: a Raft connection of another cluster (or of none): refused")

// sayHello writes the hello of cluster id on a connection dialed.
func sayHello(c net.Conn, id string, timeout time.Duration) error {
	if len(id) > 255 {
		return fmt.Errorf("raftstore: cluster id %q is too long", id)
	}
	hello := append([]byte(helloMagic), byte(len(id)))
	hello = append(hello, id...)
	_ = c.SetWriteDeadline(time.Now().Add(timeout))
	defer c.SetWriteDeadline(time.Time{})
	if _, err := c.Write(hello); err != nil {
		return fmt.Errorf("raftstore: raft hello: %w", err)
	}
	return nil
}

// hear reads a connection's hello, if it starts with one, and checks it.
// It returns what it read of a connection with none, for Raft to read.
func (k *clusterCheck) hear(c net.Conn) (unread []byte, err error) {
	_ = c.SetReadDeadline(time.Now().Add(helloTimeout))
	defer c.SetReadDeadline(time.Time{})
	first := make([]byte, 1)
	if _, err := io.ReadFull(c, first); err != nil {
		return nil, err
	}
	if first[0] != helloMagic[0] {
		return first, nil // no hello: a server of an older version
	}
	rest := make([]byte, len(helloMagic)) // the magic's rest and the length
	if _, err := io.ReadFull(c, rest); err != nil {
		return nil, err
	}
	if string(first)+string(rest[:len(rest)-1]) != helloMagic {
		return nil, fmt.Errorf("%w: not a stor Raft hello", errOtherCluster)
	}
	theirs := make([]byte, rest[len(rest)-1])
	if _, err := io.ReadFull(c, theirs); err != nil {
		return nil, err
	}
	if ours := k.cluster(); string(theirs) != ours || ours == "" {
		k.refused(c.RemoteAddr(), string(theirs), ours)
		return nil, errOtherCluster
	}
	return nil, nil
}

// checkedConn is an accepted connection whose first read hears its hello.
// Raft's NetworkTransport reads each connection from one goroutine.
type checkedConn struct {
	*trackedConn
	check  *clusterCheck
	heard  bool
	err    error
	unread []byte
}

func (c *checkedConn) Read(p []byte) (int, error) {
	if !c.heard {
		c.heard = true
		c.unread, c.err = c.check.hear(c.trackedConn)
	}
	if c.err != nil {
		return 0, c.err
	}
	if len(c.unread) > 0 {
		n := copy(p, c.unread)
		c.unread = c.unread[n:]
		return n, nil
	}
	return c.trackedConn.Read(p)
}

// hclogFor routes hashicorp/raft's hclog output into slog. raft logs
// preformatted lines; each becomes one slog record with component=raft.
// Once closing is set, errors on connections closed by the store's own
// shutdown are logged at debug level.
func hclogFor(l *slog.Logger, closing *atomic.Bool) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		Name:        "raft",
		Level:       hclog.Info,
		Output:      slogWriter{l: l.With("component", "raft"), closing: closing},
		DisableTime: true,
	})
}

type slogWriter struct {
	l       *slog.Logger
	closing *atomic.Bool
}

func (w slogWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	switch {
	case w.closing != nil && w.closing.Load() && strings.Contains(line, net.ErrClosed.Error()):
		// A read or write on a connection this store closed as it shut
		// down (streamLayer.Close), not a fault.
		w.l.Debug(line)
	case strings.Contains(line, errOtherCluster.Error()):
		// A connection of another cluster, refused: said once in a
		// while by the store (refusedRaftPeer), not at each retry.
		w.l.Debug(line)
	case strings.HasPrefix(line, "[ERROR]"):
		w.l.Error(strings.TrimSpace(line[7:]))
	case strings.HasPrefix(line, "[WARN]"):
		w.l.Warn(strings.TrimSpace(line[6:]))
	case strings.HasPrefix(line, "[INFO]"):
		w.l.Info(strings.TrimSpace(line[6:]))
	default:
		w.l.Debug(line)
	}
	return len(p), nil
}

var _ io.Writer = slogWriter{}

// errNotJoined answers a vote asked of a server that has not joined
// (memberGate).
var errNotJoined = errors.New("raftstore: this server has not joined the cluster: it votes for no one")

// memberGate is the Raft transport of a store that may not have joined
// the cluster yet: until it has (member), it answers every vote and
// pre-vote request with errNotJoined, which the candidate counts as no
// vote. A server on a wiped or replaced data dir is still a voter in the
// configuration but remembers neither the entries it acknowledged nor
// the votes it cast: hashicorp/raft grants a vote while its own
// configuration is empty, so it could elect a leader that lacks committed
// entries, or vote twice in one term. Joined afresh (or bootstrapped),
// it votes as any member. Everything else passes through: the leader's
// entries, snapshots and heartbeats (a join in progress needs them).
type memberGate struct {
	*raft.NetworkTransport
	member func() bool
	ch     chan raft.RPC
}

// newMemberGate relays t's requests until done is closed.
func newMemberGate(t *raft.NetworkTransport, member func() bool, done <-chan struct{}) *memberGate {
	g := &memberGate{NetworkTransport: t, member: member, ch: make(chan raft.RPC)}
	go g.relay(t.Consumer(), done)
	return g
}

// Consumer implements raft.Transport.
func (g *memberGate) Consumer() <-chan raft.RPC { return g.ch }

func (g *memberGate) relay(in <-chan raft.RPC, done <-chan struct{}) {
	for {
		var rpc raft.RPC
		select {
		case <-done:
			return
		case rpc = <-in:
		}
		switch rpc.Command.(type) {
		case *raft.RequestVoteRequest, *raft.RequestPreVoteRequest:
			if !g.member() {
				rpc.Respond(nil, errNotJoined)
				continue
			}
		}
		select {
		case <-done:
			return
		case g.ch <- rpc:
		}
	}
}
