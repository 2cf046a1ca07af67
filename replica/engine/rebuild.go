package engine

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// RebuildSource is what a rebuild reads from: one healthy replica, and the
// write history of every healthy replica (for a delta).
type RebuildSource struct {
	// Read is the healthy replica the data is copied from.
	Read ReplicaConn
	// ReadID is Read's replica id: a target that can read it itself
	// (CopyTarget) is asked to copy each chunk from it. "" relays every
	// chunk (read from Read, written to the target).
	ReadID string
	// History are all healthy replicas (Read among them): a delta copies
	// the regions any of them wrote since the target fell behind.
	History []ReplicaConn
}

// The copy's defaults (RebuildPlan): measured in docs/BENCHMARKS.md,
// "Rebuild".
const (
	DefaultRebuildChunk    = 1 << 20
	DefaultRebuildInFlight = 4
	// MaxRebuildInFlight bounds the chunks a rebuild copies at once (the
	// copy's buffers are InFlight x ChunkBytes).
	MaxRebuildInFlight = 64
)

// progressTimeout bounds a rebuild's report of its progress to the
// control plane, during which the copy waits; progressInterval spaces
// the reports of plain progress (ProgressReports).
const (
	progressTimeout  = 2 * time.Second
	progressInterval = 2 * time.Second
)

// RebuildPlan says what to copy.
type RebuildPlan struct {
	// FromGeneration > 0 asks for a delta: the regions written at or after
	// that generation (the one at which the target stopped being healthy,
	// kept by raftstore through failed rebuilds), plus
	// the target's own dirty regions (writes it took that the others may
	// not have). 0 is a full rebuild of every allocated extent.
	FromGeneration uint64
	// Size is the volume size.
	Size int64
	// ResumeFrom: a full rebuild that was interrupted copies only from
	// here on (everything below was copied and flushed on the target, and
	// every write since reached the target: it stayed in the write set).
	//
	// Resumed with no write order (Order nil: a server's rebuild of a
	// detached volume), it trusts nothing the target's earlier writers
	// left besides what the checkpoint says was copied. The checkpoint
	// may be an engine's that has since died with a write it never
	// acknowledged on the target alone: below the checkpoint, or in a
	// sector the target's rebuild tracking keeps from the copy. No engine
	// flush cleared that write's dirty region on the target (an engine's
	// flush waits until every replica applied the writes before it or was
	// recorded faulty, and one that cannot record a failure flushes
	// nothing more: flushOrdered), and this rebuild, which
	// reconciles nothing, would clear it at its first flush: the replica
	// would be recorded healthy holding a write the others do not. So
	// such a rebuild resets the target's tracking (nothing else writes the
	// volume: it protects nothing), copies the target's dirty regions
	// below ResumeFrom too, and takes no checkpoint before it passes
	// ResumeFrom (a flush would clear the regions not yet copied). An
	// engine's own resumed rebuild (Order set) keeps both: the engine
	// reconciled every replica's dirty regions, the target's included,
	// when it opened.
	ResumeFrom int64
	// CheckpointBytes is how much a full rebuild copies between
	// checkpoints: it flushes the target and reports the offset below
	// which the target is complete, so an interrupted rebuild resumes
	// there. Default 256 MiB.
	CheckpointBytes int64
	// ChunkBytes is how much one copy request carries (rounded down to
	// whole sectors, at most replica.MaxIO); default DefaultRebuildChunk.
	ChunkBytes int64
	// InFlight is how many chunks are copied at once; default
	// DefaultRebuildInFlight.
	InFlight int
	// Relay copies every chunk through the caller (read from the source,
	// written to the target) even when the target could copy it itself.
	Relay bool
	// Order orders the copy against the writes of the engine that serves
	// the volume while it is copied; nil when nothing writes the volume
	// meanwhile (a detached volume, whose replicas an attach would fence
	// against the copy).
	Order WriteOrder
	// RequestTimeout bounds each request the rebuild makes of a source
	// (the extents and write history it plans by, each chunk's read; a
	// chunk the target copies itself gets it as its budget) when Order
	// does not bound the chunk: a source that stops answering fails the
	// rebuild instead of holding it. The target's requests are not
	// bounded: the target is the rebuilder's own replica (a server's
	// rebuild of a detached volume's), and a bound would only fail a slow
	// disk's flushes at every attempt. 0: only ctx bounds them (the
	// engine's Order bounds a chunk by its IOTimeout, and the engine
	// fails a replica that stops answering its writes).
	RequestTimeout time.Duration
}

// bounded returns ctx bounded by the plan's RequestTimeout.
func (p RebuildPlan) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if p.RequestTimeout > 0 {
		return context.WithTimeout(ctx, p.RequestTimeout)
	}
	return ctx, func() {}
}

// call runs one request of a source under the plan's RequestTimeout.
func (p RebuildPlan) call(ctx context.Context, f func(context.Context) error) error {
	ctx, cancel := p.bounded(ctx)
	defer cancel()
	return f(ctx)
}

// WriteOrder orders a rebuild against the writes of the engine that
// serves the volume while it copies (DESIGN.md, "Data path", points 4
// and 5). The engine's implementation is its overlap set and flush order.
type WriteOrder interface {
	// LockCopy waits until no write to [off, off+n) that began before it
	// is in flight, and keeps later writes off the range until unlock is
	// called: the copy of a block and a write to it never interleave. The
	// copy's requests run under the returned context (derived from ctx),
	// which bounds how long writes can wait for it.
	LockCopy(ctx context.Context, off, n int64) (copyCtx context.Context, unlock func(), err error)
	// Flush runs flush (of the target) in the engine's flush order: after
	// every earlier flush, and after every write that began before it.
	Flush(ctx context.Context, flush func(context.Context) error) error
}

// Progress is a rebuild's report: bytes done of total, and (for a full
// rebuild) the checkpoint offset below which the target is complete and
// durable.
type Progress struct {
	Done, Total  int64
	ResumeOffset int64
}

// RebuildStats is what a rebuild did.
type RebuildStats struct {
	Delta  bool  // a delta rebuild (false: full, also when a delta was impossible)
	Ranges int   // ranges copied
	Bytes  int64 // bytes copied
	// Copied is how many of Bytes the target copied from the source
	// itself (CopyTarget); the rest was relayed through the caller.
	Copied int64
}

// CopyTarget is a rebuild target whose server can copy a chunk from the
// source itself (the replica protocol's REBUILD_COPY; wire.Handle): the
// bytes then go from the source's server to the target's, not through the
// rebuilder. A source it cannot read within budget is wire.ErrCopySource,
// and nothing is written; a server that cannot copy answers
// wire.ErrUnknownOp.
type CopyTarget interface {
	RebuildCopy(ctx context.Context, o replica.Op, source string, off, n int64, budget time.Duration) error
}

// Rebuild copies a volume into a rebuilding target replica while writes
// may go on (they reach the target too: the caller keeps it in the write
// set). Each chunk is read from the source and written to the target while
// plan.Order holds its range against writes, so a write in flight when
// the chunk is read is on the source (and the target) before the copy,
// and a later one reaches the target after it: the copy never puts a
// block older than a write over it. The target, besides, protects every
// block a normal write touches after BeginRebuild from the copy (replica
// invariant 4); that alone does not suffice, since the target may have
// taken a write before BeginRebuild that the source had not yet applied
// when the chunk was read (ISSUE13 C). Chunks are copied several at once
// (copier). progress, if set, is called on the caller's goroutine when
// the copy begins (Done 0), about once a second while it runs, at each
// checkpoint and at the end.
func Rebuild(ctx context.Context, o replica.Op, src RebuildSource, dst ReplicaConn, plan RebuildPlan, progress func(Progress)) (RebuildStats, error) {
	var st RebuildStats
	if plan.ResumeFrom == 0 || plan.Order == nil {
		// A rebuild that starts over starts its tracking over. The target
		// may hold the tracking of an earlier attempt that failed; it then
		// left the write set and missed writes, so the blocks that
		// attempt saw written are not newer than the source's (found by
		// the jepsen harness; see docs/JEPSEN.md). Only a resumed full
		// rebuild, whose target stayed in the write set, keeps it, and
		// only under an engine's write order (RebuildPlan.ResumeFrom).
		if err := dst.EndRebuild(ctx, o); err != nil {
			return st, fmt.Errorf("rebuild: reset: %w", err)
		}
	}
	if err := dst.BeginRebuild(ctx, o); err != nil {
		return st, fmt.Errorf("rebuild: begin: %w", err)
	}
	ranges, delta, err := planRanges(ctx, o, src, dst, plan)
	if err != nil {
		return st, err
	}
	st.Delta = delta
	var total int64
	for _, r := range ranges {
		total += r.Len
	}
	report := func(resume int64) {
		if progress != nil {
			progress(Progress{Done: st.Bytes, Total: total, ResumeOffset: resume})
		}
	}
	cp := copier{o: o, src: src.Read, dst: dst, order: plan.Order, timeout: plan.RequestTimeout, report: report, st: &st}
	if ct, ok := dst.(CopyTarget); ok && src.ReadID != "" && !plan.Relay {
		cp.copyTarget, cp.srcID = ct, src.ReadID
		cp.pull.Store(true)
	}
	cp.chunk = plan.ChunkBytes
	if cp.chunk <= 0 {
		cp.chunk = DefaultRebuildChunk
	}
	// Whole sectors (every range is), at most what one request carries.
	cp.chunk = max(min(cp.chunk, total, replica.MaxIO)/replica.SectorSize*replica.SectorSize, replica.SectorSize)
	cp.inFlight = plan.InFlight
	if cp.inFlight <= 0 {
		cp.inFlight = DefaultRebuildInFlight
	}
	if !delta {
		cp.checkpoint = plan.CheckpointBytes
		if cp.checkpoint <= 0 {
			cp.checkpoint = 256 << 20
		}
		if plan.Order == nil {
			cp.checkpointFrom = plan.ResumeFrom // see RebuildPlan.ResumeFrom
		}
	}
	// The copy begins: its total is reported at once, so that the control
	// plane (stor-ctl, a fault test) sees that this attempt is copying,
	// and how much, from its first chunk rather than after a second.
	report(0)
	if err := cp.run(ctx, ranges); err != nil {
		return st, err
	}
	// FUA: the copy is complete, so the regions the target owes since
	// its server opened it (its dirty regions then, part of the plan)
	// are settled (replica/doc.go, "Dirty regions").
	end := o
	end.FUA = true
	if err := dst.EndRebuild(ctx, end); err != nil {
		return st, fmt.Errorf("rebuild: end: %w", err)
	}
	if err := flushTarget(ctx, o, dst, plan.Order); err != nil {
		return st, err
	}
	report(0)
	return st, nil
}

// copier runs a rebuild's copy: up to inFlight chunks at once, each read
// from the source and written to the target under its own hold on the
// write order (copyChunk), so the rule for a copy and a write to the same
// block is the one a single copy keeps; chunks in flight together never
// overlap. Where the target can (CopyTarget), the target's server reads
// the chunk from the source itself, under the same hold, and the bytes
// never pass through here; the first chunk it cannot read from the source
// (the two servers cut off from each other, the source failing, a server
// without REBUILD_COPY) is read here instead, which blames the source only
// if it fails here too, as a relayed copy always did, and the rest of the
// rebuild is relayed. A copy is a round trip to the source and one to the target,
// most of it waiting on the other side: serial, they left both replicas
// idle most of the time. The checkpoints stay where a serial copy puts
// them: a chunk is retired in offset order, and each checkpoint (after
// every checkpoint bytes retired, but not after the last chunk, where the
// rebuild's last flush follows at once) flushes the target, then reports
// the end of the last chunk retired, below which every chunk was written
// before the flush began. The copy goes on while a checkpoint's flush runs; the
// next checkpoint waits for it.
type copier struct {
	o          replica.Op
	src, dst   ReplicaConn
	order      WriteOrder
	timeout    time.Duration // RebuildPlan.RequestTimeout
	chunk      int64         // bytes per copy request
	inFlight   int           // copies at once
	checkpoint int64         // bytes between checkpoints; 0: none (a delta)
	// checkpointFrom: chunks below it count towards no checkpoint
	// (RebuildPlan.ResumeFrom).
	checkpointFrom int64
	report         func(resume int64)
	st             *RebuildStats

	// copyTarget is dst when it copies chunks itself, from replica srcID,
	// while pull holds.
	copyTarget CopyTarget
	srcID      string
	pull       atomic.Bool
}

// copyJob is one chunk of a range, from launch to retirement.
type copyJob struct {
	off, n int64
	lastOf bool // the last chunk of its range
	buf    []byte
	err    error
	copied bool // by the target (CopyTarget)
	done   bool
}

// run copies ranges (ascending, disjoint) and returns the first failure.
// The progress report is called on the caller's goroutine only.
func (c *copier) run(parent context.Context, ranges []replica.Extent) error {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	results := make(chan *copyJob, c.inFlight)
	type flushResult struct {
		resume int64
		err    error
	}
	flushed := make(chan flushResult, 1)
	flushing := false
	var first error
	fail := func(err error) {
		if first == nil {
			first = err
			cancel()
		}
	}
	// waitFlush takes the running checkpoint flush's result.
	waitFlush := func() {
		r := <-flushed
		flushing = false
		switch {
		case r.err != nil:
			fail(r.err)
		case first == nil:
			c.report(r.resume)
		}
	}
	var free [][]byte
	var queue []*copyJob // launched, in offset order, not yet retired
	ri, pos := 0, int64(0)
	if len(ranges) > 0 {
		pos = ranges[0].Off
	}
	var since int64
	last := time.Now()
	for {
		for first == nil && len(queue) < c.inFlight && ri < len(ranges) {
			if err := ctx.Err(); err != nil {
				fail(fmt.Errorf("rebuild: %w", err))
				break
			}
			r := ranges[ri]
			j := &copyJob{off: pos, n: min(c.chunk, r.Off+r.Len-pos)}
			pos += j.n
			if pos == r.Off+r.Len {
				j.lastOf = true
				if ri++; ri < len(ranges) {
					pos = ranges[ri].Off
				}
			}
			if n := len(free); n > 0 {
				j.buf, free = free[n-1], free[:n-1]
			}
			queue = append(queue, j)
			go func() {
				j.err = c.copyChunk(ctx, j)
				results <- j
			}()
		}
		if len(queue) == 0 {
			break
		}
		got := <-results
		got.done = true
		switch {
		case got.err == nil:
		case parent.Err() != nil:
			fail(fmt.Errorf("rebuild: %w", parent.Err()))
		default:
			fail(got.err)
		}
		for len(queue) > 0 && queue[0].done {
			j := queue[0]
			queue = queue[1:]
			if j.buf != nil {
				free = append(free, j.buf)
			}
			if j.err != nil || first != nil {
				continue
			}
			c.st.Bytes += j.n
			if j.copied {
				c.st.Copied += j.n
			}
			if j.lastOf {
				c.st.Ranges++
			}
			if j.off >= c.checkpointFrom {
				since += j.n
			}
			switch {
			case c.checkpoint > 0 && since >= c.checkpoint && (ri < len(ranges) || len(queue) > 0):
				// (Not after the last chunk: the rebuild's last flush
				// follows at once.)
				// Every chunk below j's end is on the target: make it
				// durable, then say so (waitFlush).
				if flushing {
					if waitFlush(); first != nil {
						continue
					}
				}
				if err := ctx.Err(); err != nil {
					fail(fmt.Errorf("rebuild: %w", err))
					continue
				}
				flushing = true
				resume := j.off + j.n
				go func() { flushed <- flushResult{resume, flushTarget(ctx, c.o, c.dst, c.order)} }()
				since, last = 0, time.Now()
			case time.Since(last) > time.Second:
				c.report(0)
				last = time.Now()
			}
		}
	}
	if flushing {
		waitFlush()
	}
	return first
}

// copyChunk copies chunk j from the source to the target, holding its
// range against writes (order) from the read to the write: the target
// copies it if it can (copier), else it is relayed in j.buf.
func (c *copier) copyChunk(ctx context.Context, j *copyJob) error {
	parent := ctx
	var span time.Duration // how long the order lets one copy take
	if c.order != nil {
		start := time.Now()
		copyCtx, unlock, err := c.order.LockCopy(ctx, j.off, j.n)
		if err != nil {
			return fmt.Errorf("rebuild: %w", err)
		}
		defer unlock()
		ctx = copyCtx
		if d, ok := ctx.Deadline(); ok {
			span = d.Sub(start)
		}
	}
	budget := copyBudget(ctx)
	if c.order == nil && c.timeout > 0 {
		budget = c.timeout
	}
	if c.pull.Load() {
		err := c.copyTarget.RebuildCopy(ctx, c.o, c.srcID, j.off, j.n, budget)
		switch {
		case err == nil:
			j.copied = true
			return nil
		case errors.Is(err, wire.ErrCopySource), errors.Is(err, wire.ErrUnknownOp),
			errors.Is(err, context.DeadlineExceeded) && parent.Err() == nil:
			// (A copy that did not answer in time may be a slow source as
			// well as a slow target: the relay tells them apart.)
			// Not the target's failure, nor surely the source's: relay
			// this chunk and the rest, so that a source that fails here
			// too is blamed, and only then. The relay has a copy's whole
			// time of its own (the hold lasts until it is done): the
			// target's answer may have come late, and a source must not
			// be blamed for the time the target took.
			c.pull.Store(false)
			if err := parent.Err(); err != nil {
				return fmt.Errorf("rebuild: %w", err)
			}
			if span > 0 {
				relayCtx, cancel := context.WithTimeout(parent, span)
				defer cancel()
				ctx = relayCtx
			}
		default:
			return fmt.Errorf("rebuild: copy into target: %w", err)
		}
	}
	if j.buf == nil {
		j.buf = make([]byte, c.chunk)
	}
	p := j.buf[:j.n]
	readCtx := ctx
	if c.order == nil && c.timeout > 0 { // the source's read alone is bounded
		var cancel context.CancelFunc
		readCtx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	if err := c.src.ReadAt(readCtx, c.o, p, j.off); err != nil {
		return fmt.Errorf("rebuild: read source: %w", errSource{err, -1})
	}
	if err := c.dst.RebuildWrite(ctx, c.o, p, j.off); err != nil {
		return fmt.Errorf("rebuild: write target: %w", err)
	}
	return nil
}

// copyBudget is how long a target may spend reading a chunk from the
// source: half of what is left of ctx, so that a source it cannot read
// leaves the time to read it here and blame the right replica.
func copyBudget(ctx context.Context) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return max(time.Until(d)/2, time.Millisecond)
	}
	return wire.DefaultCopyBudget
}

// flushTarget flushes the target, in the engine's flush order if there is
// one.
func flushTarget(ctx context.Context, o replica.Op, dst ReplicaConn, order WriteOrder) error {
	flush := func(ctx context.Context) error { return dst.Flush(ctx, o) }
	var err error
	if order != nil {
		err = order.Flush(ctx, flush)
	} else {
		err = flush(ctx)
	}
	if err != nil {
		return fmt.Errorf("rebuild: flush target: %w", err)
	}
	return nil
}

// engineOrder is the engine's WriteOrder for the rebuilds it drives.
type engineOrder struct{ e *Engine }

// LockCopy bounds the copy by IOTimeout, as every replica request: a
// replica that does not answer in time has failed, and writes to the
// range wait for it no longer.
func (o engineOrder) LockCopy(ctx context.Context, off, n int64) (context.Context, func(), error) {
	if o.e.cfg.UnsafeUnorderedRebuild {
		ctx, cancel := context.WithTimeout(ctx, o.e.cfg.IOTimeout)
		return ctx, cancel, nil // the broken mode of ISSUE13 C; see Config
	}
	sp, err := o.e.overlaps.lock(ctx, spanCopy, off, n)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.e.cfg.IOTimeout)
	return ctx, func() { cancel(); o.e.overlaps.unlock(sp) }, nil
}

// Flush bounds the flush by IOTimeout, as every replica request: it holds
// the engine's flush turn, which every other flush waits for.
func (o engineOrder) Flush(ctx context.Context, flush func(context.Context) error) error {
	return o.e.flushOrdered(ctx, func(ctx context.Context) error { return o.e.call(ctx, flush) })
}

// errSource marks an error as a source replica's, and says which one, so
// the caller blames the right replica: history is the index in
// RebuildSource.History of the replica whose write history failed, or -1
// for RebuildSource.Read.
type errSource struct {
	error
	history int
}

func (e errSource) Unwrap() error { return e.error }

// IsSourceError reports whether a Rebuild error came from a source
// replica (RebuildSource.Read or one of RebuildSource.History) rather than
// the target.
func IsSourceError(err error) bool {
	var s errSource
	return errors.As(err, &s)
}

// FailedHistory reports the index in RebuildSource.History of the replica
// whose write history a Rebuild could not read, if that is what err is. A
// history failure is that replica's, not the read source's.
func FailedHistory(err error) (int, bool) {
	var s errSource
	if errors.As(err, &s) && s.history >= 0 {
		return s.history, true
	}
	return 0, false
}

func planRanges(ctx context.Context, o replica.Op, src RebuildSource, dst ReplicaConn, plan RebuildPlan) ([]replica.Extent, bool, error) {
	if plan.FromGeneration > 0 {
		var regions []replica.Extent
		lost := false
		for i, h := range src.History {
			var r []replica.Extent
			err := plan.call(ctx, func(ctx context.Context) (err error) {
				r, err = h.WrittenSince(ctx, o, plan.FromGeneration)
				return err
			})
			if errors.Is(err, replica.ErrHistoryLost) {
				lost = true
				break
			}
			if err != nil {
				return nil, false, fmt.Errorf("rebuild: write history: %w", errSource{err, i})
			}
			regions = append(regions, r...)
		}
		if !lost {
			own, err := dst.DirtyRegions(ctx, o)
			if err != nil {
				return nil, false, fmt.Errorf("rebuild: target dirty regions: %w", err)
			}
			return mergeExtents(append(regions, own...), plan.Size), true, nil
		}
	}
	// Full: every extent the source holds, and every extent the target
	// holds (a returning replica may hold writes the source never had;
	// copying the source's contents there, zeroes included, removes them).
	all, err := allExtents(ctx, o, src.Read, plan)
	if err != nil {
		return nil, false, fmt.Errorf("rebuild: source extents: %w", errSource{err, -1})
	}
	own, err := allExtents(ctx, o, dst, RebuildPlan{}) // the target's: not bounded
	if err != nil {
		return nil, false, fmt.Errorf("rebuild: target extents: %w", err)
	}
	merged := mergeExtents(append(all, own...), plan.Size)
	if plan.ResumeFrom > 0 {
		merged = clipFrom(merged, plan.ResumeFrom)
		if plan.Order == nil {
			dirty, err := dst.DirtyRegions(ctx, o)
			if err != nil {
				return nil, false, fmt.Errorf("rebuild: target dirty regions: %w", err)
			}
			merged = mergeExtents(append(clipBelow(dirty, plan.ResumeFrom), merged...), plan.Size)
		}
	}
	return merged, false, nil
}

// clipBelow keeps what lies below off.
func clipBelow(xs []replica.Extent, off int64) []replica.Extent {
	var out []replica.Extent
	for _, x := range xs {
		switch {
		case x.Off >= off:
		case x.Off+x.Len > off:
			out = append(out, replica.Extent{Off: x.Off, Len: off - x.Off})
		default:
			out = append(out, x)
		}
	}
	return out
}

// clipFrom drops what lies below off.
func clipFrom(xs []replica.Extent, off int64) []replica.Extent {
	var out []replica.Extent
	for _, x := range xs {
		switch {
		case x.Off+x.Len <= off:
		case x.Off < off:
			out = append(out, replica.Extent{Off: off, Len: x.Off + x.Len - off})
		default:
			out = append(out, x)
		}
	}
	return out
}

func allExtents(ctx context.Context, o replica.Op, r ReplicaConn, plan RebuildPlan) ([]replica.Extent, error) {
	var all []replica.Extent
	from := int64(0)
	for {
		var page []replica.Extent
		err := plan.call(ctx, func(ctx context.Context) (err error) {
			page, err = r.Extents(ctx, o, "", from, 4096)
			return err
		})
		if err != nil {
			return nil, err
		}
		if len(page) == 0 {
			return all, nil
		}
		all = append(all, page...)
		last := page[len(page)-1]
		from = last.Off + last.Len
	}
}

// chunksOf splits a range into pieces of at most n bytes.
func chunksOf(off, length, n int64) []replica.Extent {
	var out []replica.Extent
	for length > 0 {
		l := min(length, n)
		out = append(out, replica.Extent{Off: off, Len: l})
		off, length = off+l, length-l
	}
	return out
}

// startRebuilds starts a rebuild for every rebuilding replica in the write
// set that has none running. The engine drives rebuilds of its own volume
// because it also sends the target every new write: there is no moment
// when a write reaches the source and not the target.
func (e *Engine) startRebuilds() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() || e.fenced.Load() || e.broken.Load() { // broken: its flushes are refused (flushOrdered)
		return
	}
	for id, m := range e.members {
		if m.info.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || e.rebuilding[id] {
			continue
		}
		e.rebuilding[id] = true
		info := m.info
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.rebuild(info)
			e.mu.Lock()
			delete(e.rebuilding, info.Id)
			e.mu.Unlock()
		}()
	}
}

// rebuild copies into one rebuilding replica and reports it healthy. A
// rebuild that stops (a replica it used left the write set, no source)
// is started again by retryJoins.
func (e *Engine) rebuild(r *storpb.Replica) {
	ctx := e.ctx
	log := e.logger.With("replica", r.Id, "server", r.ServerId, "delta_from", r.RebuildFromGeneration)
	e.mu.Lock()
	target := e.members[r.Id]
	e.mu.Unlock()
	if target == nil {
		return
	}
	// The target is in the write set: every write that takes the set from
	// now on reaches it. A write that took the set before does not, and
	// may not yet be on any source when the copy reads their extents or
	// write history to plan what to copy: wait for those first (ISSUE13 C).
	if !e.cfg.UnsafeUnorderedRebuild {
		if err := e.overlaps.wait(ctx); err != nil {
			return
		}
	}
	sources := e.readSet()
	if len(sources) == 0 {
		return
	}
	var history []ReplicaConn
	for _, s := range sources {
		history = append(history, s.conn)
	}
	start := time.Now()
	log.Info("rebuild started", "source", sources[0].info.Id)
	report := ProgressReports(ctx, e.cfg.Control.Volumes, e.id, r, e.epoch)
	// copied and left are this rebuild's shares of rebuildCopied and
	// rebuildLeft (RebuildProgress).
	var copied, left int64
	defer func() { e.rebuildLeft.Add(-left) }()
	stats, err := Rebuild(ctx, e.op(false), RebuildSource{Read: sources[0].conn, ReadID: sources[0].info.Id, History: history}, target.conn,
		RebuildPlan{FromGeneration: r.RebuildFromGeneration, Size: int64(e.size.Load()), ResumeFrom: int64(r.RebuildResumeOffset), Order: engineOrder{e},
			ChunkBytes: e.cfg.RebuildChunkBytes, InFlight: e.cfg.RebuildInFlight, Relay: e.cfg.RebuildRelay},
		func(p Progress) {
			e.rebuildCopied.Add(p.Done - copied)
			copied = p.Done
			l := max(p.Total-p.Done, 0)
			e.rebuildLeft.Add(l - left)
			left = l
			report(p)
		})
	e.rebuildCopied.Add(stats.Bytes - copied) // what the last report did not count
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		log.Warn("rebuild failed", "err", err)
		if cerr := e.classify(ctx, err); cerr != nil {
			return // fenced
		}
		if e.broken.Load() {
			return // no replica's fault: the engine stopped (its flushes are refused)
		}
		// Blame the replica the error came from. A history failure is
		// that replica's: blaming the read source instead took a replica
		// holding every write out of the read set and left the failing
		// one the last healthy copy (jepsen seed 1016, docs/JEPSEN.md).
		blame := target
		if i, ok := FailedHistory(err); ok {
			blame = sources[i]
		} else if IsSourceError(err) {
			blame = sources[0]
		}
		// (If it left the write set during the copy, its connection closed
		// then, markFaulty records nothing.)
		_ = e.markFaulty(ctx, blame, blame.info.Id, fmt.Sprintf("rebuild: %v", err))
		return
	}
	resp, err := e.cfg.Control.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
		VolumeId: e.id, ReplicaId: r.Id, State: storpb.ReplicaState_REPLICA_STATE_HEALTHY,
		Epoch: e.epoch, Generation: r.Generation, Reason: "rebuild complete",
	})
	if err != nil {
		if status.Code(err) == codes.Aborted {
			e.fence("the control plane refused our epoch")
		}
		log.Warn("rebuild done but not recorded", "err", err)
		return
	}
	e.applyVolume(resp.Volume)
	log.Info("rebuild complete", "delta", stats.Delta, "ranges", stats.Ranges, "bytes", stats.Bytes, "copied_by_target", stats.Copied,
		"took", time.Since(start).Round(time.Millisecond))
}

// ProgressReports returns the progress callback of a rebuild of r that
// reports to the control plane (vols): the first report, every checkpoint
// and then plain progress every progressInterval. A report is not worth a
// stalled copy: one the control plane has not taken within
// progressTimeout is dropped (the control client retries a call without
// a deadline for as long as the cluster has no leader, and a leader whose
// disk hangs takes a call and never answers it). A dropped checkpoint
// only makes a later resume start lower. The engine's rebuilds and the
// servers' rebuilds of detached volumes both report through it.
func ProgressReports(ctx context.Context, vols storpb.VolumeServiceClient, volumeID string, r *storpb.Replica, epoch uint64) func(Progress) {
	var last time.Time
	return func(p Progress) {
		if p.ResumeOffset == 0 && !last.IsZero() && time.Since(last) < progressInterval {
			return
		}
		pctx, cancel := context.WithTimeout(ctx, progressTimeout)
		_, _ = vols.SetReplicaState(pctx, ProgressRequest(volumeID, r, epoch, p))
		cancel()
		last = time.Now()
	}
}

// ProgressRequest is the control-plane report of the progress of a
// rebuild of r (as it was when the rebuild started: its generation names
// the attempt, so a late report of an attempt that failed cannot record
// its checkpoint for a later one).
func ProgressRequest(volumeID string, r *storpb.Replica, epoch uint64, p Progress) *storpb.SetReplicaStateRequest {
	return &storpb.SetReplicaStateRequest{
		VolumeId: volumeID, ReplicaId: r.Id, Generation: r.Generation, State: storpb.ReplicaState_REPLICA_STATE_REBUILDING, Epoch: epoch,
		RebuildDoneBytes: uint64(p.Done), RebuildTotalBytes: uint64(max(p.Total, 1)), RebuildResumeOffset: uint64(p.ResumeOffset),
	}
}
