package replica

import (
	"fmt"
	"sync"
)

var zeroBlock [BlockSize]byte

var blockPool = sync.Pool{New: func() any { return new([BlockSize]byte) }}

// checkRange validates a request of n bytes at off against a view of size
// bytes; a request is at most limit bytes (MaxIO for one that carries a
// payload, MaxZeroes for WriteZeroes and Trim).
func checkRange(off, n int64, size uint64, limit int64) error {
	switch {
	case off < 0:
		return fmt.Errorf("%w: negative offset %d", ErrInvalid, off)
	case n < 0:
		return fmt.Errorf("%w: negative length %d", ErrInvalid, n)
	case off%SectorSize != 0 || n%SectorSize != 0:
		return fmt.Errorf("%w: offset %d or length %d is not a multiple of %d", ErrInvalid, off, n, SectorSize)
	case n > limit:
		return fmt.Errorf("%w: length %d exceeds the %d-byte limit", ErrInvalid, n, limit)
	case uint64(off) > size || uint64(n) > size-uint64(off):
		return fmt.Errorf("%w: %d bytes at %d are past the end of the %d-byte volume", ErrInvalid, n, off, size)
	}
	return nil
}

// ReadAt reads len(p) bytes of the volume at off.
func (r *Replica) ReadAt(o Op, p []byte, off int64) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if err := checkRange(off, int64(len(p)), r.size.Load(), MaxIO); err != nil {
		return err
	}
	if len(p) == 0 {
		return nil
	}
	// The blocks are locked against writers for the read, as a writer
	// locks them: a read overlapping a write sees each block whole, before
	// or after it, never a page the write is half through copying.
	b0, b1 := uint64(off)/BlockSize, uint64(off+int64(len(p))-1)/BlockSize+1
	r.ranges.lock(b0, b1)
	defer r.ranges.unlock(b0, b1)
	return r.readViewLocked(len(r.layers)-1, p, off)
}

// readViewLocked reads the volume as layers[0..top] show it: each block
// from the topmost of them whose index holds it, zeroes if none does. The
// caller holds mu.
func (r *Replica) readViewLocked(top int, p []byte, off int64) error {
	if len(p) == 0 {
		return nil
	}
	end := off + int64(len(p))
	b0 := uint64(off) / BlockSize
	nb := int((uint64(end)-1)/BlockSize - b0 + 1)
	var stack [16]int32
	owner := stack[:0]
	if nb <= len(stack) {
		owner = stack[:nb]
	} else {
		owner = make([]int32, nb)
	}
	for i := range owner {
		owner[i] = -1
	}
	left := nb
	for li := top; li >= 0 && left > 0; li-- {
		l := r.layers[li]
		l.mu.RLock()
		for i := range owner {
			if owner[i] < 0 && l.idx.has(b0+uint64(i)) {
				owner[i] = int32(li)
				left--
			}
		}
		l.mu.RUnlock()
	}
	for i := 0; i < nb; {
		j := i + 1
		for j < nb && owner[j] == owner[i] {
			j++
		}
		segStart := max(off, int64(b0+uint64(i))*BlockSize)
		segEnd := min(end, int64(b0+uint64(j))*BlockSize)
		buf := p[segStart-off : segEnd-off]
		if owner[i] < 0 {
			clear(buf)
		} else if err := r.layers[owner[i]].readAt(buf, segStart); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// readBlockBelowLocked reads block b as the layers below the head show it.
func (r *Replica) readBlockBelowLocked(b uint64, buf []byte) error {
	return r.readViewLocked(len(r.layers)-2, buf[:BlockSize], int64(b)*BlockSize)
}

// WriteAt writes p to the volume at off.
func (r *Replica) WriteAt(o Op, p []byte, off int64) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if err := checkRange(off, int64(len(p)), r.size.Load(), MaxIO); err != nil {
		return err
	}
	return r.writeLocked(o, off, int64(len(p)), true, func(h *layer) error {
		return r.writeDataLocked(h, p, off)
	})
}

// WriteZeroes makes [off, off+n) read as zeroes: whole blocks become holes
// in the head (punched) that mask older layers; partial blocks are
// zero-filled. n is limited to MaxZeroes, not MaxIO (no payload is
// carried).
func (r *Replica) WriteZeroes(o Op, off, n int64) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if err := checkRange(off, n, r.size.Load(), MaxZeroes); err != nil {
		return err
	}
	return r.writeLocked(o, off, n, true, func(h *layer) error {
		return r.zeroLocked(h, off, n)
	})
}

// Trim discards [off, off+n). It has the same effect as WriteZeroes:
// reads after a trim return zeroes, also where an older snapshot layer
// holds data.
func (r *Replica) Trim(o Op, off, n int64) error {
	return r.WriteZeroes(o, off, n)
}

// writeLocked runs apply as a write to [off, off+n): the dirty regions are
// marked (durably) first, the write history notes o.Generation, the
// blocks are locked against other writers, and FUA syncs afterwards. A
// normal write (not a rebuild write) is recorded for a rebuild in
// progress. The caller holds mu shared.
func (r *Replica) writeLocked(o Op, off, n int64, normal bool, apply func(h *layer) error) error {
	if n == 0 {
		if o.FUA {
			return r.syncFor(r.syncStarted.Load() + 1)
		}
		return nil
	}
	r0, r1 := uint64(off)/uint64(r.regionSize), uint64(off+n-1)/uint64(r.regionSize)
	span, err := r.dirty.start(r0, r1, r.syncStarted.Load())
	if err != nil {
		return err
	}
	r.hist.note(r0, r1, o.Generation)
	b0, b1 := uint64(off)/BlockSize, uint64(off+n-1)/BlockSize+1
	r.ranges.lock(b0, b1)
	err = apply(r.layers[len(r.layers)-1])
	if normal && r.rebuild != nil {
		r.rebuild.touch(uint64(off)/SectorSize, uint64(n)/SectorSize)
	}
	r.ranges.unlock(b0, b1)
	r.dirty.done(span, r.syncStarted.Load())
	if err != nil {
		return err
	}
	if o.FUA {
		return r.syncFor(r.syncStarted.Load() + 1)
	}
	return nil
}

// writeDataLocked writes p at off into the head h. Whole blocks are
// written in place and entered into the index after their data; a partial
// block that the head lacks is first copied up from the layers below, so
// the head's block is always complete. The caller holds the range lock.
func (r *Replica) writeDataLocked(h *layer, p []byte, off int64) error {
	end := off + int64(len(p))
	for pos := off; pos < end; {
		b := uint64(pos) / BlockSize
		bStart := int64(b) * BlockSize
		if pos == bStart && end-pos >= BlockSize {
			k := (end - pos) / BlockSize
			if err := h.writeAt(p[pos-off:pos-off+k*BlockSize], pos); err != nil {
				r.unwriteLocked(h, b, uint64(k))
				return err
			}
			h.add(b, uint64(k))
			pos += k * BlockSize
			continue
		}
		segEnd := min(end, bStart+BlockSize)
		if err := r.writePartialLocked(h, b, p[pos-off:segEnd-off], pos); err != nil {
			return err
		}
		pos = segEnd
	}
	return nil
}

// writePartialLocked writes data (inside block b) at pos into the head.
func (r *Replica) writePartialLocked(h *layer, b uint64, data []byte, pos int64) error {
	if h.has(b) {
		return h.writeAt(data, pos)
	}
	buf := blockPool.Get().(*[BlockSize]byte)
	defer blockPool.Put(buf)
	if err := r.readBlockBelowLocked(b, buf[:]); err != nil {
		return err
	}
	copy(buf[pos-int64(b)*BlockSize:], data)
	if err := h.writeAt(buf[:], int64(b)*BlockSize); err != nil {
		r.unwriteLocked(h, b, 1)
		return err
	}
	h.add(b, 1)
	return nil
}

// unwriteLocked restores, after a failed write of blocks [b, b+k) to the
// head h, what h's index says of them: a block the index does not hold is
// a hole in the head file (replica/shortcircuit.go), and the failed write
// (a short write, then ENOSPC or EIO) may have put some of its bytes
// there. A read through the server skips such a block, but a direct view
// of a one-layer replica reads every block from the head file, and would
// have read the failed write's bytes where the server reads zeroes (or,
// with snapshot layers, the older data). A block the index holds was the
// head's already: the failed write leaves it partly overwritten for every
// reader alike, as a disk's failed write does. If even the punch fails,
// the replica fails: nothing else restores the rule. The caller holds the
// range lock.
func (r *Replica) unwriteLocked(h *layer, b, k uint64) {
	for i := b; i < b+k; {
		if h.has(i) {
			i++
			continue
		}
		j := i + 1
		for j < b+k && !h.has(j) {
			j++
		}
		if err := h.punch(int64(i)*BlockSize, int64(j-i)*BlockSize); err != nil {
			r.fail(fmt.Errorf("punching blocks %d-%d, which a failed write may have left in the head: %w", i, j-1, err))
			return
		}
		i = j
	}
}

// zeroLocked zeroes [off, off+n) in the head h. Whole blocks are punched
// and enter (or stay in) the head's index as holes, which read as zeroes
// and mask the layers below; partial blocks are zero-filled.
func (r *Replica) zeroLocked(h *layer, off, n int64) error {
	end := off + n
	for pos := off; pos < end; {
		b := uint64(pos) / BlockSize
		bStart := int64(b) * BlockSize
		if pos == bStart && end-pos >= BlockSize {
			k := uint64(end-pos) / BlockSize
			if err := h.punch(pos, int64(k)*BlockSize); err != nil {
				return err
			}
			h.add(b, k)
			pos += int64(k) * BlockSize
			continue
		}
		segEnd := min(end, bStart+BlockSize)
		if err := r.writePartialLocked(h, b, zeroBlock[:segEnd-pos], pos); err != nil {
			return err
		}
		pos = segEnd
	}
	return nil
}

// unionNextRun returns the first maximal run of blocks held by any of ls
// that contains or follows from (clipped to start at from).
func unionNextRun(ls []*layer, from uint64) (start, end uint64, ok bool) {
	for _, l := range ls {
		if s, e, lok := l.nextRun(from); lok && (!ok || s < start || (s == start && e > end)) {
			start, end, ok = s, e, true
		}
	}
	if !ok {
		return 0, 0, false
	}
	for grown := true; grown; {
		grown = false
		for _, l := range ls {
			if s, e, lok := l.nextRun(end); lok && s == end {
				end, grown = e, true
			}
		}
	}
	return start, end, true
}

// Flush makes every write that completed before Flush was called durable,
// data and index, and clears dirty regions that have been idle since the
// previous Flush began.
func (r *Replica) Flush(o Op) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	return r.flushLocked()
}

// flushLocked is Flush; the caller holds mu.
func (r *Replica) flushLocked() error {
	r.flushMu.Lock()
	defer r.flushMu.Unlock()
	num, err := r.syncLocked()
	if err != nil {
		return err
	}
	if err := r.dirty.flushed(num); err != nil {
		r.log.Warn("clearing dirty regions failed; they stay dirty", "err", err)
	}
	return nil
}

// syncFor makes durable every write completed before sync number target
// began: if a sync that started after them has completed, nothing is
// done (concurrent FUA writes share syncs). The caller holds mu.
func (r *Replica) syncFor(target uint64) error {
	r.flushMu.Lock()
	defer r.flushMu.Unlock()
	if r.syncDone.Load() >= target {
		return nil
	}
	_, err := r.syncLocked()
	return err
}

// syncLocked makes every layer and the write history durable and returns
// the sync's number. A write that completed before the number was taken
// is covered. A failure fails the replica (see fail). The caller holds mu
// and flushMu.
func (r *Replica) syncLocked() (uint64, error) {
	if err := r.failed(); err != nil {
		return 0, err
	}
	num := r.syncStarted.Add(1)
	for _, l := range r.layers {
		if err := l.syncLocked(); err != nil {
			return 0, r.fail(err)
		}
	}
	if err := r.hist.persistLocked(); err != nil {
		return 0, r.fail(err)
	}
	r.syncDone.Store(num)
	return num, nil
}

// Grow enlarges the volume to size bytes (a multiple of BlockSize). A
// smaller size is ErrInvalid; the same size is a no-op. The new size is
// durable when Grow returns.
func (r *Replica) Grow(o Op, size uint64) error {
	if err := r.enterExclusive(o); err != nil {
		return err
	}
	defer r.mu.Unlock()
	return r.growLocked(size)
}

func (r *Replica) growLocked(size uint64) error {
	cur := r.size.Load()
	switch {
	case size%BlockSize != 0 || size > MaxSize:
		return fmt.Errorf("%w: size %d is not a multiple of %d up to %d", ErrInvalid, size, BlockSize, uint64(MaxSize))
	case size < cur:
		return fmt.Errorf("%w: cannot shrink from %d to %d bytes", ErrInvalid, cur, size)
	case size == cur:
		return nil
	}
	if err := r.invalidateDirect("grown"); err != nil {
		return err
	}
	m := r.meta.clone()
	m.Size = size
	if err := writeMeta(r.fs, r.dir, m); err != nil {
		return err
	}
	r.meta = m
	r.size.Store(size)
	r.log.Info("grown", "size", size)
	return nil
}

// DirtyRegions returns the regions marked in the dirty-region log as
// extents (whole regions, clipped to the volume size, coalesced).
func (r *Replica) DirtyRegions(o Op) ([]Extent, error) {
	if err := r.enter(o); err != nil {
		return nil, err
	}
	defer r.mu.RUnlock()
	return r.regionExtents(r.dirty.list()), nil
}

// WrittenSince returns the regions with a write at generation >= gen, as
// extents. ErrHistoryLost: the history does not reach back to gen.
func (r *Replica) WrittenSince(o Op, gen uint64) ([]Extent, error) {
	if err := r.enter(o); err != nil {
		return nil, err
	}
	defer r.mu.RUnlock()
	runs, err := r.hist.since(gen)
	if err != nil {
		return nil, err
	}
	return r.regionExtents(runs), nil
}

func (r *Replica) regionExtents(runs [][2]uint64) []Extent {
	size := int64(r.size.Load())
	out := []Extent{}
	for _, run := range runs {
		s, e := int64(run[0])*r.regionSize, min(int64(run[1])*r.regionSize, size)
		if s < e {
			out = append(out, Extent{Off: s, Len: e - s})
		}
	}
	return out
}
