package replicatest

import (
	"bytes"
	"fmt"
	"math/rand"
	"slices"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
)

// testSnapshots: a snapshot reads the volume as of its cut while the head
// moves on; cutting an existing id is a no-op; deleting the oldest, a
// middle and the newest snapshot keeps every remaining view.
func testSnapshots(t *testing.T, h *Harness) {
	const size = mib
	r := h.Create("r", size)
	rng := rand.New(rand.NewSource(5))
	m := &model{data: make([]byte, size)}
	views := map[string][]byte{}
	write := func(off, n int64) {
		p := randBytes(rng, int(n))
		must(t, r.WriteAt(op, p, off), "write")
		m.write(p, off)
	}
	check := func(what string) {
		t.Helper()
		sameBytes(t, readAll(t, r, op), m.data, "%s: head", what)
		for _, id := range r.Snapshots() {
			sameBytes(t, readSnapAll(t, r, op, id, size), views[id], "%s: snapshot %s", what, id)
		}
		if len(r.Snapshots()) != len(views) {
			t.Fatalf("%s: snapshots %v, want %d", what, r.Snapshots(), len(views))
		}
	}
	cut := func(id string) {
		must(t, r.CreateSnapshot(op, id), "CreateSnapshot(%s)", id)
		views[id] = m.snapshot()
	}

	write(0, 64<<10)
	cut("a")
	write(32<<10, 64<<10)
	write(512, 1024) // partial block over a snapshot block
	cut("b")
	must(t, r.WriteZeroes(op, 0, 16<<10), "zero")
	m.zero(0, 16<<10)
	write(200<<10, 4096)
	cut("c")
	write(8192, 512)
	check("after three cuts")

	before := readAll(t, r, op)
	must(t, r.CreateSnapshot(op, "b"), "CreateSnapshot of an existing id")
	if got := fmt.Sprint(r.Snapshots()); got != "[a b c]" {
		t.Fatalf("snapshots %s after re-cutting b, want [a b c]", got)
	}
	sameBytes(t, readSnapAll(t, r, op, "b", size), views["b"], "b after re-cutting it")
	sameBytes(t, readAll(t, r, op), before, "head after re-cutting b")

	h.Reopen()
	r = h.Replica("r")
	check("after reopen")

	must(t, r.DeleteSnapshot(op, "b"), "delete the middle snapshot")
	delete(views, "b")
	check("after deleting b")
	must(t, r.DeleteSnapshot(op, "a"), "delete the oldest snapshot")
	delete(views, "a")
	check("after deleting a")
	wantErr(t, r.DeleteSnapshot(op, "a"), replica.ErrNotFound, "deleting a twice")
	cut("d")
	must(t, r.DeleteSnapshot(op, "d"), "delete the newest snapshot")
	delete(views, "d")
	check("after deleting d")
	h.Reopen()
	r = h.Replica("r")
	check("after deletes and reopen")
	if got := fmt.Sprint(r.Snapshots()); got != "[c]" {
		t.Fatalf("snapshots %s, want [c]", got)
	}
}

// testSnapshotModel: a random sequence of writes, zeroes, cuts, deletes
// and reopens; every view always matches a byte model, and Extents always
// covers every non-zero block.
func testSnapshotModel(t *testing.T, h *Harness) {
	rng := rand.New(rand.NewSource(Seed(t)))
	const size = 512 << 10
	r := h.Create("r", size)
	m := &model{data: make([]byte, size)}
	views := map[string][]byte{}
	var order []string
	next := 0
	checkViews := func(step int) {
		t.Helper()
		sameBytes(t, readAll(t, r, op), m.data, "step %d: head", step)
		if got := r.Snapshots(); !slices.Equal(got, order) {
			t.Fatalf("step %d: snapshots %v, want %v", step, got, order)
		}
		for _, id := range order {
			sameBytes(t, readSnapAll(t, r, op, id, size), views[id], "step %d: snapshot %s", step, id)
		}
		for _, id := range append([]string{""}, order...) {
			exts, err := r.Extents(op, id, 0, 0)
			must(t, err, "Extents(%q)", id)
			checkExtents(t, exts, 0, size)
			img := m.data
			if id != "" {
				img = views[id]
			}
			for b := int64(0); b < size; b += replica.BlockSize {
				if !isZero(img[b:b+replica.BlockSize]) && !covered(exts, b, replica.BlockSize) {
					t.Fatalf("step %d: view %q: block %d holds data but no extent covers it: %+v", step, id, b/replica.BlockSize, exts)
				}
			}
		}
	}
	for step := range 120 {
		switch k := rng.Intn(20); {
		case k < 10:
			off, n := randRange(rng, size, 24<<10)
			p := randBytes(rng, int(n))
			must(t, r.WriteAt(op, p, off), "step %d: write", step)
			m.write(p, off)
		case k < 12:
			off, n := randRange(rng, size, 24<<10)
			must(t, r.WriteZeroes(op, off, n), "step %d: zeroes", step)
			m.zero(off, n)
		case k < 15:
			id := fmt.Sprintf("s%d", next)
			next++
			must(t, r.CreateSnapshot(op, id), "step %d: cut %s", step, id)
			views[id] = m.snapshot()
			order = append(order, id)
		case k < 18:
			if len(order) == 0 {
				continue
			}
			i := rng.Intn(len(order))
			id := order[i]
			must(t, r.DeleteSnapshot(op, id), "step %d: delete %s", step, id)
			delete(views, id)
			order = slices.Delete(order, i, i+1)
		case k < 19:
			must(t, r.Flush(op), "flush")
		default:
			h.Reopen()
			r = h.Replica("r")
		}
		if step%10 == 9 {
			checkViews(step)
		}
	}
	checkViews(-1)
	h.Reopen()
	r = h.Replica("r")
	checkViews(-2)
}

func isZero(p []byte) bool {
	for _, c := range p {
		if c != 0 {
			return false
		}
	}
	return true
}

// testSnapshotDeleteConcurrent: deleting a snapshot merges it into the
// head while writers write to the head; no write is lost, the head never
// reads anything but the model's old or new data, and the other
// snapshots are untouched.
func testSnapshotDeleteConcurrent(t *testing.T, h *Harness) {
	seed := Seed(t)
	rng := rand.New(rand.NewSource(seed))
	const size = 4 * mib
	r := h.Create("r", size)
	m := &model{data: make([]byte, size)}
	for off := int64(0); off < size; off += mib {
		p := randBytes(rng, mib)
		must(t, r.WriteAt(op, p, off), "fill")
		m.write(p, off)
	}
	must(t, r.CreateSnapshot(op, "old"), "cut old")
	oldView := m.snapshot()
	p := randBytes(rng, 256<<10)
	must(t, r.WriteAt(op, p, mib), "write")
	m.write(p, mib)
	must(t, r.CreateSnapshot(op, "victim"), "cut victim")

	var wg sync.WaitGroup
	const writers = 3
	errs := make(chan error, writers+1)
	stop := make(chan struct{})
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed + int64(w) + 1))
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// Writers own interleaved 64 KiB stripes, so the model is
				// exact per stripe.
				stripe := int64(rng.Intn(size/(64<<10)/writers)*writers+w) * (64 << 10)
				off, n := randRange(rng, 64<<10, 16<<10)
				p := randBytes(rng, int(n))
				if err := r.WriteAt(op, p, stripe+off); err != nil {
					errs <- err
					return
				}
				m.write(p, stripe+off)
				if i > 400 {
					return
				}
			}
		}()
	}
	if err := r.DeleteSnapshot(op, "victim"); err != nil {
		errs <- err
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	sameBytes(t, readAll(t, r, op), m.data, "head after a concurrent merge")
	sameBytes(t, readSnapAll(t, r, op, "old", size), oldView, "older snapshot after the merge")
	h.Reopen()
	r = h.Replica("r")
	sameBytes(t, readAll(t, r, op), m.data, "head after reopen")
	if got := fmt.Sprint(r.Snapshots()); got != "[old]" {
		t.Fatalf("snapshots %s, want [old]", got)
	}
}

// testExtents: the allocated ranges of each view, coalesced across layers,
// clipped at from, limited.
func testExtents(t *testing.T, h *Harness) {
	const size = mib
	const bs = replica.BlockSize
	r := h.Create("r", size)
	rng := rand.New(rand.NewSource(6))
	exts, err := r.Extents(op, "", 0, 0)
	must(t, err, "Extents of an empty replica")
	if len(exts) != 0 {
		t.Fatalf("extents of an empty replica: %+v", exts)
	}
	must(t, r.WriteAt(op, randBytes(rng, 2*bs), 0), "write blocks 0-1")
	must(t, r.WriteAt(op, randBytes(rng, bs), 5*bs), "write block 5")
	must(t, r.WriteAt(op, randBytes(rng, 512), 9*bs+1024), "write a sector of block 9")
	must(t, r.WriteAt(op, randBytes(rng, 2*bs), size-2*bs), "write the last two blocks")
	must(t, r.CreateSnapshot(op, "s"), "cut")
	must(t, r.WriteAt(op, randBytes(rng, bs), 2*bs), "write block 2 in the head")
	must(t, r.WriteZeroes(op, 5*bs, bs), "zero block 5 in the head (masks the snapshot)")

	type want = []replica.Extent
	x := func(off, n int64) replica.Extent { return replica.Extent{Off: off, Len: n} }
	cases := []struct {
		view  string
		from  int64
		limit int
		want  want
	}{
		{"", 0, 0, want{x(0, 3*bs), x(5*bs, bs), x(9*bs, bs), x(size-2*bs, 2*bs)}},
		{"s", 0, 0, want{x(0, 2*bs), x(5*bs, bs), x(9*bs, bs), x(size-2*bs, 2*bs)}},
		{"", bs, 0, want{x(bs, 2*bs), x(5*bs, bs), x(9*bs, bs), x(size-2*bs, 2*bs)}},
		{"", 2048, 0, want{x(2048, 3*bs-2048), x(5*bs, bs), x(9*bs, bs), x(size-2*bs, 2*bs)}},
		{"", 3 * bs, 2, want{x(5*bs, bs), x(9*bs, bs)}},
		{"", 0, 1, want{x(0, 3*bs)}},
		{"", size - bs, 0, want{x(size-bs, bs)}},
		{"", size, 0, want{}},
		{"s", 6 * bs, 0, want{x(9*bs, bs), x(size-2*bs, 2*bs)}},
	}
	check := func(what string) {
		for _, c := range cases {
			got, err := r.Extents(op, c.view, c.from, c.limit)
			must(t, err, "Extents(%q, %d, %d)", c.view, c.from, c.limit)
			if len(got) == 0 && len(c.want) == 0 {
				continue
			}
			if !slices.Equal(got, c.want) {
				t.Fatalf("%s: Extents(%q, from %d, limit %d) = %+v, want %+v", what, c.view, c.from, c.limit, got, c.want)
			}
		}
	}
	check("live")
	h.Reopen()
	r = h.Replica("r")
	check("after reopen")
	// Deleting the snapshot merges it into the head: the head's extents
	// are unchanged.
	must(t, r.DeleteSnapshot(op, "s"), "delete s")
	cases = slices.DeleteFunc(cases, func(c struct {
		view  string
		from  int64
		limit int
		want  want
	}) bool {
		return c.view == "s"
	})
	check("after merging the snapshot")
	// Extents is about allocation, not content: the bytes behind them are
	// what ReadAt returns.
	got, err := r.Extents(op, "", 0, 0)
	must(t, err, "Extents")
	img := readAll(t, r, op)
	for b := int64(0); b < size; b += bs {
		if !bytes.Equal(img[b:b+bs], make([]byte, bs)) && !covered(got, b, bs) {
			t.Fatalf("block %d has data outside the extents %+v", b/bs, got)
		}
	}
}
