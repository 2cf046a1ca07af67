package replicatest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"testing"

	"github.com/stor-io/stor/replica"
)

func regionsOf(exts []replica.Extent, rs int64) map[int64]bool {
	out := map[int64]bool{}
	for _, e := range exts {
		for off := e.Off / rs * rs; off < e.Off+e.Len; off += rs {
			out[off/rs] = true
		}
	}
	return out
}

func writtenSince(t *testing.T, r *replica.Replica, gen uint64) (map[int64]bool, error) {
	t.Helper()
	exts, err := r.WrittenSince(op, gen)
	if err != nil {
		return nil, err
	}
	checkExtents(t, exts, 0, int64(r.Size()))
	return regionsOf(exts, r.RegionSize()), nil
}

// testDirtyRegions: a write marks its regions dirty before it is applied,
// the marks survive a crash, and a region is cleared only once two flushes
// have passed with no write to it (the first flush after a write may find
// it still in flight elsewhere).
func testDirtyRegions(t *testing.T, h *Harness) {
	r := h.Create("r", 8*mib)
	rs := r.RegionSize()
	size := int64(r.Size())
	if rs <= 0 || rs%replica.BlockSize != 0 {
		t.Fatalf("RegionSize %d", rs)
	}
	dirty := func(what string) map[int64]bool {
		t.Helper()
		exts, err := r.DirtyRegions(op)
		must(t, err, "DirtyRegions %s", what)
		checkExtents(t, exts, 0, size)
		for _, e := range exts {
			if e.Off%rs != 0 || (e.Len%rs != 0 && e.Off+e.Len != size) {
				t.Fatalf("%s: dirty extent %+v is not whole regions of %d", what, e, rs)
			}
		}
		return regionsOf(exts, rs)
	}
	if d := dirty("of a new replica"); len(d) != 0 {
		t.Fatalf("a new replica has dirty regions %v", d)
	}
	nreg := (size + rs - 1) / rs
	if nreg < 4 {
		t.Skipf("region size %d leaves only %d regions", rs, nreg)
	}
	rng := rand.New(rand.NewSource(8))
	must(t, r.WriteAt(op, randBytes(rng, 4096), 1*rs+4096), "write to region 1")
	must(t, r.WriteAt(op, randBytes(rng, 8192), 3*rs-4096), "write across regions 2 and 3")
	want := []int64{1, 2, 3}
	d := dirty("after writes")
	for _, reg := range want {
		if !d[reg] {
			t.Fatalf("region %d written but not dirty: %v", reg, d)
		}
	}
	if d[0] || d[nreg-1] {
		t.Fatalf("unwritten regions are dirty: %v", d)
	}

	h.Crash(8)
	r = h.Replica("r")
	d = dirty("after a crash")
	for _, reg := range want {
		if !d[reg] {
			t.Fatalf("region %d was written before the crash, but is not dirty after it: %v", reg, d)
		}
	}
	must(t, r.Flush(op), "flush 1")
	d = dirty("after one flush")
	if !d[1] {
		t.Fatalf("region 1 cleared by the first flush after the crash; clearing needs two")
	}
	must(t, r.Flush(op), "flush 2")
	// Regions dirty at the open are owed (a crash may have lost writes
	// there that only a rebuild or a reconcile restores): no flush clears
	// them until an EndRebuild with FUA settles them.
	for _, what := range []string{"after two flushes", "after an EndRebuild without FUA and a flush"} {
		d = dirty(what)
		for _, reg := range want {
			if !d[reg] {
				t.Fatalf("region %d, dirty at the open, cleared %s: %v", reg, what, d)
			}
		}
		must(t, r.EndRebuild(op), "EndRebuild")
		must(t, r.Flush(op), "flush")
	}
	settle := op
	settle.FUA = true
	must(t, r.EndRebuild(settle), "EndRebuild with FUA")
	must(t, r.Flush(op), "flush after the settle")
	must(t, r.Flush(op), "second flush after the settle")
	if d := dirty("two flushes after the settle"); len(d) != 0 {
		t.Fatalf("dirty regions %v after the settle and two idle flushes", d)
	}

	must(t, r.WriteAt(op, randBytes(rng, 512), (nreg-1)*rs), "write to the last region")
	must(t, r.Flush(op), "flush 3")
	if d := dirty("one flush after a write"); !d[nreg-1] {
		t.Fatalf("the last region was cleared by the first flush after its write")
	}
	must(t, r.Flush(op), "flush 4")
	if d := dirty("two flushes after a write"); len(d) != 0 {
		t.Fatalf("dirty regions %v two flushes after the last write", d)
	}
}

// testWriteHistory: WrittenSince names the regions written at a generation
// at or after the one asked, precisely within a session; after a reopen
// or a crash it still names every such region (or, honestly, reports
// ErrHistoryLost).
func testWriteHistory(t *testing.T, h *Harness) {
	r := h.Create("r", 8*mib)
	rs := r.RegionSize()
	nreg := int64(r.Size()) / rs
	if nreg < 8 {
		t.Skipf("region size %d leaves only %d regions", rs, nreg)
	}
	rng := rand.New(rand.NewSource(9))
	at := func(gen uint64) replica.Op { return replica.Op{Epoch: 1, Generation: gen} }
	must(t, r.WriteAt(at(1), randBytes(rng, 4096), 0), "gen 1 write to region 0")
	must(t, r.WriteAt(at(2), randBytes(rng, 4096), 2*rs), "gen 2 write to region 2")
	must(t, r.WriteAt(at(3), randBytes(rng, 4096), 4*rs), "gen 3 write to region 4")
	must(t, r.WriteZeroes(at(3), 5*rs, 4096), "gen 3 zeroes in region 5")
	must(t, r.WriteAt(at(2), randBytes(rng, 4096), 6*rs), "late gen 2 write to region 6")

	expect := func(what string, gen uint64, want []int64, exact bool) {
		t.Helper()
		got, err := writtenSince(t, r, gen)
		if errors.Is(err, replica.ErrHistoryLost) && !exact {
			t.Logf("%s: WrittenSince(%d): %v (allowed)", what, gen, err)
			return
		}
		must(t, err, "%s: WrittenSince(%d)", what, gen)
		for _, reg := range want {
			if !got[reg] {
				t.Fatalf("%s: WrittenSince(%d) = regions %v, missing %d", what, gen, got, reg)
			}
		}
		if exact && len(got) != len(want) {
			t.Fatalf("%s: WrittenSince(%d) = regions %v, want exactly %v", what, gen, got, want)
		}
		if got[nreg-1] {
			t.Fatalf("%s: WrittenSince(%d) names region %d, never written", what, gen, nreg-1)
		}
	}
	expect("live", 0, []int64{0, 2, 4, 5, 6}, true)
	expect("live", 1, []int64{0, 2, 4, 5, 6}, true)
	expect("live", 2, []int64{2, 4, 5, 6}, true)
	expect("live", 3, []int64{4, 5}, true)
	expect("live", 4, nil, true)

	must(t, r.Flush(op), "flush")
	h.Reopen()
	r = h.Replica("r")
	expect("after reopen", 1, []int64{0, 2, 4, 5, 6}, false)
	expect("after reopen", 3, []int64{4, 5}, false)

	// Unflushed writes at a new generation, then a crash.
	must(t, r.WriteAt(at(5), randBytes(rng, 4096), 7*rs), "gen 5 write to region 7")
	must(t, r.WriteAt(at(5), randBytes(rng, 4096), 1*rs), "gen 5 write to region 1")
	h.Crash(9)
	r = h.Replica("r")
	got, err := writtenSince(t, r, 5)
	if errors.Is(err, replica.ErrHistoryLost) {
		t.Logf("after a crash: %v (allowed)", err)
		return
	}
	must(t, err, "WrittenSince(5) after a crash")
	for _, reg := range []int64{1, 7} {
		if !got[reg] {
			t.Fatalf("after a crash: WrittenSince(5) = %v misses region %d written at generation 5", got, reg)
		}
	}
	expect("after a crash", 1, []int64{0, 1, 2, 4, 5, 6}, false)
}

// testCrashDurability: after a crash, every block reads as it was at the
// last flush (or FUA write, or snapshot cut) or as one of the writes made
// to it since; never as zeroes or anything else. Snapshots cut before the
// crash read exactly. Every region with writes since the last flush is
// dirty.
func testCrashDurability(t *testing.T, h *Harness) {
	if !h.env.LosesUnsynced {
		t.Skip("the environment's Crash does not lose unsynced data")
	}
	seed := Seed(t)
	rng := rand.New(rand.NewSource(seed))
	const size = mib
	const bs = replica.BlockSize
	r := h.Create("r", size)
	m := &model{data: make([]byte, size)}
	durable := m.snapshot()
	cands := map[int64][][]byte{} // block -> images written since durable
	views := map[string][]byte{}
	var order []string
	synced := func() {
		durable = m.snapshot()
		clear(cands)
	}
	note := func(off, n int64) {
		for b := off / bs; b <= (off+n-1)/bs; b++ {
			cands[b] = append(cands[b], bytes.Clone(m.data[b*bs:(b+1)*bs]))
		}
	}
	for round := range 4 {
		for step := range 40 {
			off, n := randRange(rng, size, 32<<10)
			switch k := rng.Intn(20); {
			case k < 11:
				p := randBytes(rng, int(n))
				must(t, r.WriteAt(op, p, off), "round %d step %d: write", round, step)
				m.write(p, off)
				note(off, n)
			case k < 13:
				must(t, r.WriteZeroes(op, off, n), "round %d step %d: zeroes", round, step)
				m.zero(off, n)
				note(off, n)
			case k < 15:
				fua := op
				fua.FUA = true
				p := randBytes(rng, int(n))
				must(t, r.WriteAt(fua, p, off), "round %d step %d: FUA write", round, step)
				m.write(p, off)
				synced() // a FUA write covers it and everything completed before
			case k < 17:
				must(t, r.Flush(op), "round %d step %d: flush", round, step)
				synced()
			case k < 18:
				id := fmt.Sprintf("r%ds%d", round, step)
				must(t, r.CreateSnapshot(op, id), "round %d step %d: cut", round, step)
				views[id] = m.snapshot()
				order = append(order, id)
				synced()
			case k < 19 && len(order) > 0:
				i := rng.Intn(len(order))
				must(t, r.DeleteSnapshot(op, order[i]), "round %d step %d: delete %s", round, step, order[i])
				delete(views, order[i])
				order = slices.Delete(order, i, i+1)
			}
		}
		dirtyWant := map[int64]bool{}
		for b := range cands {
			dirtyWant[b*bs/r.RegionSize()] = true
		}

		h.Crash(seed + int64(round))
		r = h.Replica("r")
		got := readAll(t, r, op)
		for b := int64(0); b < size/bs; b++ {
			img := got[b*bs : (b+1)*bs]
			if bytes.Equal(img, durable[b*bs:(b+1)*bs]) {
				continue
			}
			ok := false
			for _, c := range cands[b] {
				ok = ok || bytes.Equal(img, c)
			}
			if !ok {
				what := "neither its durable content nor a later write"
				if isZero(img) {
					what = "zeroes, which it never held since its last flush"
				}
				t.Fatalf("round %d: after the crash block %d reads %s (%d writes since the flush)", round, b, what, len(cands[b]))
			}
		}
		if got := r.Snapshots(); !slices.Equal(got, order) && !(len(got) == 0 && len(order) == 0) {
			// A delete that returned is durable; a cut that returned is too.
			t.Fatalf("round %d: snapshots after the crash %v, want %v", round, got, order)
		}
		for _, id := range order {
			sameBytes(t, readSnapAll(t, r, op, id, size), views[id], "round %d: snapshot %s after the crash", round, id)
		}
		exts, err := r.DirtyRegions(op)
		must(t, err, "DirtyRegions")
		d := regionsOf(exts, r.RegionSize())
		for reg := range dirtyWant {
			if !d[reg] {
				t.Fatalf("round %d: region %d had unflushed writes before the crash but is not dirty: %v", round, reg, d)
			}
		}
		copy(m.data, got)
		synced()
	}
}

// testCrashMetadata: what a control call acknowledged survives a crash:
// a created replica, a raised epoch, a grown size, a cut snapshot, a
// deleted snapshot and a deleted replica.
func testCrashMetadata(t *testing.T, h *Harness) {
	seed := Seed(t)
	for i := range int64(3) {
		id := fmt.Sprintf("r%d", i)
		r := h.Create(id, mib)
		h.Crash(seed + 10*i)
		r = h.Replica(id)
		must(t, r.Fence(7), "Fence(7)")
		h.Crash(seed + 10*i + 1)
		r = h.Replica(id)
		if r.Epoch() != 7 {
			t.Fatalf("epoch %d after a crash, want 7", r.Epoch())
		}
		e7 := replica.Op{Epoch: 7}
		must(t, r.Grow(e7, 2*mib), "Grow")
		p := randBytes(rand.New(rand.NewSource(seed)), 8192)
		must(t, r.WriteAt(e7, p, mib), "write")
		must(t, r.CreateSnapshot(e7, "s1"), "cut s1")
		must(t, r.CreateSnapshot(e7, "s2"), "cut s2")
		must(t, r.DeleteSnapshot(e7, "s1"), "delete s1")
		h.Crash(seed + 10*i + 2)
		r = h.Replica(id)
		if r.Size() != 2*mib {
			t.Fatalf("size %d after a crash, want %d", r.Size(), 2*mib)
		}
		if got := fmt.Sprint(r.Snapshots()); got != "[s2]" {
			t.Fatalf("snapshots %s after a crash, want [s2]", got)
		}
		snap := make([]byte, 8192)
		must(t, r.ReadSnapshotAt(e7, "s2", snap, mib), "read s2")
		sameBytes(t, snap, p, "snapshot s2 after a crash")
		sameBytes(t, read(t, r, e7, mib, 8192), p, "head after a crash")
		must(t, h.Store().Delete(id), "Delete")
		h.Crash(seed + 10*i + 3)
		if _, err := h.Store().Get(id); !errors.Is(err, replica.ErrNotFound) {
			t.Fatalf("Get(%s) after a deleted replica and a crash: %v, want ErrNotFound", id, err)
		}
	}
}
