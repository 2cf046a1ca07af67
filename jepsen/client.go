package jepsen

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// The client host runs the volume engine exactly as stor-ctl nbd serve
// and the CSI node plugin set it up (engine.Open over the retrying
// control client and the wire connector), in its own process so that it
// can be killed with SIGKILL. The harness drives it with JSON requests on
// stdin, one per line; it answers each on stdout, in any order.

// Request is one command to a client process.
type Request struct {
	ID uint64 `json:"id"`
	// Op: open, write, read, flush, close (the engine closes without
	// detaching), detach (it closes and detaches the volume, as a clean
	// unstage does), fill (Len bytes of filler written at Off).
	Op string `json:"op"`
	// open: the volume, the node to attach as, the control addresses.
	Volume  string   `json:"volume,omitempty"`
	Node    string   `json:"node,omitempty"`
	Servers []string `json:"servers,omitempty"`
	// LocalSockets, for open: the short-circuit read sockets of the
	// servers on this client's machine (ClusterConfig.LocalReads).
	LocalSockets []string `json:"local_sockets,omitempty"`
	// TLS, for open: the certificate the process presents to the control
	// API and the data ports (the harness's operator certificate).
	TLS pki.Files `json:"tls"`
	// Broken names a deliberately broken engine mode (see BrokenModes);
	// used only to prove the checkers can fail.
	Broken string `json:"broken,omitempty"`
	// write, read: the byte offset; write: the data; read: the length.
	Off  int64  `json:"off,omitempty"`
	Data []byte `json:"data,omitempty"`
	Len  int    `json:"len,omitempty"`
	// TimeoutMS bounds the request in the engine.
	TimeoutMS int `json:"timeout_ms,omitempty"`
	// Conn, for write, read and flush: 0 calls the engine directly;
	// 1..NBDConns sends the request over that NBD connection of the
	// process (see nbdConns).
	Conn int `json:"conn,omitempty"`
}

// Response answers a Request.
type Response struct {
	ID    uint64 `json:"id"`
	OK    bool   `json:"ok"`
	Kind  string `json:"kind,omitempty"` // failure class: fenced, io, timeout, closed, error
	Err   string `json:"err,omitempty"`
	Epoch uint64 `json:"epoch,omitempty"`
	Data  []byte `json:"data,omitempty"`
}

// BrokenMode is a deliberately broken mode of the system, switched on
// only to prove that the checkers can fail (the "harness can fail"
// tests). A mode acts through any of its hooks; each nil hook does
// nothing. Adding one is an entry in BrokenModes and a test that runs it
// (runBroken).
type BrokenMode struct {
	Doc string
	// Conn wraps every replica connection the client's engine opens.
	Conn func(engine.ReplicaConn) engine.ReplicaConn
	// Engine adjusts the client's engine configuration before Open (for
	// a test knob of the engine).
	Engine func(*engine.Config)
	// ServerEnv is added to every stor-server's environment (for a knob
	// the jepsenfaults build of the server reads).
	ServerEnv []string
}

// BrokenModes are the broken modes by name. The connection and engine
// hooks exist only in this harness's client; no stor binary runs them.
var BrokenModes = map[string]BrokenMode{
	"early-ack": {Doc: "each replica write is acknowledged as soon as it is sent, before the replica answered", Conn: earlyAck},
	"early-cut": {Doc: "each replica's snapshot cut is acknowledged at once and made 100-600 ms later, while writes go on", Conn: earlyCut},
	"rebuild-from-latest-fault": {Doc: "a rebuild retried after a failed one starts its delta from the replica's latest fault, not from where it stopped being healthy (issue 13, A)",
		Engine: rebuildFromLatestFault},
	"unordered-rebuild": {Doc: "a rebuild's copies overwrite newer writes: they are ordered neither against the engine's writes in flight nor by the target's tracking of what was written since the rebuild began (issue 13, C)",
		Engine: unorderedRebuild, Conn: untrackedRebuildWrites},
	"blind-reconcile": {Doc: "the reconcile after an unclean stop copies nothing: every replica's digests say it holds what the others hold",
		Conn: blindReconcile},
	"stale-incarnations": {Doc: "every server lets each attach handle of a replica serve, not only the newest: writes an engine gave up on with their connection land after the replica's new incarnation was rebuilt (wire's doc, \"Incarnations\")",
		ServerEnv: []string{"STOR_JEPSEN_STALE_INCARNATIONS=1"}},
	"admit-new-data-dirs": {Doc: "every server ignores data dir identity: one whose data dir was wiped is admitted and makes the replicas placed on it again, empty, under records that have them healthy or rebuilding by a delta",
		ServerEnv: []string{"STOR_JEPSEN_IGNORE_DATA_DIR=1"}},
	"stale-local-reads": {Doc: "a short-circuit read of the co-located server's replica uses what it read even after the server stopped vouching for the file (a snapshot cut, a newer epoch, a rebuild)",
		Engine: func(cfg *engine.Config) { cfg.UnsafeStaleLocalReads = true }},
}

type clientProc struct {
	mu  sync.Mutex // guards eng, nbd, c and dataDial
	eng *engine.Engine
	nbd *nbdConns // the NBD connections serving eng
	c   *client.Client
	// dataDial opens replica connections under the certificate of the
	// first open.
	dataDial pki.DialFunc

	outMu sync.Mutex
	out   *json.Encoder
	log   *slog.Logger
}

// RunClient serves requests from in until it closes.
func RunClient(in io.Reader, out io.Writer, logw io.Writer) error {
	p := &clientProc{out: json.NewEncoder(out), log: slog.New(slog.NewTextHandler(logw, nil))}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	var wg sync.WaitGroup
	for sc.Scan() {
		var req Request
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			return fmt.Errorf("client: bad request: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.reply(p.handle(req))
		}()
	}
	wg.Wait()
	return sc.Err()
}

func (p *clientProc) reply(r Response) {
	p.outMu.Lock()
	defer p.outMu.Unlock()
	_ = p.out.Encode(r)
}

func (p *clientProc) engine() (*engine.Engine, *nbdConns) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.eng, p.nbd
}

func (p *clientProc) handle(req Request) Response {
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp := Response{ID: req.ID}
	var err error
	switch req.Op {
	case "open":
		err = p.open(ctx, req)
		if e, _ := p.engine(); err == nil && e != nil {
			resp.Epoch = e.Epoch()
		}
	case "write", "read", "flush", "close", "detach", "fill":
		e, conns := p.engine()
		if e == nil {
			err = errors.New("client: no engine open")
			break
		}
		resp.Epoch = e.Epoch()
		switch {
		case req.Conn != 0:
			resp.Data, err = conns.call(ctx, req)
			return finish(resp, err)
		}
		switch req.Op {
		case "write":
			err = e.WriteAt(ctx, req.Data, req.Off, false)
		case "read":
			buf := make([]byte, req.Len)
			if err = e.ReadAt(ctx, buf, req.Off); err == nil {
				resp.Data = buf
			}
		case "flush":
			err = e.Flush(ctx)
		case "close":
			err = e.Close(ctx, false)
		case "detach":
			conns.close()
			err = e.Close(ctx, true)
		case "fill":
			err = fill(ctx, e, req.Off, req.Len)
		}
	default:
		err = fmt.Errorf("client: unknown op %q", req.Op)
	}
	return finish(resp, err)
}

// finish completes resp with err's class.
func finish(resp Response, err error) Response {
	if err == nil {
		resp.OK = true
		return resp
	}
	resp.Err = err.Error()
	switch {
	case errors.Is(err, engine.ErrFenced):
		resp.Kind = "fenced"
	case errors.Is(err, engine.ErrIO):
		resp.Kind = "io"
	case errors.Is(err, engine.ErrClosed):
		resp.Kind = "closed"
	case errors.Is(err, context.DeadlineExceeded):
		resp.Kind = "timeout"
	default:
		resp.Kind = "error"
	}
	return resp
}

// open attaches the volume here with a new epoch (a takeover: any other
// holder, including this process's previous engine, is fenced).
func (p *clientProc) open(ctx context.Context, req Request) error {
	p.mu.Lock()
	if p.c == nil {
		src, err := pki.Load(req.TLS, p.log)
		if err != nil {
			p.mu.Unlock()
			return err
		}
		c, err := client.Dial(req.Servers, src.GRPCDialCredentials())
		if err != nil {
			p.mu.Unlock()
			return err
		}
		p.c, p.dataDial = c, src.Dialer(nil, pki.RoleServer)
	}
	c, dataDial := p.c, p.dataDial
	p.mu.Unlock()
	mode, ok := BrokenModes[req.Broken]
	if req.Broken != "" && !ok {
		return fmt.Errorf("client: unknown broken mode %q", req.Broken)
	}
	connect := engine.WireConnector(wire.ClientConfig{Dial: dataDial})
	if mode.Conn != nil {
		connect = wrapConns(connect, mode.Conn)
	}
	cfg := engine.Config{
		Volume: req.Volume, NodeID: req.Node, Takeover: true,
		Control:      engine.ControlPlane{Volumes: c.Volumes, Cluster: c.Cluster, Snapshots: c.Snapshots},
		Connect:      connect,
		IOTimeout:    engineIOTimeout,
		FaultTimeout: 20 * time.Second,
		Logger:       p.log,
		LocalReaders: engine.DialLocalReaders(ctx, req.LocalSockets, p.log),
	}
	if mode.Engine != nil {
		mode.Engine(&cfg)
	}
	eng, err := engine.Open(ctx, cfg)
	if err != nil {
		return err
	}
	conns, err := serveNBD(eng, p.log)
	if err != nil {
		_ = eng.Close(ctx, false)
		return err
	}
	p.mu.Lock()
	old, oldConns := p.eng, p.nbd
	p.eng, p.nbd = eng, conns
	p.mu.Unlock()
	if old != nil {
		go func() {
			cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			oldConns.close()
			_ = old.Close(cctx, false)
		}()
	}
	return nil
}

// wrapConns is next with every replica connection it opens wrapped.
func wrapConns(next engine.Connector, wrap func(engine.ReplicaConn) engine.ReplicaConn) engine.Connector {
	return func(ctx context.Context, addr string, open wire.OpenRequest) (engine.ReplicaConn, error) {
		c, err := next(ctx, addr, open)
		if err != nil {
			return nil, err
		}
		return wrap(c), nil
	}
}

// earlyAck is the "early-ack" broken mode: every replica write returns
// success as soon as it is handed to the connection, while the replica
// has not answered yet (and may never apply it).
func earlyAck(c engine.ReplicaConn) engine.ReplicaConn { return earlyAckConn{c} }

type earlyAckConn struct{ engine.ReplicaConn }

func (c earlyAckConn) WriteAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	buf := append([]byte(nil), p...)
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = c.ReplicaConn.WriteAt(ctx, o, buf, off)
	}()
	return nil
}

// earlyCut is the "early-cut" broken mode: a replica's snapshot cut
// returns success at once and is made 100-600 ms later, so writes the
// engine resumed after the cut land in the snapshot, a different set on
// each replica.
func earlyCut(c engine.ReplicaConn) engine.ReplicaConn {
	if cut, ok := c.(snapshotCutter); ok {
		return earlyCutConn{ReplicaConn: c, cut: cut}
	}
	return c
}

// snapshotCutter is the wire connection's snapshot capability the engine
// looks for.
type snapshotCutter interface {
	CreateSnapshot(ctx context.Context, o replica.Op, id string) error
}

type earlyCutConn struct {
	engine.ReplicaConn
	cut snapshotCutter
}

func (c earlyCutConn) CreateSnapshot(ctx context.Context, o replica.Op, id string) error {
	delay := time.Duration(100+rand.IntN(500)) * time.Millisecond
	go func() {
		time.Sleep(delay)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = c.cut.CreateSnapshot(ctx, o, id)
	}()
	return nil
}
