package wire

import (
	"math/bits"
	"sync"
)

// Payload buffers are pooled in power-of-two size classes from 4 KiB to
// 8 MiB, so a steady stream of I/O reuses the same memory. Larger buffers
// (only a control payload could be) are allocated and left to the GC.
const (
	minBufShift = 12 // 4 KiB
	maxBufShift = 23 // 8 MiB
)

var bufPools [maxBufShift - minBufShift + 1]sync.Pool

func bufClass(n int) int {
	if n <= 1<<minBufShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minBufShift
}

// getBuf returns a buffer of at least n bytes; put it back with putBuf.
func getBuf(n int) *[]byte {
	c := bufClass(n)
	if c >= len(bufPools) {
		b := make([]byte, n)
		return &b
	}
	if v := bufPools[c].Get(); v != nil {
		return v.(*[]byte)
	}
	b := make([]byte, 1<<(c+minBufShift))
	return &b
}

// bufSize is the capacity of the buffer getBuf(n) returns.
func bufSize(n int) int {
	c := bufClass(n)
	if c >= len(bufPools) {
		return n
	}
	return 1 << (c + minBufShift)
}

// putBuf returns a buffer from getBuf to its pool. nil is ignored.
func putBuf(b *[]byte) {
	if b == nil {
		return
	}
	n := cap(*b)
	c := bufClass(n)
	if c >= len(bufPools) || n != 1<<(c+minBufShift) {
		return
	}
	*b = (*b)[:n]
	bufPools[c].Put(b)
}
