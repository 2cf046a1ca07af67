package replica

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// findSnapshotLocked returns the index in r.layers of snapshot id, or -1.
// The caller holds mu.
func (r *Replica) findSnapshotLocked(id string) int {
	for i, l := range r.layers[:len(r.layers)-1] {
		if l.snapshot == id && !l.deleting {
			return i
		}
	}
	return -1
}

// CreateSnapshot cuts a crash-consistent snapshot named id: with every
// write excluded, it syncs the head, freezes it as a read-only layer named
// id and opens a new, empty head. The snapshot holds exactly the writes
// completed before CreateSnapshot was called. An existing id is a no-op.
func (r *Replica) CreateSnapshot(o Op, id string) error {
	if err := r.enterExclusive(o); err != nil {
		return err
	}
	defer r.mu.Unlock()
	if err := validName(id); err != nil {
		return err
	}
	if r.findSnapshotLocked(id) >= 0 {
		return nil
	}
	r.flushMu.Lock()
	_, err := r.syncLocked()
	r.flushMu.Unlock()
	if err != nil {
		return err
	}

	if err := r.invalidateDirect("snapshot cut"); err != nil {
		return err
	}
	m := r.meta.clone()
	newID := m.NextLayer
	nl, err := createLayer(r.fs, r.dir, newID)
	if err != nil {
		return err
	}
	undo := func() {
		nl.close()
		nl.removeFiles(r.fs)
	}
	if err := r.fs.SyncDir(r.dir); err != nil {
		undo()
		return ioErr("sync dir", err)
	}
	size := r.size.Load()
	m.Layers[len(m.Layers)-1].Snapshot = id
	m.Layers[len(m.Layers)-1].Size = size
	m.Layers = append(m.Layers, metaLayer{ID: newID})
	m.NextLayer++
	if err := writeMeta(r.fs, r.dir, m); err != nil {
		undo()
		return err
	}
	head := r.layers[len(r.layers)-1]
	head.snapshot, head.size = id, size
	r.layers = append(r.layers, nl)
	r.meta = m
	r.cache.resize(r, r.fileCountLocked())
	r.log.Info("snapshot created", "snapshot", id, "layer", head.id)
	return nil
}

// Snapshots returns the snapshot ids, oldest first.
func (r *Replica) Snapshots() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	ids := []string{}
	if r.closed {
		return ids
	}
	for _, l := range r.layers[:len(r.layers)-1] {
		if !l.deleting {
			ids = append(ids, l.snapshot)
		}
	}
	return ids
}

// ReadSnapshotAt reads len(p) bytes at off of the volume as it was when
// snapshot id was cut (bounded by the size it had then).
func (r *Replica) ReadSnapshotAt(o Op, id string, p []byte, off int64) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	i := r.findSnapshotLocked(id)
	if i < 0 {
		return fmt.Errorf("%w: snapshot %q of replica %s", ErrNotFound, id, r.id)
	}
	if err := checkRange(off, int64(len(p)), r.layers[i].size, MaxIO); err != nil {
		return err
	}
	return r.readViewLocked(i, p, off)
}

// mergeChunk is how many blocks DeleteSnapshot copies per hold of mu.
const mergeChunk = 256

// DeleteSnapshot deletes snapshot id: its blocks that the next layer up
// lacks are copied into that layer (which is the head, or a newer
// snapshot), that layer is synced, and then the snapshot's layer is
// dropped from meta.json and its files removed. No remaining view changes
// at any point: a block copied up reads the same through the upper layer
// as it did through the snapshot. The copy runs in chunks, each holding mu
// shared and the blocks' range lock, so writes, fencing and snapshot cuts
// proceed meanwhile; a head write to a block always wins over the copy.
func (r *Replica) DeleteSnapshot(o Op, id string) error {
	r.snapMu.Lock()
	defer r.snapMu.Unlock()

	if err := r.enterExclusive(o); err != nil {
		return err
	}
	i := r.findSnapshotLocked(id)
	if i < 0 {
		r.mu.Unlock()
		return fmt.Errorf("%w: snapshot %q of replica %s", ErrNotFound, id, r.id)
	}
	l, upper := r.layers[i], r.layers[i+1]
	l.deleting = true
	r.mu.Unlock()

	done := false
	defer func() {
		if !done {
			r.mu.Lock()
			l.deleting = false
			r.mu.Unlock()
		}
	}()

	for from := uint64(0); ; {
		if err := r.enter(o); err != nil {
			return err
		}
		next, more, err := r.mergeChunkLocked(l, upper, from)
		r.mu.RUnlock()
		if err != nil {
			return err
		}
		if !more {
			break
		}
		from = next
	}

	if err := r.enter(o); err != nil {
		return err
	}
	r.flushMu.Lock()
	err := upper.syncLocked()
	r.flushMu.Unlock()
	r.mu.RUnlock()
	if err != nil {
		return r.fail(err)
	}

	if err := r.enterExclusive(o); err != nil {
		return err
	}
	i = slices.Index(r.layers, l)
	if err := r.invalidateDirect("snapshot layer dropped"); err != nil {
		r.mu.Unlock()
		return err
	}
	m := r.meta.clone()
	m.Layers = slices.Delete(m.Layers, i, i+1)
	if err := writeMeta(r.fs, r.dir, m); err != nil {
		r.mu.Unlock()
		return err
	}
	r.meta = m
	r.layers = slices.Delete(slices.Clone(r.layers), i, i+1)
	if r.filesOpen {
		r.cache.resize(r, r.fileCountLocked())
	}
	done = true
	r.mu.Unlock()

	if err := l.close(); err != nil {
		r.log.Warn("closing deleted snapshot layer", "snapshot", id, "err", err)
	}
	if err := l.removeFiles(r.fs); err != nil {
		r.log.Warn("removing deleted snapshot layer; it is removed at the next open", "snapshot", id, "err", err)
	}
	r.log.Info("snapshot deleted", "snapshot", id, "mergedInto", upper.id)
	return nil
}

// mergeChunkLocked copies up to mergeChunk blocks of l at or after from
// that upper lacks into upper, and returns where to continue. The caller
// holds mu shared.
func (r *Replica) mergeChunkLocked(l, upper *layer, from uint64) (next uint64, more bool, err error) {
	budget := uint64(mergeChunk)
	buf := make([]byte, mergeChunk*BlockSize)
	for budget > 0 {
		s, e, ok := l.nextRun(from)
		if !ok {
			return 0, false, nil
		}
		e = min(e, s+budget)
		budget -= e - s
		r.ranges.lock(s, e)
		err := r.copyBlocksLocked(l, upper, s, e, buf)
		r.ranges.unlock(s, e)
		if err != nil {
			return 0, false, err
		}
		from = e
	}
	return from, true, nil
}

// copyBlocksLocked copies blocks [s, e) of l that upper lacks into upper.
// The caller holds the range lock of [s, e).
func (r *Replica) copyBlocksLocked(l, upper *layer, s, e uint64, buf []byte) error {
	buf = buf[:(e-s)*BlockSize]
	if err := l.readAt(buf, int64(s)*BlockSize); err != nil {
		return err
	}
	for b := s; b < e; b++ {
		if upper.has(b) {
			continue
		}
		data := buf[(b-s)*BlockSize : (b-s+1)*BlockSize]
		var err error
		if isZero(data) {
			err = upper.punch(int64(b)*BlockSize, BlockSize)
		} else {
			err = upper.writeAt(data, int64(b)*BlockSize)
		}
		if err != nil {
			return err
		}
		upper.add(b, 1)
	}
	return nil
}

// isZero reports whether p is all zero bytes. It compares through a
// pointer to each block: converting the slice to an array value copies
// the block first, which cost a rebuild's target about 4% of its CPU
// (replica/isZero in a profile of BenchmarkRebuild) where a block of
// data differs from zero at its first bytes.
func isZero(p []byte) bool {
	for len(p) >= BlockSize {
		if *(*[BlockSize]byte)(p[:BlockSize]) != zeroBlock {
			return false
		}
		p = p[BlockSize:]
	}
	for _, c := range p {
		if c != 0 {
			return false
		}
	}
	return true
}

// Extents returns the allocated ranges (data or zero masks) of a view: the
// head's ("") or snapshot id's. They are ordered and coalesced, start at or
// after from (an extent straddling from is clipped), and number at most
// limit (limit <= 0: all).
func (r *Replica) Extents(o Op, snapshotID string, from int64, limit int) ([]Extent, error) {
	if err := r.enter(o); err != nil {
		return nil, err
	}
	defer r.mu.RUnlock()
	top, size := len(r.layers)-1, r.size.Load()
	if snapshotID != "" {
		top = r.findSnapshotLocked(snapshotID)
		if top < 0 {
			return nil, fmt.Errorf("%w: snapshot %q of replica %s", ErrNotFound, snapshotID, r.id)
		}
		size = r.layers[top].size
	}
	if from < 0 || uint64(from) > size {
		return nil, fmt.Errorf("%w: extents from %d of a %d-byte volume", ErrInvalid, from, size)
	}
	ls := r.layers[:top+1]
	nblocks := size / BlockSize
	out := []Extent{}
	for pos := uint64(from) / BlockSize; ; {
		s, e, ok := unionNextRun(ls, pos)
		if !ok || s >= nblocks {
			break
		}
		e = min(e, nblocks)
		ext := Extent{Off: int64(s) * BlockSize, Len: int64(e-s) * BlockSize}
		if ext.Off < from {
			ext.Len -= from - ext.Off
			ext.Off = from
		}
		if ext.Len > 0 {
			out = append(out, ext)
		}
		if limit > 0 && len(out) == limit {
			break
		}
		pos = e
	}
	return out, nil
}

// LayerName names the layer that snapshot snapshotID's cut at volume epoch
// epoch gets on a replica. The cluster names layers by cut epoch so that a
// cut made at one epoch is never mistaken for one made at another (a
// retried cut by id is a no-op, which must not hide an older point in
// time); see raftstore/snapshot.go.
func LayerName(snapshotID string, epoch uint64) string {
	return fmt.Sprintf("%s_e%d", snapshotID, epoch)
}

// ParseLayerName splits a name made by LayerName.
func ParseLayerName(name string) (snapshotID string, epoch uint64, ok bool) {
	i := strings.LastIndex(name, "_e")
	if i <= 0 {
		return "", 0, false
	}
	epoch, err := strconv.ParseUint(name[i+2:], 10, 64)
	if err != nil {
		return "", 0, false
	}
	return name[:i], epoch, true
}
