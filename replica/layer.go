package replica

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
)

// indexOp is one record of a layer's index journal: blocks
// [start, start+n) entered the layer. A layer's index only grows: a block
// zeroed or trimmed stays in it as a hole (a mask).
type indexOp struct {
	start, n uint64
}

const (
	indexOpSize = 17 // kind u8, start u64, count u64
	indexAdd    = 1  // the only kind
)

func encodeIndexOps(ops []indexOp) []byte {
	b := make([]byte, 0, len(ops)*indexOpSize)
	for _, op := range ops {
		b = append(b, indexAdd)
		b = binary.BigEndian.AppendUint64(b, op.start)
		b = binary.BigEndian.AppendUint64(b, op.n)
	}
	return b
}

func decodeIndexOps(p []byte, maxBlock uint64) ([]indexOp, error) {
	if len(p)%indexOpSize != 0 {
		return nil, fmt.Errorf("%w: index batch of %d bytes", ErrCorrupt, len(p))
	}
	ops := make([]indexOp, 0, len(p)/indexOpSize)
	for ; len(p) > 0; p = p[indexOpSize:] {
		op := indexOp{start: binary.BigEndian.Uint64(p[1:]), n: binary.BigEndian.Uint64(p[9:])}
		if p[0] != indexAdd || op.n == 0 || op.start >= maxBlock || op.n > maxBlock-op.start {
			return nil, fmt.Errorf("%w: bad index record %d %d+%d", ErrCorrupt, p[0], op.start, op.n)
		}
		ops = append(ops, op)
	}
	return ops, nil
}

// layer is one level of a replica's chain: a sparse data file holding each
// block at its volume offset, and the index of the blocks the layer holds.
type layer struct {
	id   uint64
	data File
	base string // path prefix: <dir>/layer-<id>

	// Guarded by Replica.mu (written with it held exclusively).
	snapshot string // "" for the head
	size     uint64 // volume size when cut (snapshot layers)
	deleting bool

	unsynced atomic.Bool // data written since the last Sync

	// loaded: the index has been replayed (and, while the replica's files
	// are open, the files are open). Guarded by Replica.mu.
	loaded bool

	mu      sync.RWMutex
	idx     blockSet  // guarded by mu
	pending []indexOp // guarded by mu: index changes not yet journaled

	// Guarded by Replica.flushMu.
	jnl       *journal
	jnlOps    int // records in the journal
	compactAt int // rewrite the journal when jnlOps passes this
}

const minCompactOps = 4096

func layerBase(dir string, id uint64) string {
	return filepath.Join(dir, fmt.Sprintf("layer-%08d", id))
}

// createLayer creates the empty files of a layer and syncs them; the
// caller syncs the directory.
func createLayer(fsys FS, dir string, id uint64) (*layer, error) {
	base := layerBase(dir, id)
	f, err := fsys.OpenFile(base+".data", os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, ioErr("create layer data", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return nil, ioErr("sync layer data", err)
	}
	f.Close()
	if err := writeJournalFile(fsys, base+".idx", journalKindIndex, 1, nil); err != nil {
		return nil, err
	}
	return openLayer(fsys, dir, id, ^uint64(0))
}

// openLayer opens a layer and replays its index. maxBlock bounds the block
// numbers a record may name.
func openLayer(fsys FS, dir string, id uint64, maxBlock uint64) (*layer, error) {
	l := &layer{id: id, base: layerBase(dir, id)}
	if err := l.load(fsys, maxBlock); err != nil {
		return nil, err
	}
	return l, nil
}

// unloadedLayer is a layer of dir whose files are not opened and whose
// index is not read until its replica's files are next opened (reopen):
// how a replica's snapshot layers are opened by OpenStore (doc.go, "Open
// files").
func unloadedLayer(dir string, id uint64) *layer {
	return &layer{id: id, base: layerBase(dir, id)}
}

// load opens the files of a layer never opened in this process and
// replays its index, all or nothing. maxBlock bounds the block numbers a
// record may name.
func (l *layer) load(fsys FS, maxBlock uint64) error {
	f, err := fsys.OpenFile(l.base+".data", os.O_RDWR, 0)
	if err != nil {
		if os.IsNotExist(err) {
			return fmt.Errorf("%w: %s.data is missing", ErrCorrupt, l.base)
		}
		return ioErr("open layer data", err)
	}
	j, payloads, err := openJournal(fsys, l.base+".idx", journalKindIndex)
	if err != nil {
		f.Close()
		return err
	}
	var idx blockSet
	nops := 0
	for _, p := range payloads {
		ops, err := decodeIndexOps(p, maxBlock)
		if err != nil {
			f.Close()
			j.close()
			return fmt.Errorf("%s.idx: %w", l.base, err)
		}
		for _, op := range ops {
			idx.add(op.start, op.n)
		}
		nops += len(ops)
	}
	l.mu.Lock()
	l.idx = idx
	l.mu.Unlock()
	l.data, l.jnl, l.jnlOps, l.loaded = f, j, nops, true
	l.compactAt = max(minCompactOps, 2*idx.countRuns())
	return nil
}

// unload drops the index of a layer whose files are closed and whose
// index changes are all journaled (the replica was synced): the next
// reopen loads it again. A layer with changes not journaled is left
// loaded.
func (l *layer) unload() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.loaded || len(l.pending) > 0 || l.data != nil || l.unsynced.Load() {
		return
	}
	l.idx = blockSet{}
	l.jnl, l.jnlOps, l.compactAt, l.loaded = nil, 0, 0, false
}

// close closes the layer's files; reopen opens them again. Closing a
// closed or unloaded layer is a no-op.
func (l *layer) close() error {
	var err error
	if l.data != nil {
		err = l.data.Close()
		l.data = nil
	}
	if l.jnl == nil {
		return err
	}
	if jerr := l.jnl.close(); err == nil {
		err = jerr
	}
	return err
}

// reopen opens the files of a layer closed by close: its index stays in
// memory and nothing is replayed. A layer not loaded yet is loaded.
func (l *layer) reopen(fsys FS, maxBlock uint64) error {
	if !l.loaded {
		return l.load(fsys, maxBlock)
	}
	f, err := fsys.OpenFile(l.base+".data", os.O_RDWR, 0)
	if err != nil {
		return ioErr("reopen layer data", err)
	}
	if err := l.jnl.reopen(); err != nil {
		f.Close()
		return err
	}
	l.data = f
	return nil
}

// layerFiles is the number of files an open layer holds.
const layerFiles = 2

func (l *layer) has(b uint64) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.idx.has(b)
}

func (l *layer) nextRun(from uint64) (start, end uint64, ok bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.idx.nextRun(from)
}

// add enters blocks into the index (after their data is written).
func (l *layer) add(start, n uint64) {
	l.mu.Lock()
	if l.idx.add(start, n) {
		l.pending = append(l.pending, indexOp{start: start, n: n})
	}
	l.mu.Unlock()
}

func (l *layer) writeAt(p []byte, off int64) error {
	_, err := l.data.WriteAt(p, off)
	l.unsynced.Store(true)
	return ioErr("write layer data", err)
}

func (l *layer) punch(off, n int64) error {
	err := l.data.PunchHole(off, n)
	l.unsynced.Store(true)
	return ioErr("punch layer data", err)
}

func (l *layer) readAt(p []byte, off int64) error {
	return ioErr("read layer data", readFull(l.data, p, off))
}

// syncLocked makes the layer durable: first the data, then the index
// changes made before the data sync began. The index thus never names a
// block whose data is not durable. The caller holds Replica.flushMu.
func (l *layer) syncLocked() error {
	l.mu.Lock()
	ops := l.pending
	l.pending = nil
	var snapshot []indexOp
	if len(ops) > 0 && l.jnlOps+len(ops) > l.compactAt {
		l.idx.runs(func(s, e uint64) bool {
			snapshot = append(snapshot, indexOp{start: s, n: e - s})
			return true
		})
	}
	l.mu.Unlock()
	restore := func() {
		l.mu.Lock()
		l.pending = append(ops, l.pending...)
		l.mu.Unlock()
		l.unsynced.Store(true)
	}
	if l.unsynced.Swap(false) {
		if err := l.data.Sync(); err != nil {
			restore()
			return ioErr("sync layer data", err)
		}
	}
	if len(ops) == 0 {
		return nil
	}
	if snapshot != nil {
		// The snapshot was taken with ops, before the data sync: it names
		// exactly the blocks that are durable now.
		if err := l.jnl.rewrite(splitPayloads(nil, encodeIndexOps(snapshot), indexOpSize)); err != nil {
			restore()
			return err
		}
		l.jnlOps = len(snapshot)
		l.compactAt = max(minCompactOps, 2*len(snapshot))
		return nil
	}
	if err := l.jnl.append(splitPayloads(nil, encodeIndexOps(ops), indexOpSize)...); err != nil {
		restore()
		return err
	}
	l.jnlOps += len(ops)
	return nil
}

func (l *layer) removeFiles(fsys FS) error {
	err := fsys.Remove(l.base + ".data")
	if err2 := fsys.Remove(l.base + ".idx"); err == nil {
		err = err2
	}
	return err
}
