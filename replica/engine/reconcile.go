package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// reconcile makes every opened replica identical in the regions any of
// them marks dirty: after an unclean stop, writes that were in flight may
// have reached some replicas and not others. The contents of one healthy
// replica (the local one when there is one) win; since none of those
// writes was acknowledged, either version is allowed, but only one may
// remain. It runs before Open returns, so no I/O sees the difference.
//
// Each chunk is first compared (differing): the replicas' servers digest
// it where it lies, and only the blocks whose digests differ are copied.
// After an unclean stop most of a dirty region is the same everywhere
// (regions stay dirty for two flushes after their last write, and what
// was in flight at the stop is a few blocks), so a reconcile moves
// digests, not the regions (docs/BENCHMARKS.md, "Node-plugin restart").
func (e *Engine) reconcile(ctx context.Context) error {
	var dirty []replica.Extent
	for _, m := range e.writeSet() {
		var regions []replica.Extent
		err := e.call(ctx, func(ctx context.Context) error {
			var err error
			regions, err = m.conn.DirtyRegions(ctx, e.op(false))
			return err
		})
		if err != nil {
			if cerr := e.classify(ctx, err); cerr != nil {
				return cerr
			}
			if ferr := e.markFaulty(ctx, m, m.info.Id, fmt.Sprintf("dirty regions: %v", err)); ferr != nil {
				return ferr
			}
			continue
		}
		dirty = append(dirty, regions...)
	}
	dirty = mergeExtents(dirty, int64(e.size.Load()))
	if len(dirty) == 0 {
		return nil
	}
	var total, copied int64
	for _, x := range dirty {
		total += x.Len
	}
	e.logger.Info("reconciling dirty regions after an unclean stop", "regions", len(dirty), "bytes", total)
	start := time.Now()
	buf := make([]byte, min(total, replica.MaxIO))
	for _, x := range dirty {
		for _, c := range chunks(x.Off, x.Len) {
			differ, err := e.differing(ctx, c.Off, c.Len)
			if err != nil {
				return err
			}
			for _, d := range differ {
				if err := e.copyFromOne(ctx, buf[:d.Len], d.Off); err != nil {
					return err
				}
				copied += d.Len
			}
		}
	}
	e.logger.Info("dirty regions reconciled", "bytes", total, "copied", copied, "took", time.Since(start).Round(time.Millisecond))
	if err := e.flush(ctx); err != nil {
		return err
	}
	// The healthy replicas owe nothing now: settle the regions they kept
	// dirty from before their servers opened them (EndRebuild with FUA;
	// replica/doc.go, "Dirty regions"). A rebuilding one settles when its
	// rebuild completes. A failure leaves them owed, which only costs the
	// next reconcile a look at them.
	for _, m := range e.readSet() {
		if err := e.call(ctx, func(ctx context.Context) error { return m.conn.EndRebuild(ctx, e.op(true)) }); err != nil {
			e.logger.Warn("settling a reconciled replica's dirty regions", "replica", m.info.Id, "err", err)
		}
	}
	return nil
}

// Digester is a replica whose server digests a range of its head where
// it lies (the replica protocol's DIGEST; wire.Handle): one digest per
// wire.DigestBlock, equal for equal contents. A server that cannot
// answers wire.ErrUnknownOp.
type Digester interface {
	Digests(ctx context.Context, o replica.Op, off int64, n int) ([]uint64, error)
}

// differing returns the runs of wire.DigestBlock blocks of [off, off+n)
// in which the replicas of the write set may differ: those whose digests
// are not the same on all of them. A replica that fails to answer is
// recorded faulty and leaves the comparison (and the set); where the
// replicas cannot be compared (one cannot digest, or is not a Digester),
// the whole range.
//
// The answer holds for copyFromOne whichever healthy replica it ends up
// copying from: outside the runs every replica left in the set holds the
// same blocks, and nothing writes in between (reconcile runs before any
// I/O is served).
func (e *Engine) differing(ctx context.Context, off, n int64) ([]replica.Extent, error) {
	whole := []replica.Extent{{Off: off, Len: n}}
	set := e.writeSet()
	if len(set) < 2 {
		return whole, nil // nothing to compare; copyFromOne says whether there is a source
	}
	for _, m := range set {
		if _, ok := m.conn.(Digester); !ok {
			return whole, nil
		}
	}
	digests := make([][]uint64, len(set))
	errs := make([]error, len(set))
	var wg sync.WaitGroup
	for i, m := range set {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = e.call(ctx, func(ctx context.Context) error {
				var err error
				digests[i], err = m.conn.(Digester).Digests(ctx, e.op(false), off, int(n))
				return err
			})
		}()
	}
	wg.Wait()
	want := int((n + wire.DigestBlock - 1) / wire.DigestBlock)
	var cmp [][]uint64
	for i, err := range errs {
		switch {
		case err == nil && len(digests[i]) == want:
			cmp = append(cmp, digests[i])
			continue
		case err == nil:
			err = fmt.Errorf("%d digests of %d bytes, want %d", len(digests[i]), n, want)
			errs[i] = err // not compared
		case errors.Is(err, wire.ErrUnknownOp):
			return whole, nil
		}
		if cerr := e.classify(ctx, err); cerr != nil {
			return nil, cerr
		}
		if ferr := e.markFaulty(ctx, set[i], set[i].info.Id, fmt.Sprintf("reconcile digest: %v", err)); ferr != nil {
			return nil, ferr
		}
	}
	// (A member whose state changed is a new *member of the same
	// incarnation, its connection carried over.)
	for _, m := range e.writeSet() {
		i := slices.IndexFunc(set, func(c *member) bool { return c.info.Id == m.info.Id && c.incarnation == m.incarnation })
		if i < 0 || errs[i] != nil {
			return whole, nil // not compared (not expected: the set only shrinks here)
		}
	}
	if len(cmp) < 2 {
		return whole, nil
	}
	var out []replica.Extent
	for b := range want {
		same := true
		for _, ds := range cmp[1:] {
			same = same && ds[b] == cmp[0][b]
		}
		if same {
			continue
		}
		bo := off + int64(b)*wire.DigestBlock
		bl := min(wire.DigestBlock, off+n-bo)
		if k := len(out); k > 0 && out[k-1].Off+out[k-1].Len == bo {
			out[k-1].Len += bl
			continue
		}
		out = append(out, replica.Extent{Off: bo, Len: bl})
	}
	return out, nil
}

// copyFromOne reads a range from the first healthy replica and writes it
// to all the others.
func (e *Engine) copyFromOne(ctx context.Context, p []byte, off int64) error {
	for {
		src := e.readSet()
		if len(src) == 0 {
			return fmt.Errorf("%w: volume %s has no healthy replica to reconcile from", ErrIO, e.name)
		}
		err := e.call(ctx, func(ctx context.Context) error { return src[0].conn.ReadAt(ctx, e.op(false), p, off) })
		if err != nil {
			if cerr := e.classify(ctx, err); cerr != nil {
				return cerr
			}
			if ferr := e.markFaulty(ctx, src[0], src[0].info.Id, fmt.Sprintf("reconcile read: %v", err)); ferr != nil {
				return ferr
			}
			continue
		}
		var others []*member
		for _, m := range e.writeSet() {
			if m != src[0] {
				others = append(others, m)
			}
		}
		if len(others) == 0 {
			return nil
		}
		return e.fanOut(ctx, others, func(ctx context.Context, m *member) error {
			return m.conn.WriteAt(ctx, e.op(false), p, off)
		})
	}
}

// mergeExtents sorts, clips to size and coalesces overlapping or adjacent
// extents.
func mergeExtents(xs []replica.Extent, size int64) []replica.Extent {
	slices.SortFunc(xs, func(a, b replica.Extent) int {
		switch {
		case a.Off < b.Off:
			return -1
		case a.Off > b.Off:
			return 1
		}
		return 0
	})
	var out []replica.Extent
	for _, x := range xs {
		if x.Off >= size || x.Len <= 0 {
			continue
		}
		x.Len = min(x.Len, size-x.Off)
		if n := len(out); n > 0 && x.Off <= out[n-1].Off+out[n-1].Len {
			end := max(out[n-1].Off+out[n-1].Len, x.Off+x.Len)
			out[n-1].Len = end - out[n-1].Off
			continue
		}
		out = append(out, x)
	}
	return out
}
