package engine

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/stor-io/stor/replica"
)

// reconcile makes every opened replica identical in the regions any of
// them marks dirty: after an unclean stop, writes that were in flight may
// have reached some replicas and not others. The contents of one healthy
// replica (the local one when there is one) win; since none of those
// writes was acknowledged, either version is allowed, but only one may
// remain. It runs before Open returns, so no I/O sees the difference.
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
	var total int64
	for _, x := range dirty {
		total += x.Len
	}
	e.logger.Info("reconciling dirty regions after an unclean stop", "regions", len(dirty), "bytes", total)
	start := time.Now()
	buf := make([]byte, min(total, replica.MaxIO))
	for _, x := range dirty {
		for _, c := range chunks(x.Off, x.Len) {
			if err := e.copyFromOne(ctx, buf[:c.Len], c.Off); err != nil {
				return err
			}
		}
	}
	e.logger.Info("dirty regions reconciled", "bytes", total, "took", time.Since(start).Round(time.Millisecond))
	return e.flush(ctx)
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
