package replica

import (
	"cmp"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
)

// fileCache bounds the files a Store keeps open for its replicas (see
// doc.go, "Open files"). It knows which replicas have their files open
// and how many each holds; when opening one would pass the budget, it
// closes the least recently used idle ones first.
type fileCache struct {
	budget int
	clock  atomic.Uint64 // advanced at every open; a replica's lastUse is a reading of it

	mu     sync.Mutex
	open   map[*Replica]int // guarded by mu: replicas with open files, and how many each holds
	nfiles int              // guarded by mu: the sum of open
	opens  uint64           // guarded by mu: file sets opened since the store opened
	closes uint64           // guarded by mu: idle file sets closed
}

func newFileCache(budget int) *fileCache {
	return &fileCache{budget: budget, open: map[*Replica]int{}}
}

// add records that r opened n files, and marks r as the most recently
// used. The caller holds r.mu exclusively.
func (c *fileCache) add(r *Replica, n int) {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.nfiles += n - c.open[r]
	c.open[r] = n
	c.opens++
	c.mu.Unlock()
	r.lastUse.Store(c.clock.Add(1))
}

// resize records that r, whose files are open, now holds n (a snapshot
// was cut or dropped). The caller holds r.mu exclusively.
func (c *fileCache) resize(r *Replica, n int) {
	if c == nil {
		return
	}
	c.mu.Lock()
	if old, ok := c.open[r]; ok {
		c.nfiles += n - old
		c.open[r] = n
	}
	c.mu.Unlock()
}

// remove records that r closed its files. The caller holds r.mu
// exclusively.
func (c *fileCache) remove(r *Replica, idle bool) {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.nfiles -= c.open[r]
	delete(c.open, r)
	if idle {
		c.closes++
	}
	c.mu.Unlock()
}

// stats returns the files open, and the file sets opened and closed idle.
func (c *fileCache) stats() (files int, opens, closes uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nfiles, c.opens, c.closes
}

// makeRoom closes idle replicas, least recently used first, until need
// more files fit in the budget; it closes an eighth of the budget more
// than that, so that its sort is paid once per many opens. A replica that
// is busy (a request holds its operation lock), rebuilding, pinned, or self is
// left open; if that leaves too few to close, the budget is exceeded
// rather than a request failed. The caller holds no replica's lock (it
// only ever tries them, so it cannot deadlock with one that holds its own).
func (c *fileCache) makeRoom(self *Replica, need int) {
	if c == nil {
		return
	}
	c.mu.Lock()
	over := c.nfiles + need - c.budget
	c.mu.Unlock()
	if over > 0 {
		c.closeIdle(self, over+c.budget/8)
	}
}

// closeIdle closes idle replicas other than self, least recently used
// first, until at least n files are closed or none is left to try.
func (c *fileCache) closeIdle(self *Replica, n int) {
	if c == nil {
		return
	}
	type cand struct {
		r    *Replica
		used uint64
	}
	c.mu.Lock()
	cands := make([]cand, 0, len(c.open))
	for r := range c.open {
		if r != self {
			cands = append(cands, cand{r, r.lastUse.Load()})
		}
	}
	c.mu.Unlock()
	slices.SortFunc(cands, func(a, b cand) int { return cmp.Compare(a.used, b.used) })
	for _, v := range cands {
		if n <= 0 {
			return
		}
		n -= v.r.closeIfIdle()
	}
}

// Pin keeps the replica's files open (once they are) until the returned
// function is called: the data service pins a replica for as long as a
// client has it open (an attached engine, a rebuild, a clone copy), so
// that such a replica never pays a reopen. Pins are counted; calling the
// returned function more than once is a no-op. A pin is a hint about
// cost, not a lock: a request never depends on one (doc.go, "Open
// files").
func (r *Replica) Pin() (unpin func()) {
	r.pins.Add(1)
	var once sync.Once
	return func() { once.Do(func() { r.pins.Add(-1) }) }
}

// noteUse marks r as used now, for the cache's choice of what to close.
// It writes only when the clock moved, so concurrent requests to one
// replica do not contend on it.
func (r *Replica) noteUse() {
	if r.cache == nil {
		return
	}
	if t := r.cache.clock.Load(); r.lastUse.Load() != t {
		r.lastUse.Store(t)
	}
}

// fileCountLocked is the number of files r holds while open. The caller
// holds mu.
func (r *Replica) fileCountLocked() int { return 3 + layerFiles*len(r.layers) }

// closeIfIdle closes r's files if no request holds its operation lock (it
// only tries the lock), no rebuild is in progress on it and it is not
// pinned, and returns how many it closed.
func (r *Replica) closeIfIdle() int {
	if !r.mu.TryLock() {
		return 0
	}
	defer r.mu.Unlock()
	if r.closed || !r.filesOpen || r.rebuild != nil || r.pins.Load() > 0 {
		return 0
	}
	n := r.fileCountLocked()
	r.closeIdleLocked()
	return n
}

// closeIdleLocked makes everything the replica holds durable and closes
// its files; its in-memory state (the head's index, dirty regions and
// their clearing times, write history, epoch, a failure) stays. Its
// snapshot layers' indexes, durable in their journals once synced, are
// dropped, to be read again at the next reopen. A failed sync fails the
// replica as any failed sync does; its files are closed all the same.
// The caller holds mu exclusively.
func (r *Replica) closeIdleLocked() {
	if r.failure.Load() == nil {
		r.flushMu.Lock()
		_, err := r.syncLocked()
		r.flushMu.Unlock()
		if err != nil {
			r.log.Warn("syncing an idle replica before closing its files", "err", err)
		}
	}
	if err := r.closeFiles(); err != nil {
		r.log.Warn("closing an idle replica's files", "err", err)
	}
	if r.failure.Load() == nil {
		for _, l := range r.layers[:len(r.layers)-1] {
			l.unload()
		}
	}
	r.filesOpen = false
	r.cache.remove(r, true)
}

// reopen opens the files of r, closed while it was idle, first making
// room for them in the cache. need is how many it will open.
func (r *Replica) reopen(need int) error {
	if err := r.failed(); err != nil {
		return err
	}
	r.cache.makeRoom(r, need)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.filesOpen {
		return nil
	}
	if err := r.failed(); err != nil {
		// Refused as by an open failed replica; nothing to reopen for.
		return err
	}
	err := r.reopenFilesLocked()
	if r.cache != nil && outOfFiles(err) {
		// The process (or system) is out of descriptors for reasons of its
		// own (connections, say): give back some of the cache's and try
		// once more, rather than fail a request, which would make the
		// engine take this replica for faulty.
		r.log.Warn("out of file descriptors reopening a replica; closing idle replicas", "err", err)
		r.cache.closeIdle(r, need+r.cache.budget/8)
		err = r.reopenFilesLocked()
	}
	if errors.Is(err, ErrCorrupt) {
		// A snapshot layer's index journal that cannot be read (at its
		// first load, or a reload after an idle close): nothing could
		// serve the blocks it names.
		return r.fail(err)
	}
	if err != nil {
		return err
	}
	r.filesOpen = true
	r.cache.add(r, r.fileCountLocked())
	return nil
}

// reopenFilesLocked opens the files closed by closeIdleLocked, all or
// none, and loads the layers not loaded yet (those OpenStore left
// closed). The caller holds mu exclusively.
func (r *Replica) reopenFilesLocked() (err error) {
	defer func() {
		if err != nil {
			r.closeFiles()
		}
	}()
	f, err := r.fs.OpenFile(filepath.Join(r.dir, epochName), os.O_RDWR, 0)
	if err != nil {
		return ioErr("reopen epoch", err)
	}
	r.epochFile = f
	maxBlock := r.size.Load() / BlockSize
	for _, l := range r.layers {
		if err := l.reopen(r.fs, maxBlock); err != nil {
			return err
		}
	}
	if err := r.dirty.reopen(); err != nil {
		return err
	}
	return r.hist.jnl.reopen()
}

// outOfFiles reports whether err is the process or the system running out
// of file descriptors.
func outOfFiles(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// lockOpen takes mu exclusively with the replica's files open (or the
// replica closed, which the caller checks).
func (r *Replica) lockOpen() error {
	for {
		r.mu.Lock()
		if r.closed || r.filesOpen {
			r.noteUse()
			return nil
		}
		need := r.fileCountLocked()
		r.mu.Unlock()
		if err := r.reopen(need); err != nil {
			return err
		}
	}
}
