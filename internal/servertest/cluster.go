// Package servertest runs in-process stor clusters for tests: N real
// servers on loopback with their own data dirs, a Network that can
// partition them, and Stop, Kill, Restart, Partition and Heal.
package servertest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/raftstore"
)

// Options tune a test cluster. Zero fields take the defaults noted.
type Options struct {
	// Servers started by NewCluster. Default 3.
	Servers int
	// Configure, if set, edits each server's config before it starts
	// (index i). Zones, labels, capacity, raft tuning go here.
	Configure func(i int, cfg *server.Config)
	// TLS runs every server with mutual TLS: a CA and certificates made in
	// the cluster's directory (TLSFiles), and the clients of Node.Client,
	// Dial and EngineConfig present an operator certificate. Default off.
	TLS bool
	// NodeIssuer (with TLS) lets every server issue CSI node certificates
	// from the cluster's CA (server.NodeCertConfig's issuer files; the
	// caller's Configure sets the Reviewer).
	NodeIssuer bool
	// LocalSockets gives every server a short-circuit read socket
	// (server.Config.LocalSocket; Node.LocalSocket, Cluster.LocalReaders).
	LocalSockets bool
}

// Node is one server of a Cluster. Its addresses and data dir survive
// restarts.
type Node struct {
	Index    int
	ID       string
	Dir      string
	Addr     string // control address
	RaftAddr string
	DataAddr string // replica data service
	// LocalSocket is the server's short-circuit read socket (with
	// Options.LocalSockets).
	LocalSocket string

	mu  sync.Mutex
	srv *server.Server
	cfg server.Config
	// ports are its control, raft and data listeners while it is
	// stopped (nil: not held), handed to the server when it starts: its
	// ports are never free for another process (another test binary's
	// server) to take, which would fail its restart.
	ports  [3]*heldPort
	conn   *grpc.ClientConn
	client Clients
}

// Clients are the control API clients of one node.
type Clients struct {
	Cluster   storpb.ClusterServiceClient
	Volumes   storpb.VolumeServiceClient
	Snapshots storpb.SnapshotServiceClient
}

// Server returns the running server, or nil when stopped.
func (n *Node) Server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Cluster is an in-process stor cluster.
type Cluster struct {
	t     testing.TB
	opts  Options
	Net   *Network
	Nodes []*Node
	log   *testLog
	base  string // parent of the nodes' data dirs
}

// TestConfig is the server config servertest uses: fast heartbeats and a
// short down timeout so liveness tests run in seconds.
func TestConfig() server.Config {
	cfg := server.DefaultConfig()
	cfg.HeartbeatInterval = 100 * time.Millisecond
	cfg.ShutdownTimeout = 5 * time.Second
	cfg.Raft.ServerDownTimeout = 2 * time.Second
	cfg.Capacity = 1 << 40
	// Checksums and ReadSnapshot compare replicas' bytes over the data
	// protocol, which without TLS identities only this lets them do.
	cfg.InsecureDataInspect = true
	cfg.Insecure = true // loopback only; NewCluster's TLS option turns it off
	return cfg
}

// NewCluster starts opts.Servers servers: the first bootstraps, the others
// join it. It returns once every server is a registered member and a
// leader is known. Everything is stopped in t.Cleanup.
func NewCluster(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if opts.Servers == 0 {
		opts.Servers = 3
	}
	// The data dirs' removal must run after the servers stop: cleanups run
	// last-registered first, so create the base dir before registering Close.
	c := &Cluster{t: t, opts: opts, Net: NewNetwork(), log: newTestLog(t), base: t.TempDir()}
	t.Cleanup(c.Close)
	for range opts.Servers {
		c.AddNode()
	}
	c.WaitMembers(opts.Servers, 30*time.Second)
	return c
}

// AddNode starts one more server that joins through node 0.
func (c *Cluster) AddNode() *Node {
	c.t.Helper()
	i := len(c.Nodes)
	n := &Node{Index: i, ID: fmt.Sprintf("s%d", i+1), Dir: filepath.Join(c.base, fmt.Sprintf("s%d", i+1))}
	// The first start uses listeners bound here (so no other process can
	// take the ports in between); restarts bind the same addresses again.
	ctl, raftLn, data := listen(c.t), listen(c.t), listen(c.t)
	n.Addr, n.RaftAddr, n.DataAddr = ctl.Addr().String(), raftLn.Addr().String(), data.Addr().String()
	c.Net.Register(n.Addr, i)
	c.Net.Register(n.RaftAddr, i)
	c.Net.Register(n.DataAddr, i)
	cfg := TestConfig()
	cfg.ID, cfg.DataDir, cfg.Listen, cfg.RaftListen = n.ID, n.Dir, n.Addr, n.RaftAddr
	cfg.DataListen = n.DataAddr
	if i > 0 {
		cfg.Join = []string{c.Nodes[0].Addr}
	}
	cfg.Dial = c.Net.Dialer(i)
	cfg.Logger = c.log.logger.With("node", n.ID)
	if c.opts.TLS {
		cfg.TLS, cfg.Insecure = c.TLSSource(pki.Identity{Role: pki.RoleServer, Name: n.ID}), false
		if c.opts.NodeIssuer {
			cfg.NodeCerts.IssuerCert, cfg.NodeCerts.IssuerKey = filepath.Join(c.TLSDir(), "ca.crt"), filepath.Join(c.TLSDir(), "ca.key")
		}
	}
	if c.opts.LocalSockets {
		// Unix socket paths are short (108 bytes): not under t.TempDir().
		dir, err := os.MkdirTemp("", "stor-local")
		if err != nil {
			c.t.Fatalf("servertest: %v", err)
		}
		c.t.Cleanup(func() { os.RemoveAll(dir) })
		n.LocalSocket = filepath.Join(dir, "local.sock")
		cfg.LocalSocket = n.LocalSocket
	}
	if c.opts.Configure != nil {
		c.opts.Configure(i, &cfg)
	}
	n.cfg = cfg
	n.ports = [3]*heldPort{{ln: ctl}, {ln: raftLn}, {ln: data}}
	c.Nodes = append(c.Nodes, n)
	c.Start(i)
	return n
}

func listen(t testing.TB) *net.TCPListener {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("servertest: listen: %v", err)
	}
	return l.(*net.TCPListener)
}

// Start starts node i (again) with its data dir and addresses.
func (c *Cluster) Start(i int) {
	c.t.Helper()
	if err := c.TryStart(i); err != nil {
		c.t.Fatalf("servertest: start %s: %v", c.Nodes[i].ID, err)
	}
}

// TryStart is Start returning the error (for tests of refused starts).
func (c *Cluster) TryStart(i int) error {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return fmt.Errorf("already running")
	}
	var srv *server.Server
	var err error
	cfg := n.cfg
	handed := n.handOverLocked()
	cfg.Listener, cfg.RaftListener, cfg.DataListener = handed[0], handed[1], handed[2]
	c.Net.SetStopped(i, false)
	// A port that was not held is bound again by address: a socket in
	// TIME_WAIT cannot block a listener, but retry briefly.
	for range 50 {
		srv, err = server.Start(cfg)
		if err == nil || !strings.Contains(err.Error(), "address already in use") {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		for _, ln := range handed {
			if ln != nil {
				ln.Close()
			}
		}
		c.Net.SetStopped(i, true)
		n.holdLocked(c.t)
		return err
	}
	n.srv = srv
	if n.conn == nil {
		conn, err := grpc.NewClient("passthrough:///"+n.Addr, c.dialCredentials(), grpc.WithContextDialer(c.clientDialer))
		if err != nil {
			return err
		}
		n.conn = conn
		n.client = Clients{
			Cluster:   storpb.NewClusterServiceClient(conn),
			Volumes:   storpb.NewVolumeServiceClient(conn),
			Snapshots: storpb.NewSnapshotServiceClient(conn),
		}
	}
	return nil
}

// Stop shuts node i down gracefully (leadership handed off).
func (c *Cluster) Stop(i int) {
	if srv := c.take(i); srv != nil {
		if err := srv.Close(); err != nil {
			c.t.Logf("servertest: stop %s: %v", c.Nodes[i].ID, err)
		}
		c.Net.SetStopped(i, true)
		c.Nodes[i].hold(c.t)
	}
}

// Kill stops node i abruptly: no leadership transfer, RPCs cut off.
func (c *Cluster) Kill(i int) {
	c.Net.SetStopped(i, true) // its peers stop dialing it now
	if srv := c.take(i); srv != nil {
		srv.Kill()
		c.Nodes[i].hold(c.t)
	}
}

// heldPort is a stopped node's listener. While it is held, each
// connection to it is closed at once, as near as a listener comes to a
// port that refuses it (this cluster's own dials to a stopped node are
// refused before they reach it: Network.SetStopped).
type heldPort struct {
	ln   *net.TCPListener
	done chan struct{} // closed when its accept loop returns; nil: none
}

// hold keeps the ports of a node just stopped until it starts again. A
// port another process took first is logged, and bound by address at the
// restart.
func (n *Node) hold(t testing.TB) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.holdLocked(t)
}

func (n *Node) holdLocked(t testing.TB) {
	for k, addr := range []string{n.Addr, n.RaftAddr, n.DataAddr} {
		if n.ports[k] != nil {
			continue
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Logf("servertest: %s stopped, its port %s not held: %v", n.ID, addr, err)
			continue
		}
		p := &heldPort{ln: ln.(*net.TCPListener), done: make(chan struct{})}
		go func() {
			defer close(p.done)
			for {
				c, err := p.ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		n.ports[k] = p
	}
}

// handOverLocked stops the held ports' accept loops and returns their
// listeners (nil where none is held), no longer held, for the server to
// start on; n.mu is held.
func (n *Node) handOverLocked() [3]net.Listener {
	var out [3]net.Listener
	for k, p := range n.ports {
		if p == nil {
			continue
		}
		if p.done != nil {
			_ = p.ln.SetDeadline(time.Now()) // its Accept returns
			<-p.done
			_ = p.ln.SetDeadline(time.Time{})
		}
		out[k] = p.ln
		n.ports[k] = nil
	}
	return out
}

// releaseLocked closes the held ports; n.mu is held.
func (n *Node) releaseLocked() {
	for _, ln := range n.handOverLocked() {
		if ln != nil {
			ln.Close()
		}
	}
}

// clientDialer is plainDial for gRPC (which adds TLS itself).
func (c *Cluster) clientDialer(ctx context.Context, addr string) (net.Conn, error) {
	return c.plainDial(ctx, "tcp", addr)
}

// Restart kills node i and starts it again.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	c.Kill(i)
	c.Start(i)
}

func (c *Cluster) take(i int) *server.Server {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	srv := n.srv
	n.srv = nil
	return srv
}

// Partition cuts node i off from every other node.
func (c *Cluster) Partition(i int) {
	all := make([]int, len(c.Nodes))
	for j := range all {
		all[j] = j
	}
	c.Net.Isolate(i, all)
}

// Heal removes every partition.
func (c *Cluster) Heal() { c.Net.Heal() }

// Client returns the control API clients of node i (whether or not it is
// running; calls to a stopped node fail with Unavailable).
func (c *Cluster) Client(i int) Clients { return c.Nodes[i].client }

// Leader waits up to timeout for exactly one running node that leads and
// can serve linearizable reads, and returns its index.
func (c *Cluster) Leader(timeout time.Duration) int {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		leader := -1
		count := 0
		for i, n := range c.Nodes {
			srv := n.Server()
			if srv == nil || !srv.Store().IsLeader() {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			err := srv.Store().ConsistentRead(ctx)
			cancel()
			if err == nil {
				leader = i
				count++
			}
		}
		if count == 1 {
			return leader
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.t.Fatalf("servertest: no leader within %v", timeout)
	return -1
}

// WaitMembers waits until the leader's FSM has n registered servers, all
// up, the Raft configuration has n members, and every running node has
// applied what the leader had (so each can forward to the leader).
func (c *Cluster) WaitMembers(n int, timeout time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		l := c.Leader(time.Until(deadline))
		st := c.Nodes[l].Server().Store().Status()
		up := 0
		_ = c.Nodes[l].Server().Store().View(func(r *raftstore.Reader) error {
			servers, _ := r.Servers()
			for _, s := range servers {
				if s.State == storpb.ServerState_SERVER_STATE_UP {
					up++
				}
			}
			return nil
		})
		caughtUp := true
		for _, node := range c.Nodes {
			if srv := node.Server(); srv != nil && srv.Store().AppliedIndex() < st.Applied {
				caughtUp = false
			}
		}
		if len(st.Members) == n && up == n && caughtUp {
			return
		}
		last = fmt.Sprintf("%d raft members, %d servers up", len(st.Members), up)
		time.Sleep(50 * time.Millisecond)
	}
	c.t.Fatalf("servertest: cluster did not reach %d members within %v (%s)", n, timeout, last)
}

// Close stops every node; it runs in t.Cleanup.
func (c *Cluster) Close() {
	for i, n := range c.Nodes {
		c.Kill(i)
		n.mu.Lock()
		n.releaseLocked()
		n.mu.Unlock()
		if n.conn != nil {
			n.conn.Close()
			n.conn = nil
		}
	}
	c.log.stop()
}

// testLog routes server logs to t.Log until the test ends. Only warnings
// and errors are shown unless STOR_TEST_LOG=debug or info.
type testLog struct {
	mu     sync.Mutex
	t      testing.TB
	done   bool
	logger *slog.Logger
}

func newTestLog(t testing.TB) *testLog {
	l := &testLog{t: t}
	lvl := slog.LevelWarn
	if v := os.Getenv("STOR_TEST_LOG"); v != "" {
		_ = lvl.UnmarshalText([]byte(v))
	}
	l.logger = slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: lvl}))
	return l
}

func (l *testLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.done {
		l.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (l *testLog) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.done = true
}

var _ io.Writer = (*testLog)(nil)

// Operator is the identity of the clients of a TLS cluster.
var Operator = pki.Identity{Role: pki.RoleOperator, Name: "servertest"}

// TLSDir holds the CA (ca.crt, ca.key) and the certificates of a TLS
// cluster.
func (c *Cluster) TLSDir() string { return filepath.Join(c.base, "tls") }

// TLSDirOf is the TLSDir of the cluster a server with cfg belongs to: for
// Options.Configure, which runs before NewCluster returns (the cluster CA's
// ca.crt and ca.key are there by then).
func TLSDirOf(cfg server.Config) string { return filepath.Join(filepath.Dir(cfg.DataDir), "tls") }

// TLSFiles returns the certificate files of id, issued by the cluster's CA
// if they do not exist yet.
func (c *Cluster) TLSFiles(id pki.Identity) pki.Files {
	c.t.Helper()
	if err := pki.EnsureLocal(c.TLSDir(), id); err != nil {
		c.t.Fatalf("servertest: certificates: %v", err)
	}
	return pki.LocalFiles(c.TLSDir(), id)
}

// TLSSource loads TLSFiles(id).
func (c *Cluster) TLSSource(id pki.Identity) *pki.Source {
	c.t.Helper()
	src, err := pki.Load(c.TLSFiles(id), c.log.logger.With("tls", id.String()))
	if err != nil {
		c.t.Fatalf("servertest: %v", err)
	}
	return src
}

// dialCredentials are the transport credentials of the cluster's clients.
func (c *Cluster) dialCredentials() grpc.DialOption {
	if !c.opts.TLS {
		return grpc.WithTransportCredentials(insecure.NewCredentials())
	}
	return c.TLSSource(Operator).GRPCDialCredentials()
}

// dataDial is the dialer of the cluster's engines (TLS with Options.TLS).
func (c *Cluster) dataDial() func(ctx context.Context, network, addr string) (net.Conn, error) {
	if !c.opts.TLS {
		return c.plainDial
	}
	return c.TLSSource(Operator).Dialer(c.plainDial, pki.RoleServer)
}

// plainDial dials for the test's clients: refused while the node is
// stopped (Network.SetStopped), so they do not reach whatever took its
// port.
func (c *Cluster) plainDial(ctx context.Context, network, addr string) (net.Conn, error) {
	if err := c.Net.refusedIfStopped(network, addr); err != nil {
		return nil, err
	}
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}
