package replica_test

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

// A multi-chunk DeleteSnapshot merging into a SNAPSHOT upper layer while
// the replica is idle-closed (and its indexes dropped) between chunks;
// concurrent readers of the snapshot; then a crash and a reopen.
func TestDeleteSnapshotIdleClosedBetweenChunks(t *testing.T) {
	mem := errorfs.NewMemFS()
	cfg := replica.Config{Dir: "/stor", FS: mem, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	const nb = 9000
	a := create(t, s, "a", nb*replica.BlockSize)
	blk := func(b int, v byte) []byte {
		p := pattern(v)
		p[0], p[1] = byte(b), byte(b>>8)
		return p
	}
	// s1: every block, value 1. s2: odd blocks, value 2. head: block%3==0 value 3.
	for b := 0; b < nb; b++ {
		if err := a.WriteAt(op, blk(b, 1), int64(b)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.CreateSnapshot(op, "s1"); err != nil {
		t.Fatal(err)
	}
	for b := 1; b < nb; b += 2 {
		if err := a.WriteAt(op, blk(b, 2), int64(b)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.CreateSnapshot(op, "s2"); err != nil {
		t.Fatal(err)
	}
	for b := 0; b < nb; b += 3 {
		if err := a.WriteAt(op, blk(b, 3), int64(b)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
	}
	wantS2 := func(b int) []byte {
		if b%2 == 1 {
			return blk(b, 2)
		}
		return blk(b, 1)
	}
	wantHead := func(b int) []byte {
		if b%3 == 0 {
			return blk(b, 3)
		}
		return wantS2(b)
	}
	var stop atomic.Bool
	var closes atomic.Int64
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			if replica.CloseIfIdle(a) > 0 {
				closes.Add(1)
			}
		}
	}()
	var bad atomic.Int64
	go func() {
		defer wg.Done()
		buf := make([]byte, replica.BlockSize)
		for i := 0; !stop.Load(); i = (i + 97) % nb {
			if err := a.ReadSnapshotAt(op, "s2", buf, int64(i)*replica.BlockSize); err != nil {
				t.Errorf("ReadSnapshotAt: %v", err)
				return
			}
			if !bytes.Equal(buf, wantS2(i)) {
				bad.Add(1)
			}
		}
	}()
	if err := a.DeleteSnapshot(op, "s1"); err != nil {
		t.Errorf("DeleteSnapshot: %v", err)
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d idle closes during the delete", closes.Load())
	if bad.Load() > 0 {
		t.Errorf("%d bad snapshot reads during the delete", bad.Load())
	}
	check := func(a *replica.Replica, when string) {
		t.Helper()
		buf := make([]byte, replica.BlockSize)
		nbad := 0
		for b := 0; b < nb; b++ {
			if err := a.ReadSnapshotAt(op, "s2", buf, int64(b)*replica.BlockSize); err != nil {
				t.Fatalf("%s: ReadSnapshotAt: %v", when, err)
			}
			if !bytes.Equal(buf, wantS2(b)) {
				nbad++
			}
			if got := readBlock(t, a, int64(b)*replica.BlockSize); !bytes.Equal(got, wantHead(b)) {
				nbad++
			}
		}
		if nbad > 0 {
			t.Errorf("%s: %d bad blocks", when, nbad)
		}
	}
	check(a, "after delete")
	replica.CloseIfIdle(a)
	check(a, "after idle close")
	replica.CloseIfIdle(a)
	// crash with the replica idle-closed and its snapshot indexes dropped
	crashed := mem.CrashLoseAll()
	s2 := openStore(t, replica.Config{Dir: "/stor", FS: crashed, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
	defer s2.Close()
	a2, err := s2.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	check(a2, "after crash")
}

// Writes, snapshot cuts, deletes and reads racing idle closes; every
// snapshot must read as it did when cut.
func TestCutsDeletesAndIdleClosesRace(t *testing.T) {
	mem := errorfs.NewMemFS()
	s := openStore(t, replica.Config{Dir: "/stor", FS: mem, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
	defer s.Close()
	const nb = 600
	a := create(t, s, "a", nb*replica.BlockSize)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			replica.CloseIfIdle(a)
		}
	}()
	// model: per snapshot, the full volume image at cut.
	img := make([]byte, nb)
	snaps := map[string][]byte{}
	order := []string{}
	for round := 0; round < 12; round++ {
		for b := round; b < nb; b += 1 + round%5 {
			v := byte(round + 1)
			if err := a.WriteAt(op, pattern(v), int64(b)*replica.BlockSize); err != nil {
				t.Fatal(err)
			}
			img[b] = v
		}
		name := "s" + string(rune('a'+round))
		if err := a.CreateSnapshot(op, name); err != nil {
			t.Fatal(err)
		}
		snaps[name] = append([]byte(nil), img...)
		order = append(order, name)
		if round%3 == 2 {
			// delete the oldest-but-one, merging into a snapshot upper
			victim := order[len(order)-3]
			if err := a.DeleteSnapshot(op, victim); err != nil {
				t.Fatal(err)
			}
			delete(snaps, victim)
			for i, n := range order {
				if n == victim {
					order = append(order[:i], order[i+1:]...)
					break
				}
			}
		}
	}
	stop.Store(true)
	wg.Wait()
	buf := make([]byte, replica.BlockSize)
	verify := func(a *replica.Replica, when string) {
		nbad := 0
		for name, im := range snaps {
			for b := 0; b < nb; b++ {
				if err := a.ReadSnapshotAt(op, name, buf, int64(b)*replica.BlockSize); err != nil {
					t.Fatalf("%s: %v", when, err)
				}
				if !bytes.Equal(buf, pattern(im[b])) {
					nbad++
				}
			}
		}
		if nbad > 0 {
			t.Errorf("%s: %d bad snapshot blocks", when, nbad)
		}
	}
	verify(a, "live")
	replica.CloseIfIdle(a)
	verify(a, "after idle close")
}

// A delete that fails halfway leaves the upper SNAPSHOT layer with index
// ops not journaled; an idle close then syncs and drops it; the snapshot
// must read the same after the reload and after a crash.
func TestFailedMergeIntoASnapshotThenIdleClose(t *testing.T) {
	e := newMemEnv(t)
	s := e.open()
	r := create(t, s, "r", 1<<20)
	for b := 0; b < 40; b++ {
		if err := r.WriteAt(op, pattern(byte(b+1)), int64(b)*replica.BlockSize); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.CreateSnapshot(op, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteAt(op, pattern(0xee), 5*replica.BlockSize); err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(op, "s2"); err != nil {
		t.Fatal(err)
	}
	want := func(b int) []byte {
		if b == 5 {
			return pattern(0xee)
		}
		if b < 40 {
			return pattern(byte(b + 1))
		}
		return make([]byte, replica.BlockSize)
	}
	check := func(r *replica.Replica, when string) {
		t.Helper()
		buf := make([]byte, replica.BlockSize)
		for b := 0; b < 64; b++ {
			if err := r.ReadSnapshotAt(op, "s2", buf, int64(b)*replica.BlockSize); err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			if !bytes.Equal(buf, want(b)) {
				t.Errorf("%s: s2 block %d: %x", when, b, buf[:2])
			}
			if got := readBlock(t, r, int64(b)*replica.BlockSize); !bytes.Equal(got, want(b)) {
				t.Errorf("%s: head block %d: %x", when, b, got[:2])
			}
		}
	}
	e.efs.Add(errorfs.Rule{Path: "layer-00000002.data", Ops: errorfs.OpWrite, After: 3, Times: 1})
	if err := r.DeleteSnapshot(op, "s1"); err == nil {
		t.Fatalf("delete did not fail")
	}
	check(r, "after failed delete")
	if replica.CloseIfIdle(r) == 0 {
		t.Fatalf("not closed")
	}
	if got := replica.LoadedLayers(r); got != 1 {
		t.Errorf("%d loaded", got)
	}
	check(r, "after idle close")
	replica.CloseIfIdle(r)
	s = e.crash()
	r = get(t, s, "r")
	check(r, "after crash")
	if err := r.DeleteSnapshot(op, "s1"); err != nil {
		t.Fatal(err)
	}
	replica.CloseIfIdle(r)
	check(r, "after retried delete and idle close")
	s.Close()
}
