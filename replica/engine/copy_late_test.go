package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// deadlineOrder is a WriteOrder whose copies run under a deadline, as
// engineOrder's IOTimeout.
type deadlineOrder struct{ d time.Duration }

func (o deadlineOrder) LockCopy(ctx context.Context, off, n int64) (context.Context, func(), error) {
	c, cancel := context.WithTimeout(ctx, o.d)
	return c, cancel, nil
}

func (o deadlineOrder) Flush(ctx context.Context, flush func(context.Context) error) error {
	return flush(ctx)
}

// lateCopyTarget is a target whose server began the REBUILD_COPY late
// (waiting for MaxMemory in getBuf, its connection's in-flight budget:
// none of it counted in the budget) and then could not reach the source
// within the budget: its ErrCopySource arrives just before the engine's
// deadline.
type lateCopyTarget struct{ conn }

func (t lateCopyTarget) RebuildCopy(ctx context.Context, o replica.Op, source string, off, n int64, budget time.Duration) error {
	d, _ := ctx.Deadline()
	select {
	case <-time.After(time.Until(d) - 2*time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return fmt.Errorf("remote: cut off from %s: %w", source, wire.ErrCopySource)
}

// rttSource is a healthy source over a network with a 5 ms round trip:
// like wire's roundTrip, a call whose ctx has ended fails at once.
type rttSource struct{ conn }

func (s rttSource) ReadAt(ctx context.Context, o replica.Op, p []byte, off int64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case <-time.After(5 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.conn.ReadAt(ctx, o, p, off)
}

// The relay that follows a target's ErrCopySource has a copy's whole time
// of its own. The target's answer may come late (it waited for memory or
// for its connection's in-flight budget before its budget began, or the
// path back was slow): the relay used to get whatever time was left, its
// read of a healthy source then failed on the engine's own deadline, and
// that was reported as the source's failure, so the engine would record a
// healthy source faulty (the last healthy one: the volume stops).
func TestRebuildRelayAfterALateCopyFailureHasItsOwnTime(t *testing.T) {
	o := replica.Op{Epoch: 1, Generation: 1}
	src, dst := newMemReplica("src", 1<<20), newMemReplica("dst", 1<<20)
	data := randomBytes(7, 1<<20)
	if err := (conn{src}).WriteAt(context.Background(), o, data, 0); err != nil {
		t.Fatal(err)
	}
	st, err := engine.Rebuild(context.Background(), o,
		engine.RebuildSource{Read: rttSource{conn{src}}, ReadID: "src", History: []engine.ReplicaConn{rttSource{conn{src}}}},
		lateCopyTarget{conn{dst}}, engine.RebuildPlan{Size: 1 << 20, Order: deadlineOrder{300 * time.Millisecond}}, nil)
	if engine.IsSourceError(err) {
		t.Fatalf("a healthy source (answering in 5 ms) was blamed: %v", err)
	}
	if err != nil {
		t.Fatalf("the rebuild failed: %v", err)
	}
	if st.Copied != 0 || !bytes.Equal(dst.snapshot(), data) {
		t.Fatalf("relayed %d of %d bytes; the target holds the source: %v", st.Bytes-st.Copied, st.Bytes, bytes.Equal(dst.snapshot(), data))
	}
}
