package raftstore

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

// The sequence internal/server's tests and replica/engine's produced on
// one host (two test binaries at once): a leader of cluster A kept
// replicating to its follower's address after the follower stopped; a
// server of a new cluster B came to listen there (the port reused), took
// A's entries, stepped down and joined A's log, and B's records then
// named every server on other data dirs. Here B's server is heard by no
// one of A's, and keeps leading its own cluster.
func TestARaftPeerOfAnotherClusterIsNotHeard(t *testing.T) {
	logs := &testLogs{}
	a1 := openTestStore(t, "s1", nil, logs)
	if err := a1.Bootstrap(); err != nil {
		t.Fatal(err)
	}
	waitLeading(t, a1)

	// A's second server, a non-voter (a1 keeps a quorum when it stops).
	port := newHandoff(t) // a2's port, then b1's
	a2 := openTestStore(t, "s2", port.listener(), logs)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a2.JoiningCluster(a1.ClusterID())
	if _, voter, err := a1.Join(ctx, &storpb.Server{Id: "s2", Address: "127.0.0.1:1", RaftAddress: a2.RaftAddress(), RaftClusterCheck: true}); err != nil || voter {
		t.Fatalf("join s2: voter %v, %v", voter, err)
	}
	if err := a2.Joined(a1.ClusterID()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "s2 to apply A's entries", func() bool { return a2.Status().Applied >= a1.Status().Applied })
	a2.Close()

	// B's first server, on s2's old address, named as A's are.
	b1 := openTestStore(t, "s1", port.listener(), logs)
	if err := b1.Bootstrap(); err != nil {
		t.Fatal(err)
	}
	bCluster := b1.ClusterID()
	// B's server leads B, a cluster of one, and applies B's entries only:
	// until it says it refused A's leader, and a second after.
	intact := func() bool {
		lid, _ := b1.Leader()
		conf, err := b1.configuration()
		var fsmCluster string
		_ = b1.View(func(r *Reader) error { fsmCluster = r.ClusterID(); return nil })
		switch {
		case err == nil && len(conf.Servers) == 1 && (lid == "" || lid == "s1") && (fsmCluster == "" || fsmCluster == bCluster):
			return b1.IsLeader() && fsmCluster == bCluster
		default:
			t.Fatalf("B's server, dialed by A's leader: leader %v (leader id %q), configuration %v (%v), cluster %q (B is %q, A %q)",
				b1.IsLeader(), lid, conf.Servers, err, fsmCluster, bCluster, a1.ClusterID())
			return false
		}
	}
	waitFor(t, "B's server leading B", intact)
	if bCluster == "" || bCluster == a1.ClusterID() {
		t.Fatalf("clusters %q and %q", a1.ClusterID(), bCluster)
	}
	// a1 goes on replicating to that address (heartbeats, and entries),
	// after a backoff of its failures to reach it.
	if _, voter, err := a1.Join(ctx, &storpb.Server{Id: "s3", Address: "127.0.0.1:2", RaftAddress: "127.0.0.1:9", RaftClusterCheck: true}); err != nil || voter {
		t.Fatalf("join s3: voter %v, %v", voter, err)
	}
	refused := time.Time{}
	for deadline := time.Now().Add(60 * time.Second); refused.IsZero() || time.Since(refused) < time.Second; {
		if time.Now().After(deadline) {
			t.Fatal("B's server did not say, in 60 s, it refused a Raft peer of another cluster")
		}
		if !intact() {
			t.Fatal("B's server no longer leads")
		}
		if refused.IsZero() && logs.has("a Raft peer of another cluster dialed this server: refused") {
			refused = time.Now()
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A's leader leads on; its own servers hear it.
	if !a1.IsLeader() {
		t.Error("A's leader lost its leadership")
	}
}

// A server's record says whether it checks the hello as its heartbeats
// do: a member restarted on this version (it only heartbeats) is dialed
// with the hello from then on, and one restarted on an older version
// (which would hang up on it) without.
func TestARestartedServersRecordSaysWhetherItChecksTheHello(t *testing.T) {
	a1 := openTestStore(t, "s1", nil, &testLogs{})
	if err := a1.Bootstrap(); err != nil {
		t.Fatal(err)
	}
	waitLeading(t, a1)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s2 := func(checks bool) *storpb.Server {
		return &storpb.Server{Id: "s2", Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:9", RaftClusterCheck: checks}
	}
	if _, _, err := a1.Join(ctx, s2(false)); err != nil { // a server of an older version
		t.Fatal(err)
	}
	for _, checks := range []bool{true, false, true} { // upgraded, downgraded, upgraded
		if err := a1.Heartbeat(ctx, s2(checks)); err != nil {
			t.Fatal(err)
		}
		if got := a1.checksRaftHello("127.0.0.1:9"); got != checks {
			t.Fatalf("after a heartbeat with raft_cluster_check %v, s2 is dialed with a hello: %v", checks, got)
		}
	}
}

// Each connection a store accepts is heard by Raft only if its hello
// names the store's cluster; one with no hello (a server of an older
// version) is heard as it was. A store of no cluster hears no hello.
func TestTheRaftHelloIsChecked(t *testing.T) {
	request := []byte{0, 1, 2, 3} // what raft writes first: a type byte from 0
	cases := []struct {
		name         string
		ours, theirs string
		hello, heard bool
	}{
		{"the same cluster", "A", "A", true, true},
		{"another cluster", "A", "B", true, false},
		{"no cluster, dialed with a hello", "", "B", true, false},
		{"no cluster, dialed with an empty one", "", "", true, false},
		{"an older version's dialer (no hello)", "A", "", false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var refused []string
			accept := &clusterCheck{
				cluster: func() string { return tc.ours },
				refused: func(_ net.Addr, theirs, ours string) { refused = append(refused, theirs+"→"+ours) },
			}
			dialer, acceptor := net.Pipe()
			defer dialer.Close()
			defer acceptor.Close()
			go func() {
				if tc.hello {
					if err := sayHello(dialer, tc.theirs, time.Second); err != nil {
						return
					}
				}
				dialer.Write(request)
			}()
			c := &checkedConn{trackedConn: &trackedConn{Conn: acceptor, s: &streamLayer{}}, check: accept}
			got := make([]byte, len(request))
			_, err := io.ReadFull(c, got)
			switch {
			case tc.heard && (err != nil || !bytes.Equal(got, request)):
				t.Fatalf("read %v, %v; want the request %v", got, err, request)
			case !tc.heard && !errors.Is(err, errOtherCluster):
				t.Fatalf("read %v, %v; want errOtherCluster", got, err)
			case !tc.heard && len(refused) != 1:
				t.Fatalf("refusals told: %q", refused)
			case tc.heard && len(refused) != 0:
				t.Fatalf("refusals told: %q", refused)
			}
		})
	}
}

// openTestStore opens a store in a temporary dir, on ln (or a new
// loopback port), closed when the test ends.
func openTestStore(t *testing.T, id string, ln net.Listener, logs *testLogs) *Store {
	t.Helper()
	cfg := DefaultConfig()
	cfg.ID, cfg.Dir, cfg.RaftListener = id, t.TempDir(), ln
	cfg.RaftBind = "127.0.0.1:0"
	cfg.MaxVoters = 1
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 100*time.Millisecond, 100*time.Millisecond, 50*time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil)).With("store", id)
	s, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func waitLeading(t *testing.T, s *Store) {
	t.Helper()
	waitFor(t, s.ID()+" leading a named cluster", func() bool {
		var named string
		_ = s.View(func(r *Reader) error { named = r.ClusterID(); return nil })
		return s.IsLeader() && named != ""
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// handoff is a loopback port handed from a store closed to the next one
// (a listener each, on one socket): the port is never free, for another
// process to take, in between.
type handoff struct {
	ln    net.Listener
	conns chan net.Conn
	stop  chan struct{}
}

func newHandoff(t *testing.T) *handoff {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &handoff{ln: ln, conns: make(chan net.Conn), stop: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			select {
			case h.conns <- c:
			case <-h.stop:
				c.Close()
				return
			}
		}
	}()
	t.Cleanup(func() { close(h.stop); ln.Close(); <-done })
	return h
}

// listener is the port's listener for the next store.
func (h *handoff) listener() net.Listener { return &handedListener{h: h, done: make(chan struct{})} }

type handedListener struct {
	h    *handoff
	done chan struct{}
	once sync.Once
}

func (l *handedListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.h.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	case <-l.h.stop:
		return nil, net.ErrClosed
	}
}

func (l *handedListener) Close() error   { l.once.Do(func() { close(l.done) }); return nil }
func (l *handedListener) Addr() net.Addr { return l.h.ln.Addr() }

// testLogs keeps what stores log, for a test to look for.
type testLogs struct {
	mu    sync.Mutex
	lines []string
}

func (l *testLogs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, string(p))
	return len(p), nil
}

func (l *testLogs) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			return true
		}
	}
	return false
}
