package replica

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
)

const (
	creatingPrefix = ".creating-"
	deletingPrefix = ".deleting-"
)

// Spec describes a replica to create.
type Spec struct {
	ID       string // the replica id: a safe file name (see validName)
	VolumeID string // the volume it belongs to
	Size     uint64 // bytes: > 0, a multiple of BlockSize, at most MaxSize
	// VolumeName is the volume's name, for this store's logs only (a
	// replica is not told its volume's name otherwise).
	VolumeName string
}

// Store is the set of replicas in one directory of one server.
type Store struct {
	cfg Config
	log *slog.Logger

	cache *fileCache

	mu       sync.Mutex
	closed   bool
	replicas map[string]*Replica // guarded by mu
	damaged  map[string]error    // guarded by mu: replicas that failed to open
}

// OpenStore opens every replica directory in cfg.Dir (creating the
// directory if needed). A replica that cannot be opened is logged and
// listed by Damaged with its error; it is never deleted or overwritten
// (only Delete removes it). Snapshot layers are read at a replica's
// first request, not here (doc.go, "Open files"): an unreadable one
// fails the replica then. Leftovers of an interrupted Create or Delete
// are removed.
func OpenStore(cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Store{cfg: cfg, log: cfg.Logger, cache: newFileCache(cfg.MaxOpenFiles), replicas: map[string]*Replica{}, damaged: map[string]error{}}
	fsys := cfg.FS
	if err := fsys.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, ioErr("mkdir "+cfg.Dir, err)
	}
	// The directory may have just been created: make its entry durable,
	// or a crash could take every replica created in it along.
	if err := fsys.SyncDir(filepath.Dir(filepath.Clean(cfg.Dir))); err != nil {
		return nil, ioErr("sync the parent of "+cfg.Dir, err)
	}
	entries, err := fsys.ReadDir(cfg.Dir)
	if err != nil {
		return nil, ioErr("read "+cfg.Dir, err)
	}
	var names []string
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(cfg.Dir, name)
		if strings.HasPrefix(name, creatingPrefix) || strings.HasPrefix(name, deletingPrefix) {
			s.log.Info("removing the leftover of an interrupted create or delete", "dir", path)
			if err := fsys.RemoveAll(path); err != nil {
				s.log.Warn("removing leftover failed", "dir", path, "err", err)
			}
			continue
		}
		if !e.IsDir() {
			continue
		}
		if validName(name) != nil {
			s.log.Warn("ignoring a directory that is not a replica", "dir", path)
			continue
		}
		names = append(names, name)
	}
	s.openAll(names)
	if err := fsys.SyncDir(cfg.Dir); err != nil {
		return nil, errors.Join(ioErr("sync dir "+cfg.Dir, err), s.Close())
	}
	return s, nil
}

// openParallel is how many replicas OpenStore opens at once. Opening is
// a few small reads per replica; on a cold page cache they wait for the
// disk, which serves many at once (measured in docs/BENCHMARKS.md).
const openParallel = 16

// openAll opens the replicas named (directories of the store) with
// openParallel workers, and enters them into the store, or into damaged
// with their errors.
func (s *Store) openAll(names []string) {
	type result struct {
		name string
		r    *Replica
		err  error
	}
	todo := make(chan string)
	done := make(chan result)
	var wg sync.WaitGroup
	for range min(openParallel, len(names)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range todo {
				s.cache.makeRoom(nil, newReplicaFiles)
				r, err := s.openReplica(filepath.Join(s.cfg.Dir, name))
				if err == nil {
					s.cacheAdd(r)
				}
				done <- result{name, r, err}
			}
		}()
	}
	go func() {
		defer close(todo)
		for _, name := range names {
			todo <- name
		}
	}()
	go func() {
		wg.Wait()
		close(done)
	}()
	for res := range done {
		if res.err != nil {
			s.log.Error("replica is damaged; it is kept as it is and not served", "replica", res.name,
				"dir", filepath.Join(s.cfg.Dir, res.name), "err", res.err)
			s.damaged[res.name] = res.err
			continue
		}
		s.replicas[res.name] = res.r
	}
}

// Create creates a replica, or returns the existing one with the same ID
// and VolumeID (growing it if spec.Size is larger). An existing replica of
// another volume is ErrExists.
func (s *Store) Create(spec Spec) (*Replica, error) {
	if err := validName(spec.ID); err != nil {
		return nil, err
	}
	if spec.VolumeID == "" || len(spec.VolumeID) > 1024 {
		return nil, fmt.Errorf("%w: volume id of %d bytes", ErrInvalid, len(spec.VolumeID))
	}
	if spec.Size == 0 || spec.Size%BlockSize != 0 || spec.Size > MaxSize {
		return nil, fmt.Errorf("%w: size %d is not a positive multiple of %d up to %d", ErrInvalid, spec.Size, BlockSize, uint64(MaxSize))
	}
	s.cache.makeRoom(nil, newReplicaFiles)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	if r := s.replicas[spec.ID]; r != nil {
		if r.VolumeID() != spec.VolumeID {
			return nil, fmt.Errorf("%w: replica %s belongs to volume %s, not %s", ErrExists, spec.ID, r.VolumeID(), spec.VolumeID)
		}
		if spec.Size > r.Size() {
			r.mu.Lock()
			err := error(ErrClosed)
			if !r.closed {
				err = r.growLocked(spec.Size)
			}
			r.mu.Unlock()
			if err != nil {
				return nil, err
			}
		}
		return r, nil
	}
	if err := s.damaged[spec.ID]; err != nil {
		return nil, fmt.Errorf("replica %s exists but is damaged (delete it first): %w", spec.ID, err)
	}
	fsys, dir := s.cfg.FS, s.cfg.Dir
	tmp := filepath.Join(dir, creatingPrefix+spec.ID)
	final := filepath.Join(dir, spec.ID)
	if _, err := fsys.Stat(final); err == nil {
		return s.adoptLocked(spec, final)
	}
	if err := fsys.RemoveAll(tmp); err != nil {
		return nil, ioErr("remove "+tmp, err)
	}
	if err := createReplicaFiles(fsys, tmp, spec, s.cfg.RegionSize); err != nil {
		fsys.RemoveAll(tmp)
		return nil, err
	}
	if err := fsys.Rename(tmp, final); err != nil {
		fsys.RemoveAll(tmp)
		return nil, ioErr("rename "+tmp, err)
	}
	err := ioErr("sync dir "+dir, fsys.SyncDir(dir))
	var r *Replica
	if err == nil {
		r, err = s.openReplica(final)
	}
	if err != nil {
		s.undoCreateLocked(spec.ID, err)
		return nil, err
	}
	s.addLocked(r)
	s.log.Info("replica created", "replica", spec.ID, "volume", spec.VolumeName, "volume_id", spec.VolumeID, "size", spec.Size)
	return r, nil
}

// undoCreateLocked takes away the directory of replica id, which a Create
// renamed into place but then failed to make durable or to open (cause):
// a failed Create leaves nothing that a later Create or OpenStore would
// take for a replica. If even the rename away fails, the directory stays
// (it is complete: everything in it was synced before the rename) and a
// retried Create adopts it (adoptLocked).
func (s *Store) undoCreateLocked(id string, cause error) {
	fsys, dir := s.cfg.FS, s.cfg.Dir
	trash := filepath.Join(dir, deletingPrefix+id)
	if err := fsys.RemoveAll(trash); err != nil {
		s.log.Warn("undoing a failed create", "replica", id, "cause", cause, "err", err)
		return
	}
	if err := fsys.Rename(filepath.Join(dir, id), trash); err != nil {
		s.log.Warn("undoing a failed create; a retried create adopts it", "replica", id, "cause", cause, "err", err)
		return
	}
	if err := fsys.SyncDir(dir); err != nil {
		s.log.Warn("undoing a failed create", "replica", id, "cause", cause, "err", err)
	}
	if err := fsys.RemoveAll(trash); err != nil {
		s.log.Warn("removing the files of a failed create; retried at the next open", "dir", trash, "err", err)
	}
}

// adoptLocked is Create for a replica directory that exists but that this
// store did not open: what a Create whose undo failed leaves (see
// undoCreateLocked). If it opens and belongs to spec's volume it is taken
// as created (grown to spec.Size if smaller); otherwise ErrExists, and it
// is left as it is.
func (s *Store) adoptLocked(spec Spec, path string) (*Replica, error) {
	r, err := s.openReplica(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %s exists and is not a replica this store opened: %w", ErrExists, path, err)
	}
	if r.VolumeID() != spec.VolumeID {
		r.Close()
		return nil, fmt.Errorf("%w: %s exists and holds a replica of volume %s, not %s", ErrExists, path, r.VolumeID(), spec.VolumeID)
	}
	if spec.Size > r.Size() {
		r.mu.Lock()
		err := r.growLocked(spec.Size)
		r.mu.Unlock()
		if err != nil {
			r.Close()
			return nil, err
		}
	}
	s.addLocked(r)
	s.log.Info("replica adopted: a directory left by an earlier create", "replica", spec.ID, "volume", spec.VolumeName, "volume_id", spec.VolumeID)
	return r, nil
}

// openReplica opens the replica in dir. Out of descriptors (EMFILE,
// ENFILE: the process's other files), it closes idle replicas and tries
// once more, rather than take the replica for damaged or fail a create
// for a shortage the file cache can relieve.
func (s *Store) openReplica(dir string) (*Replica, error) {
	r, err := openReplica(s.cfg.FS, dir, s.log)
	if outOfFiles(err) {
		s.log.Warn("out of file descriptors opening a replica; closing idle replicas", "dir", dir, "err", err)
		s.cache.closeIdle(nil, newReplicaFiles+s.cache.budget/8)
		r, err = openReplica(s.cfg.FS, dir, s.log)
	}
	return r, err
}

// newReplicaFiles is how many files a replica without snapshots holds open.
const newReplicaFiles = 3 + layerFiles

// addLocked enters r, just opened, into the store and its file cache. The
// caller holds s.mu.
func (s *Store) addLocked(r *Replica) {
	s.cacheAdd(r)
	s.replicas[r.id] = r
}

// cacheAdd enters r, just opened, into the store's file cache (if its
// files were left open: see openReplica).
func (s *Store) cacheAdd(r *Replica) {
	r.cache = s.cache
	r.mu.Lock()
	if r.filesOpen {
		s.cache.add(r, r.fileCountLocked())
	}
	r.mu.Unlock()
}

// Get returns replica id: ErrNotFound if there is none; the open error if
// it is damaged.
func (s *Store) Get(id string) (*Replica, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	if r := s.replicas[id]; r != nil {
		return r, nil
	}
	if err := s.damaged[id]; err != nil {
		return nil, fmt.Errorf("replica %s is damaged: %w", id, err)
	}
	return nil, fmt.Errorf("%w: replica %s", ErrNotFound, id)
}

// Delete closes replica id and removes its directory, damaged or not.
// ErrNotFound if there is none.
func (s *Store) Delete(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	r := s.replicas[id]
	_, damaged := s.damaged[id]
	if r == nil && !damaged {
		return fmt.Errorf("%w: replica %s", ErrNotFound, id)
	}
	if r != nil {
		if err := r.Close(); err != nil {
			s.log.Warn("closing a replica being deleted", "replica", id, "err", err)
		}
	}
	fsys, dir := s.cfg.FS, s.cfg.Dir
	trash := filepath.Join(dir, deletingPrefix+id)
	if err := fsys.RemoveAll(trash); err != nil {
		return ioErr("remove "+trash, err)
	}
	if err := fsys.Rename(filepath.Join(dir, id), trash); err != nil {
		err = ioErr("rename "+id, err)
		if r != nil {
			delete(s.replicas, id)
			s.damaged[id] = fmt.Errorf("delete failed half-way: %w", err)
		}
		return err
	}
	delete(s.replicas, id)
	delete(s.damaged, id)
	if err := fsys.SyncDir(dir); err != nil {
		return ioErr("sync dir "+dir, err)
	}
	if err := fsys.RemoveAll(trash); err != nil {
		s.log.Warn("removing a deleted replica's files; retried at the next open", "dir", trash, "err", err)
	}
	s.log.Info("replica deleted", "replica", id)
	return nil
}

// List returns the open replicas ordered by id.
func (s *Store) List() []*Replica {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := slices.Sorted(maps.Keys(s.replicas))
	out := make([]*Replica, 0, len(ids))
	for _, id := range ids {
		out = append(out, s.replicas[id])
	}
	return out
}

// Damaged returns the replicas that could not be opened, with their
// errors (errors.Is ErrCorrupt or ErrIO in general).
func (s *Store) Damaged() map[string]error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.damaged)
}

// Close closes every replica (each is flushed first). Calls after Close
// fail with ErrClosed.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	for _, id := range slices.Sorted(maps.Keys(s.replicas)) {
		if err := s.replicas[id].Close(); err != nil {
			errs = append(errs, fmt.Errorf("replica %s: %w", id, err))
		}
	}
	return errors.Join(errs...)
}
