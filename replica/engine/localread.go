package engine

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/localread"
	"github.com/stor-io/stor/replica/wire"
)

// LocalReader opens short-circuit reads (replica/localread) of replicas
// held by a server on this host; *localread.Client implements it.
type LocalReader interface {
	// ServerID is the server whose replicas it opens.
	ServerID() string
	// OpenLocal opens a direct view of replica open.Replica at open.Epoch.
	OpenLocal(ctx context.Context, open wire.OpenRequest) (LocalView, error)
}

// LocalView reads one replica directly. ReadAt fails (localread.ErrStale)
// once the replica changed in a way that ends the view; the engine then
// drops it and reads through the server. A view of several layers
// (Layers > 1) is told of every write, zero and trim before it is sent
// (Track: it reads those blocks from the head from then on); false means
// the view must be dropped.
type LocalView interface {
	ReadAt(p []byte, off int64) error
	Layers() int
	Track(off, n int64) bool
	Close() error
}

// localRetry is how long after a failed open the engine reads a replica
// through its server before trying to open a view again; localRefused
// after the server refused (ErrNotDirect: a rebuild, too many layers).
const (
	localRetry   = time.Second
	localRefused = 5 * time.Second
)

// localOpenTimeout bounds opening a view: reads wait for it (the first
// one; the others read through the server meanwhile).
const localOpenTimeout = time.Second

// localRead is the short-circuit state of one opened replica on a local
// server. It lives as long as the replica's connection: members replaced
// by a state change carry it over.
type localRead struct {
	reader LocalReader
	view   atomic.Pointer[localViewRef] // nil: none open
	// closed: never again (the replica failed or left the set, or the
	// engine closed). Set without mu, so that closing never waits for an
	// open (which may wait for quiesce).
	closed atomic.Bool

	mu      sync.Mutex // serialises opening
	retryAt time.Time  // guarded by mu
	why     string     // guarded by mu: the last reason no view could be opened
}

type localViewRef struct{ v LocalView }

// newLocalRead returns the short-circuit state for a replica on serverID,
// or nil when no LocalReader reaches that server.
func (e *Engine) newLocalRead(serverID string) *localRead {
	for _, lr := range e.cfg.LocalReaders {
		if lr.ServerID() == serverID {
			return &localRead{reader: lr}
		}
	}
	return nil
}

// isLocal reports whether serverID runs on this host.
func (e *Engine) isLocal(serverID string) bool { return e.localServers[serverID] }

// readLocal tries to serve a read of healthy member m directly; it
// reports whether it did. The caller holds the read's overlap span, so no
// write to the range is in flight: what the file holds is what every
// replica acknowledged. Any failure (no view, a stale view, an error) is
// answered by reading through the server, which applies every rule and
// reports a real failure of the replica.
func (e *Engine) readLocal(ctx context.Context, m *member, p []byte, off int64) bool {
	l := m.local
	if l == nil {
		return false
	}
	ref := l.view.Load()
	if ref == nil {
		if ref = e.openLocal(ctx, m); ref == nil {
			return false
		}
	}
	err := ref.v.ReadAt(p, off)
	if err == nil || (e.cfg.UnsafeStaleLocalReads && errors.Is(err, localread.ErrStale)) {
		e.localReads.Add(1)
		return true
	}
	// Stale (an epoch, layer, rebuild or server change) or an error: drop
	// the view; the next read may open a new one.
	if l.view.CompareAndSwap(ref, nil) {
		if errors.Is(err, localread.ErrStale) {
			e.logger.Debug("short-circuit read view dropped", "replica", m.info.Id, "err", err)
		} else {
			e.logger.Warn("a direct read of the local replica failed; reading it through its server", "replica", m.info.Id, "err", err)
		}
		ref.v.Close()
	}
	return false
}

// openLocal opens a view for m unless one was opened meanwhile, the last
// attempt failed less than localRetry ago, the replica was dropped, or
// another read is opening one (this read goes through the server rather
// than wait for it).
func (e *Engine) openLocal(ctx context.Context, m *member) *localViewRef {
	l := m.local
	if !l.mu.TryLock() {
		return nil
	}
	defer l.mu.Unlock()
	if ref := l.view.Load(); ref != nil {
		return ref
	}
	if l.closed.Load() || time.Now().Before(l.retryAt) {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, localOpenTimeout)
	defer cancel()
	open := wire.OpenRequest{Replica: m.info.Id, Volume: e.id, Node: e.cfg.NodeID, Epoch: e.epoch, Purpose: e.purpose}
	// A view of one layer reads every block from the head, whatever is
	// written meanwhile: it opens as it is. A view of several must know
	// every write the server's indexes do not show yet: it is opened
	// again with no write in flight (a write holds quiesce shared from
	// before it is sent until it is done), so each write is either in the
	// indexes or tracked by the view (trackLocal), never neither.
	v, err := l.reader.OpenLocal(ctx, open)
	var ref *localViewRef
	if err == nil && v.Layers() == 1 {
		ref = &localViewRef{v: v}
		l.view.Store(ref)
	} else if err == nil {
		v.Close()
		e.quiesce.Lock()
		if v, err = l.reader.OpenLocal(ctx, open); err == nil {
			ref = &localViewRef{v: v}
			l.view.Store(ref)
		}
		e.quiesce.Unlock()
	}
	if ref != nil && l.closed.Load() {
		// Closed while it opened: close drops what it finds, this is ours.
		if l.view.CompareAndSwap(ref, nil) {
			ref.v.Close()
		}
		return nil
	}
	if err != nil {
		l.retryAt = time.Now().Add(localRetry)
		if errors.Is(err, replica.ErrNotDirect) {
			l.retryAt = time.Now().Add(localRefused)
		}
		// Logged when the reason changes (a retained snapshot keeps a
		// replica from direct reads for as long as it exists).
		why := err.Error()
		if errors.Is(err, replica.ErrNotDirect) {
			why = "not-direct"
		}
		if why != l.why {
			l.why = why
			e.logger.Info("the local replica cannot be read directly now; reading it through its server", "replica", m.info.Id, "server", m.info.ServerId, "err", err)
		} else {
			e.logger.Debug("the local replica still cannot be read directly", "replica", m.info.Id, "err", err)
		}
		return nil
	}
	l.why = ""
	e.logger.Info("reading the local replica directly (short-circuit)", "replica", m.info.Id, "server", m.info.ServerId, "short_circuit_reads", e.localReads.Load())
	return ref
}

// close drops the view for good (the replica left the set, or the engine
// closed).
func (l *localRead) close() {
	if l == nil {
		return
	}
	l.closed.Store(true)
	if ref := l.view.Swap(nil); ref != nil {
		ref.v.Close()
	}
}

// ShortCircuitReads is the number of reads (chunks of at most
// replica.MaxIO) served directly from a local replica since Open.
func (e *Engine) ShortCircuitReads() int64 { return e.localReads.Load() }

// LocalReadersOf makes LocalReaders of clients of local servers' sockets.
func LocalReadersOf(clients ...*localread.Client) []LocalReader {
	out := make([]LocalReader, len(clients))
	for i, c := range clients {
		out[i] = localClient{c}
	}
	return out
}

type localClient struct{ c *localread.Client }

func (l localClient) ServerID() string { return l.c.ServerID() }

func (l localClient) OpenLocal(ctx context.Context, open wire.OpenRequest) (LocalView, error) {
	v, err := l.c.Open(ctx, open)
	if err != nil {
		return nil, err
	}
	return v, nil
}

// DialLocalReaders dials the short-circuit read sockets of the servers on
// this host (stor-server --local-socket). A socket that does not answer is
// logged and left out: the engine reads those replicas through their
// servers, and dials again at its next open.
func DialLocalReaders(ctx context.Context, paths []string, log *slog.Logger) []LocalReader {
	var clients []*localread.Client
	for _, p := range paths {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := localread.Dial(dctx, p)
		cancel()
		if err != nil {
			log.Warn("local server's short-circuit read socket did not answer; its replicas are read through the server", "socket", p, "err", err)
			continue
		}
		clients = append(clients, c)
	}
	return LocalReadersOf(clients...)
}

// trackLocal tells every open view that [off, off+n) is about to be
// written (LocalView.Track); a view that cannot track it is dropped. The
// caller holds quiesce shared (beginWrite).
func (e *Engine) trackLocal(off, n int64) {
	if len(e.cfg.LocalReaders) == 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, m := range e.members {
		l := m.local
		if l == nil {
			continue
		}
		ref := l.view.Load()
		if ref == nil || ref.v.Layers() == 1 || ref.v.Track(off, n) {
			continue
		}
		if l.view.CompareAndSwap(ref, nil) {
			e.logger.Debug("short-circuit read view dropped: it tracked too many writes", "replica", m.info.Id)
			ref.v.Close()
		}
	}
}

// stopLocal ends direct reads of replica id for good, before its failure
// is recorded: a write it failed may have left its files without what
// the others hold, and nothing on its server tells a view so.
func (e *Engine) stopLocal(id string) {
	e.mu.Lock()
	m := e.members[id]
	e.mu.Unlock()
	if m != nil {
		m.local.close()
	}
}
