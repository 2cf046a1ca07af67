package replicatest

import (
	"math/rand"
	"sync"
	"testing"

	"github.com/stor-io/stor/replica"
)

const sector = replica.SectorSize

// testRebuild: RebuildWrite fills what normal writes did not touch since
// BeginRebuild, sector by sector, and nothing else; without a rebuild it
// is refused; after EndRebuild it is refused again.
func testRebuild(t *testing.T, h *Harness) {
	const size = mib
	const bs = replica.BlockSize
	r := h.Create("r", size)
	rng := rand.New(rand.NewSource(7))
	before := randBytes(rng, 4*bs)
	must(t, r.WriteAt(op, before, 0), "write before the rebuild")
	must(t, r.BeginRebuild(op), "BeginRebuild")
	must(t, r.BeginRebuild(op), "BeginRebuild again")

	m := &model{data: make([]byte, size)}
	m.write(before, 0)
	normal := randBytes(rng, bs)
	must(t, r.WriteAt(op, normal, bs), "normal write of block 1")
	m.write(normal, bs)
	must(t, r.WriteAt(op, normal[:sector], 2*bs+sector), "normal write of sector 1 of block 2")
	m.write(normal[:sector], 2*bs+sector)
	must(t, r.WriteZeroes(op, 3*bs, bs), "normal zeroes of block 3")
	m.zero(3*bs, bs)
	must(t, r.Trim(op, 4*bs+2*sector, sector), "normal trim of sector 2 of block 4")
	m.zero(4*bs+2*sector, sector)

	// The rebuild copies blocks 0-5 from a "source".
	src := randBytes(rng, 6*bs)
	must(t, r.RebuildWrite(op, src, 0), "RebuildWrite")
	for s := int64(0); s < 6*bs; s += sector {
		touched := (s >= bs && s < 2*bs) || s == 2*bs+sector || (s >= 3*bs && s < 4*bs) || s == 4*bs+2*sector
		if !touched {
			m.write(src[s:s+sector], s)
		}
	}
	sameBytes(t, read(t, r, op, 0, 6*bs), m.data[:6*bs], "after the rebuild write")

	// A later normal write wins over an earlier rebuild write, and a later
	// rebuild write does not undo it.
	p := randBytes(rng, bs)
	must(t, r.WriteAt(op, p, 0), "normal write of block 0")
	m.write(p, 0)
	must(t, r.RebuildWrite(op, randBytes(rng, bs), 0), "rebuild write of block 0 again")
	sameBytes(t, read(t, r, op, 0, 6*bs), m.data[:6*bs], "after a second rebuild write")

	must(t, r.EndRebuild(op), "EndRebuild")
	must(t, r.EndRebuild(op), "EndRebuild again")
	wantErr(t, r.RebuildWrite(op, p, 0), replica.ErrInvalid, "RebuildWrite after EndRebuild")
	h.Reopen()
	r = h.Replica("r")
	sameBytes(t, readAll(t, r, op), m.data, "after reopen")
}

// testRebuildConcurrent: writers and a rebuilder race over the same
// blocks; at the end every sector a writer wrote holds the writer's last
// data and every other sector holds the rebuilder's.
func testRebuildConcurrent(t *testing.T, h *Harness) {
	seed := Seed(t)
	const size = mib
	const bs = replica.BlockSize
	const writers = 3
	r := h.Create("r", size)
	// Old content that the rebuild must replace wherever writers do not.
	must(t, r.WriteAt(op, randBytes(rand.New(rand.NewSource(seed)), size), 0), "old content")
	must(t, r.BeginRebuild(op), "BeginRebuild")

	src := randBytes(rand.New(rand.NewSource(seed+100)), size)
	expect := &model{data: make([]byte, size)}
	copy(expect.data, src)
	var wg sync.WaitGroup
	errs := make(chan error, writers+1)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed + int64(w) + 1))
			for range 200 {
				// Writer w owns blocks b with b % writers == w.
				b := int64(rng.Intn(size/bs/writers)*writers + w)
				var off, n int64
				switch rng.Intn(3) {
				case 0:
					off, n = b*bs, bs
				default:
					s0 := rng.Int63n(bs / sector)
					off, n = b*bs+s0*sector, (1+rng.Int63n(bs/sector-s0))*sector
				}
				var err error
				if rng.Intn(5) == 0 {
					err = r.WriteZeroes(op, off, n)
					expect.zero(off, n)
				} else {
					p := randBytes(rng, int(n))
					err = r.WriteAt(op, p, off)
					expect.write(p, off)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewSource(seed - 1))
		for off := int64(0); off < size; {
			n := min((1+rng.Int63n(64))*sector, size-off)
			if err := r.RebuildWrite(op, src[off:off+n], off); err != nil {
				errs <- err
				return
			}
			off += n
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	must(t, r.EndRebuild(op), "EndRebuild")
	sameBytes(t, readAll(t, r, op), expect.data, "after a rebuild racing writers")
}
