package replica_test

import (
	"io"
	"log/slog"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// The benchmarks run on a real temporary directory. Each has a baseline
// sub-benchmark doing the same I/O with pwrite/pread on one sparse file,
// so the store's overhead reads as a ratio (these machines are noisy):
//
//	go test ./replica -run '^$' -bench . -benchtime 2s

type benchTarget interface {
	WriteAt(p []byte, off int64) error
	ReadAt(p []byte, off int64) error
}

type replicaTarget struct{ r *replica.Replica }

func (t replicaTarget) WriteAt(p []byte, off int64) error { return t.r.WriteAt(op, p, off) }
func (t replicaTarget) ReadAt(p []byte, off int64) error  { return t.r.ReadAt(op, p, off) }

type fileTarget struct{ f *os.File }

func (t fileTarget) WriteAt(p []byte, off int64) error { _, err := t.f.WriteAt(p, off); return err }
func (t fileTarget) ReadAt(p []byte, off int64) error {
	_, err := t.f.ReadAt(p, off)
	if err == io.EOF {
		err = nil
	}
	return err
}

func benchTargets(b *testing.B, volume uint64, fn func(b *testing.B, t benchTarget)) {
	b.Run("replica", func(b *testing.B) {
		s, err := replica.OpenStore(replica.Config{Dir: b.TempDir(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		r, err := s.Create(replica.Spec{ID: "bench", VolumeID: "v", Size: volume})
		if err != nil {
			b.Fatal(err)
		}
		fn(b, replicaTarget{r})
	})
	b.Run("baseline-file", func(b *testing.B) {
		f, err := os.Create(filepath.Join(b.TempDir(), "file"))
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		fn(b, fileTarget{f})
	})
}

// warmRegions writes one block in every 1 MiB region, so the timed writes
// find their dirty-region bits set, as writes in steady use do (the first
// write to a clean region pays one fdatasync of the dirty log; see
// BenchmarkWrite4KColdRegions).
func warmRegions(b *testing.B, t benchTarget, span int64) {
	p := make([]byte, 4096)
	for off := int64(0); off < span; off += 1 << 20 {
		if err := t.WriteAt(p, off); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkWrite4K: random block-aligned 4 KiB writes over 256 MiB, no
// flushes.
func BenchmarkWrite4K(b *testing.B) {
	const span = 256 << 20
	benchTargets(b, span, func(b *testing.B, t benchTarget) {
		warmRegions(b, t, span)
		p := make([]byte, 4096)
		rand.Read(p)
		rng := rand.New(rand.NewSource(1))
		b.SetBytes(4096)
		b.ResetTimer()
		for range b.N {
			if err := t.WriteAt(p, rng.Int63n(span/4096)*4096); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWrite4KConcurrent: random 4 KiB writes over 256 MiB from 32
// goroutines at once, as the data service runs a connection's requests
// (one goroutine per request, QD32). Besides ns/op it reports the CPU the
// process used per write (user+system, cpu-us/op), which other work on a
// shared machine disturbs less than wall-clock time. The baseline's
// goroutines pwrite one file concurrently.
func BenchmarkWrite4KConcurrent(b *testing.B) {
	const span = 256 << 20
	benchTargets(b, span, func(b *testing.B, t benchTarget) {
		warmRegions(b, t, span)
		var seed atomic.Int64
		b.SetBytes(4096)
		b.SetParallelism(32 / runtime.GOMAXPROCS(0))
		cpu0 := cpuTime(b)
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			p := make([]byte, 4096)
			rng := rand.New(rand.NewSource(seed.Add(1)))
			rng.Read(p)
			for pb.Next() {
				if err := t.WriteAt(p, rng.Int63n(span/4096)*4096); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N), "cpu-us/op")
	})
}

// cpuTime is the CPU time (user and system) the process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkRead4K: random 4 KiB reads over 64 MiB of written data.
func BenchmarkRead4K(b *testing.B) {
	const span = 64 << 20
	benchTargets(b, span, func(b *testing.B, t benchTarget) {
		p := make([]byte, 1<<20)
		rand.Read(p)
		for off := int64(0); off < span; off += 1 << 20 {
			if err := t.WriteAt(p, off); err != nil {
				b.Fatal(err)
			}
		}
		rng := rand.New(rand.NewSource(1))
		q := make([]byte, 4096)
		b.SetBytes(4096)
		b.ResetTimer()
		for range b.N {
			if err := t.ReadAt(q, rng.Int63n(span/4096)*4096); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWrite1M: sequential 1 MiB writes wrapping over 256 MiB.
func BenchmarkWrite1M(b *testing.B) {
	const span = 256 << 20
	benchTargets(b, span, func(b *testing.B, t benchTarget) {
		warmRegions(b, t, span)
		p := make([]byte, 1<<20)
		rand.Read(p)
		b.SetBytes(1 << 20)
		b.ResetTimer()
		for i := range b.N {
			if err := t.WriteAt(p, int64(i)%(span>>20)<<20); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWrite4KColdRegions: 4 KiB writes that each land in a region
// whose dirty bit is clear (a new region of a 1 TiB volume each time), so
// each syncs the dirty log first: the worst case, met once per region
// after it was cleared.
func BenchmarkWrite4KColdRegions(b *testing.B) {
	const volume = 1 << 40
	benchTargets(b, volume, func(b *testing.B, t benchTarget) {
		p := make([]byte, 4096)
		rand.Read(p)
		b.SetBytes(4096)
		b.ResetTimer()
		for i := range b.N {
			if err := t.WriteAt(p, int64(i)%(volume>>20)<<20); err != nil {
				b.Fatal(err)
			}
		}
	})
}
