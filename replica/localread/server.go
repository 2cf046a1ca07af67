package localread

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stor-io/stor/replica"
)

// maxMessage bounds a request and a reply.
const maxMessage = 4096

// connTimeout bounds one connection: its request, the open, the reply.
const connTimeout = 10 * time.Second

// Reply codes.
const (
	codeOK         = ""
	codeStaleEpoch = "stale-epoch"
	codeNotDirect  = "not-direct"
	codeNotFound   = "not-found"
	codeInvalid    = "invalid"
	codeDenied     = "denied"
	codeFailed     = "failed"
)

type request struct {
	Replica string `json:"replica"`
	Volume  string `json:"volume"`
	Epoch   uint64 `json:"epoch"`
}

// protocolVersion is the reply's version: a client refuses any other (the
// descriptors' order and the index's encoding are this version's).
const protocolVersion = 1

type reply struct {
	Version    int    `json:"version"`
	ServerID   string `json:"server_id"`
	Generation uint64 `json:"generation,omitempty"`
	// Runs is, per layer (oldest first), how many index runs follow the
	// reply's line.
	Runs  []int  `json:"runs,omitempty"`
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
}

// Server hands out short-circuit reads of a store's replicas.
type Server struct {
	store    *replica.Store
	serverID string
	log      *slog.Logger

	// hasHandle, if set, reports whether an engine holds a replica open
	// at an epoch through this server process (RequireHandles).
	hasHandle func(replica string, epoch uint64) bool

	mu     sync.Mutex
	lns    map[net.Listener]bool
	views  map[*net.UnixConn]bool // connections held open by Views
	closed bool
	wg     sync.WaitGroup
}

// NewServer serves store's replicas as server serverID.
func NewServer(store *replica.Store, serverID string, log *slog.Logger) *Server {
	if log == nil {
		log = slog.Default()
	}
	return &Server{store: store, serverID: serverID, log: log, lns: map[net.Listener]bool{}, views: map[*net.UnixConn]bool{}}
}

// RequireHandles makes the server vouch for a replica's files only to an
// engine that holds the replica open at the request's epoch through this
// server process, as has reports (the replica data service's
// wire.Server.HasHandle); others are refused with replica.ErrNotDirect
// and read through the server. A server process that crashed loses the
// writes its replicas acknowledged since their last flush, and comes back
// at the same epoch: an engine whose connection died with it must find
// that out by its next request through the server failing (and record the
// replica faulty), not open a view of the restarted replica and read holes
// where it had writes acknowledged. Call it before Serve.
func (s *Server) RequireHandles(has func(replica string, epoch uint64) bool) { s.hasHandle = has }

// Listen makes the unix socket at path with mode 0600, replacing a stale
// socket left by a previous process but not one a live process listens
// on, nor any other kind of file.
func Listen(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("localread: %s exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("localread: %s is in use by another process (another stor-server with the same --local-socket?)", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("localread: remove stale socket: %w", err)
		}
	}
	// Bound with no permission for group and others, so that no one else
	// can connect between the bind and the chmod.
	old := unix.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("localread: %w", err)
	}
	return ln, nil
}

// Serve accepts connections on ln until Close; it returns nil after Close.
func (s *Server) Serve(ln *net.UnixListener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		ln.Close()
		return nil
	}
	s.lns[ln] = true
	s.mu.Unlock()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			return fmt.Errorf("localread: accept: %w", err)
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return nil
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveConn(c)
		}()
	}
}

// Close stops the listeners and waits for the connections being served.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for ln := range s.lns {
		ln.Close()
	}
	for c := range s.views {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *Server) serveConn(c *net.UnixConn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(connTimeout))
	if err := checkPeer(c); err != nil {
		s.log.Warn("short-circuit read refused", "err", err)
		s.send(c, reply{Version: protocolVersion, ServerID: s.serverID, Code: codeDenied, Error: err.Error()}, nil)
		return
	}
	line, err := readLine(c)
	if err != nil {
		s.log.Debug("short-circuit read: bad request", "err", err)
		s.send(c, reply{Version: protocolVersion, ServerID: s.serverID, Code: codeInvalid, Error: err.Error()}, nil)
		return
	}
	var req request
	if err := json.Unmarshal(line, &req); err != nil {
		s.send(c, reply{Version: protocolVersion, ServerID: s.serverID, Code: codeInvalid, Error: "malformed request: " + err.Error()}, nil)
		return
	}
	if req.Replica == "" {
		s.send(c, reply{Version: protocolVersion, ServerID: s.serverID}, nil)
		return
	}
	// The view ends with c: the replica closes it when it cannot
	// advance its read generation (replica.Replica.OpenDirect).
	files, err := s.open(req, func() { c.Close() })
	if err != nil {
		s.send(c, reply{Version: protocolVersion, ServerID: s.serverID, Code: codeOf(err), Error: err.Error()}, nil)
		return
	}
	rep := reply{Version: protocolVersion, ServerID: s.serverID, Generation: files.Generation}
	for _, runs := range files.Index {
		rep.Runs = append(rep.Runs, len(runs))
	}
	err = s.send(c, rep, files)
	files.Close()
	if err == nil {
		s.log.Debug("short-circuit read opened", "replica", req.Replica, "volume_id", req.Volume, "epoch", req.Epoch, "read_generation", files.Generation)
		s.holdOpen(c)
	}
	// The view has ended only once c is closed: until then a revoke
	// must still be able to end it.
	c.Close()
	files.Done()
}

// holdOpen keeps a View's connection open until the client closes it (or
// sends anything) or the server closes: the View checks after every read
// that it is still open, so a read cannot outlive this process unnoticed
// (the kernel closes it when the process dies, before any other server
// could apply a newer epoch's write to a replica this one was serving).
func (s *Server) holdOpen(c *net.UnixConn) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.views[c] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.views, c)
		s.mu.Unlock()
	}()
	c.SetDeadline(time.Time{})
	var b [1]byte
	c.Read(b[:]) // returns at EOF, on any byte, or when Close closes c
}

func (s *Server) open(req request, revoke func()) (*replica.DirectFiles, error) {
	r, err := s.store.Get(req.Replica)
	if err != nil {
		return nil, err
	}
	if r.VolumeID() != req.Volume {
		return nil, fmt.Errorf("%w: replica %s belongs to volume %s, not %s", replica.ErrInvalid, req.Replica, r.VolumeID(), req.Volume)
	}
	if s.hasHandle != nil && !s.hasHandle(req.Replica, req.Epoch) {
		return nil, fmt.Errorf("%w: no engine holds replica %s open at epoch %d through this server process (it restarted since the engine opened it?): read it through the server",
			replica.ErrNotDirect, req.Replica, req.Epoch)
	}
	return r.OpenDirect(replica.Op{Epoch: req.Epoch}, revoke)
}

// checkPeer admits root and this process's user at the other end of c
// (each side checks the other).
func checkPeer(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("peer credentials: %w", cerr)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer pid %d runs as uid %d: only root and uid %d are trusted with replicas' files", cred.Pid, cred.Uid, os.Geteuid())
	}
	return nil
}

func (s *Server) send(c *net.UnixConn, rep reply, files *replica.DirectFiles) error {
	b, err := json.Marshal(rep)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	var oob []byte
	if files != nil {
		fds := []int{int(files.Gen.Fd())}
		for _, f := range files.Layers {
			fds = append(fds, int(f.Fd()))
		}
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		s.log.Debug("short-circuit read: reply not sent", "err", err)
		return err
	}
	if files == nil {
		return nil
	}
	// The indexes: 16 bytes per run (start, end; little-endian).
	w := bufio.NewWriterSize(c, 64<<10)
	var run [16]byte
	for _, runs := range files.Index {
		for _, x := range runs {
			binary.LittleEndian.PutUint64(run[:8], x[0])
			binary.LittleEndian.PutUint64(run[8:], x[1])
			w.Write(run[:])
		}
	}
	if err := w.Flush(); err != nil {
		s.log.Debug("short-circuit read: indexes not sent", "err", err)
		return err
	}
	return nil
}

func codeOf(err error) string {
	switch {
	case errors.Is(err, replica.ErrStaleEpoch):
		return codeStaleEpoch
	case errors.Is(err, replica.ErrNotDirect):
		return codeNotDirect
	case errors.Is(err, replica.ErrNotFound):
		return codeNotFound
	case errors.Is(err, replica.ErrInvalid):
		return codeInvalid
	}
	return codeFailed
}

// readLine reads one request line of at most maxMessage bytes.
func readLine(r io.Reader) ([]byte, error) {
	buf := make([]byte, 0, 256)
	var b [1]byte
	for len(buf) < maxMessage {
		if _, err := r.Read(b[:]); err != nil {
			return nil, fmt.Errorf("read request: %w", err)
		}
		if b[0] == '\n' {
			return buf, nil
		}
		buf = append(buf, b[0])
	}
	return nil, fmt.Errorf("request longer than %d bytes", maxMessage)
}
