package replica

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
)

// A journal is an append-only file of checksummed batches; the layer
// indexes and the write history are kept in journals (see doc.go, "On-disk
// formats"). Each append is one batch, written and synced before the
// append returns. Replay distinguishes a torn tail (the last append was cut
// short by a crash: ignored and truncated) from damage in the middle (a bad
// batch followed by a good one: ErrCorrupt). A journal that grows large is
// rewritten whole (compacted) into a temporary file that is synced and
// renamed over it.

const (
	journalMagic      = "STORJNL1"
	journalVersion    = 1
	journalHeaderSize = 32
	batchMagic        = 0x5354424a // "STBJ"
	batchHeaderSize   = 20
	maxBatchPayload   = 4 << 20

	journalKindIndex   = 1
	journalKindHistory = 2
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type journal struct {
	fs   FS
	path string
	kind uint32
	f    File
	size int64  // append offset
	seq  uint64 // seq of the last batch
}

func journalHeader(kind uint32) []byte {
	h := make([]byte, journalHeaderSize)
	copy(h, journalMagic)
	binary.BigEndian.PutUint32(h[8:], kind)
	binary.BigEndian.PutUint32(h[12:], journalVersion)
	binary.BigEndian.PutUint32(h[28:], crc32.Checksum(h[:28], castagnoli))
	return h
}

func appendBatch(dst []byte, seq uint64, payload []byte) []byte {
	var h [batchHeaderSize]byte
	binary.BigEndian.PutUint32(h[0:], batchMagic)
	binary.BigEndian.PutUint64(h[4:], seq)
	binary.BigEndian.PutUint32(h[12:], uint32(len(payload)))
	crc := crc32.Update(crc32.Checksum(h[:16], castagnoli), castagnoli, payload)
	binary.BigEndian.PutUint32(h[16:], crc)
	dst = append(dst, h[:]...)
	return append(dst, payload...)
}

// parseBatch decodes the batch at buf[off:]; ok is false if there is no
// whole, checksummed batch there.
func parseBatch(buf []byte, off int) (seq uint64, payload []byte, next int, ok bool) {
	if len(buf)-off < batchHeaderSize {
		return 0, nil, 0, false
	}
	h := buf[off : off+batchHeaderSize]
	if binary.BigEndian.Uint32(h[0:]) != batchMagic {
		return 0, nil, 0, false
	}
	n := int(binary.BigEndian.Uint32(h[12:]))
	if n > maxBatchPayload || len(buf)-off-batchHeaderSize < n {
		return 0, nil, 0, false
	}
	payload = buf[off+batchHeaderSize : off+batchHeaderSize+n]
	crc := crc32.Update(crc32.Checksum(h[:16], castagnoli), castagnoli, payload)
	if crc != binary.BigEndian.Uint32(h[16:]) {
		return 0, nil, 0, false
	}
	return binary.BigEndian.Uint64(h[4:]), payload, off + batchHeaderSize + n, true
}

// replayJournal parses a journal image. It returns the payloads in order,
// the length of the valid prefix and the last seq.
func replayJournal(buf []byte, kind uint32) (payloads [][]byte, valid int, seq uint64, err error) {
	if len(buf) < journalHeaderSize || !bytes.Equal(buf[:journalHeaderSize], journalHeader(kind)) {
		return nil, 0, 0, fmt.Errorf("%w: bad journal header", ErrCorrupt)
	}
	off := journalHeaderSize
	first := true
	for off < len(buf) {
		s, p, next, ok := parseBatch(buf, off)
		if !ok {
			// A torn tail is the last, unsynced append. Any good batch
			// after this point was appended after this one was synced, so
			// this one is damage, not a tear.
			for q := off + 1; q+batchHeaderSize <= len(buf); q++ {
				if binary.BigEndian.Uint32(buf[q:]) != batchMagic {
					continue
				}
				if s2, _, _, ok2 := parseBatch(buf, q); ok2 && (first || s2 > seq) {
					return nil, 0, 0, fmt.Errorf("%w: damaged journal batch at offset %d (a good batch follows at %d)", ErrCorrupt, off, q)
				}
			}
			break
		}
		if !first && s != seq+1 {
			return nil, 0, 0, fmt.Errorf("%w: journal batch at offset %d has seq %d after %d", ErrCorrupt, off, s, seq)
		}
		first = false
		seq = s
		payloads = append(payloads, p)
		off = next
	}
	return payloads, off, seq, nil
}

// openJournal opens and replays the journal at path, truncating a torn
// tail so that later appends follow the last good batch.
func openJournal(fsys FS, path string, kind uint32) (*journal, [][]byte, error) {
	f, err := fsys.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, nil, fmt.Errorf("%w: %s is missing", ErrCorrupt, path)
		}
		return nil, nil, ioErr("open "+path, err)
	}
	buf, err := readWhole(f)
	if err != nil {
		f.Close()
		return nil, nil, ioErr("read "+path, err)
	}
	payloads, valid, seq, err := replayJournal(buf, kind)
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	if valid < len(buf) {
		if err := f.Truncate(int64(valid)); err != nil {
			f.Close()
			return nil, nil, ioErr("truncate torn tail of "+path, err)
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return nil, nil, ioErr("sync "+path, err)
		}
	}
	return &journal{fs: fsys, path: path, kind: kind, f: f, size: int64(valid), seq: seq}, payloads, nil
}

// writeJournalFile writes a whole journal (header and one batch per
// payload, seqs from firstSeq) to path and syncs it. It does not sync the
// directory.
func writeJournalFile(fsys FS, path string, kind uint32, firstSeq uint64, payloads [][]byte) error {
	buf := journalHeader(kind)
	for i, p := range payloads {
		buf = appendBatch(buf, firstSeq+uint64(i), p)
	}
	f, err := fsys.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return ioErr("create "+path, err)
	}
	if _, err := f.WriteAt(buf, 0); err != nil {
		f.Close()
		return ioErr("write "+path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return ioErr("sync "+path, err)
	}
	return ioErr("close "+path, f.Close())
}

// append writes batches, syncing each before writing the next: so a crash
// can tear only the last one, which replay can tell from damage.
func (j *journal) append(payloads ...[]byte) error {
	for _, p := range payloads {
		buf := appendBatch(nil, j.seq+1, p)
		if _, err := j.f.WriteAt(buf, j.size); err != nil {
			return ioErr("append "+j.path, err)
		}
		if err := j.f.Sync(); err != nil {
			return ioErr("sync "+j.path, err)
		}
		j.size += int64(len(buf))
		j.seq++
	}
	return nil
}

// rewrite replaces the journal with one holding payloads (compaction):
// temp file, sync, rename, sync dir.
func (j *journal) rewrite(payloads [][]byte) error {
	tmp := j.path + ".tmp"
	if err := writeJournalFile(j.fs, tmp, j.kind, j.seq+1, payloads); err != nil {
		return err
	}
	if err := j.fs.Rename(tmp, j.path); err != nil {
		return ioErr("rename "+tmp, err)
	}
	if err := j.fs.SyncDir(filepath.Dir(j.path)); err != nil {
		return ioErr("sync dir of "+j.path, err)
	}
	f, err := j.fs.OpenFile(j.path, os.O_RDWR, 0)
	if err != nil {
		return ioErr("reopen "+j.path, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return ioErr("stat "+j.path, err)
	}
	j.f.Close()
	j.f = f
	j.size = st.Size()
	j.seq += uint64(len(payloads))
	return nil
}

// close closes the journal's file; it is reopened by reopen. Closing a
// closed journal is a no-op.
func (j *journal) close() error {
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}

// reopen opens the file of a journal closed by close. Appends go on at
// the recorded size and seq: the file was synced to them before the close.
func (j *journal) reopen() error {
	f, err := j.fs.OpenFile(j.path, os.O_RDWR, 0)
	if err != nil {
		return ioErr("reopen "+j.path, err)
	}
	j.f = f
	return nil
}

// splitPayloads cuts records of recSize bytes into payloads that fit a
// batch, each starting with prefix.
func splitPayloads(prefix, records []byte, recSize int) [][]byte {
	per := (maxBatchPayload - len(prefix)) / recSize * recSize
	var out [][]byte
	for len(records) > 0 || len(out) == 0 {
		k := min(per, len(records))
		p := append(append([]byte(nil), prefix...), records[:k]...)
		out = append(out, p)
		records = records[k:]
	}
	return out
}
