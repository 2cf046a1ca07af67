package replica

import (
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sync"
)

// The write history: per region, the highest replica-set generation of a
// write there, kept in memory and journaled at every sync (see doc.go,
// "Write history"). Values are stored as generation+1 so that 0 means
// "never written".
//
// A journal batch payload is validFrom u64 followed by records of region
// u64, count u64, value u64 (value = generation+1 of regions
// [region, region+count)). Replay takes the maximum per region and the
// validFrom of the last batch.

const (
	histChunkShift = 12
	histChunkLen   = 1 << histChunkShift
	histRecSize    = 24
)

type history struct {
	mu        sync.Mutex
	chunks    map[uint64]*[histChunkLen]uint64 // guarded by mu
	pending   blockSet                         // guarded by mu: regions changed since the last persist
	validFrom uint64                           // guarded by mu
	validNew  bool                             // guarded by mu: validFrom not yet journaled

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
	h := &history{chunks: map[uint64]*[histChunkLen]uint64{}, jnl: j}
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
			for r := start; r < start+n; r++ {
				h.raiseLocked(r, v, false)
			}
			h.jnlRecs++
		}
	}
	h.compactAt = max(minCompactOps, 2*h.jnlRecs)
	return h, nil
}

func (h *history) close() error { return h.jnl.close() }

func (h *history) raiseLocked(r, v uint64, track bool) {
	c := h.chunks[r>>histChunkShift]
	if c == nil {
		c = new([histChunkLen]uint64)
		h.chunks[r>>histChunkShift] = c
	}
	if c[r&(histChunkLen-1)] < v {
		c[r&(histChunkLen-1)] = v
		if track {
			h.pending.add(r, 1)
		}
	}
}

func (h *history) get(r uint64) uint64 {
	if c := h.chunks[r>>histChunkShift]; c != nil {
		return c[r&(histChunkLen-1)]
	}
	return 0
}

// note records a write at generation gen to regions [r0, r1].
func (h *history) note(r0, r1, gen uint64) {
	v := gen + 1
	if gen == math.MaxUint64 {
		v = gen
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for r := r0; r <= r1; r++ {
		h.raiseLocked(r, v, true)
	}
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
	keys := make([]uint64, 0, len(h.chunks))
	for k := range h.chunks {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var runs [][2]uint64
	for _, k := range keys {
		for i, val := range h.chunks[k] {
			if val < v {
				continue
			}
			r := k<<histChunkShift | uint64(i)
			if n := len(runs); n > 0 && runs[n-1][1] == r {
				runs[n-1][1] = r + 1
			} else {
				runs = append(runs, [2]uint64{r, r + 1})
			}
		}
	}
	return runs, nil
}

// records encodes regions as runs of equal values.
func (h *history) recordsLocked(each func(fn func(start, end uint64) bool)) ([]byte, int) {
	var b []byte
	n := 0
	emit := func(s, e, v uint64) {
		if v == 0 {
			return
		}
		b = binary.BigEndian.AppendUint64(b, s)
		b = binary.BigEndian.AppendUint64(b, e-s)
		b = binary.BigEndian.AppendUint64(b, v)
		n++
	}
	each(func(start, end uint64) bool {
		s, v := start, h.get(start)
		for r := start + 1; r < end; r++ {
			if rv := h.get(r); rv != v {
				emit(s, r, v)
				s, v = r, rv
			}
		}
		emit(s, end, v)
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
	h.pending = blockSet{}
	recs, n := h.recordsLocked(changed.runs)
	compact := h.jnlRecs+n > h.compactAt
	if compact {
		var all blockSet
		for k := range h.chunks {
			all.add(k<<histChunkShift, histChunkLen)
		}
		recs, n = h.recordsLocked(all.runs)
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
		changed.runs(func(s, e uint64) bool { h.pending.add(s, e-s); return true })
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
