package replicatest

import (
	"bytes"
	"fmt"
	"math"
	"math/rand"
	"strings"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
)

const mib = 1 << 20

// testStore: Create is idempotent per ID and VolumeID, refuses another
// volume's ID and bad specs, grows on a larger size; Get, List and Delete
// see the same set, which survives a reopen.
func testStore(t *testing.T, h *Harness) {
	s := h.Store()
	r1 := h.Create("r1", mib)
	if r1.ID() != "r1" || r1.VolumeID() != "vol-r1" || r1.Size() != mib {
		t.Fatalf("created replica: id %q volume %q size %d", r1.ID(), r1.VolumeID(), r1.Size())
	}
	must(t, r1.WriteAt(op, bytes.Repeat([]byte{7}, 4096), 0), "write")

	again, err := s.Create(replica.Spec{ID: "r1", VolumeID: "vol-r1", Size: mib})
	must(t, err, "Create again")
	if again != r1 {
		t.Fatalf("Create again returned another replica")
	}
	_, err = s.Create(replica.Spec{ID: "r1", VolumeID: "other", Size: mib})
	wantErr(t, err, replica.ErrExists, "Create with another volume id")
	smaller, err := s.Create(replica.Spec{ID: "r1", VolumeID: "vol-r1", Size: 4096})
	must(t, err, "Create with a smaller size")
	if smaller.Size() != mib {
		t.Fatalf("Create with a smaller size changed the size to %d", smaller.Size())
	}
	grown, err := s.Create(replica.Spec{ID: "r1", VolumeID: "vol-r1", Size: 2 * mib})
	must(t, err, "Create with a larger size")
	if grown.Size() != 2*mib {
		t.Fatalf("Create with a larger size: size %d, want %d", grown.Size(), 2*mib)
	}

	for _, spec := range []replica.Spec{
		{ID: "", VolumeID: "v", Size: mib},
		{ID: ".", VolumeID: "v", Size: mib},
		{ID: "..", VolumeID: "v", Size: mib},
		{ID: "../escape", VolumeID: "v", Size: mib},
		{ID: "a/b", VolumeID: "v", Size: mib},
		{ID: ".hidden", VolumeID: "v", Size: mib},
		{ID: "sp ace", VolumeID: "v", Size: mib},
		{ID: "nul\x00", VolumeID: "v", Size: mib},
		{ID: strings.Repeat("a", 1000), VolumeID: "v", Size: mib},
		{ID: "ok", VolumeID: "", Size: mib},
		{ID: "ok", VolumeID: "v", Size: 0},
		{ID: "ok", VolumeID: "v", Size: 1000},
		{ID: "ok", VolumeID: "v", Size: 4096 + 512},
		{ID: "ok", VolumeID: "v", Size: math.MaxUint64 / 4096 * 4096},
	} {
		_, err := s.Create(spec)
		wantErr(t, err, replica.ErrInvalid, "Create(%+v)", spec)
	}

	h.Create("r2", mib)
	_, err = s.Get("nope")
	wantErr(t, err, replica.ErrNotFound, "Get(nope)")
	wantErr(t, s.Delete("nope"), replica.ErrNotFound, "Delete(nope)")
	if ids := listIDs(s); ids != "r1,r2" {
		t.Fatalf("List: %s, want r1,r2", ids)
	}

	s = h.Reopen()
	if ids := listIDs(s); ids != "r1,r2" {
		t.Fatalf("List after reopen: %s, want r1,r2", ids)
	}
	r1 = h.Replica("r1")
	if r1.Size() != 2*mib || r1.VolumeID() != "vol-r1" {
		t.Fatalf("after reopen: size %d volume %q", r1.Size(), r1.VolumeID())
	}
	sameBytes(t, read(t, r1, op, 0, 4096), bytes.Repeat([]byte{7}, 4096), "data after reopen")

	must(t, s.Delete("r1"), "Delete(r1)")
	_, err = s.Get("r1")
	wantErr(t, err, replica.ErrNotFound, "Get after Delete")
	s = h.Reopen()
	if ids := listIDs(s); ids != "r2" {
		t.Fatalf("List after delete and reopen: %s, want r2", ids)
	}
	// The id is free again, and the new replica starts empty.
	r1 = h.Create("r1", mib)
	sameBytes(t, read(t, r1, op, 0, 4096), make([]byte, 4096), "recreated replica")
}

func listIDs(s *replica.Store) string {
	var ids []string
	for _, r := range s.List() {
		ids = append(ids, r.ID())
	}
	return strings.Join(ids, ",")
}

// testReadYourWrites: a random mix of writes, zeroes and trims of every
// alignment reads back as a byte model says, unwritten space reads as
// zeroes, and all of it survives a clean reopen.
func testReadYourWrites(t *testing.T, h *Harness) {
	rng := rand.New(rand.NewSource(Seed(t)))
	const size = 4 * mib
	r := h.Create("r", size)
	sameBytes(t, readAll(t, r, op), make([]byte, size), "a new replica")
	m := &model{data: make([]byte, size)}
	for i := range 400 {
		off, n := randRange(rng, size, 96<<10)
		switch k := rng.Intn(10); {
		case k < 6:
			p := randBytes(rng, int(n))
			must(t, r.WriteAt(op, p, off), "op %d: WriteAt(%d, %d)", i, off, n)
			m.write(p, off)
		case k < 7:
			must(t, r.WriteZeroes(op, off, n), "op %d: WriteZeroes(%d, %d)", i, off, n)
			m.zero(off, n)
		case k < 8:
			must(t, r.Trim(op, off, n), "op %d: Trim(%d, %d)", i, off, n)
			m.zero(off, n)
		default:
			sameBytes(t, read(t, r, op, off, n), m.data[off:off+n], "op %d: ReadAt(%d, %d)", i, off, n)
		}
		if i%100 == 0 {
			must(t, r.Flush(op), "Flush")
		}
	}
	sameBytes(t, readAll(t, r, op), m.data, "whole volume")
	h.Reopen()
	sameBytes(t, readAll(t, h.Replica("r"), op), m.data, "whole volume after reopen")
}

// testValidation: malformed requests fail with ErrInvalid on every method,
// nothing panics, and the data is unchanged afterwards.
func testValidation(t *testing.T, h *Harness) {
	const size = 16 * mib
	r := h.Create("r", size)
	rng := rand.New(rand.NewSource(1))
	before := randBytes(rng, 1*mib)
	must(t, r.WriteAt(op, before, size-mib), "write the tail")
	must(t, r.WriteAt(op, before, 0), "write the head")
	must(t, r.CreateSnapshot(op, "s"), "CreateSnapshot")
	image := readAll(t, r, op)

	buf := func(n int) []byte { return make([]byte, n) }
	cases := []struct {
		name string
		call func() error
	}{
		{"read negative offset", func() error { return r.ReadAt(op, buf(512), -512) }},
		{"read at the end", func() error { return r.ReadAt(op, buf(512), size) }},
		{"read past the end", func() error { return r.ReadAt(op, buf(1024), size-512) }},
		{"read far past the end", func() error { return r.ReadAt(op, buf(512), math.MaxInt64-511) }},
		{"read misaligned offset", func() error { return r.ReadAt(op, buf(512), 100) }},
		{"read misaligned length", func() error { return r.ReadAt(op, buf(100), 0) }},
		{"read oversized", func() error { return r.ReadAt(op, buf(replica.MaxIO+512), 0) }},
		{"write negative offset", func() error { return r.WriteAt(op, buf(512), -4096) }},
		{"write at the end", func() error { return r.WriteAt(op, buf(512), size) }},
		{"write past the end", func() error { return r.WriteAt(op, buf(8192), size-4096) }},
		{"write misaligned offset", func() error { return r.WriteAt(op, buf(512), 4097) }},
		{"write misaligned length", func() error { return r.WriteAt(op, buf(513), 0) }},
		{"write oversized", func() error { return r.WriteAt(op, buf(replica.MaxIO+4096), 0) }},
		{"zeroes negative length", func() error { return r.WriteZeroes(op, 0, -4096) }},
		{"zeroes negative offset", func() error { return r.WriteZeroes(op, -4096, 4096) }},
		{"zeroes past the end", func() error { return r.WriteZeroes(op, size-4096, 8192) }},
		{"zeroes overflowing", func() error { return r.WriteZeroes(op, 4096, math.MaxInt64-4095) }},
		{"zeroes misaligned", func() error { return r.WriteZeroes(op, 256, 512) }},
		{"trim negative length", func() error { return r.Trim(op, 0, -512) }},
		{"trim past the end", func() error { return r.Trim(op, size, 512) }},
		{"trim misaligned", func() error { return r.Trim(op, 0, 1000) }},
		{"grow smaller", func() error { return r.Grow(op, size-4096) }},
		{"grow misaligned", func() error { return r.Grow(op, size+512) }},
		{"grow absurd", func() error { return r.Grow(op, math.MaxUint64-4095) }},
		{"snapshot read past the end", func() error { return r.ReadSnapshotAt(op, "s", buf(512), size) }},
		{"snapshot read misaligned", func() error { return r.ReadSnapshotAt(op, "s", buf(512), 1) }},
		{"snapshot read oversized", func() error { return r.ReadSnapshotAt(op, "s", buf(replica.MaxIO+512), 0) }},
		{"snapshot bad id", func() error { return r.CreateSnapshot(op, "../x") }},
		{"snapshot empty id", func() error { return r.CreateSnapshot(op, "") }},
		{"snapshot id with slash", func() error { return r.CreateSnapshot(op, "a/b") }},
		{"extents negative from", func() error { _, err := r.Extents(op, "", -1, 0); return err }},
		{"extents from past the end", func() error { _, err := r.Extents(op, "", size+4096, 0); return err }},
		{"rebuild write without a rebuild", func() error { return r.RebuildWrite(op, buf(4096), 0) }},
	}
	for _, c := range cases {
		wantErr(t, c.call(), replica.ErrInvalid, "%s", c.name)
	}
	wantErr(t, r.ReadSnapshotAt(op, "nope", buf(512), 0), replica.ErrNotFound, "snapshot read of an unknown id")
	wantErr(t, r.DeleteSnapshot(op, "nope"), replica.ErrNotFound, "delete of an unknown snapshot")
	_, err := r.Extents(op, "nope", 0, 0)
	wantErr(t, err, replica.ErrNotFound, "extents of an unknown snapshot")

	// Zero-length requests in range are fine.
	must(t, r.ReadAt(op, nil, size), "empty read at the end")
	must(t, r.WriteAt(op, nil, 0), "empty write")
	must(t, r.WriteZeroes(op, size, 0), "empty zeroes at the end")

	if r.Size() != size {
		t.Fatalf("size changed to %d", r.Size())
	}
	if got := r.Snapshots(); fmt.Sprint(got) != "[s]" {
		t.Fatalf("snapshots changed: %v", got)
	}
	sameBytes(t, readAll(t, r, op), image, "volume after bad requests")
	sameBytes(t, readSnapAll(t, r, op, "s", size), image, "snapshot after bad requests")
}

// testZeroesMask: WriteZeroes and Trim make whole and partial blocks read
// as zeroes in the head, also over data held by a snapshot, which keeps
// its data; a partial write into a zeroed block keeps the rest zero.
func testZeroesMask(t *testing.T, h *Harness) {
	const size = mib
	r := h.Create("r", size)
	rng := rand.New(rand.NewSource(2))
	data := randBytes(rng, 64<<10)
	must(t, r.WriteAt(op, data, 0), "write")
	must(t, r.CreateSnapshot(op, "s"), "snapshot")
	m := &model{data: make([]byte, size)}
	m.write(data, 0)

	must(t, r.WriteZeroes(op, 4096, 8192), "zero blocks 1-2")
	m.zero(4096, 8192)
	must(t, r.Trim(op, 16384, 4096), "trim block 4")
	m.zero(16384, 4096)
	must(t, r.WriteZeroes(op, 20480+512, 1024), "zero sectors 1-2 of block 5")
	m.zero(20480+512, 1024)
	must(t, r.Trim(op, 24576+3584, 512+4096+512), "trim the last sector of block 6 through the first of block 8")
	m.zero(24576+3584, 512+4096+512)
	sameBytes(t, read(t, r, op, 0, 64<<10), m.data[:64<<10], "head after zeroes")
	sameBytes(t, readSnapAll(t, r, op, "s", size), append(bytes.Clone(data), make([]byte, size-len(data))...), "snapshot after zeroes")

	// A partial write into a masked block: the rest of it stays zero, not
	// the snapshot's data.
	p := randBytes(rng, 512)
	must(t, r.WriteAt(op, p, 4096+1024), "partial write into a zeroed block")
	m.write(p, 4096+1024)
	// And into a block only the snapshot holds: the rest is the
	// snapshot's.
	must(t, r.WriteAt(op, p, 40960+512), "partial write over a snapshot block")
	m.write(p, 40960+512)
	sameBytes(t, read(t, r, op, 0, 64<<10), m.data[:64<<10], "head after partial writes")

	h.Reopen()
	r = h.Replica("r")
	sameBytes(t, readAll(t, r, op), m.data, "head after reopen")
	sameBytes(t, readSnapAll(t, r, op, "s", size)[:len(data)], data, "snapshot after reopen")

	// Deleting the snapshot keeps the masks.
	must(t, r.DeleteSnapshot(op, "s"), "delete snapshot")
	sameBytes(t, readAll(t, r, op), m.data, "head after deleting the snapshot")
	// A large zeroing (beyond MaxIO, no payload) of the whole volume.
	must(t, r.WriteZeroes(op, 0, size), "zero everything")
	sameBytes(t, readAll(t, r, op), make([]byte, size), "after zeroing everything")
}

// testGrow: Grow refuses to shrink, is a no-op at the same size, and the
// new space reads zeroes and takes writes; the size survives a reopen; a
// snapshot keeps the size it was cut at.
func testGrow(t *testing.T, h *Harness) {
	r := h.Create("r", mib)
	rng := rand.New(rand.NewSource(3))
	p := randBytes(rng, 4096)
	must(t, r.WriteAt(op, p, mib-4096), "write the last block")
	must(t, r.CreateSnapshot(op, "small"), "snapshot")
	must(t, r.Grow(op, mib), "Grow to the same size")
	wantErr(t, r.Grow(op, mib-4096), replica.ErrInvalid, "Grow smaller")
	must(t, r.Grow(op, 3*mib), "Grow")
	if r.Size() != 3*mib {
		t.Fatalf("size %d after Grow, want %d", r.Size(), 3*mib)
	}
	sameBytes(t, read(t, r, op, mib, 2*mib), make([]byte, 2*mib), "grown space")
	q := randBytes(rng, 8192)
	must(t, r.WriteAt(op, q, 3*mib-8192), "write at the new end")
	wantErr(t, r.ReadSnapshotAt(op, "small", make([]byte, 4096), mib), replica.ErrInvalid, "snapshot read past its size")

	h.Reopen()
	r = h.Replica("r")
	if r.Size() != 3*mib {
		t.Fatalf("size %d after reopen, want %d", r.Size(), 3*mib)
	}
	sameBytes(t, read(t, r, op, mib-4096, 4096), p, "old last block")
	sameBytes(t, read(t, r, op, 3*mib-8192, 8192), q, "new last blocks")
	snap := make([]byte, 4096)
	must(t, r.ReadSnapshotAt(op, "small", snap, mib-4096), "snapshot read")
	sameBytes(t, snap, p, "snapshot's last block")
}

// testConcurrent: writers of disjoint ranges and readers run in parallel;
// everything reads back.
func testConcurrent(t *testing.T, h *Harness) {
	seed := Seed(t)
	const size, workers = 4 * mib, 4
	r := h.Create("r", size)
	m := &model{data: make([]byte, size)}
	var wg sync.WaitGroup
	errs := make(chan error, workers*2)
	for w := range workers {
		wg.Add(2)
		lo := int64(w) * size / workers
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed + int64(w)))
			for range 150 {
				off, n := randRange(rng, size/workers, 32<<10)
				p := randBytes(rng, int(n))
				if err := r.WriteAt(op, p, lo+off); err != nil {
					errs <- err
					return
				}
				m.write(p, lo+off)
				if rng.Intn(20) == 0 {
					if err := r.Flush(op); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed - int64(w)))
			for range 150 {
				off, n := randRange(rng, size, 32<<10)
				if err := r.ReadAt(op, make([]byte, n), off); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	sameBytes(t, readAll(t, r, op), m.data, "volume after concurrent writes")
}

// testClosed: after Close, requests fail with ErrClosed and nothing
// panics.
func testClosed(t *testing.T, h *Harness) {
	s := h.Store()
	r := h.Create("r", mib)
	must(t, s.Delete("r"), "Delete")
	wantErr(t, r.WriteAt(op, make([]byte, 4096), 0), replica.ErrClosed, "write to a deleted replica")
	r2 := h.Create("r2", mib)
	h.close()
	wantErr(t, r2.ReadAt(op, make([]byte, 4096), 0), replica.ErrClosed, "read after store Close")
	wantErr(t, r2.Fence(5), replica.ErrClosed, "fence after store Close")
	_, err := s.Get("r2")
	wantErr(t, err, replica.ErrClosed, "Get after store Close")
	_, err = s.Create(replica.Spec{ID: "r3", VolumeID: "v", Size: mib})
	wantErr(t, err, replica.ErrClosed, "Create after store Close")
	must(t, r2.Close(), "second Close of a replica")
}
