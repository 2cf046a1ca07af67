package wire

import (
	"context"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// Two copies share one source connection (as a rebuild's in-flight chunks
// do). One has a short budget left (it waited for payload memory, say) and
// its read is slow; the other has plenty of budget and its read answers in
// 150 ms. The first read's budget ending used to close the SHARED
// connection, so the second read failed too (ErrDisconnected, which
// REBUILD_COPY answers as ErrCopySource: the engine then relayed this chunk
// and every later chunk of the rebuild; found by review). Only a read
// still receiving its reply stallGrace after its budget cuts it now.
func TestAShortBudgetDoesNotCutASiblingRead(t *testing.T) {
	p := newCopyPair(t, time.Minute)
	o := replica.Op{Epoch: 1}
	const slowOff, okOff = 0, 8192
	p.src.setHook(func(op string, off int64) error {
		if op == "ReadAt" {
			switch off {
			case slowOff:
				time.Sleep(time.Second)
			case okOff:
				time.Sleep(150 * time.Millisecond)
			}
		}
		return nil
	})
	// Open the source first, so both reads use the same connection.
	buf := make([]byte, 4096)
	if err := p.sources.ReadSource(context.Background(), OpenRequest{Replica: "dst"}, "src", o, buf, 4096); err != nil {
		t.Fatal(err)
	}
	okErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		okErr <- p.sources.ReadSource(ctx, OpenRequest{Replica: "dst"}, "src", o, make([]byte, 4096), okOff)
	}()
	time.Sleep(10 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	slowErr := p.sources.ReadSource(ctx, OpenRequest{Replica: "dst"}, "src", o, make([]byte, 4096), slowOff)
	start := time.Now()
	err := <-okErr
	t.Logf("short-budget read: %v; sibling read (5 s budget, source answers in 150 ms): %v (after %v more)", slowErr, err, time.Since(start).Round(time.Millisecond))
	if err != nil {
		t.Fatalf("a read with 5 s of budget left failed because another read's budget ended on the shared connection: %v", err)
	}
}
