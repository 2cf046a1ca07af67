package replica_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

// corruptSnapshotStore: replica "bad" has snapshot s1 whose index is
// garbage; replica "good" has no snapshots. Reopened with budget files.
func corruptSnapshotStore(t *testing.T, budget int) (*replica.Store, *pathsFS) {
	mem := errorfs.NewMemFS()
	pfs := &pathsFS{FS: mem}
	cfg := replica.Config{Dir: "/stor", FS: pfs, Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: budget}
	s := openStore(t, cfg)
	r := create(t, s, "bad", 1<<20)
	if err := r.WriteAt(op, pattern(1), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(op, "s1"); err != nil {
		t.Fatal(err)
	}
	g := create(t, s, "good", 1<<20)
	if err := g.WriteAt(op, pattern(2), 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := mem.OpenFile("/stor/bad/layer-00000001.idx", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(bytes.Repeat([]byte{0xa5}, 64), 0)
	f.Close()
	s, err = replica.OpenStore(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, pfs
}

// TestFailedFirstLoadIsNotRetried: once the first request found a snapshot
// index unreadable and failed the replica, later requests should be
// refused as by any failed replica, not re-read the damaged journal (and
// make room in the file cache for it) every time.
func TestFailedFirstLoadIsNotRetried(t *testing.T) {
	s, pfs := corruptSnapshotStore(t, 64)
	defer s.Close()
	r := get(t, s, "bad")
	buf := make([]byte, replica.BlockSize)
	if err := r.ReadAt(op, buf, 0); !errors.Is(err, replica.ErrCorrupt) {
		t.Fatalf("first read: %v, want ErrCorrupt", err)
	}
	pfs.take()
	var last error
	for range 5 {
		last = r.ReadAt(op, buf, 0)
	}
	n := 0
	for _, p := range pfs.take() {
		if strings.HasSuffix(p, "layer-00000001.idx") {
			n++
		}
	}
	t.Logf("5 reads of the failed replica: last error %v", last)
	if n != 0 {
		t.Errorf("5 requests to a replica failed at its first request reopened its damaged index %d times", n)
	}
	if !strings.Contains(fmt.Sprint(last), "failed earlier") {
		t.Errorf("a later request's error %q is not the failed replica's (\"failed earlier\")", last)
	}
}

// TestFailedReplicaClosesNoOtherReplica: a request to the replica failed
// at its first load is refused without making room in the file cache (it
// would close a healthy idle replica each time).
func TestFailedReplicaClosesNoOtherReplica(t *testing.T) {
	s, _ := corruptSnapshotStore(t, 8) // room for "good" (5), not for "bad" (7) beside it
	defer s.Close()
	bad, good := get(t, s, "bad"), get(t, s, "good")
	buf := make([]byte, replica.BlockSize)
	bad.ReadAt(op, buf, 0) // fails the replica
	_, _, closes0 := replica.FileCacheStats(s)
	for range 5 {
		if err := good.ReadAt(op, buf, 0); err != nil {
			t.Fatal(err)
		}
		if err := bad.ReadAt(op, buf, 0); err == nil {
			t.Fatal("read of the failed replica succeeded")
		}
	}
	_, _, closes := replica.FileCacheStats(s)
	if closes-closes0 != 0 {
		t.Errorf("5 refused requests to a failed replica closed a healthy idle replica %d times", closes-closes0)
	}
}

// TestFirstRequestsRaceAfterARestart: after a restart, replicas with snapshots take their
// first requests from many goroutines at once (reads, snapshot reads,
// extents, direct opens, snapshot deletes), under a tiny file budget;
// every read is right, and no descriptor is left open after Close.
func TestFirstRequestsRaceAfterARestart(t *testing.T) {
	const nrep, nsnap, workers, rounds = 6, 3, 8, 300
	dir := t.TempDir()
	cfs := &countingFS{FS: replica.OS()}
	cfg := replica.Config{Dir: dir, FS: cfs, Logger: replicatest.Logger(t), RegionSize: testRegionSize, MaxOpenFiles: 16}
	s := openStore(t, cfg)
	for i := range nrep {
		r := create(t, s, fmt.Sprintf("r%d", i), 1<<20)
		for k := range nsnap {
			if err := r.WriteAt(op, pattern(byte(k+1)), int64(k)*replica.BlockSize); err != nil {
				t.Fatal(err)
			}
			if err := r.CreateSnapshot(op, fmt.Sprintf("s%d", k)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		s = openStore(t, cfg)
		seed := time.Now().UnixNano()
		t.Logf("round %d seed %d", round, seed)
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewSource(seed + int64(w)))
				buf := make([]byte, replica.BlockSize)
				for range rounds {
					r := get(t, s, fmt.Sprintf("r%d", rng.Intn(nrep)))
					k := rng.Intn(nsnap)
					var err error
					switch rng.Intn(5) {
					case 0:
						if err = r.ReadAt(op, buf, int64(k)*replica.BlockSize); err == nil && !bytes.Equal(buf, pattern(byte(k+1))) {
							err = fmt.Errorf("%s block %d: %x", r.ID(), k, buf[:4])
						}
					case 1:
						err = r.ReadSnapshotAt(op, fmt.Sprintf("s%d", nsnap-1), buf, int64(k)*replica.BlockSize)
						if errors.Is(err, replica.ErrNotFound) {
							err = nil
						} else if err == nil && !bytes.Equal(buf, pattern(byte(k+1))) {
							err = fmt.Errorf("%s snapshot block %d: %x", r.ID(), k, buf[:4])
						}
					case 2:
						var ext []replica.Extent
						ext, err = r.Extents(op, "", 0, 0)
						if err == nil && (len(ext) != 1 || ext[0].Len != nsnap*replica.BlockSize) {
							err = fmt.Errorf("%s extents %v", r.ID(), ext)
						}
					case 3:
						var d *replica.DirectFiles
						d, err = r.OpenDirect(op, noRevoke)
						if err == nil {
							err = d.Close()
						} else if errors.Is(err, replica.ErrNotDirect) {
							err = nil
						}
					case 4:
						if round == 2 && rng.Intn(10) == 0 {
							err = r.DeleteSnapshot(op, fmt.Sprintf("s%d", k))
							if errors.Is(err, replica.ErrNotFound) {
								err = nil
							}
						}
					}
					if err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if n := cfs.open.Load(); n != 0 {
			t.Fatalf("%d files open after Close", n)
		}
	}
}

// TestTornSnapshotIndexTailAtFirstLoad: a torn tail on a snapshot layer's index
// (the last append of a merge cut short) is still tolerated and
// truncated, now at the first request instead of at OpenStore.
func TestTornSnapshotIndexTailAtFirstLoad(t *testing.T) {
	mem := errorfs.NewMemFS()
	cfg := replica.Config{Dir: "/stor", FS: mem, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r := create(t, s, "r1", 1<<20)
	for k := range 2 {
		if err := r.WriteAt(op, pattern(byte(k+1)), int64(k)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
		if err := r.CreateSnapshot(op, fmt.Sprintf("s%d", k)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	const idx = "/stor/r1/layer-00000002.idx"
	f, err := mem.OpenFile(idx, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := f.Stat()
	size := st.Size()
	f.WriteAt([]byte{0x53, 0x54, 0x42, 0x4a, 0, 0, 0}, size) // a batch header cut short
	f.Close()
	s = openStore(t, cfg)
	defer s.Close()
	r = get(t, s, "r1")
	if got := readBlock(t, r, replica.BlockSize); !bytes.Equal(got, pattern(2)) {
		t.Fatalf("block 1: %x", got[:4])
	}
	if err := r.DeleteSnapshot(op, "s0"); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, cfg)
	defer s2.Close()
	r = get(t, s2, "r1")
	for k := range 2 {
		if got := readBlock(t, r, int64(k)*replica.BlockSize); !bytes.Equal(got, pattern(byte(k+1))) {
			t.Fatalf("block %d after merge and restart: %x", k, got[:4])
		}
	}
	buf := make([]byte, replica.BlockSize)
	if err := r.ReadSnapshotAt(op, "s1", buf, 0); err != nil || !bytes.Equal(buf, pattern(1)) {
		t.Fatalf("s1 block 0 after merge: %v %x", err, buf[:4])
	}
}
