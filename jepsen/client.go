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
	// Op: open, write, read, flush, close.
	Op string `json:"op"`
	// open: the volume, the node to attach as, the control addresses.
	Volume  string   `json:"volume,omitempty"`
	Node    string   `json:"node,omitempty"`
	Servers []string `json:"servers,omitempty"`
	// Broken names a deliberately broken engine mode (see BrokenModes);
	// used only to prove the checkers can fail.
	Broken string `json:"broken,omitempty"`
	// write, read: the byte offset; write: the data; read: the length.
	Off  int64  `json:"off,omitempty"`
	Data []byte `json:"data,omitempty"`
	Len  int    `json:"len,omitempty"`
	// TimeoutMS bounds the request in the engine.
	TimeoutMS int `json:"timeout_ms,omitempty"`
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

// BrokenModes are the engine faults the "harness can fail" tests switch
// on in a client process. They exist only in this harness's client; no
// stor binary can run them.
var BrokenModes = map[string]string{
	"early-ack": "each replica write is acknowledged as soon as it is sent, before the replica answered",
	"early-cut": "each replica's snapshot cut is acknowledged at once and made 100-600 ms later, while writes go on",
}

type clientProc struct {
	mu  sync.Mutex // guards eng and c
	eng *engine.Engine
	c   *client.Client

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

func (p *clientProc) engine() *engine.Engine {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.eng
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
		if e := p.engine(); err == nil && e != nil {
			resp.Epoch = e.Epoch()
		}
	case "write", "read", "flush", "close":
		e := p.engine()
		if e == nil {
			err = errors.New("client: no engine open")
			break
		}
		resp.Epoch = e.Epoch()
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
		}
	default:
		err = fmt.Errorf("client: unknown op %q", req.Op)
	}
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
		c, err := client.Dial(req.Servers)
		if err != nil {
			p.mu.Unlock()
			return err
		}
		p.c = c
	}
	c := p.c
	p.mu.Unlock()
	connect := engine.WireConnector(wire.ClientConfig{})
	switch req.Broken {
	case "":
	case "early-ack":
		connect = wrapConns(connect, earlyAck)
	case "early-cut":
		connect = wrapConns(connect, earlyCut)
	default:
		return fmt.Errorf("client: unknown broken mode %q", req.Broken)
	}
	eng, err := engine.Open(ctx, engine.Config{
		Volume: req.Volume, NodeID: req.Node, Takeover: true,
		Control:      engine.ControlPlane{Volumes: c.Volumes, Cluster: c.Cluster, Snapshots: c.Snapshots},
		Connect:      connect,
		IOTimeout:    3 * time.Second,
		FaultTimeout: 20 * time.Second,
		Logger:       p.log,
	})
	if err != nil {
		return err
	}
	p.mu.Lock()
	old := p.eng
	p.eng = eng
	p.mu.Unlock()
	if old != nil {
		go func() {
			cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = old.Close(cctx, false)
		}()
	}
	return nil
}

// wrapConns is next with every replica connection it opens wrapped.
func wrapConns(next engine.Connector, wrap func(engine.ReplicaConn) engine.ReplicaConn) engine.Connector {
	return func(ctx context.Context, addr, id string, epoch uint64) (engine.ReplicaConn, error) {
		c, err := next(ctx, addr, id, epoch)
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
