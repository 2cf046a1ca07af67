//go:build linux

package replica_test

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stor-io/stor/replica"
)

// BenchmarkOpenStore measures a server's restart: OpenStore of a
// directory of 10,000 replicas of 16 MiB (each written one block), until
// it returns, and then the first read of every replica (most of them
// reopen their files then: the default budget keeps at most 4096 files
// open). The replicas are copies of one made by the store, with their ids
// changed, because creating 10,000 takes minutes of fsyncs. The page cache
// is warm ("warm", as after a process restart) or the replicas' files are
// dropped from it first ("cold", see dropPageCache). MiB-heap is the Go
// heap in use with the store open and every replica read once (the
// test's own included):
//
//	go test ./replica -run '^$' -bench 'OpenStore$' -benchtime 3x
func BenchmarkOpenStore(b *testing.B) {
	const n = 10000
	cfg := storeOfCopies(b, n, 0)
	b.Run("warm", func(b *testing.B) { benchOpenStore(b, cfg, n, nil) })
	b.Run("cold", func(b *testing.B) { benchOpenStore(b, cfg, n, func() { dropPageCache(b, cfg.Dir) }) })
}

// BenchmarkOpenStoreSnapshots is BenchmarkOpenStore with 5 snapshot
// layers under every replica's head: a server's share of 50,000
// snapshots of 10,000 volumes of 3 replicas on 3 servers (issue 16). Each
// layer holds one written block; the block read first is in the oldest
// layer, under the other five. A replica open holds 15 files (3, and 2
// per layer), so the default budget of 4096 keeps about 270 open.
// MaxFDs is the most descriptors the process had open, sampled after
// OpenStore and after every 1,000th first read:
//
//	go test ./replica -run '^$' -bench OpenStoreSnapshots -benchtime 3x
func BenchmarkOpenStoreSnapshots(b *testing.B) {
	const n = 10000
	cfg := storeOfCopies(b, n, 5)
	b.Run("warm", func(b *testing.B) { benchOpenStore(b, cfg, n, nil) })
	b.Run("cold", func(b *testing.B) { benchOpenStore(b, cfg, n, func() { dropPageCache(b, cfg.Dir) }) })
}

// storeOfCopies makes a store of n replicas of 16 MiB, each with
// snapshots layers under its head: one made by the store (a block written
// in each layer, the first at offset 0, the k-th at k blocks), and n-1
// copies of its files with the ids changed, because creating 10,000
// takes minutes of fsyncs. It returns the store's configuration.
func storeOfCopies(b *testing.B, n, snapshots int) replica.Config {
	dir := b.TempDir()
	cfg := replica.Config{Dir: dir, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s, err := replica.OpenStore(cfg)
	if err != nil {
		b.Fatal(err)
	}
	r, err := s.Create(replica.Spec{ID: "r00000", VolumeID: "v00000", Size: 16 << 20})
	if err != nil {
		b.Fatal(err)
	}
	for k := range snapshots + 1 {
		if err := r.WriteAt(op, make([]byte, replica.BlockSize), int64(k)*replica.BlockSize); err != nil {
			b.Fatal(err)
		}
		if k < snapshots {
			if err := r.CreateSnapshot(op, fmt.Sprintf("snap-%d", k)); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := s.Close(); err != nil {
		b.Fatal(err)
	}
	tmpl := filepath.Join(dir, "r00000")
	files, err := os.ReadDir(tmpl)
	if err != nil {
		b.Fatal(err)
	}
	for i := 1; i < n; i++ {
		id := fmt.Sprintf("r%05d", i)
		dst := filepath.Join(dir, id)
		if err := os.Mkdir(dst, 0o755); err != nil {
			b.Fatal(err)
		}
		for _, f := range files {
			data, err := os.ReadFile(filepath.Join(tmpl, f.Name()))
			if err != nil {
				b.Fatal(err)
			}
			if f.Name() == "meta.json" {
				data = []byte(strings.NewReplacer(`"r00000"`, `"`+id+`"`, `"v00000"`, `"v`+id[1:]+`"`).Replace(string(data)))
			}
			if err := os.WriteFile(filepath.Join(dst, f.Name()), data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	return cfg
}

// benchOpenStore opens the store of n replicas b.N times, each after
// prepare (timer stopped), and reads every replica once after each open.
func benchOpenStore(b *testing.B, cfg replica.Config, n int, prepare func()) {
	buf := make([]byte, replica.BlockSize)
	var firstRead time.Duration
	var heap uint64 // with every replica open and read once
	maxFDs := 0
	sampleFDs := func() {
		if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
			maxFDs = max(maxFDs, len(fds))
		}
	}
	b.ResetTimer()
	for range b.N {
		if prepare != nil {
			b.StopTimer()
			prepare()
			b.StartTimer()
		}
		s, err := replica.OpenStore(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if got := len(s.List()); got != n {
			d := s.Damaged()
			for id, err := range d {
				b.Fatalf("%d replicas open, want %d; %d damaged, such as %s: %v", got, n, len(d), id, err)
			}
			b.Fatalf("%d replicas open, want %d", got, n)
		}
		sampleFDs()
		start := time.Now()
		for i, r := range s.List() {
			if err := r.ReadAt(op, buf, 0); err != nil {
				b.Fatal(err)
			}
			if i%1000 == 999 {
				firstRead += time.Since(start)
				sampleFDs()
				start = time.Now()
			}
		}
		firstRead += time.Since(start)
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		heap += ms.HeapAlloc
		if err := s.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(firstRead.Milliseconds())/float64(b.N), "ms-first-reads/op")
	b.ReportMetric(float64(heap)/float64(b.N)/(1<<20), "MiB-heap")
	b.ReportMetric(float64(maxFDs), "MaxFDs")
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms-open/op")
}

// dropPageCache writes back the filesystem of dir and drops the pages of
// every file under dir from the page cache (POSIX_FADV_DONTNEED, which
// needs no privilege and touches no other file). Directory blocks and
// inodes stay cached: this is a cold start of the data, not of the
// filesystem's metadata.
func dropPageCache(b *testing.B, dir string) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		b.Fatal(err)
	}
	err = unix.Syncfs(fd)
	unix.Close(fd)
	if err != nil {
		b.Fatal(err)
	}
	err = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		return unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	})
	if err != nil {
		b.Fatal(err)
	}
}
