package replica

import (
	"math/bits"
	"slices"
)

const (
	setChunkShift = 15
	setChunkBits  = 1 << setChunkShift // members per chunk
	setChunkMask  = setChunkBits - 1
	setChunkWords = setChunkBits / 64
)

// setChunk is the bitmap of setChunkBits consecutive numbers.
type setChunk struct {
	words [setChunkWords]uint64
	count int
}

// blockSet is a sparse set of numbers (blocks, sectors or regions): a map
// of fixed-size bitmap chunks, allocated where members are. A chunk covers
// 32768 numbers in 4 KiB, so an index over 128 MiB of fully written volume
// costs 4 KiB and an untouched range costs nothing. Not safe for
// concurrent use; its owner guards it.
type blockSet struct {
	chunks map[uint64]*setChunk
	keys   []uint64 // sorted keys of chunks
	n      uint64   // members
}

func (s *blockSet) len() uint64 { return s.n }

func (s *blockSet) has(x uint64) bool {
	c := s.chunks[x>>setChunkShift]
	if c == nil {
		return false
	}
	i := x & setChunkMask
	return c.words[i/64]&(1<<(i%64)) != 0
}

func (s *blockSet) chunk(key uint64, create bool) *setChunk {
	if c := s.chunks[key]; c != nil || !create {
		return c
	}
	if s.chunks == nil {
		s.chunks = make(map[uint64]*setChunk)
	}
	c := new(setChunk)
	s.chunks[key] = c
	i, _ := slices.BinarySearch(s.keys, key)
	s.keys = slices.Insert(s.keys, i, key)
	return c
}

func (s *blockSet) dropChunk(key uint64) {
	delete(s.chunks, key)
	if i, ok := slices.BinarySearch(s.keys, key); ok {
		s.keys = slices.Delete(s.keys, i, i+1)
	}
}

// add inserts [start, start+n) and reports whether any number was new.
func (s *blockSet) add(start, n uint64) bool {
	changed := false
	for n > 0 {
		key, lo := start>>setChunkShift, start&setChunkMask
		m := min(n, setChunkBits-lo)
		c := s.chunk(key, true)
		added := 0
		forWords(lo, m, func(w int, mask uint64) {
			added += bits.OnesCount64(mask &^ c.words[w])
			c.words[w] |= mask
		})
		c.count += added
		s.n += uint64(added)
		changed = changed || added > 0
		start += m
		n -= m
	}
	return changed
}

// remove deletes [start, start+n) and reports whether any number was
// present.
func (s *blockSet) remove(start, n uint64) bool {
	changed := false
	for n > 0 {
		key, lo := start>>setChunkShift, start&setChunkMask
		m := min(n, setChunkBits-lo)
		if c := s.chunk(key, false); c != nil {
			removed := 0
			forWords(lo, m, func(w int, mask uint64) {
				removed += bits.OnesCount64(mask & c.words[w])
				c.words[w] &^= mask
			})
			c.count -= removed
			s.n -= uint64(removed)
			changed = changed || removed > 0
			if c.count == 0 {
				s.dropChunk(key)
			}
		}
		start += m
		n -= m
	}
	return changed
}

// forWords calls fn for each word of a chunk overlapping bits [lo, lo+n)
// with the mask of those bits in the word.
func forWords(lo, n uint64, fn func(w int, mask uint64)) {
	for n > 0 {
		w, b := lo/64, lo%64
		k := min(n, 64-b)
		mask := ^uint64(0)
		if k < 64 {
			mask = (1<<k - 1) << b
		}
		fn(int(w), mask)
		lo += k
		n -= k
	}
}

// nextRun returns the first maximal run [start, end) of members that
// contains or follows from; a run that contains from is clipped to start
// at from.
func (s *blockSet) nextRun(from uint64) (start, end uint64, ok bool) {
	start, ok = s.nextMember(from)
	if !ok {
		return 0, 0, false
	}
	return start, s.nextGap(start), true
}

// nextMember returns the smallest member >= from.
func (s *blockSet) nextMember(from uint64) (uint64, bool) {
	key := from >> setChunkShift
	i, _ := slices.BinarySearch(s.keys, key)
	for ; i < len(s.keys); i++ {
		k := s.keys[i]
		lo := uint64(0)
		if k == key {
			lo = from & setChunkMask
		}
		if b, ok := s.chunks[k].scan(lo, false); ok {
			return k<<setChunkShift | b, true
		}
	}
	return 0, false
}

// nextGap returns the smallest non-member >= from.
func (s *blockSet) nextGap(from uint64) uint64 {
	for {
		key := from >> setChunkShift
		c := s.chunks[key]
		if c == nil {
			return from
		}
		if b, ok := c.scan(from&setChunkMask, true); ok {
			return key<<setChunkShift | b
		}
		from = (key + 1) << setChunkShift
	}
}

// scan returns the first bit >= lo that is set (or, with gaps, clear).
func (c *setChunk) scan(lo uint64, gaps bool) (uint64, bool) {
	for w := lo / 64; w < setChunkWords; w++ {
		word := c.words[w]
		if gaps {
			word = ^word
		}
		if w == lo/64 {
			word &= ^uint64(0) << (lo % 64)
		}
		if word != 0 {
			return w*64 + uint64(bits.TrailingZeros64(word)), true
		}
	}
	return 0, false
}

// runs calls fn for each maximal run of members in order until fn returns
// false.
func (s *blockSet) runs(fn func(start, end uint64) bool) {
	for from := uint64(0); ; {
		start, end, ok := s.nextRun(from)
		if !ok || !fn(start, end) {
			return
		}
		from = end
	}
}

// countRuns returns the number of maximal runs.
func (s *blockSet) countRuns() int {
	n := 0
	s.runs(func(uint64, uint64) bool { n++; return true })
	return n
}
