package replica

import "sync"

// rangeLock serialises readers and writers of overlapping block ranges
// while those of disjoint ranges proceed in parallel. A holder of [lo, hi) owns those
// blocks of the head (and, during a merge, of the layer merged into): a
// read-merge-write of a partial block, the check-and-write of a rebuild,
// and the check-and-copy of a merge are atomic per block with respect to
// each other and to writes.
type rangeLock struct {
	mu   sync.Mutex
	cond sync.Cond
	held [][2]uint64 // guarded by mu
}

func (l *rangeLock) lock(lo, hi uint64) {
	l.mu.Lock()
	if l.cond.L == nil {
		l.cond.L = &l.mu
	}
	for l.overlapsLocked(lo, hi) {
		l.cond.Wait()
	}
	l.held = append(l.held, [2]uint64{lo, hi})
	l.mu.Unlock()
}

func (l *rangeLock) overlapsLocked(lo, hi uint64) bool {
	for _, h := range l.held {
		if lo < h[1] && h[0] < hi {
			return true
		}
	}
	return false
}

func (l *rangeLock) unlock(lo, hi uint64) {
	l.mu.Lock()
	for i, h := range l.held {
		if h[0] == lo && h[1] == hi {
			l.held[i] = l.held[len(l.held)-1]
			l.held = l.held[:len(l.held)-1]
			break
		}
	}
	l.cond.Broadcast()
	l.mu.Unlock()
}
