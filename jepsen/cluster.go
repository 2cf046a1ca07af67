package jepsen

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/pki"
)

// Ports every stor-server uses on its host's address: control, Raft and
// data; Raft and data are advertised on the link proxy's ports.
const (
	portControl   = 7400
	portRaft      = 7401
	portData      = 7402
	portRaftProxy = 7411
	portDataProxy = 7412
)

// Server is one stor-server host: the server process and its link proxy.
type Server struct {
	ID    string
	Host  *Host
	Proc  *Proc
	Proxy *Proc
	// LocalSocket is its short-circuit read socket (LocalReads), or "".
	LocalSocket string
	// DataDir is its data dir (--data-dir).
	DataDir string
	// proxyIn is the proxy's command pipe.
	proxyMu sync.Mutex
}

// ControlAddr is the server's control address.
func (s *Server) ControlAddr() string { return fmt.Sprintf("%s:%d", s.Host.Addr, portControl) }

// ClientHost is one client host; Session is its current client process.
type ClientHost struct {
	Name string
	Host *Host
	Proc *Proc
	// Local is the server on the same machine (ClusterConfig.LocalReads),
	// or nil.
	Local *Server

	mu      sync.Mutex
	session *Session
	epoch   uint64
}

// Cluster is the hosts, the servers and the client hosts of one run.
type Cluster struct {
	Net     *Net
	Servers []*Server
	Clients []*ClientHost
	Dir     string
	Control *client.Client
	Volume  string
	// Broken is passed to every engine open (the "harness can fail" tests).
	Broken string
	// selfBin runs the client and proxy roles (the test binary, re-exec'd).
	selfBin string
	// TLS is the operator's certificate (Operator), which the harness's
	// control clients, its replica reads and every client process
	// present; tls is it loaded.
	TLS pki.Files
	tls *pki.Source
	// sockDir holds the servers' LocalSockets.
	sockDir string
}

// Operator is the identity of everything the harness runs besides the
// servers: its control clients (the nemeses replace replicas, detach,
// expand and snapshot, which a csi-node may not), the checkers' replica
// reads (an inspection, which needs an operator), and the client
// processes, whose engines attach with a takeover (an operator's right: a
// csi-node only re-attaches what is attached to it).
var Operator = pki.Identity{Role: pki.RoleOperator, Name: "jepsen"}

// Dial opens a connection to a data port under the operator's
// certificate (TLS, the server's certificate verified).
func (c *Cluster) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return c.tls.Dialer(nil, pki.RoleServer)(ctx, network, addr)
}

// DialControl opens a control client to addrs under the operator's
// certificate.
func (c *Cluster) DialControl(addrs []string) (*client.Client, error) {
	return client.Dial(addrs, c.tls.GRPCDialCredentials())
}

// ClusterConfig says what to start.
type ClusterConfig struct {
	Servers, Clients int
	// ServerBin is the stor-server binary; SelfBin a binary whose
	// STOR_JEPSEN_ROLE=client|proxy runs RunClient or RunProxy.
	ServerBin, SelfBin string
	// Dir holds the data dirs and logs.
	Dir    string
	Broken string
	// ServerEnv is added to every server's environment.
	ServerEnv []string
	// LocalReads co-locates client host ci with server si (for i below
	// both counts): the server offers short-circuit reads on a unix socket
	// (stor-server --local-socket) and the client's engine reads its
	// replica directly, as the CSI node plugin on a storage node does. The
	// two are one machine: partitions never separate them (colocated).
	LocalReads bool
}

// StartCluster creates the hosts, starts the servers and their proxies,
// waits for a leader with every server a member, and starts the client
// processes (without opening an engine). Close undoes all of it.
func StartCluster(ctx context.Context, cfg ClusterConfig) (_ *Cluster, err error) {
	Cleanup(ctx)
	var names []string
	for i := range cfg.Servers {
		names = append(names, fmt.Sprintf("s%d", i))
	}
	for i := range cfg.Clients {
		names = append(names, fmt.Sprintf("c%d", i))
	}
	n, err := NewNet(ctx, names)
	if err != nil {
		return nil, err
	}
	c := &Cluster{Net: n, Dir: cfg.Dir, Broken: cfg.Broken, selfBin: cfg.SelfBin, Volume: "jepsen"}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	// Every run has a CA of its own, in its data dir, and a certificate
	// per server and for the operator; everything speaks TLS.
	tlsDir := filepath.Join(cfg.Dir, "tls")
	ids := []pki.Identity{Operator}
	for i := range cfg.Servers {
		ids = append(ids, pki.Identity{Role: pki.RoleServer, Name: fmt.Sprintf("stor-%d", i)})
	}
	if err := pki.EnsureLocal(tlsDir, ids...); err != nil {
		return nil, err
	}
	c.TLS = pki.LocalFiles(tlsDir, Operator)
	if c.tls, err = pki.Load(c.TLS, nil); err != nil {
		return nil, err
	}
	var join []string
	for i := range cfg.Servers {
		join = append(join, fmt.Sprintf("%s:%d", n.Host(fmt.Sprintf("s%d", i)).Addr, portControl))
	}
	for i := range cfg.Servers {
		h := n.Host(fmt.Sprintf("s%d", i))
		id := fmt.Sprintf("stor-%d", i) // ordinal 0 bootstraps
		dataDir := filepath.Join(cfg.Dir, id)
		if err := os.MkdirAll(dataDir, 0o755); err != nil {
			return nil, err
		}
		s := &Server{ID: id, Host: h, DataDir: dataDir}
		if cfg.LocalReads {
			// Socket paths are short (108 bytes): not under cfg.Dir.
			if c.sockDir == "" {
				if c.sockDir, err = os.MkdirTemp("", "stor-jepsen"); err != nil {
					return nil, err
				}
			}
			s.LocalSocket = filepath.Join(c.sockDir, id+".sock")
		}
		certs := pki.LocalFiles(tlsDir, pki.Identity{Role: pki.RoleServer, Name: id})
		s.Proc = &Proc{Name: id, Host: h, Bin: cfg.ServerBin, LogPath: filepath.Join(cfg.Dir, id+".log"), Env: cfg.ServerEnv,
			Args: []string{
				"--id", id, "--data-dir", dataDir,
				"--listen", fmt.Sprintf("%s:%d", h.Addr, portControl),
				"--raft-listen", fmt.Sprintf("%s:%d", h.Addr, portRaft),
				"--data-listen", fmt.Sprintf("%s:%d", h.Addr, portData),
				"--raft-advertise", fmt.Sprintf("%s:%d", h.Addr, portRaftProxy),
				"--data-advertise", fmt.Sprintf("%s:%d", h.Addr, portDataProxy),
				"--join", strings.Join(join, ","),
				"--server-down-timeout", "5s", "--capacity", "10GiB",
				"--tls-cert", certs.Cert, "--tls-key", certs.Key, "--tls-ca", certs.CA,
			}}
		if s.LocalSocket != "" {
			s.Proc.Args = append(s.Proc.Args, "--local-socket", s.LocalSocket)
		}
		s.Proxy = &Proc{Name: id + "-proxy", Host: h, Bin: cfg.SelfBin, LogPath: filepath.Join(cfg.Dir, id+"-proxy.log"),
			Env: []string{"STOR_JEPSEN_ROLE=proxy"},
			Args: []string{
				fmt.Sprintf("%s:%d=%s:%d", h.Addr, portRaftProxy, h.Addr, portRaft),
				fmt.Sprintf("%s:%d=%s:%d", h.Addr, portDataProxy, h.Addr, portData),
			}}
		c.Servers = append(c.Servers, s)
		if err := s.Proxy.Start(true); err != nil {
			return nil, err
		}
		if line, err := s.Proxy.Stdout().ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
			return nil, fmt.Errorf("proxy on %s did not start: %q %v", h.Name, line, err)
		}
		if err := s.Proc.Start(false); err != nil {
			return nil, err
		}
	}
	if c.Control, err = c.DialControl(join); err != nil {
		return nil, err
	}
	if err := c.WaitHealthy(ctx, 60*time.Second); err != nil {
		return nil, err
	}
	for i := range cfg.Clients {
		name := fmt.Sprintf("c%d", i)
		h := n.Host(name)
		ch := &ClientHost{Name: name, Host: h, Proc: &Proc{Name: name, Host: h, Bin: cfg.SelfBin,
			LogPath: filepath.Join(cfg.Dir, name+".log"), Env: []string{"STOR_JEPSEN_ROLE=client"}}}
		if cfg.LocalReads && i < len(c.Servers) {
			ch.Local = c.Servers[i]
		}
		c.Clients = append(c.Clients, ch)
	}
	return c, nil
}

// ServerAddrs are the control addresses of all servers.
func (c *Cluster) ServerAddrs() []string {
	var out []string
	for _, s := range c.Servers {
		out = append(out, s.ControlAddr())
	}
	return out
}

// Leader returns the server the cluster names as leader, or nil.
func (c *Cluster) Leader(ctx context.Context) *Server {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	st, err := c.Control.Cluster.Status(ctx, &storpb.StatusRequest{})
	if err != nil {
		return nil
	}
	for _, s := range c.Servers {
		if s.ID == st.GetLeaderId() {
			return s
		}
	}
	return nil
}

// WaitHealthy waits for a leader whose membership lists every server and
// reports every server up.
func (c *Cluster) WaitHealthy(ctx context.Context, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	var last string
	for time.Now().Before(deadline) {
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		ls, err := c.Control.Cluster.ListServers(rctx, &storpb.ListServersRequest{})
		cancel()
		if err == nil {
			up := 0
			for _, s := range ls.GetServers() {
				if s.GetState() == storpb.ServerState_SERVER_STATE_UP {
					up++
				}
			}
			if up == len(c.Servers) && c.Leader(ctx) != nil {
				return nil
			}
			last = fmt.Sprintf("%d of %d servers up", up, len(c.Servers))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
	return fmt.Errorf("cluster not healthy after %v: %s", limit, last)
}

// ProxyCommand sends a command line to s's link proxy.
func (s *Server) ProxyCommand(cmd string) error {
	s.proxyMu.Lock()
	defer s.proxyMu.Unlock()
	if _, err := fmt.Fprintln(s.Proxy.Stdin(), cmd); err != nil {
		return err
	}
	line, err := s.Proxy.Stdout().ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != "ok" {
		return fmt.Errorf("proxy %s: %s", s.ID, line)
	}
	return nil
}

// Session returns the client host's current session and engine epoch.
func (ch *ClientHost) Session() (*Session, uint64) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	return ch.session, ch.epoch
}

// Open starts the client process if it is not running and opens the
// volume in it (a takeover: a new epoch fences every other engine).
func (c *Cluster) Open(ctx context.Context, ch *ClientHost) (uint64, error) {
	ch.mu.Lock()
	s := ch.session
	if s == nil || s.isDead() {
		// Whatever is left of an earlier process goes first.
		ch.Proc.Kill()
		var err error
		if s, err = startSession(ch.Proc); err != nil {
			ch.mu.Unlock()
			return 0, err
		}
		ch.session = s
	}
	ch.mu.Unlock()
	req := Request{Op: "open", Volume: c.Volume, Node: ch.Name, Servers: c.ServerAddrs(), TLS: c.TLS, Broken: c.Broken, TimeoutMS: 30000}
	if ch.Local != nil {
		req.LocalSockets = []string{ch.Local.LocalSocket}
	}
	r, err := s.Call(ctx, req)
	if err != nil {
		return 0, err
	}
	if !r.OK {
		return 0, fmt.Errorf("open on %s: %s", ch.Name, r.Err)
	}
	ch.mu.Lock()
	ch.epoch = r.Epoch
	ch.mu.Unlock()
	return r.Epoch, nil
}

// KillClient kills the client host's process (its engine dies uncleanly).
func (c *Cluster) KillClient(ch *ClientHost) {
	// Under ch.mu, so that no Open starts a process in between that the
	// session reset would then orphan.
	ch.mu.Lock()
	defer ch.mu.Unlock()
	ch.Proc.Kill()
	ch.session = nil
}

// Close stops everything and removes the hosts.
func (c *Cluster) Close() {
	for _, ch := range c.Clients {
		ch.Proc.Kill()
	}
	for _, s := range c.Servers {
		s.Proc.Kill()
		s.Proxy.Kill()
	}
	if c.Control != nil {
		c.Control.Close()
	}
	c.Net.Close()
	if c.sockDir != "" {
		os.RemoveAll(c.sockDir)
	}
}

// colocated reports whether hosts a and b are one machine (a client host
// and its Local server).
func (c *Cluster) colocated(a, b *Host) bool {
	for _, ch := range c.Clients {
		if ch.Local != nil && (ch.Host == a && ch.Local.Host == b || ch.Host == b && ch.Local.Host == a) {
			return true
		}
	}
	return false
}
