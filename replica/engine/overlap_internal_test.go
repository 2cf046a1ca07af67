package engine

import (
	"context"
	"testing"
	"time"
)

// tryLock asks for a span of kind k on [off, off+n) and reports whether it
// is granted within d: the span if so, else the channel it will come on.
func tryLock(o *overlaps, k spanKind, off, n int64, d time.Duration) (*span, bool, chan *span) {
	got := make(chan *span, 1)
	go func() {
		s, err := o.lock(context.Background(), k, off, n)
		if err == nil {
			got <- s
		}
	}()
	select {
	case s := <-got:
		return s, true, nil
	case <-time.After(d):
		return nil, false, got
	}
}

// What waits for what in the overlap set: everything for an earlier
// overlapping write, a write for earlier reads and copies, nothing else;
// and first come, first served, so a waiting copy of a large range holds
// off later writes into it instead of being starved by them.
func TestOverlapsOrderFirstComeFirstServed(t *testing.T) {
	const short = 100 * time.Millisecond
	var o overlaps
	w1, ok, _ := tryLock(&o, spanWrite, 0, 4096, time.Second)
	if !ok {
		t.Fatal("a write to an idle range waits")
	}
	// Reads and a copy of the written range wait for the write.
	if _, ok, _ := tryLock(&o, spanRead, 0, 4096, short); ok {
		t.Fatal("a read of a block with a write in flight did not wait for it")
	}
	_, ok, copyGot := tryLock(&o, spanCopy, 0, 1<<20, short)
	if ok {
		t.Fatal("a copy of a block with a write in flight did not wait for it")
	}
	// A later write inside the copy's range, though clear of the first
	// write, waits for the waiting copy.
	_, ok, w2Got := tryLock(&o, spanWrite, 8192, 4096, short)
	if ok {
		t.Fatal("a write overtook a copy of its range that was waiting before it")
	}
	o.unlock(w1)
	var c *span
	select {
	case c = <-copyGot:
	case <-time.After(time.Second):
		t.Fatal("the copy did not run once the write before it was done")
	}
	select {
	case <-w2Got:
		t.Fatal("the later write ran while the copy held its range")
	case <-time.After(short):
	}
	// Reads do not wait for copies or for each other.
	r1, ok, _ := tryLock(&o, spanRead, 1<<20, 4096, time.Second)
	if !ok {
		t.Fatal("a read waited for another read")
	}
	r2, ok, _ := tryLock(&o, spanRead, 1<<20, 4096, time.Second)
	if !ok {
		t.Fatal("a read waited for another read")
	}
	r3, ok, _ := tryLock(&o, spanRead, 16384, 4096, time.Second)
	if !ok {
		t.Fatal("a read waited for a copy")
	}
	o.unlock(r3)
	o.unlock(c)
	select {
	case w2 := <-w2Got:
		o.unlock(w2)
	case <-time.After(time.Second):
		t.Fatal("the later write did not run once the copy was done")
	}
	// A write waits for the reads in flight of its range.
	_, ok, w3Got := tryLock(&o, spanWrite, 1<<20, 4096, short)
	if ok {
		t.Fatal("a write overtook a read of its block in flight")
	}
	o.unlock(r1)
	o.unlock(r2)
	select {
	case w3 := <-w3Got:
		o.unlock(w3)
	case <-time.After(time.Second):
		t.Fatal("the write did not run once the reads were done")
	}
}
