package replica

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// rebuildState records, per sector, what normal writes touched since
// BeginRebuild. It lives in memory only: after a reopen the rebuilder must
// call BeginRebuild again and read its source after that. Its session
// names it (RebuildSession), so that a rebuild write made for it is never
// applied to a later one (RebuildWriteSession).
type rebuildState struct {
	session uint64 // never 0; set at creation
	mu      sync.Mutex
	touched blockSet // sector numbers
}

// rebuildSessions numbers the rebuild sessions of the process.
var rebuildSessions atomic.Uint64

func (s *rebuildState) touch(sector, n uint64) {
	s.mu.Lock()
	s.touched.add(sector, n)
	s.mu.Unlock()
}

// untouched returns a mask of the sectors of block b not touched by a
// normal write (bit i: sector i of the block).
func (s *rebuildState) untouched(b uint64) uint8 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var m uint8
	for i := range uint64(BlockSize / SectorSize) {
		if !s.touched.has(b*(BlockSize/SectorSize) + i) {
			m |= 1 << i
		}
	}
	return m
}

// BeginRebuild starts tracking normal writes for RebuildWrite. Calling it
// while a rebuild is in progress keeps the tracking so far.
func (r *Replica) BeginRebuild(o Op) error {
	_, err := r.BeginRebuildSession(o)
	return err
}

// BeginRebuildSession is BeginRebuild, and names the rebuild it leaves in
// progress (RebuildSession), in the same step.
func (r *Replica) BeginRebuildSession(o Op) (uint64, error) {
	if err := r.enterExclusive(o); err != nil {
		return 0, err
	}
	defer r.mu.Unlock()
	if r.rebuild == nil {
		if err := r.invalidateDirect("rebuild begun"); err != nil {
			return 0, err
		}
		r.rebuild = &rebuildState{session: rebuildSessions.Add(1)}
		r.log.Info("rebuild begun")
	}
	return r.rebuild.session, nil
}

// EndRebuild stops the tracking. Without a rebuild in progress it is a
// no-op. With o.FUA it also settles the regions the replica owes since it
// was opened (doc.go, "Dirty regions"): the caller says it copied them
// (its rebuild completed, or its reconcile did), not that it gave up.
func (r *Replica) EndRebuild(o Op) error {
	if err := r.enterExclusive(o); err != nil {
		return err
	}
	defer r.mu.Unlock()
	if r.rebuild != nil {
		r.rebuild = nil
		r.log.Info("rebuild ended")
	}
	if o.FUA {
		// The caller copied every region this replica owes: a rebuild
		// that completed, or a reconcile (doc.go, "Dirty regions").
		if n := r.dirty.settle(); n > 0 {
			r.log.Info("regions dirty since the replica was opened are settled", "regions", n)
		}
	}
	return nil
}

// RebuildWrite writes p at off like WriteAt, except that it leaves every
// sector that a normal write (WriteAt, WriteZeroes, Trim) touched since
// BeginRebuild as it is. Each block is checked and written under the same
// lock normal writes take, so a block is never overwritten by a rebuild
// write that lost a race with a normal one. Without a rebuild in progress
// it is ErrInvalid.
func (r *Replica) RebuildWrite(o Op, p []byte, off int64) error {
	return r.rebuildWrite(0, o, p, off)
}

// RebuildSession names the rebuild in progress (the tracking BeginRebuild
// started, until EndRebuild): a number no other rebuild of any replica of
// this process has. Without a rebuild in progress it is ErrInvalid.
func (r *Replica) RebuildSession(o Op) (uint64, error) {
	if err := r.enter(o); err != nil {
		return 0, err
	}
	defer r.mu.RUnlock()
	if r.rebuild == nil {
		return 0, fmt.Errorf("%w: no rebuild in progress on replica %s", ErrInvalid, r.id)
	}
	return r.rebuild.session, nil
}

// RebuildWriteSession is RebuildWrite for the rebuild named session only:
// once that rebuild has ended (and another may have begun: a rebuild that
// starts over), it writes nothing and fails with ErrInvalid. A copy that
// read its source for one rebuild may carry bytes older than a write the
// next rebuild's tracking no longer knows of; it must not land there.
func (r *Replica) RebuildWriteSession(session uint64, o Op, p []byte, off int64) error {
	if session == 0 {
		return fmt.Errorf("%w: rebuild session 0", ErrInvalid)
	}
	return r.rebuildWrite(session, o, p, off)
}

// rebuildWrite is RebuildWrite, for the rebuild named session only if it
// is not 0.
func (r *Replica) rebuildWrite(session uint64, o Op, p []byte, off int64) error {
	if err := r.enter(o); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if err := checkRange(off, int64(len(p)), r.size.Load(), MaxIO); err != nil {
		return err
	}
	st := r.rebuild
	if st == nil {
		return fmt.Errorf("%w: no rebuild in progress on replica %s", ErrInvalid, r.id)
	}
	if session != 0 && st.session != session {
		return fmt.Errorf("%w: rebuild session %d of replica %s has ended (now %d)", ErrInvalid, session, r.id, st.session)
	}
	return r.writeLocked(o, off, int64(len(p)), false, func(h *layer) error {
		return r.rebuildLocked(h, st, p, off)
	})
}

// rebuildLocked applies a rebuild write block by block (runs of whole
// untouched data blocks in one write). The caller holds the range lock.
func (r *Replica) rebuildLocked(h *layer, st *rebuildState, p []byte, off int64) error {
	const all = uint8(1<<(BlockSize/SectorSize) - 1)
	end := off + int64(len(p))
	runStart, runEnd := off, off // pending run of whole data blocks
	flushRun := func() error {
		if runStart == runEnd {
			return nil
		}
		err := r.writeDataLocked(h, p[runStart-off:runEnd-off], runStart)
		runStart = runEnd
		return err
	}
	for pos := off; pos < end; {
		b := uint64(pos) / BlockSize
		bStart := int64(b) * BlockSize
		segEnd := min(end, bStart+BlockSize)
		data := p[pos-off : segEnd-off]
		free := st.untouched(b)
		// Sectors of this block that the request covers.
		var want uint8
		for s := (pos - bStart) / SectorSize; s < (segEnd-bStart)/SectorSize; s++ {
			want |= 1 << s
		}
		if want == all && free == all && !isZero(data) {
			if runEnd != bStart {
				if err := flushRun(); err != nil {
					return err
				}
				runStart = bStart
			}
			runEnd = segEnd
			pos = segEnd
			continue
		}
		if err := flushRun(); err != nil {
			return err
		}
		var err error
		switch {
		case free&want == 0:
			// Every sector was written since BeginRebuild: keep them.
		case want == all && free == all:
			err = r.zeroLocked(h, bStart, BlockSize)
		default:
			err = r.mergeSectorsLocked(h, b, data, pos, free&want)
		}
		if err != nil {
			return err
		}
		pos = segEnd
		runStart, runEnd = pos, pos
	}
	return flushRun()
}

// mergeSectorsLocked writes the sectors of data (at pos, inside block b)
// selected by mask over the block as the volume shows it now.
func (r *Replica) mergeSectorsLocked(h *layer, b uint64, data []byte, pos int64, mask uint8) error {
	buf := blockPool.Get().(*[BlockSize]byte)
	defer blockPool.Put(buf)
	bStart := int64(b) * BlockSize
	if err := r.readViewLocked(len(r.layers)-1, buf[:], bStart); err != nil {
		return err
	}
	for s := range int64(BlockSize / SectorSize) {
		if mask&(1<<s) == 0 {
			continue
		}
		so := bStart + s*SectorSize
		copy(buf[s*SectorSize:(s+1)*SectorSize], data[so-pos:so-pos+SectorSize])
	}
	return r.writeDataLocked(h, buf[:], bStart)
}
