package wire

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// The benchmarks run over loopback TCP against the in-memory fake, so they
// measure the protocol and its goroutines, not a disk. Each reports MB/s
// (from SetBytes) and IOPS. Compare, in the same run: pipelined against
// QD 1; QD 1 against bare loopback TCP (BenchmarkBaselineRawTCP); and the
// protocol against the fake called directly (BenchmarkBaselineDirect4K):
//
//	go test ./replica/wire/ -run '^$' -bench . -benchtime 3s

const benchSize = 64 << 20

func benchHandle(b *testing.B) *Handle {
	f := newFakeReplica("r1", benchSize)
	f.quiet = true
	h := newHarness(b, ServerConfig{Logger: discardLogger()}, f)
	_, hd := h.open("r1", 1)
	return hd
}

// runIO issues b.N requests of size bytes from qd goroutines, each
// request at its own offset, and reports IOPS.
func runIO(b *testing.B, qd, size int, do func(p []byte, off int64) error) {
	b.SetBytes(int64(size))
	b.ReportAllocs()
	var next atomic.Int64
	var wg sync.WaitGroup
	var failOnce sync.Once
	var failed error
	slots := int64(benchSize / size)
	b.ResetTimer()
	start := time.Now()
	for range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := make([]byte, size)
			var err error
			for err == nil {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				err = do(p, (i%slots)*int64(size))
			}
			failOnce.Do(func() { failed = err })
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if failed != nil {
		b.Fatal(failed)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "IOPS")
}

func writeOp(hd *Handle) func(p []byte, off int64) error {
	return func(p []byte, off int64) error {
		return hd.WriteAt(context.Background(), replica.Op{Epoch: 1}, p, off)
	}
}

func readOp(hd *Handle) func(p []byte, off int64) error {
	return func(p []byte, off int64) error {
		return hd.ReadAt(context.Background(), replica.Op{Epoch: 1}, p, off)
	}
}

// BenchmarkWrite4KPipelined: 32 writers share one connection.
func BenchmarkWrite4KPipelined(b *testing.B) {
	runIO(b, 32, 4096, writeOp(benchHandle(b)))
}

// BenchmarkWrite4KPipelinedAttach: as BenchmarkWrite4KPipelined, through
// an attach handle, whose every write passes its replica's attach gate
// (the read lock and the incarnation check), against the same with the
// gate off (UnsafeStaleIncarnations, the jepsen broken mode): the gate's
// cost on the data path. Interleave the two:
//
//	go test ./replica/wire/ -run '^$' -bench 'Write4KPipelinedAttach' -benchtime 200000x -count 8
func BenchmarkWrite4KPipelinedAttach(b *testing.B) {
	for _, gate := range []bool{true, false} {
		b.Run(fmt.Sprintf("gate=%v", gate), func(b *testing.B) {
			f := newFakeReplica("r1", benchSize)
			f.quiet = true
			h := newHarness(b, ServerConfig{Logger: discardLogger(), UnsafeStaleIncarnations: !gate}, f)
			hd, err := h.dial(ClientConfig{}).OpenFor(context.Background(), OpenRequest{Replica: "r1", Epoch: 1, Purpose: PurposeAttach, Incarnation: 1})
			if err != nil {
				b.Fatal(err)
			}
			if orders := h.srv.Stats().AttachOrders; (orders == 1) != gate {
				b.Fatalf("gate=%v, but the data port orders %d replicas' attach handles", gate, orders)
			}
			runIO(b, 32, 4096, writeOp(hd))
		})
	}
}

// BenchmarkWrite4KQD1 is the unpipelined baseline: one write at a time.
func BenchmarkWrite4KQD1(b *testing.B) {
	runIO(b, 1, 4096, writeOp(benchHandle(b)))
}

func BenchmarkRead4K(b *testing.B) {
	for _, qd := range []int{1, 32} {
		b.Run(fmt.Sprintf("qd=%d", qd), func(b *testing.B) {
			runIO(b, qd, 4096, readOp(benchHandle(b)))
		})
	}
}

func BenchmarkWrite1M(b *testing.B) {
	for _, qd := range []int{1, 4} {
		b.Run(fmt.Sprintf("qd=%d", qd), func(b *testing.B) {
			runIO(b, qd, 1<<20, writeOp(benchHandle(b)))
		})
	}
}

// BenchmarkBaselineDirect4K calls the fake store directly with 32
// goroutines: the ceiling the protocol is measured against.
func BenchmarkBaselineDirect4K(b *testing.B) {
	f := newFakeReplica("r1", benchSize)
	f.quiet = true
	runIO(b, 32, 4096, func(p []byte, off int64) error {
		return f.WriteAt(replica.Op{Epoch: 1}, p, off)
	})
}

// BenchmarkBaselineRawTCP is loopback TCP with no protocol: QD 1, a
// request of a header plus size bytes answered by a 32-byte reply, as
// plain reads and writes on one connection. It is the ceiling
// BenchmarkWrite4KQD1 and BenchmarkWrite1M/qd=1 are measured against.
func BenchmarkBaselineRawTCP(b *testing.B) {
	for _, size := range []int{4096, 1 << 20} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			var wg sync.WaitGroup
			defer wg.Wait()
			defer ln.Close()
			wg.Add(1)
			go func() {
				defer wg.Done()
				nc, err := ln.Accept()
				if err != nil {
					return
				}
				defer nc.Close()
				req, ack := make([]byte, RequestHeaderSize+size), make([]byte, ReplyHeaderSize)
				for {
					if _, err := io.ReadFull(nc, req); err != nil {
						return
					}
					if _, err := nc.Write(ack); err != nil {
						return
					}
				}
			}()
			nc, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer nc.Close()
			req, ack := make([]byte, RequestHeaderSize+size), make([]byte, ReplyHeaderSize)
			b.SetBytes(int64(size))
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				if _, err := nc.Write(req); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(nc, ack); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "IOPS")
		})
	}
}
