package raftstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// FSM is the metadata state machine: raft.BatchingFSM over a bbolt file.
// Raft calls ApplyBatch, Snapshot and Restore from one goroutine; View and
// Watch may be called from any goroutine at any time.
type FSM struct {
	path   string
	logger *slog.Logger
	hub    *watchHub

	applied atomic.Uint64 // mirror of meta/applied_index after each commit
	changed chan struct{} // signalled (never blocking) after every commit

	// mu guards db: readers hold it shared, Restore swaps the file under it
	// exclusively.
	mu sync.RWMutex
	db *bolt.DB
}

var _ raft.BatchingFSM = (*FSM)(nil)

// result is what ApplyBatch returns for one command: the object the
// command created or changed, or the error it was refused with.
type result struct {
	msg proto.Message
	err error
}

// OpenFSM opens (creating if needed) the state machine stored at path.
func OpenFSM(path string, logger *slog.Logger) (*FSM, error) {
	db, err := openStateDB(path)
	if err != nil {
		return nil, err
	}
	f := &FSM{path: path, logger: logger, db: db, hub: newWatchHub(), changed: make(chan struct{}, 1)}
	f.applied.Store(f.readApplied())
	return f, nil
}

func openStateDB(path string) (*bolt.DB, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		if err == bolt.ErrTimeout {
			return nil, fmt.Errorf("raftstore: %s is locked by another process (is another stor-server using this data dir?)", path)
		}
		return nil, fmt.Errorf("%w: open %s: %v", ErrCorrupt, path, err)
	}
	// Create missing buckets and the snapshot index; a complete file is
	// not written to, so that a start that is refused later leaves the
	// directory as it found it.
	complete := true
	_ = db.View(func(tx *bolt.Tx) error {
		for _, b := range allBuckets {
			complete = complete && tx.Bucket(b) != nil
		}
		complete = complete && snapshotIndexAgrees(tx)
		return nil
	})
	if complete {
		return db, nil
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range allBuckets {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		if snapshotIndexAgrees(tx) {
			return nil
		}
		return rebuildSnapshotIndex(tx)
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("%w: init %s: %v", ErrCorrupt, path, err)
	}
	return db, nil
}

// snapshotIndexAgrees reports whether bucketVolumeSnapshots holds as many
// entries as bucketSnapshots. It is missing in a file or image from
// before it (or holds another count if a server that did not keep it
// wrote to it); the FSM keeps the two in step (writer.put, writer.del).
func snapshotIndexAgrees(tx *bolt.Tx) bool {
	idx, snaps := tx.Bucket(bucketVolumeSnapshots), tx.Bucket(bucketSnapshots)
	return idx != nil && snaps != nil && idx.Stats().KeyN == snaps.Stats().KeyN
}

// rebuildSnapshotIndex refills bucketVolumeSnapshots from bucketSnapshots.
func rebuildSnapshotIndex(tx *bolt.Tx) error {
	if err := tx.DeleteBucket(bucketVolumeSnapshots); err != nil {
		return err
	}
	idx, err := tx.CreateBucket(bucketVolumeSnapshots)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketSnapshots).ForEach(func(k, v []byte) error {
		s := &storpb.Snapshot{}
		if err := proto.Unmarshal(v, s); err != nil {
			return fmt.Errorf("%w: snapshot %q: %v", ErrCorrupt, k, err)
		}
		return idx.Put(snapshotIndexKey(s.VolumeId, string(k)), nil)
	})
}

func (f *FSM) readApplied() uint64 {
	var idx uint64
	_ = f.db.View(func(tx *bolt.Tx) error {
		idx = (&Reader{tx: tx}).AppliedIndex()
		return nil
	})
	return idx
}

// AppliedIndex is the index of the last log entry the FSM has applied.
func (f *FSM) AppliedIndex() uint64 { return f.applied.Load() }

// View runs fn on a consistent read-only view of the state.
func (f *FSM) View(fn func(r *Reader) error) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.db == nil {
		return ErrClosed
	}
	return f.db.View(func(tx *bolt.Tx) error { return fn(&Reader{tx: tx}) })
}

// Close closes the database and ends every watch.
func (f *FSM) Close() error {
	f.hub.closeAll()
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.db == nil {
		return nil
	}
	err := f.db.Close()
	f.db = nil
	return err
}

// Apply applies one entry; raft uses ApplyBatch, this satisfies raft.FSM.
func (f *FSM) Apply(l *raft.Log) interface{} {
	return f.ApplyBatch([]*raft.Log{l})[0]
}

// ApplyBatch applies entries in one bbolt transaction and records the last
// index with them. Entries at or below the applied index (replayed after a
// restart) are skipped and answered with nil.
func (f *FSM) ApplyBatch(logs []*raft.Log) []interface{} {
	out := make([]interface{}, len(logs))
	f.mu.RLock()
	defer f.mu.RUnlock()
	applied := f.applied.Load()
	watching := f.hub.any()
	var events []VolumeEvent // one per committed change to a volume, in order
	var last uint64
	err := f.db.Update(func(tx *bolt.Tx) error {
		w := &writer{Reader: Reader{tx: tx}}
		for i, l := range logs {
			if l.Index <= applied {
				continue
			}
			last = l.Index
			if l.Type != raft.LogCommand {
				continue
			}
			cmd, err := decodeCommand(l.Data)
			if err != nil {
				f.logger.Error("undecodable raft entry", "index", l.Index, "err", err)
				out[i] = result{err: err}
				continue
			}
			msg, err := w.apply(cmd)
			w.recordCloneFailures()
			out[i] = result{msg: msg, err: err}
			if err == nil && watching {
				if v, ok := msg.(*storpb.Volume); ok {
					// A deleted volume kept for its snapshots is still there.
					ev := VolumeEvent{Index: l.Index, Deleted: cmd.Op == opDeleteVolume && !IsDeleted(v), id: v.Id}
					if !ev.Deleted {
						ev.Volume = proto.Clone(v).(*storpb.Volume)
					}
					events = append(events, ev)
				}
				for _, id := range w.lastTouched { // side effects (a removed server, a snapshot command)
					switch v, err := w.Volume(id); {
					case err == nil:
						events = append(events, VolumeEvent{Volume: v, Index: l.Index, id: id})
					case errors.Is(err, ErrNotFound): // a tombstone removed with its last snapshot
						events = append(events, VolumeEvent{Deleted: true, Index: l.Index, id: id})
					}
				}
			}
			w.lastTouched = w.lastTouched[:0]
		}
		if last > 0 {
			w.putRaw(bucketMeta, string(keyAppliedIndex), string(binary.BigEndian.AppendUint64(nil, last)))
		}
		return nil
	})
	if err != nil {
		// The state machine cannot persist what Raft committed. Going on
		// would answer from state that a restart loses.
		panic(fmt.Sprintf("raftstore: commit applied entries to %s: %v", f.path, err))
	}
	if last > 0 {
		f.applied.Store(last)
		for _, ev := range events {
			f.hub.publish(ev.id, ev)
		}
		f.signal()
	}
	return out
}

func (f *FSM) signal() {
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

// Changed is signalled after the state changes (coalesced: one signal may
// stand for many changes). It has one consumer: whoever reads it first.
func (f *FSM) Changed() <-chan struct{} { return f.changed }

// publishCurrentLocked sends the current state of the given volumes to
// their watchers (after a restore). Callers hold f.mu.
func (f *FSM) publishCurrentLocked(ids map[string]bool, index uint64) {
	if len(ids) == 0 {
		return
	}
	_ = f.db.View(func(tx *bolt.Tx) error {
		r := &Reader{tx: tx}
		for id := range ids {
			v, err := r.Volume(id)
			f.hub.publish(id, VolumeEvent{Volume: v, Index: index, Deleted: err != nil, id: id})
		}
		return nil
	})
}

// Snapshot copies the whole database into memory. Metadata is small (a
// volume record is a few hundred bytes), and a copy lets Persist run while
// Apply goes on without holding a bbolt read transaction open.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var buf bytes.Buffer
	err := f.db.View(func(tx *bolt.Tx) error {
		_, err := tx.WriteTo(&buf)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("raftstore: snapshot: %w", err)
	}
	return &fsmSnapshot{data: buf.Bytes()}, nil
}

// Restore replaces the state with a snapshot (a bbolt image). The image is
// validated by opening it before the current file is replaced.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	tmp := f.path + ".restore"
	if err := writeFileSync(tmp, rc); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("raftstore: restore: %w", err)
	}
	if err := checkStateImage(tmp); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("raftstore: restore: %w", err)
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	if f.db != nil {
		if err := f.db.Close(); err != nil {
			return fmt.Errorf("raftstore: restore: close %s: %w", f.path, err)
		}
	}
	if err := os.Rename(tmp, f.path); err != nil {
		return fmt.Errorf("raftstore: restore: %w", err)
	}
	db, err := openStateDB(f.path)
	if err != nil {
		// Without a state machine this server cannot go on.
		panic(fmt.Sprintf("raftstore: reopen %s after restore: %v", f.path, err))
	}
	f.db = db
	idx := f.readApplied()
	f.applied.Store(idx)
	f.logger.Info("restored state machine from snapshot", "applied_index", idx)
	// Every watcher gets its volume's state as of the snapshot.
	f.publishCurrentLocked(f.hub.watched(), idx)
	f.signal()
	return nil
}

// checkStateImage validates a snapshot image before it replaces the state:
// a bbolt file whose header agrees with its length (bbolt maps the file and
// would fault on pages past its end), holding a state machine with an
// applied index. Raft already checksums snapshots; this guards against an
// image that was never a state machine's.
func checkStateImage(path string) error {
	if err := checkBoltLength(path); err != nil {
		return err
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		return fmt.Errorf("%w: snapshot image: %v", ErrCorrupt, err)
	}
	defer db.Close()
	return db.View(func(tx *bolt.Tx) error {
		for _, b := range requiredBuckets {
			if tx.Bucket(b) == nil {
				return fmt.Errorf("%w: snapshot image has no %q bucket", ErrCorrupt, b)
			}
		}
		if (&Reader{tx: tx}).AppliedIndex() == 0 {
			return fmt.Errorf("%w: snapshot image has no applied index", ErrCorrupt)
		}
		return nil
	})
}

// bbolt's on-disk meta page, as laid out by go.etcd.io/bbolt: a 16-byte
// page header, then magic, version, page size, flags (4 bytes each), the
// root bucket (16), the freelist page id (8), the high-water page id (8).
const (
	boltMagic       = 0xED0CDAED
	boltMetaOffset  = 16
	boltPgidOffset  = boltMetaOffset + 16 + 16 + 8
	boltMinFileSize = 4 * 512
)

// checkBoltLength refuses a file shorter than the pages its meta pages
// claim, or without a valid meta page.
func checkBoltLength(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if len(b) < boltMinFileSize {
		return fmt.Errorf("%w: snapshot image is %d bytes, too short for a database", ErrCorrupt, len(b))
	}
	le := binary.LittleEndian
	ok := false
	for _, pageOff := range []int{0, -1} {
		off := 0
		if pageOff == -1 {
			ps := int(le.Uint32(b[boltMetaOffset+8:]))
			if ps < 512 || ps > 1<<20 || ps+boltPgidOffset+8 > len(b) {
				continue
			}
			off = ps
		}
		m := b[off+boltMetaOffset:]
		if le.Uint32(m) != boltMagic {
			continue
		}
		pageSize := uint64(le.Uint32(m[8:]))
		pgid := le.Uint64(b[off+boltPgidOffset:])
		if pageSize == 0 || pgid > uint64(len(b))/pageSize {
			return fmt.Errorf("%w: snapshot image is %d bytes but its header counts %d pages of %d bytes", ErrCorrupt, len(b), pgid, pageSize)
		}
		ok = true
	}
	if !ok {
		return fmt.Errorf("%w: snapshot image has no valid bbolt meta page", ErrCorrupt)
	}
	return nil
}

func writeFileSync(path string, r io.Reader) error {
	fh, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(fh, r); err != nil {
		fh.Close()
		return err
	}
	if err := fh.Sync(); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

type fsmSnapshot struct {
	data []byte
}

func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(s.data); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s *fsmSnapshot) Release() {}
