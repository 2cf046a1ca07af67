package replica

import (
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"sync"
)

// The write history: per region, the highest replica-set generation of a
// write there, kept in memory as runs of regions (runMap: a write to a
// range costs the runs it meets, not its regions) and journaled at every
// sync (see doc.go, "Write history"). Values are stored as generation+1 so
// that 0 means "never written".
//
// A journal batch payload is validFrom u64 followed by records of region
// u64, count u64, value u64 (value = generation+1 of regions
// [region, region+count)). Replay takes the maximum per region and the
// validFrom of the last batch.

const histRecSize = 24

type history struct {
	mu        sync.Mutex
	vals      runMap // guarded by mu: per region, generation+1 of its latest write
	pending   runMap // guarded by mu: regions changed since the last persist (value 1)
	validFrom uint64 // guarded by mu
	validNew  bool   // guarded by mu: validFrom not yet journaled

	// Guarded by Replica.flushMu.
	jnl       *journal
	jnlRecs   int
	compactAt int
}

func histPayload(validFrom uint64, recs []byte) []byte {
	p := binary.BigEndian.AppendUint64(nil, validFrom)
	return append(p, recs...)
}

// writeHistoryFile writes a fresh history journal holding only validFrom
// (temp file and rename; the caller syncs the directory).
func writeHistoryFile(fsys FS, path string, validFrom uint64) error {
	tmp := path + ".tmp"
	if err := writeJournalFile(fsys, tmp, journalKindHistory, 1, [][]byte{histPayload(validFrom, nil)}); err != nil {
		return err
	}
	return ioErr("rename "+tmp, fsys.Rename(tmp, path))
}

func openHistory(fsys FS, path string, nregions uint64) (*history, error) {
	j, payloads, err := openJournal(fsys, path, journalKindHistory)
	if err != nil {
		return nil, err
	}
	h := &history{jnl: j}
	for _, p := range payloads {
		if len(p) < 8 || (len(p)-8)%histRecSize != 0 {
			j.close()
			return nil, fmt.Errorf("%w: %s: history batch of %d bytes", ErrCorrupt, path, len(p))
		}
		h.validFrom = binary.BigEndian.Uint64(p)
		for rec := p[8:]; len(rec) > 0; rec = rec[histRecSize:] {
			start, n, v := binary.BigEndian.Uint64(rec), binary.BigEndian.Uint64(rec[8:]), binary.BigEndian.Uint64(rec[16:])
			if n == 0 || start >= nregions || n > nregions-start {
				j.close()
				return nil, fmt.Errorf("%w: %s: bad history record %d+%d", ErrCorrupt, path, start, n)
			}
			h.vals.raise(start, start+n, v, nil)
			h.jnlRecs++
		}
	}
	h.compactAt = max(minCompactOps, 2*h.jnlRecs)
	return h, nil
}

func (h *history) close() error { return h.jnl.close() }

// note records a write at generation gen to regions [r0, r1].
func (h *history) note(r0, r1, gen uint64) {
	v := gen + 1
	if gen == math.MaxUint64 {
		v = gen
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.vals.raise(r0, r1+1, v, func(s, e uint64) { h.pending.set(s, e, 1) })
}

// since returns the runs of regions [start, end) with a write at
// generation >= gen, or ErrHistoryLost if the history does not reach back
// to gen.
func (h *history) since(gen uint64) ([][2]uint64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if gen < h.validFrom {
		return nil, fmt.Errorf("%w: history is complete from generation %d, asked from %d", ErrHistoryLost, h.validFrom, gen)
	}
	v := gen + 1
	if gen == math.MaxUint64 {
		v = gen
	}
	var runs [][2]uint64
	h.vals.all(func(s, e, val uint64) bool {
		if val < v {
			return true
		}
		if n := len(runs); n > 0 && runs[n-1][1] == s {
			runs[n-1][1] = e
		} else {
			runs = append(runs, [2]uint64{s, e})
		}
		return true
	})
	return runs, nil
}

// recordsLocked encodes the values of the regions in ranges (a runMap
// whose runs name them) as records of runs of equal values.
func (h *history) recordsLocked(ranges *runMap) ([]byte, int) {
	var b []byte
	n := 0
	ranges.all(func(start, end, _ uint64) bool {
		h.vals.each(start, end, func(s, e, v uint64) bool {
			b = binary.BigEndian.AppendUint64(b, s)
			b = binary.BigEndian.AppendUint64(b, e-s)
			b = binary.BigEndian.AppendUint64(b, v)
			n++
			return true
		})
		return true
	})
	return b, n
}

// persistLocked journals the changes since the last persist. The caller
// holds Replica.flushMu.
func (h *history) persistLocked() error {
	h.mu.Lock()
	if h.pending.len() == 0 && !h.validNew {
		h.mu.Unlock()
		return nil
	}
	changed := h.pending
	h.pending = runMap{}
	recs, n := h.recordsLocked(&changed)
	compact := h.jnlRecs+n > h.compactAt
	if compact {
		recs, n = h.recordsLocked(&h.vals)
	}
	validFrom := h.validFrom
	h.validNew = false
	h.mu.Unlock()

	var err error
	if compact {
		err = h.jnl.rewrite(splitPayloads(binary.BigEndian.AppendUint64(nil, validFrom), recs, histRecSize))
	} else {
		err = h.jnl.append(splitPayloads(binary.BigEndian.AppendUint64(nil, validFrom), recs, histRecSize)...)
	}
	if err != nil {
		h.mu.Lock()
		changed.all(func(s, e, _ uint64) bool { h.pending.set(s, e, 1); return true })
		h.validNew = true
		h.mu.Unlock()
		return err
	}
	if compact {
		h.jnlRecs = n
		h.compactAt = max(minCompactOps, 2*n)
	} else {
		h.jnlRecs += n
	}
	return nil
}

func historyPath(dir string) string { return filepath.Join(dir, historyName) }
