package replica_test

import (
	"errors"
	"runtime"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/replicatest"
)

// allocated returns the bytes f allocates (the whole process's, so it is
// an upper bound).
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

const tib = 1 << 40

func createBig(t *testing.T, regionSize int64, size uint64) *replica.Replica {
	t.Helper()
	s := openStore(t, replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t), RegionSize: regionSize})
	t.Cleanup(func() { s.Close() })
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: size})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestZeroesLongerThanTheCapAreRefused: a WriteZeroes or Trim may name at
// most replica.MaxZeroes bytes; a longer one is ErrInvalid and costs the
// server nothing in proportion to its length (a 4 TiB trim used to
// allocate 221 MiB, holding the dirty-log lock).
func TestZeroesLongerThanTheCapAreRefused(t *testing.T) {
	r := createBig(t, replica.DefaultRegionSize, 4*tib)
	op := replica.Op{Epoch: 1, Generation: 1}
	var err error
	n := allocated(func() { err = r.Trim(op, 0, 4*tib) })
	if !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("trim of the whole 4 TiB volume: %v, want ErrInvalid", err)
	}
	if n > 1<<20 {
		t.Fatalf("refusing a 4 TiB trim allocated %d bytes", n)
	}
	if err := r.WriteZeroes(op, 0, replica.MaxZeroes+replica.SectorSize); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("zeroes of MaxZeroes+512 bytes: %v, want ErrInvalid", err)
	}
	if err := r.WriteZeroes(op, 4*tib-replica.MaxZeroes, replica.MaxZeroes); err != nil {
		t.Fatalf("zeroes of MaxZeroes bytes: %v", err)
	}
}

// TestZeroesMarkRunsNotRegions: the dirty-region log and the write history
// mark a range as runs, so a maximal trim costs the same whatever the
// region size, and what it marked reads back as one extent.
func TestZeroesMarkRunsNotRegions(t *testing.T) {
	const regionSize = replica.BlockSize // the smallest: 262144 regions per MaxZeroes
	r := createBig(t, regionSize, 4*tib)
	op := replica.Op{Epoch: 1, Generation: 3}
	var err error
	n := allocated(func() { err = r.Trim(op, replica.MaxZeroes, replica.MaxZeroes) })
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a %d-byte trim over %d regions allocated %d bytes", replica.MaxZeroes, replica.MaxZeroes/regionSize, n)
	if n > 256<<10 {
		t.Fatalf("a %d-byte trim over %d regions allocated %d bytes: marking is per region", replica.MaxZeroes, replica.MaxZeroes/regionSize, n)
	}
	want := []replica.Extent{{Off: replica.MaxZeroes, Len: replica.MaxZeroes}}
	dirty, err := r.DirtyRegions(op)
	if err != nil || len(dirty) != 1 || dirty[0] != want[0] {
		t.Fatalf("dirty regions %v (%v), want %v", dirty, err, want)
	}
	since, err := r.WrittenSince(op, 3)
	if err != nil || len(since) != 1 || since[0] != want[0] {
		t.Fatalf("written since 3: %v (%v), want %v", since, err, want)
	}
	if since, err := r.WrittenSince(op, 4); err != nil || len(since) != 0 {
		t.Fatalf("written since 4: %v (%v), want none", since, err)
	}
	// Two flushes clear the regions (the clearing rule).
	for range 2 {
		if err := r.Flush(op); err != nil {
			t.Fatal(err)
		}
	}
	if dirty, err := r.DirtyRegions(op); err != nil || len(dirty) != 0 {
		t.Fatalf("dirty regions after two flushes: %v (%v)", dirty, err)
	}
}
