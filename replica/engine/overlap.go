package engine

import (
	"context"
	"sync"
)

// overlaps orders the engine's requests to overlapping byte ranges
// (DESIGN.md, "Data path", points 4 to 6). It holds every write, read and
// rebuild copy under way, and a request waits, before it is sent anywhere,
// until every conflicting request registered before it on an overlapping
// range has finished:
//
//   - a write waits for earlier writes, reads and rebuild copies. Replicas
//     and their connections serve requests concurrently, so two
//     overlapping writes in flight together could be applied in one order
//     on one replica and in the other order on another: every replica
//     would then hold "an" acknowledged value, but not the same one, and
//     reads that move to another replica (after a failover or a rebuild)
//     would see the block go back in time (found by the jepsen harness;
//     see docs/JEPSEN.md);
//   - a read waits for earlier writes: it never returns the value of a
//     write that is not yet on every replica, which an engine crash and
//     the next open's reconcile (from a replica without it) could undo
//     (ISSUE13 J). Reads do not wait for each other or for copies;
//   - a rebuild copy (read from the source, write to the target) waits for
//     earlier writes, and later writes wait for it: a copy of a block and
//     a write to that block never interleave, so the copy cannot put a
//     block older than an acknowledged write over it (ISSUE13 C).
//
// Waiting only for requests registered earlier keeps it first come, first
// served: a rebuild copy of a large range is not starved by a stream of
// small writes into it, and there is no cycle to deadlock on. The same set
// is what a flush waits for (wait).
type overlaps struct {
	mu       sync.Mutex
	inflight map[*span]struct{} // guarded by mu
}

// spanKind is what a span orders; see overlaps.
type spanKind uint8

const (
	spanWrite spanKind = iota // a write, zeroing or trim fanned out to the write set
	spanRead                  // a read from one replica
	spanCopy                  // a rebuild's copy of a range into its target
)

// conflicts reports whether spans of kinds k and o that overlap are
// ordered: everything is ordered against writes, nothing else against
// each other.
func (k spanKind) conflicts(o spanKind) bool { return k == spanWrite || o == spanWrite }

type span struct {
	off, end int64
	kind     spanKind
	done     chan struct{}
}

// lock registers a request of kind k to [off, off+n) and waits until
// every conflicting request registered before it on an overlapping range
// has been unlocked. The caller must unlock the span it gets; on an error
// (ctx ended) it is already unlocked.
func (o *overlaps) lock(ctx context.Context, k spanKind, off, n int64) (*span, error) {
	s := &span{off: off, end: off + n, kind: k, done: make(chan struct{})}
	var buf [4]chan struct{}
	waits := buf[:0]
	o.mu.Lock()
	for x := range o.inflight {
		if x.off < s.end && s.off < x.end && k.conflicts(x.kind) {
			waits = append(waits, x.done)
		}
	}
	if o.inflight == nil {
		o.inflight = map[*span]struct{}{}
	}
	o.inflight[s] = struct{}{}
	o.mu.Unlock()
	for _, w := range waits {
		select {
		case <-w:
		case <-ctx.Done():
			o.unlock(s)
			return nil, ctx.Err()
		}
	}
	return s, nil
}

func (o *overlaps) unlock(s *span) {
	o.mu.Lock()
	delete(o.inflight, s)
	o.mu.Unlock()
	close(s.done)
}

// wait waits for every write registered before it was called.
func (o *overlaps) wait(ctx context.Context) error {
	o.mu.Lock()
	waits := make([]chan struct{}, 0, len(o.inflight))
	for x := range o.inflight {
		if x.kind == spanWrite {
			waits = append(waits, x.done)
		}
	}
	o.mu.Unlock()
	for _, w := range waits {
		select {
		case <-w:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}
