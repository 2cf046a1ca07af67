package engine

import (
	"context"
	"sync"
)

// overlaps orders writes to overlapping byte ranges. Replicas and their
// connections serve requests concurrently, so two overlapping writes in
// flight together can be applied in one order on one replica and in the
// other order on another: every replica then holds "an" acknowledged
// value, but not the same one, and reads that move to another replica
// (after a failover or a rebuild) see the block go back in time. A write
// therefore waits, before it is sent anywhere, until every overlapping
// write sent before it has been answered by every replica (found by the
// jepsen harness; see docs/JEPSEN.md). The same set is what Flush waits
// for (wait).
type overlaps struct {
	mu       sync.Mutex
	inflight map[*span]struct{} // guarded by mu
}

type span struct {
	off, end int64
	done     chan struct{}
}

// lock waits until no write in flight overlaps [off, off+n), then
// registers this one. The caller must unlock the span it gets.
func (o *overlaps) lock(ctx context.Context, off, n int64) (*span, error) {
	s := &span{off: off, end: off + n, done: make(chan struct{})}
	for {
		o.mu.Lock()
		var wait chan struct{}
		for x := range o.inflight {
			if x.off < s.end && s.off < x.end {
				wait = x.done
				break
			}
		}
		if wait == nil {
			if o.inflight == nil {
				o.inflight = map[*span]struct{}{}
			}
			o.inflight[s] = struct{}{}
			o.mu.Unlock()
			return s, nil
		}
		o.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
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
		waits = append(waits, x.done)
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
