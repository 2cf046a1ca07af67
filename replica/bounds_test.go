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
