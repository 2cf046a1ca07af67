package replica

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"slices"
	"sync"
)

// The dirty-region log: one bit per region in a file, set durably before
// the first write to a clean region is applied, cleared lazily after
// flushes (see doc.go, "Dirty regions", for the clearing rule and why it
// is safe).
//
// File format: a 4096-byte header page, then the bitmap (bit r%8 of byte
// r/8 is region r). The header is magic "STORDRT1", region size u64,
// version u32, CRC-32C of the preceding 20 bytes. Bits are only ever
// changed by writing whole bytes of the bitmap.
const (
	dirtyMagic      = "STORDRT1"
	dirtyHeaderSize = 4096
)

// dirtyLog is the dirty-region log. Its state is O(dirty regions) and
// O(writes in flight), whatever the volume size; marking a write costs
// the runs it meets, not its regions.
type dirtyLog struct {
	fs         FS
	path       string
	f          File // nil while the replica's files are closed
	regionSize int64

	mu    sync.Mutex
	bits  blockSet                // dirty regions: their bit is set on disk
	touch runMap                  // per dirty region: 1 + Replica.syncStarted when a write last started or finished there (0: none since open)
	spans map[*[2]uint64]struct{} // regions [r0, r1] of the writes in flight
	// owed are the regions that were dirty when the log was opened (by
	// this process: what a crash, or the stop before it, left). A flush
	// does not clear them: they are the only record of writes this
	// replica may have acknowledged and then lost in a crash, which a
	// rebuild or a reconcile must copy from another replica, and the
	// engine's flushes reach a replica rejoining the volume before its
	// rebuild reads them. settle releases them to the usual rule.
	owed blockSet
	// prevFlush is the sync number of the previous completed Flush: a
	// region whose last write finished before it may be cleared.
	prevFlush uint64
}

func dirtyHeader(regionSize int64) []byte {
	h := make([]byte, dirtyHeaderSize)
	copy(h, dirtyMagic)
	binary.BigEndian.PutUint64(h[8:], uint64(regionSize))
	binary.BigEndian.PutUint32(h[16:], 1)
	binary.BigEndian.PutUint32(h[20:], crc32.Checksum(h[:20], castagnoli))
	return h
}

func createDirtyLog(fsys FS, path string, regionSize int64) error {
	f, err := fsys.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return ioErr("create dirty log", err)
	}
	defer f.Close()
	if _, err := f.WriteAt(dirtyHeader(regionSize), 0); err != nil {
		return ioErr("write dirty log", err)
	}
	return ioErr("sync dirty log", f.Sync())
}

func openDirtyLog(fsys FS, path string, regionSize int64, nregions uint64) (*dirtyLog, error) {
	f, err := fsys.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("%w: %s is missing", ErrCorrupt, path)
		}
		return nil, ioErr("open dirty log", err)
	}
	buf, err := readWhole(f)
	if err != nil {
		f.Close()
		return nil, ioErr("read dirty log", err)
	}
	if len(buf) < dirtyHeaderSize || !bytes.Equal(buf[:dirtyHeaderSize], dirtyHeader(regionSize)) {
		f.Close()
		return nil, fmt.Errorf("%w: %s: bad header", ErrCorrupt, path)
	}
	d := &dirtyLog{fs: fsys, path: path, f: f, regionSize: regionSize, spans: map[*[2]uint64]struct{}{}}
	for i, b := range buf[dirtyHeaderSize:] {
		for bit := range 8 {
			if r := uint64(i)*8 + uint64(bit); b&(1<<bit) != 0 && r < nregions {
				d.bits.add(r, 1)
				d.owed.add(r, 1)
			}
		}
	}
	return d, nil
}

// writeBytesLocked rewrites the bitmap bytes holding regions runs, one
// WriteAt per cluster of nearby bytes.
func (d *dirtyLog) writeBytesLocked(runs [][2]uint64) error {
	for i := 0; i < len(runs); {
		lo, hi := runs[i][0]/8, (runs[i][1]-1)/8
		for i++; i < len(runs) && runs[i][0]/8 <= hi+64; i++ {
			hi = max(hi, (runs[i][1]-1)/8)
		}
		// The bytes' current bits, filled run by run (not bit by bit).
		buf := make([]byte, hi-lo+1)
		first, end := lo*8, (hi+1)*8
		for from := first; ; {
			s, e, ok := d.bits.nextRun(from)
			if !ok || s >= end {
				break
			}
			e = min(e, end)
			setBits(buf, s-first, e-first)
			from = e
		}
		if _, err := d.f.WriteAt(buf, dirtyHeaderSize+int64(lo)); err != nil {
			return ioErr("write dirty log", err)
		}
	}
	return nil
}

// setBits sets bits [a, b) of buf (bit i is bit i%8 of byte i/8).
func setBits(buf []byte, a, b uint64) {
	for ; a < b && a%8 != 0; a++ {
		buf[a/8] |= 1 << (a % 8)
	}
	for ; a+8 <= b; a += 8 {
		buf[a/8] = 0xff
	}
	for ; a < b; a++ {
		buf[a/8] |= 1 << (a % 8)
	}
}

func (d *dirtyLog) setTouchLocked(r0, r1, now uint64) {
	d.touch.set(r0, r1+1, now+1)
}

// idleLocked reports whether a region whose touch value is t has had no
// write start or finish since the previous completed Flush began.
func (d *dirtyLog) idleLocked(t uint64) bool {
	last := uint64(0)
	if t > 0 {
		last = t - 1
	}
	return last < d.prevFlush
}

// start marks a write to regions [r0, r1] as begun and returns the token
// to pass to done. A clean region's bit is set and synced before start
// returns, so the write that follows is covered by the log even if the
// machine crashes during it.
func (d *dirtyLog) start(r0, r1, now uint64) (*[2]uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var set [][2]uint64
	for r := r0; r <= r1; {
		s, ok := d.bits.nextMember(r)
		if !ok || s > r1 {
			set = append(set, [2]uint64{r, r1 + 1})
			break
		}
		if s > r {
			set = append(set, [2]uint64{r, s})
		}
		r = d.bits.nextGap(s)
	}
	if len(set) > 0 {
		for _, run := range set {
			d.bits.add(run[0], run[1]-run[0])
		}
		err := d.writeBytesLocked(set)
		if err == nil {
			err = ioErr("sync dirty log", d.f.Sync())
		}
		if err != nil {
			for _, run := range set {
				d.bits.remove(run[0], run[1]-run[0])
			}
			return nil, err
		}
	}
	d.setTouchLocked(r0, r1, now)
	span := &[2]uint64{r0, r1}
	d.spans[span] = struct{}{}
	return span, nil
}

// done marks the write of span as finished.
func (d *dirtyLog) done(span *[2]uint64, now uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.spans, span)
	d.setTouchLocked(span[0], span[1], now)
}

// flushed is called after the Flush whose sync had number syncNum
// completed. It clears the regions with no write in flight whose last
// write finished before the previous completed Flush began, and returns
// an error only if writing the cleared bits failed (which leaves them set
// on disk: harmless).
func (d *dirtyLog) flushed(syncNum uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var cleared [][2]uint64
	d.bits.runs(func(s, e uint64) bool {
		pos := s
		d.touch.each(s, e, func(a, b, t uint64) bool {
			if a > pos && d.idleLocked(0) {
				cleared = d.appendIdleLocked(cleared, pos, a)
			}
			if d.idleLocked(t) {
				cleared = d.appendIdleLocked(cleared, a, b)
			}
			pos = b
			return true
		})
		if pos < e && d.idleLocked(0) {
			cleared = d.appendIdleLocked(cleared, pos, e)
		}
		return true
	})
	d.prevFlush = syncNum
	if len(cleared) == 0 {
		return nil
	}
	for _, run := range cleared {
		d.bits.remove(run[0], run[1]-run[0])
		d.touch.set(run[0], run[1], 0)
	}
	// No sync: a clear that is lost leaves the region dirty, which is safe;
	// the next set of a byte writes and syncs its current value.
	if err := d.writeBytesLocked(cleared); err != nil {
		for _, run := range cleared {
			d.bits.add(run[0], run[1]-run[0])
		}
		return err
	}
	return nil
}

// appendIdleLocked appends to runs the parts of regions [a, b) that no
// write in flight covers and that are not owed, coalescing with the last
// run.
func (d *dirtyLog) appendIdleLocked(runs [][2]uint64, a, b uint64) [][2]uint64 {
	var busy [][2]uint64
	for span := range d.spans {
		if s, e := max(span[0], a), min(span[1]+1, b); s < e {
			busy = append(busy, [2]uint64{s, e})
		}
	}
	for from := a; ; {
		s, e, ok := d.owed.nextRun(from)
		if !ok || s >= b {
			break
		}
		busy = append(busy, [2]uint64{s, min(e, b)})
		from = e
	}
	slices.SortFunc(busy, func(x, y [2]uint64) int { return cmp.Compare(x[0], y[0]) })
	add := func(s, e uint64) {
		if n := len(runs); n > 0 && runs[n-1][1] == s {
			runs[n-1][1] = e
		} else {
			runs = append(runs, [2]uint64{s, e})
		}
	}
	pos := a
	for _, x := range busy {
		if x[0] > pos {
			add(pos, x[0])
		}
		pos = max(pos, x[1])
	}
	if pos < b {
		add(pos, b)
	}
	return runs
}

// settle releases the owed regions (see dirtyLog.owed) to the usual
// clearing rule, and returns how many there were.
func (d *dirtyLog) settle() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.owed.len()
	d.owed = blockSet{}
	return n
}

// list returns the dirty regions as runs [start, end).
func (d *dirtyLog) list() [][2]uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	var runs [][2]uint64
	d.bits.runs(func(s, e uint64) bool {
		runs = append(runs, [2]uint64{s, e})
		return true
	})
	return runs
}

// close closes the log's file; reopen opens it again. Closing a closed
// log is a no-op. The caller holds Replica.mu exclusively (no write is in
// flight), so d.mu is not needed.
func (d *dirtyLog) close() error {
	if d.f == nil {
		return nil
	}
	err := d.f.Close()
	d.f = nil
	return err
}

func (d *dirtyLog) reopen() error {
	f, err := d.fs.OpenFile(d.path, os.O_RDWR, 0)
	if err != nil {
		return ioErr("reopen dirty log", err)
	}
	d.f = f
	return nil
}
