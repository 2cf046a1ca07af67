package raftstore

import (
	"context"
	"errors"
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
	return s.dial(ctx, "tcp", string(address))
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
