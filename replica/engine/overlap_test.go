package engine_test

import (
	"bytes"
	"testing"
	"time"
)

// Found by jepsen (seed 42): two overlapping writes in flight together
// reached the replicas in different orders, so after a rebuild moved the
// reads to another replica the block went back to the older value. A
// write must wait until every overlapping write sent before it has been
// answered by every replica.
func TestOverlappingWritesReachEveryReplicaInOneOrder(t *testing.T) {
	f := newFixture(t)
	e := f.open(f.config("n1"))
	slow := f.replica(2)
	slow.mu.Lock()
	slow.hold = make(chan struct{})
	slow.mu.Unlock()
	a, b := randomBytes(60, 8192), randomBytes(61, 4096)
	wroteA := make(chan error, 1)
	go func() { wroteA <- e.WriteAt(ctx10(t), a, 0, false) }()
	time.Sleep(50 * time.Millisecond) // A reaches replicas 0 and 1, waits on 2
	wroteB := make(chan error, 1)
	go func() { wroteB <- e.WriteAt(ctx10(t), b, 4096, false) }() // overlaps A's second block
	time.Sleep(300 * time.Millisecond)
	for i := range 2 {
		if got := f.replica(i).snapshot()[4096:8192]; !bytes.Equal(got, a[4096:]) {
			t.Fatalf("replica %d took the overlapping write B while A was still unanswered by replica 2", i)
		}
	}
	select {
	case err := <-wroteB:
		t.Fatalf("B returned (%v) before A was answered by every replica", err)
	default:
	}
	slow.mu.Lock()
	close(slow.hold)
	slow.hold = nil
	slow.mu.Unlock()
	if err := <-wroteA; err != nil {
		t.Fatal(err)
	}
	if err := <-wroteB; err != nil {
		t.Fatal(err)
	}
	want := append(append([]byte(nil), a[:4096]...), b...)
	for i := range 3 {
		if got := f.replica(i).snapshot()[:8192]; !bytes.Equal(got, want) {
			t.Fatalf("replica %d differs after both writes", i)
		}
	}
}
