package replica

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Short-circuit reads (DESIGN.md, "Data path", point 6). A volume engine on
// the same host as this replica's server may read the replica's layers
// itself, with pread, instead of sending each read to the server. The
// server hands it read-only descriptors (replica/localread) of
//
//   - every layer's data file (oldest first, the head last), with each
//     layer's index as it is at the open: the reader reads a block from
//     the head if the head's index held it or the reader wrote it since
//     (it is the volume's only writer, tells its view of every write
//     before sending it, and opens a view of several layers while none
//     of its writes is in flight), else from the topmost older layer
//     whose index holds it, else from the head, where such a block is a
//     hole (see below); with one layer, every block from the head;
//   - the replica's read generation file (readgen): one 8-byte counter in
//     host byte order, which the engine maps and compares after every
//     read.
//
// OpenDirect opens them when no rebuild is in progress, the chain has at
// most MaxDirectLayers layers and its indexes at most MaxDirectRuns runs,
// and the request's epoch is the replica's current one (it never raises
// the epoch: only the authorised data protocol does). A merge of a
// deleted snapshot into the layer above it leaves an open view right: the
// blocks it copies up are read from the layer they came from, unchanged
// until the layer is dropped, which ends the view.
//
// A block the head's index does not hold must be a hole in its file. A
// write reaches the file before its block enters the index, and the index
// is made durable only at a flush, so after a crash (of the server or the
// host) the file may hold data the index never recorded: the server reads
// such a block as zeroes (or from an older layer), a direct read would
// not. Opening the replica therefore punches every block of the head that
// its index does not hold within the regions the dirty-region log still
// marks, the only ones with writes not yet flushed (scrubHeadLocked); if
// that fails, the replica is never read directly until it is opened again.
//
// Everything that could make the files stop being the volume's contents
// as a read by the engine holding the epoch would see them advances the
// counter first (invalidateDirect), before the change takes effect:
// raising the epoch (a newer attach), cutting a snapshot (a new head),
// dropping a merged layer, growing, beginning a rebuild, the replica
// failing, closing (server stop, deletion) and opening it again (a new
// server process). So a direct read that, once its preads are done, still
// sees the value it was opened with read the files before any of those
// happened, which is what a read through the server at that moment would
// have returned; one that sees another value is discarded and the engine
// reads through the server, which applies the epoch and every other rule.
// The engine's own writes do not advance it: they reach the same files
// through the server (the page cache is shared), its view reads the
// blocks they touch from the head, and it never reads a block while its
// write is in flight.
//
// Advancing the counter is a file write, and can fail (EMFILE; EROFS once
// ext4 has remounted read-only). A change that can wait is then refused.
// A failure, or a close, cannot be refused: so whoever opens a view
// also gives OpenDirect a way to end it (the localread server closes the
// connection the engine checks after every read), and a failed advance
// calls every open view's before it returns. A view ends either way.
const readGenName = "readgen"

// Limits of a direct open: the descriptors one message carries, and the
// index runs one open copies.
const (
	MaxDirectLayers = 16
	MaxDirectRuns   = 1 << 20
)

// DirectFiles are the descriptors of a short-circuit read (see above). The
// caller owns and closes them, and calls Done when the view they were sent
// for ends.
type DirectFiles struct {
	// Layers are the chain's data files, oldest first, the head last,
	// opened read-only. A block past a file's end reads as zeroes.
	Layers []*os.File
	// Index is each layer's index at the open, as sorted runs of blocks
	// [start, end).
	Index [][][2]uint64
	// Gen is the read generation file, opened read-only.
	Gen *os.File
	// Generation is the counter's value when they were opened: a read is
	// valid while the file still holds it.
	Generation uint64

	r    *Replica    // whose views hold view until Done
	view *directView // this open's registration
}

// directView is an open view's registration with its replica: how to end
// it (OpenDirect's revoke).
type directView struct{ revoke func() }

// Done tells the replica the view opened with d has ended (its engine
// closed it): the replica forgets the revoke OpenDirect was given. It may
// be called before or after Close, and more than once.
func (d *DirectFiles) Done() {
	if d.r == nil {
		return
	}
	d.r.directMu.Lock()
	delete(d.r.views, d.view)
	d.r.directMu.Unlock()
}

// Close closes the files and drops the index (an open copies up to
// MaxDirectRuns runs). The view they were sent for lives on until Done.
func (d *DirectFiles) Close() error {
	d.Index = nil
	errs := []error{d.Gen.Close()}
	for _, f := range d.Layers {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}

// OpenDirect opens r for short-circuit reads at o.Epoch; see above. It
// fails with ErrStaleEpoch for an old epoch and with ErrNotDirect when the
// replica cannot be read that way now (snapshots, a rebuild, a store not
// on the OS filesystem).
//
// revoke must end the view the files are sent for, so that no read
// through it is taken as valid once revoke has returned; the replica
// calls it, at most once, when it cannot advance its read generation
// (see above). It is held until the caller calls Done.
func (r *Replica) OpenDirect(o Op, revoke func()) (*DirectFiles, error) {
	if revoke == nil {
		return nil, fmt.Errorf("%w: a direct open needs a way to end its view", ErrInvalid)
	}
	r.mu.RLock()
	for !r.closed && !r.filesOpen {
		// The indexes handed out are those of loaded layers: open it as a
		// request would.
		need := r.fileCountLocked()
		r.mu.RUnlock()
		if err := r.reopen(need); err != nil {
			return nil, err
		}
		r.mu.RLock()
	}
	defer r.mu.RUnlock()
	if r.closed {
		return nil, ErrClosed
	}
	if err := r.failed(); err != nil {
		return nil, err
	}
	switch cur := r.epoch.Load(); {
	case o.Epoch < cur:
		return nil, fmt.Errorf("%w: request epoch %d, replica %s is at %d", ErrStaleEpoch, o.Epoch, r.id, cur)
	case o.Epoch > cur:
		return nil, fmt.Errorf("%w: replica %s is at epoch %d, not %d: open it through its server first", ErrNotDirect, r.id, cur, o.Epoch)
	case r.noDirect:
		return nil, fmt.Errorf("%w: replica %s: its head could not be scrubbed when it was opened", ErrNotDirect, r.id)
	case len(r.layers) > MaxDirectLayers:
		return nil, fmt.Errorf("%w: replica %s has %d layers (at most %d)", ErrNotDirect, r.id, len(r.layers), MaxDirectLayers)
	case r.rebuild != nil:
		return nil, fmt.Errorf("%w: replica %s is being rebuilt", ErrNotDirect, r.id)
	}
	index := make([][][2]uint64, len(r.layers))
	runs := 0
	for i, l := range r.layers {
		l.mu.RLock()
		l.idx.runs(func(s, e uint64) bool {
			index[i] = append(index[i], [2]uint64{s, e})
			runs++
			return runs <= MaxDirectRuns
		})
		l.mu.RUnlock()
		if runs > MaxDirectRuns {
			return nil, fmt.Errorf("%w: replica %s's indexes have more than %d runs", ErrNotDirect, r.id, MaxDirectRuns)
		}
	}
	r.directMu.Lock()
	defer r.directMu.Unlock()
	gen, err := r.readGenLocked(true)
	if err != nil {
		return nil, err
	}
	// A failure recorded since the check above advanced the counter
	// before this read of it, or will after directMu is released: either
	// way no view of a failed replica stays valid.
	if err := r.failed(); err != nil {
		return nil, err
	}
	// The store's FS is a seam for tests; a descriptor can be handed out
	// only for a file of the operating system.
	genf, err := os.Open(filepath.Join(r.dir, readGenName))
	if err != nil {
		return nil, fmt.Errorf("%w: replica %s: %v", ErrNotDirect, r.id, err)
	}
	d := &DirectFiles{Index: index, Gen: genf, Generation: gen}
	for _, l := range r.layers {
		f, err := os.Open(l.base + ".data")
		if err != nil {
			d.Close()
			return nil, fmt.Errorf("%w: replica %s: %v", ErrNotDirect, r.id, err)
		}
		d.Layers = append(d.Layers, f)
	}
	// Held under directMu from the read of the counter on: a failure
	// recorded after the check above revokes this view too.
	if r.views == nil {
		r.views = map[*directView]bool{}
	}
	d.r, d.view = r, &directView{revoke: revoke}
	r.views[d.view] = true
	return d, nil
}

// readGenLocked returns the read generation, creating its file (at 1) if
// create is set and it does not exist; without create a missing file is 0
// (no short-circuit read was ever opened). The caller holds directMu.
func (r *Replica) readGenLocked(create bool) (uint64, error) {
	path := filepath.Join(r.dir, readGenName)
	flag := os.O_RDWR
	if create {
		flag |= os.O_CREATE
	}
	f, err := r.fs.OpenFile(path, flag, 0o644)
	if errors.Is(err, os.ErrNotExist) && !create {
		return 0, nil
	}
	if err != nil {
		return 0, ioErr("open "+readGenName, err)
	}
	defer f.Close()
	var b [8]byte
	n, err := f.ReadAt(b[:], 0)
	if n == len(b) {
		if v := binary.NativeEndian.Uint64(b[:]); v != 0 {
			return v, nil
		}
	} else if err != nil && !errors.Is(err, io.EOF) {
		return 0, ioErr("read "+readGenName, err)
	}
	// New (or torn by a crash while being created): start at 1.
	binary.NativeEndian.PutUint64(b[:], 1)
	if _, err := f.WriteAt(b[:], 0); err != nil {
		return 0, ioErr("write "+readGenName, err)
	}
	return 1, nil
}

// invalidateDirect advances the read generation, so that every
// short-circuit read opened before fails its check. It is called before
// the change it announces takes effect. When it fails, every open view is
// revoked before it returns, and a change that can be refused is not made
// (its caller returns the error). Without a readgen file (no short-circuit
// read was ever opened) it does nothing.
func (r *Replica) invalidateDirect(why string) error {
	r.directMu.Lock()
	defer r.directMu.Unlock()
	err := r.advanceReadGenLocked(why)
	if err != nil && len(r.views) > 0 {
		r.log.Warn("short-circuit reads could not be invalidated: ending their views", "why", why, "views", len(r.views), "err", err)
		for v := range r.views {
			v.revoke()
			delete(r.views, v)
		}
	}
	return err
}

func (r *Replica) advanceReadGenLocked(why string) error {
	f, err := r.fs.OpenFile(filepath.Join(r.dir, readGenName), os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return ioErr("open "+readGenName, err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], 0); err != nil && !errors.Is(err, io.EOF) {
		return ioErr("read "+readGenName, err)
	}
	v := binary.NativeEndian.Uint64(b[:]) + 1
	binary.NativeEndian.PutUint64(b[:], v)
	if _, err := f.WriteAt(b[:], 0); err != nil {
		return ioErr("write "+readGenName, err)
	}
	r.log.Debug("short-circuit reads invalidated", "why", why, "read_generation", v)
	return nil
}

// scrubHeadLocked punches the blocks of the head that its index does not
// hold within the dirty regions (see OpenDirect). It runs while the
// replica is opened, before any request; a failure only disables direct
// reads (the server's reads go through the index and are right anyway).
func (r *Replica) scrubHeadLocked() {
	h := r.layers[len(r.layers)-1]
	size := r.size.Load()
	blocksPerRegion := uint64(r.regionSize) / BlockSize
	punched := uint64(0)
	for _, run := range r.dirty.list() {
		b, end := run[0]*blocksPerRegion, min(run[1]*blocksPerRegion, size/BlockSize)
		for b < end {
			s, e, ok := h.idx.nextRun(b)
			if !ok || s >= end {
				s, e = end, end
			}
			if s > b {
				if err := h.punch(int64(b)*BlockSize, int64(s-b)*BlockSize); err != nil {
					r.noDirect = true
					r.log.Warn("scrubbing the head's unindexed blocks failed: the replica will not be read directly", "err", err)
					return
				}
				punched += s - b
			}
			b = max(e, s)
		}
	}
	if punched > 0 {
		r.log.Debug("head scrubbed of unindexed blocks in dirty regions", "blocks", punched)
	}
}
