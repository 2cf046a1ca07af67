package nbd

import (
	"math/bits"
	"sync"
)

// Payload buffers come from pools by power-of-two size class, from 4 KiB
// to 32 MiB; larger ones (only with a MaxPayload above 32 MiB) are
// allocated each time.
const (
	minBufClass = 12
	maxBufClass = 25
)

var bufPools [maxBufClass + 1]sync.Pool

func bufClass(n int) int {
	if n <= 1<<minBufClass {
		return minBufClass
	}
	return bits.Len(uint(n - 1))
}

// getBuf returns a buffer of length n (n > 0) and the pool handle to give
// back to putBuf.
func getBuf(n int) *[]byte {
	c := bufClass(n)
	if c > maxBufClass {
		b := make([]byte, n)
		return &b
	}
	if v := bufPools[c].Get(); v != nil {
		b := v.(*[]byte)
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

// bufSize is the capacity of the buffer getBuf(n) returns.
func bufSize(n int) int {
	c := bufClass(n)
	if c > maxBufClass {
		return n
	}
	return 1 << c
}

func putBuf(b *[]byte) {
	if b == nil {
		return
	}
	c := bufClass(cap(*b))
	if c > maxBufClass || cap(*b) != 1<<c {
		return
	}
	bufPools[c].Put(b)
}

// budget is a counting semaphore over a quantity (requests, bytes) that
// one goroutine (a connection's reader) acquires and others release. An
// acquisition larger than the whole budget waits until nothing is held,
// then takes it all.
type budget struct {
	mu    sync.Mutex
	cond  sync.Cond
	avail int64
	max   int64
}

func newBudget(max int64) *budget {
	b := &budget{avail: max, max: max}
	b.cond.L = &b.mu
	return b
}

func (b *budget) acquire(n int64) {
	n = min(n, b.max)
	b.mu.Lock()
	for b.avail < n {
		b.cond.Wait()
	}
	b.avail -= n
	b.mu.Unlock()
}

// held reports how much of the budget is taken.
func (b *budget) held() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.max - b.avail
}

func (b *budget) release(n int64) {
	n = min(n, b.max)
	b.mu.Lock()
	b.avail += n
	b.mu.Unlock()
	b.cond.Broadcast()
}
