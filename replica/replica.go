package replica

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Replica is one volume replica: a chain of layers (read-only snapshots and
// a writable head), its epoch, dirty-region log and write history. Its
// methods are safe for concurrent use; see doc.go for the rules they keep.
type Replica struct {
	fs         FS
	dir        string
	log        *slog.Logger
	id         string
	volumeID   string
	regionSize int64

	size  atomic.Uint64 // written with mu held exclusively
	epoch atomic.Uint64 // written with mu held exclusively

	// mu is the operation lock. Every request holds it shared from its
	// epoch check to its last effect; raising the epoch, cutting a
	// snapshot, dropping a merged layer, growing, rebuild begin/end and
	// Close hold it exclusively. So once a higher epoch is recorded no
	// request of a lower epoch is still applying anything.
	mu        sync.RWMutex
	closed    bool          // guarded by mu
	filesOpen bool          // guarded by mu: false while the store's file cache has closed them
	layers    []*layer      // guarded by mu: oldest first, the head last
	meta      meta          // guarded by mu: as in meta.json
	rebuild   *rebuildState // guarded by mu (its contents by its own lock)
	ranges    rangeLock     // per-block write serialisation
	dirty     *dirtyLog     // own lock
	hist      *history      // own lock; its journal under flushMu
	failure   atomic.Pointer[failure]

	// genMu guards the epoch file and its state; the epoch half is only
	// changed with mu held exclusively, the generation half with mu held
	// shared and genMu.
	genMu     sync.Mutex
	epochFile File
	epochSt   epochState
	maxGen    atomic.Uint64

	// flushMu serialises syncs: the layer and history journals are only
	// written with it held.
	flushMu     sync.Mutex
	syncStarted atomic.Uint64 // number of the latest sync begun
	syncDone    atomic.Uint64 // number of the latest sync completed

	snapMu sync.Mutex // serialises DeleteSnapshot

	directMu sync.Mutex           // serialises the read generation file (shortcircuit.go)
	views    map[*directView]bool // guarded by directMu: the open views (shortcircuit.go)
	noDirect bool                 // the head could not be scrubbed at open: no direct reads (shortcircuit.go)

	cache   *fileCache    // the store's; nil: the files stay open until Close
	lastUse atomic.Uint64 // cache.clock at the latest request
	pins    atomic.Int64  // Pin calls not yet undone: the cache does not close the files
}

type failure struct{ err error }

// fail makes the replica refuse all further requests: after a failed
// fsync the kernel may have dropped the dirty pages, so nothing written
// since the last good sync can be trusted to become durable.
func (r *Replica) fail(err error) error {
	if r.failure.CompareAndSwap(nil, &failure{err}) {
		r.log.Error("replica failed: refusing all further requests until reopened", "err", err)
		if ierr := r.invalidateDirect("replica failed"); ierr != nil {
			r.log.Error("short-circuit reads of the failed replica could not be invalidated: their views were ended", "err", ierr)
		}
	}
	return err
}

func (r *Replica) failed() error {
	if f := r.failure.Load(); f != nil {
		return fmt.Errorf("%w: replica %s failed earlier: %w", ErrIO, r.id, f.err)
	}
	return nil
}

// createReplicaFiles lays out a new, empty replica in dir and syncs it.
func createReplicaFiles(fsys FS, dir string, spec Spec, regionSize int64) error {
	if err := fsys.MkdirAll(dir, 0o755); err != nil {
		return ioErr("mkdir "+dir, err)
	}
	m := meta{
		Format: metaFormat, ID: spec.ID, VolumeID: spec.VolumeID, Size: spec.Size,
		RegionSize: regionSize, NextLayer: 2, Layers: []metaLayer{{ID: 1}},
	}
	l, err := createLayer(fsys, dir, 1)
	if err != nil {
		return err
	}
	l.close()
	f, err := fsys.OpenFile(filepath.Join(dir, epochName), os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return ioErr("create epoch", err)
	}
	err = writeEpoch(f, epochState{seq: 1})
	f.Close()
	if err != nil {
		return err
	}
	if err := createDirtyLog(fsys, filepath.Join(dir, dirtyName), regionSize); err != nil {
		return err
	}
	if err := writeHistoryFile(fsys, historyPath(dir), 0); err != nil {
		return err
	}
	return writeMeta(fsys, dir, m) // syncs dir
}

// openReplica opens the replica in dir, recovering what a crash left.
func openReplica(fsys FS, dir string, log *slog.Logger) (_ *Replica, err error) {
	m, err := readMeta(fsys, dir)
	if err != nil {
		return nil, err
	}
	r := &Replica{fs: fsys, dir: dir, id: m.ID, volumeID: m.VolumeID, regionSize: m.RegionSize, meta: m,
		log: log.With("replica", m.ID)}
	if want := filepath.Base(dir); want != m.ID {
		return nil, fmt.Errorf("%w: %s holds replica %q", ErrCorrupt, dir, m.ID)
	}
	r.size.Store(m.Size)
	defer func() {
		if err != nil {
			r.closeFiles()
		}
	}()

	r.epochFile, err = fsys.OpenFile(filepath.Join(dir, epochName), os.O_RDWR, 0)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("%w: epoch file is missing", ErrCorrupt)
		}
		return nil, ioErr("open epoch", err)
	}
	if r.epochSt, err = readEpoch(r.epochFile); err != nil {
		return nil, err
	}
	r.epoch.Store(r.epochSt.epoch)
	r.maxGen.Store(r.epochSt.gen)

	// The head is opened and its index read now (the scrub below needs
	// them); the snapshot layers under it at the first reopen (doc.go,
	// "Open files").
	maxBlock := m.Size / BlockSize
	for i, ml := range m.Layers {
		l := unloadedLayer(dir, ml.ID)
		if i == len(m.Layers)-1 {
			if l, err = openLayer(fsys, dir, ml.ID, maxBlock); err != nil {
				return nil, err
			}
		}
		l.snapshot, l.size = ml.Snapshot, ml.Size
		r.layers = append(r.layers, l)
	}
	if err := r.removeOrphans(); err != nil {
		return nil, err
	}
	// A new process: short-circuit reads opened by the last one end.
	if err := r.invalidateDirect("opened"); err != nil {
		return nil, err
	}

	nregions := r.regionCount(m.Size)
	if r.dirty, err = openDirtyLog(fsys, filepath.Join(dir, dirtyName), m.RegionSize, nregions); err != nil {
		return nil, err
	}
	if err := r.openHistory(nregions); err != nil {
		return nil, err
	}
	r.scrubHeadLocked()
	if len(r.layers) > 1 {
		// Its files stay closed until a request needs them.
		if err := r.closeFiles(); err != nil {
			return nil, err
		}
		return r, nil
	}
	r.filesOpen = true
	return r, nil
}

// openHistory loads the write history. Writes since the last persist are
// not in it, but each of them is in a region still marked dirty and was
// made at a generation no higher than the durable maximum generation, so
// every dirty region is taken as written at that generation. A history
// that cannot be read is started afresh, valid only from the generation
// after the highest seen: WrittenSince refuses older generations with
// ErrHistoryLost.
func (r *Replica) openHistory(nregions uint64) error {
	path := historyPath(r.dir)
	h, err := openHistory(r.fs, path, nregions)
	if errors.Is(err, ErrCorrupt) {
		validFrom := r.maxGen.Load() + 1
		r.log.Warn("write history unreadable; starting a new one", "err", err, "validFromGeneration", validFrom)
		if err := writeHistoryFile(r.fs, path, validFrom); err != nil {
			return err
		}
		if err := r.fs.SyncDir(r.dir); err != nil {
			return ioErr("sync dir", err)
		}
		h, err = openHistory(r.fs, path, nregions)
	}
	if err != nil {
		return err
	}
	r.hist = h
	gen := r.maxGen.Load()
	for _, run := range r.dirty.list() {
		h.note(run[0], run[1]-1, gen)
	}
	return nil
}

// removeOrphans deletes layer files that meta.json does not name (left by
// a crash during a snapshot cut or delete) and temporary files. A layer
// that meta.json names and whose files are not there is ErrCorrupt: the
// listing tells that of layers not loaded yet too, so that a replica
// missing one is found damaged when the store opens, not at its first
// read.
func (r *Replica) removeOrphans() error {
	entries, err := r.fs.ReadDir(r.dir)
	if err != nil {
		return ioErr("read "+r.dir, err)
	}
	known := map[uint64]bool{}
	for _, l := range r.layers {
		known[l.id] = true
	}
	present := map[string]bool{}
	for _, e := range entries {
		name := e.Name()
		present[name] = true
		orphan := strings.HasSuffix(name, ".tmp")
		if rest, ok := strings.CutPrefix(name, "layer-"); ok {
			num, _, _ := strings.Cut(rest, ".")
			id, err := strconv.ParseUint(num, 10, 64)
			orphan = err == nil && !known[id]
		}
		if orphan {
			r.log.Info("removing orphaned file", "file", name)
			if err := r.fs.Remove(filepath.Join(r.dir, name)); err != nil {
				r.log.Warn("removing orphaned file failed", "file", name, "err", err)
			}
		}
	}
	for _, l := range r.layers {
		for _, ext := range []string{".data", ".idx"} {
			if name := filepath.Base(l.base) + ext; !present[name] {
				return fmt.Errorf("%w: %s is missing", ErrCorrupt, filepath.Join(r.dir, name))
			}
		}
	}
	return nil
}

// closeFiles closes whatever files of the replica are open.
func (r *Replica) closeFiles() error {
	var errs []error
	for _, l := range r.layers {
		errs = append(errs, l.close())
	}
	if r.epochFile != nil {
		errs = append(errs, r.epochFile.Close())
		r.epochFile = nil
	}
	if r.dirty != nil {
		errs = append(errs, r.dirty.close())
	}
	if r.hist != nil {
		errs = append(errs, r.hist.close())
	}
	return errors.Join(errs...)
}

func (r *Replica) regionCount(size uint64) uint64 {
	return (size + uint64(r.regionSize) - 1) / uint64(r.regionSize)
}

// ID returns the replica id.
func (r *Replica) ID() string { return r.id }

// Failed returns why the replica failed (a sync the disk failed, say), or
// nil. A failed replica refuses every request until its store is opened
// again (its server restarts).
func (r *Replica) Failed() error { return r.failed() }

// VolumeID returns the id of the volume this is a replica of.
func (r *Replica) VolumeID() string { return r.volumeID }

// Size returns the volume size in bytes.
func (r *Replica) Size() uint64 { return r.size.Load() }

// Epoch returns the highest epoch seen.
func (r *Replica) Epoch() uint64 { return r.epoch.Load() }

// RegionSize returns the granularity of DirtyRegions and WrittenSince.
func (r *Replica) RegionSize() int64 { return r.regionSize }

// enter checks o against the replica's epoch and, on success, returns
// holding mu shared: the caller applies its request and then calls
// r.mu.RUnlock. A lower epoch is refused; a higher one is first recorded
// durably (with mu held exclusively, so no request of the old epoch is
// still in flight when it is). A higher generation is recorded durably
// before the request is applied.
func (r *Replica) enter(o Op) error {
	for {
		r.mu.RLock()
		if r.closed {
			r.mu.RUnlock()
			return ErrClosed
		}
		cur := r.epoch.Load()
		if o.Epoch < cur {
			r.mu.RUnlock()
			return fmt.Errorf("%w: request epoch %d, replica %s is at %d", ErrStaleEpoch, o.Epoch, r.id, cur)
		}
		if !r.filesOpen {
			need := r.fileCountLocked()
			r.mu.RUnlock()
			if err := r.reopen(need); err != nil {
				return err
			}
			continue
		}
		r.noteUse()
		if o.Epoch == cur {
			if err := r.failed(); err != nil {
				r.mu.RUnlock()
				return err
			}
			if o.Generation > r.maxGen.Load() {
				if err := r.raiseGen(o.Generation); err != nil {
					r.mu.RUnlock()
					return err
				}
			}
			return nil
		}
		r.mu.RUnlock()
		if err := r.lockOpen(); err != nil {
			return err
		}
		err := r.raiseEpochLocked(o.Epoch)
		r.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// enterExclusive is enter for requests that hold mu exclusively; it
// returns holding it.
func (r *Replica) enterExclusive(o Op) error {
	if err := r.lockOpen(); err != nil {
		return err
	}
	if err := r.raiseEpochLocked(o.Epoch); err != nil {
		r.mu.Unlock()
		return err
	}
	if o.Generation > r.maxGen.Load() {
		if err := r.raiseGen(o.Generation); err != nil {
			r.mu.Unlock()
			return err
		}
	}
	return nil
}

// raiseEpochLocked checks epoch against the replica's and records it if
// higher. The caller holds mu exclusively.
func (r *Replica) raiseEpochLocked(epoch uint64) error {
	if r.closed {
		return ErrClosed
	}
	cur := r.epoch.Load()
	if epoch < cur {
		return fmt.Errorf("%w: request epoch %d, replica %s is at %d", ErrStaleEpoch, epoch, r.id, cur)
	}
	if err := r.failed(); err != nil {
		return err
	}
	if epoch == cur {
		return nil
	}
	if err := r.invalidateDirect("epoch raised"); err != nil {
		return err
	}
	r.genMu.Lock()
	defer r.genMu.Unlock()
	next := r.epochSt
	next.seq++
	next.epoch = epoch
	if err := writeEpoch(r.epochFile, next); err != nil {
		return err
	}
	r.epochSt = next
	r.epoch.Store(epoch)
	r.log.Info("epoch raised", "epoch", epoch)
	return nil
}

// raiseGen durably records a higher generation. The caller holds mu
// (shared or exclusive).
func (r *Replica) raiseGen(gen uint64) error {
	r.genMu.Lock()
	defer r.genMu.Unlock()
	if gen <= r.epochSt.gen {
		return nil
	}
	next := r.epochSt
	next.seq++
	next.gen = gen
	if err := writeEpoch(r.epochFile, next); err != nil {
		return err
	}
	r.epochSt = next
	r.maxGen.Store(gen)
	return nil
}

// Fence records epoch as the highest seen, durably, before returning. A
// lower epoch than the highest is refused with ErrStaleEpoch; the same
// epoch is a no-op.
func (r *Replica) Fence(epoch uint64) error {
	if err := r.enter(Op{Epoch: epoch}); err != nil {
		return err
	}
	r.mu.RUnlock()
	return nil
}

// Close flushes the replica and closes its files. Requests after Close
// fail with ErrClosed. Closing twice is a no-op.
func (r *Replica) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	var errs []error
	errs = append(errs, r.invalidateDirect("closed"))
	if r.filesOpen && r.failure.Load() == nil {
		// (Files closed while idle were synced before they were closed;
		// those OpenStore closed hold nothing a crash could lose: what
		// the open did in dirty regions it redoes at the next open.)
		errs = append(errs, r.flushLocked())
	}
	errs = append(errs, r.closeFiles())
	r.filesOpen = false
	r.cache.remove(r, false)
	return errors.Join(errs...)
}
