package replicatest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// opCalls is every method that takes an Op, as a call with that Op.
func opCalls(r *replica.Replica, data []byte) []struct {
	name string
	call func(o replica.Op) error
} {
	return []struct {
		name string
		call func(o replica.Op) error
	}{
		{"ReadAt", func(o replica.Op) error { return r.ReadAt(o, make([]byte, 4096), 0) }},
		{"WriteAt", func(o replica.Op) error { return r.WriteAt(o, data, 0) }},
		{"WriteAt FUA", func(o replica.Op) error { o.FUA = true; return r.WriteAt(o, data, 8192) }},
		{"WriteZeroes", func(o replica.Op) error { return r.WriteZeroes(o, 0, 4096) }},
		{"Trim", func(o replica.Op) error { return r.Trim(o, 4096, 4096) }},
		{"Flush", func(o replica.Op) error { return r.Flush(o) }},
		{"Grow", func(o replica.Op) error { return r.Grow(o, r.Size()+4096) }},
		{"CreateSnapshot", func(o replica.Op) error { return r.CreateSnapshot(o, "new") }},
		{"DeleteSnapshot", func(o replica.Op) error { return r.DeleteSnapshot(o, "s") }},
		{"ReadSnapshotAt", func(o replica.Op) error { return r.ReadSnapshotAt(o, "s", make([]byte, 4096), 0) }},
		{"Extents", func(o replica.Op) error { _, err := r.Extents(o, "", 0, 0); return err }},
		{"DirtyRegions", func(o replica.Op) error { _, err := r.DirtyRegions(o); return err }},
		{"WrittenSince", func(o replica.Op) error { _, err := r.WrittenSince(o, 0); return err }},
		{"BeginRebuild", func(o replica.Op) error { return r.BeginRebuild(o) }},
		{"RebuildWrite", func(o replica.Op) error { return r.RebuildWrite(o, data, 0) }},
		{"EndRebuild", func(o replica.Op) error { return r.EndRebuild(o) }},
	}
}

// testFencing: every method refuses a lower epoch with ErrStaleEpoch and
// changes nothing; every method raises a higher epoch, durably; Fence
// itself refuses lower, accepts equal, raises higher.
func testFencing(t *testing.T, h *Harness) {
	r := h.Create("r", mib)
	must(t, r.Fence(5), "Fence(5)")
	if r.Epoch() != 5 {
		t.Fatalf("Epoch %d after Fence(5)", r.Epoch())
	}
	must(t, r.Fence(5), "Fence at the same epoch")
	wantErr(t, r.Fence(4), replica.ErrStaleEpoch, "Fence(4) after Fence(5)")
	e5 := replica.Op{Epoch: 5}
	rng := rand.New(rand.NewSource(4))
	data := randBytes(rng, 4*4096)
	must(t, r.WriteAt(e5, data, 0), "write at epoch 5")
	must(t, r.CreateSnapshot(e5, "s"), "snapshot at epoch 5")
	image := readAll(t, r, e5)
	size := r.Size()

	stale := replica.Op{Epoch: 4, Generation: 99}
	junk := randBytes(rng, 4096)
	for _, c := range opCalls(r, junk) {
		wantErr(t, c.call(stale), replica.ErrStaleEpoch, "%s at a stale epoch", c.name)
	}
	if r.Epoch() != 5 {
		t.Fatalf("Epoch %d after stale requests, want 5", r.Epoch())
	}
	sameBytes(t, readAll(t, r, e5), image, "volume after stale requests")
	if r.Size() != size {
		t.Fatalf("size %d after a stale Grow, want %d", r.Size(), size)
	}
	if got := fmt.Sprint(r.Snapshots()); got != "[s]" {
		t.Fatalf("snapshots after stale requests: %s, want [s]", got)
	}
	// A stale BeginRebuild must not have begun one.
	wantErr(t, r.RebuildWrite(e5, junk, 0), replica.ErrInvalid, "RebuildWrite after a stale BeginRebuild")

	// Each method raises a higher epoch before it acts, and the old epoch
	// is refused afterwards.
	epoch := uint64(5)
	for _, c := range opCalls(r, data) {
		if c.name == "RebuildWrite" {
			must(t, r.BeginRebuild(replica.Op{Epoch: epoch}), "BeginRebuild")
		}
		// The snapshot calls need "s" (an earlier call may have deleted it).
		must(t, r.CreateSnapshot(replica.Op{Epoch: epoch}, "s"), "recreate s")
		epoch++
		must(t, c.call(replica.Op{Epoch: epoch}), "%s at higher epoch %d", c.name, epoch)
		if r.Epoch() != epoch {
			t.Fatalf("%s at epoch %d: Epoch() is %d", c.name, epoch, r.Epoch())
		}
		wantErr(t, r.ReadAt(replica.Op{Epoch: epoch - 1}, make([]byte, 512), 0), replica.ErrStaleEpoch,
			"read at the epoch before %s raised it", c.name)
	}

	h.Reopen()
	r = h.Replica("r")
	if r.Epoch() != epoch {
		t.Fatalf("Epoch %d after reopen, want %d", r.Epoch(), epoch)
	}
	wantErr(t, r.WriteAt(replica.Op{Epoch: epoch - 1}, junk, 0), replica.ErrStaleEpoch, "stale write after reopen")
	h.Crash(1)
	r = h.Replica("r")
	if r.Epoch() != epoch {
		t.Fatalf("Epoch %d after a crash, want %d: the raise was acknowledged, so it must be durable", r.Epoch(), epoch)
	}
}

// testFencingConcurrent: writers of an old epoch race a Fence to a new
// one. Once Fence returns, no old-epoch write changes the volume: the
// check and the write are one step.
func testFencingConcurrent(t *testing.T, h *Harness) {
	r := h.Create("r", mib)
	old := replica.Op{Epoch: 1}
	must(t, r.Fence(1), "Fence(1)")
	const writers = 4
	var wg sync.WaitGroup
	started := make(chan struct{}, writers)
	errs := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := make([]byte, 4096)
			fenced := false
			deadline := time.Now().Add(20 * time.Second)
			for i := uint64(1); time.Now().Before(deadline); i++ {
				binary.LittleEndian.PutUint64(p, i)
				p[8] = byte(w)
				err := r.WriteAt(old, p, 0)
				if i == 10 {
					started <- struct{}{}
				}
				switch {
				case err == nil && fenced:
					errs <- fmt.Errorf("writer %d: a write at the old epoch succeeded after one was refused", w)
					return
				case errors.Is(err, replica.ErrStaleEpoch):
					if fenced {
						return
					}
					fenced = true
				case err != nil:
					errs <- err
					return
				}
			}
			errs <- fmt.Errorf("writer %d was never fenced", w)
		}()
	}
	for range writers {
		<-started
	}
	must(t, r.Fence(2), "Fence(2)")
	newOp := replica.Op{Epoch: 2}
	after := read(t, r, newOp, 0, 4096)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if final := read(t, r, newOp, 0, 4096); !bytes.Equal(final, after) {
		t.Fatalf("an old-epoch write landed after Fence(2) returned: block was %x..., is %x...", after[:9], final[:9])
	}
}
