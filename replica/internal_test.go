package replica

import (
	"bytes"
	"errors"
	"math/rand"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func testSeed(t *testing.T) int64 {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	return seed
}

// TestBlockSet checks add, remove, has and nextRun against a map, with
// ranges that cross chunk boundaries.
func TestBlockSet(t *testing.T) {
	rng := rand.New(rand.NewSource(testSeed(t)))
	const universe = 5 * setChunkBits
	var s blockSet
	ref := make([]bool, universe+1)
	members := 0
	for i := range 1500 {
		start := uint64(rng.Intn(universe))
		n := uint64(1 + rng.Intn(3*setChunkBits/2))
		if rng.Intn(8) == 0 {
			n = uint64(1 + rng.Intn(70))
		}
		n = min(n, universe-start)
		add := rng.Intn(3) > 0
		var want bool
		for x := start; x < start+n; x++ {
			if ref[x] != add {
				want = true
				if add {
					members++
				} else {
					members--
				}
			}
			ref[x] = add
		}
		var got bool
		if add {
			got = s.add(start, n)
		} else {
			got = s.remove(start, n)
		}
		if got != want {
			t.Fatalf("op %d (add=%v %d+%d) reported change %v, want %v", i, add, start, n, got, want)
		}
		if s.len() != uint64(members) {
			t.Fatalf("op %d: len %d, want %d", i, s.len(), members)
		}
		if i%100 != 0 {
			continue
		}
		// Full comparison, through has and through runs.
		var fromRuns []uint64
		s.runs(func(a, b uint64) bool {
			if a >= b {
				t.Fatalf("empty run %d-%d", a, b)
			}
			if s.has(a-1) && a > 0 {
				t.Fatalf("run %d-%d is not maximal", a, b)
			}
			for x := a; x < b; x++ {
				fromRuns = append(fromRuns, x)
			}
			return true
		})
		if len(fromRuns) != members {
			t.Fatalf("op %d: runs hold %d members, want %d", i, len(fromRuns), members)
		}
		for _, x := range fromRuns {
			if !ref[x] {
				t.Fatalf("op %d: runs hold %d, which is not a member", i, x)
			}
		}
		for x := range uint64(universe) {
			if s.has(x) != ref[x] {
				t.Fatalf("op %d: has(%d) = %v", i, x, s.has(x))
			}
		}
		// nextRun from inside a run is clipped.
		if from := uint64(rng.Intn(universe)); ref[from] && from+1 < universe {
			a, b, ok := s.nextRun(from)
			if !ok || a != from || !ref[b-1] || ref[b] {
				t.Fatalf("nextRun(%d) = %d, %d, %v", from, a, b, ok)
			}
		}
	}
	if len(s.keys) != len(s.chunks) {
		t.Fatalf("%d keys for %d chunks", len(s.keys), len(s.chunks))
	}
}

func writeTestJournal(t *testing.T, fsys FS, path string, payloads ...string) {
	t.Helper()
	var ps [][]byte
	for _, p := range payloads {
		ps = append(ps, []byte(p))
	}
	if err := writeJournalFile(fsys, path, journalKindIndex, 1, ps); err != nil {
		t.Fatal(err)
	}
}

// TestJournalReplay: a torn tail at any byte is ignored and truncated so
// appends continue after the last good batch; damage followed by a good
// batch is ErrCorrupt, as are a bad header and a seq gap.
func TestJournalReplay(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "j")
	fsys := OS()
	writeTestJournal(t, fsys, path, "one", "two", "three")
	whole, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lastStart := len(whole) - batchHeaderSize - len("three")
	for cut := lastStart; cut < len(whole); cut++ {
		// A tear at cut: the bytes after it are zeroes or missing.
		for _, tail := range [][]byte{nil, make([]byte, len(whole)-cut)} {
			img := append(bytes.Clone(whole[:cut]), tail...)
			if err := os.WriteFile(path, img, 0o644); err != nil {
				t.Fatal(err)
			}
			j, payloads, err := openJournal(fsys, path, journalKindIndex)
			if err != nil {
				t.Fatalf("tear at %d: %v", cut, err)
			}
			if len(payloads) != 2 || string(payloads[1]) != "two" {
				t.Fatalf("tear at %d: payloads %q", cut, payloads)
			}
			if err := j.append([]byte("four")); err != nil {
				t.Fatal(err)
			}
			j.close()
			_, payloads, err = openJournal(fsys, path, journalKindIndex)
			if err != nil || len(payloads) != 3 || string(payloads[2]) != "four" {
				t.Fatalf("tear at %d, then append: %q, %v", cut, payloads, err)
			}
		}
	}

	// Damage in the middle: flip a byte of "two".
	img := bytes.Clone(whole)
	img[journalHeaderSize+batchHeaderSize+len("one")+batchHeaderSize] ^= 0xff
	os.WriteFile(path, img, 0o644)
	if _, _, err := openJournal(fsys, path, journalKindIndex); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("damaged middle batch: %v, want ErrCorrupt", err)
	}
	// Bad header.
	img = bytes.Clone(whole)
	img[3] ^= 1
	os.WriteFile(path, img, 0o644)
	if _, _, err := openJournal(fsys, path, journalKindIndex); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("bad header: %v, want ErrCorrupt", err)
	}
	// A journal of another kind.
	writeJournalFile(fsys, path, journalKindHistory, 1, nil)
	if _, _, err := openJournal(fsys, path, journalKindIndex); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("wrong kind: %v, want ErrCorrupt", err)
	}
	// A seq gap.
	buf := journalHeader(journalKindIndex)
	buf = appendBatch(buf, 1, []byte("a"))
	buf = appendBatch(buf, 3, []byte("b"))
	os.WriteFile(path, buf, 0o644)
	if _, _, err := openJournal(fsys, path, journalKindIndex); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("seq gap: %v, want ErrCorrupt", err)
	}
	// Missing.
	os.Remove(path)
	if _, _, err := openJournal(fsys, path, journalKindIndex); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("missing journal: %v, want ErrCorrupt", err)
	}
}

// TestLayerIndexCompaction: when the journal outgrows the index it is
// rewritten whole, and the reopened index is the same.
func TestLayerIndexCompaction(t *testing.T) {
	dir := t.TempDir()
	fsys := OS()
	l, err := createLayer(fsys, dir, 1)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(testSeed(t)))
	l.compactAt = 50
	var ref blockSet
	compactions := 0
	for round := range 40 {
		for range 10 {
			b, n := uint64(rng.Intn(10000)), uint64(1+rng.Intn(4))
			l.add(b, n)
			ref.add(b, n)
		}
		if err := l.syncLocked(); err != nil {
			t.Fatal(err)
		}
		if l.compactAt != 50 { // a rewrite resets it
			compactions++
		}
		l.compactAt = 50 // keep compacting often
		if round%10 == 9 {
			l.close()
			if l, err = openLayer(fsys, dir, 1, 1<<20); err != nil {
				t.Fatal(err)
			}
			l.compactAt = 50
			var got []uint64
			l.idx.runs(func(a, b uint64) bool { got = append(got, a, b); return true })
			var want []uint64
			ref.runs(func(a, b uint64) bool { want = append(want, a, b); return true })
			if !slicesEqual(got, want) {
				t.Fatalf("round %d: reopened index differs", round)
			}
		}
	}
	if compactions == 0 {
		t.Fatalf("the journal was never compacted")
	}
	l.close()
}

func slicesEqual(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestCheckRange is the validation table of request ranges.
func TestCheckRange(t *testing.T) {
	const size = 4 << 30
	for _, c := range []struct {
		off, n int64
		limit  int64
		ok     bool
	}{
		{0, 0, MaxIO, true},
		{0, MaxZeroes, MaxZeroes, true},
		{size, 0, MaxIO, true},
		{size - 512, 512, MaxIO, true},
		{0, MaxIO, MaxIO, true},
		{size - MaxZeroes, MaxZeroes, MaxZeroes, true},
		{-512, 512, MaxIO, false},
		{0, -512, MaxIO, false},
		{1, 512, MaxIO, false},
		{0, 511, MaxIO, false},
		{size, 512, MaxIO, false},
		{size - 512, 1024, MaxIO, false},
		{512, 1<<63 - 512, MaxZeroes, false},
		{1<<63 - 512, 512, MaxZeroes, false},
		{0, MaxIO + 512, MaxIO, false},
		{0, MaxZeroes + 512, MaxZeroes, false},
		{0, size, MaxZeroes, false},
	} {
		err := checkRange(c.off, c.n, size, c.limit)
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("checkRange(%d, %d, limit %d) = %v, want ok=%v", c.off, c.n, c.limit, err, c.ok)
		}
	}
}

// TestValidName is the table of replica and snapshot ids.
func TestValidName(t *testing.T) {
	for name, ok := range map[string]bool{
		"r1": true, "pvc-0b7e-4c2a_x.y": true, "A": true,
		"": false, ".": false, "..": false, ".x": false, "a/b": false, "a\\b": false, "a b": false,
		"a\x00": false, "ü": false, string(make([]byte, MaxIDLen+1)): false,
	} {
		if err := validName(name); (err == nil) != ok {
			t.Errorf("validName(%q) = %v, want ok=%v", name, err, ok)
		}
	}
}

func TestLayerNameRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		id    string
		epoch uint64
	}{{"0f86385f-15d5-4f23-9b37-a5de854d666a", 0}, {"vol-1-source", 18446744073709551615}, {"a_e1", 7}} {
		name := LayerName(tc.id, tc.epoch)
		if err := validName(name); err != nil {
			t.Errorf("LayerName(%q, %d) = %q is not a valid layer id: %v", tc.id, tc.epoch, name, err)
		}
		id, epoch, ok := ParseLayerName(name)
		if !ok || id != tc.id || epoch != tc.epoch {
			t.Errorf("ParseLayerName(%q) = %q, %d, %v; want %q, %d", name, id, epoch, ok, tc.id, tc.epoch)
		}
	}
	for _, bad := range []string{"nightly", "_e3", "snap_ex", "snap_e"} {
		if _, _, ok := ParseLayerName(bad); ok {
			t.Errorf("ParseLayerName(%q) accepted a name LayerName does not make", bad)
		}
	}
}

// isZero finds a non-zero byte wherever it is: in the first or the last
// byte of any block, or in a tail shorter than a block.
func TestIsZero(t *testing.T) {
	for _, n := range []int{0, 1, SectorSize, BlockSize, 3*BlockSize + SectorSize} {
		p := make([]byte, n)
		if !isZero(p) {
			t.Fatalf("%d zero bytes: not zero", n)
		}
		for _, at := range []int{0, n / 2, n - 1, BlockSize - 1, BlockSize} {
			if at < 0 || at >= n {
				continue
			}
			p[at] = 1
			if isZero(p) {
				t.Fatalf("%d bytes with byte %d set: zero", n, at)
			}
			p[at] = 0
		}
	}
}

// BenchmarkIsZero: a block of data (the rebuild's case) and a zero block.
func BenchmarkIsZero(b *testing.B) {
	for _, tc := range []struct {
		name string
		fill byte
	}{{"data", 0x5a}, {"zero", 0}} {
		b.Run(tc.name, func(b *testing.B) {
			p := bytes.Repeat([]byte{tc.fill}, BlockSize)
			b.SetBytes(BlockSize)
			for b.Loop() {
				if isZero(p) != (tc.fill == 0) {
					b.Fatal("wrong answer")
				}
			}
		})
	}
}
