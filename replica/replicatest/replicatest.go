// Package replicatest is the conformance suite of replica stores: the
// behaviour the data path relies on, checked the way a user would (bytes
// read back, errors.Is on the sentinels, nothing acknowledged lost).
//
// Run it from a store implementation's tests:
//
//	func TestConformance(t *testing.T) {
//		replicatest.Run(t, func(t *testing.T) replicatest.Env { ... })
//	}
//
// Randomised tests log their seed; set STOR_SEED=<seed> to replay one.
package replicatest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// Env is the persistent state one test runs against.
type Env struct {
	// Open opens the store. Called again after the store was closed, or
	// after Crash, it must see what the previous store left.
	Open func(t *testing.T) *replica.Store
	// Crash models a crash of the machine: every store opened so far is
	// abandoned without Close (the suite never touches it again), and the
	// persistent state becomes what the crash leaves. With LosesUnsynced
	// false it may be a no-op (the process died, the page cache survived).
	Crash func(t *testing.T, seed int64)
	// LosesUnsynced reports that Crash drops data that was never synced,
	// which enables the durability tests that need real loss.
	LosesUnsynced bool
}

// Run runs the suite; newEnv makes a fresh, empty Env for each test.
func Run(t *testing.T, newEnv func(t *testing.T) Env) {
	tests := []struct {
		name string
		fn   func(t *testing.T, h *Harness)
	}{
		{"Store", testStore},
		{"ReadYourWrites", testReadYourWrites},
		{"Validation", testValidation},
		{"Fencing", testFencing},
		{"FencingConcurrent", testFencingConcurrent},
		{"ZeroesMask", testZeroesMask},
		{"Grow", testGrow},
		{"Snapshots", testSnapshots},
		{"SnapshotModel", testSnapshotModel},
		{"SnapshotDeleteConcurrent", testSnapshotDeleteConcurrent},
		{"Extents", testExtents},
		{"Rebuild", testRebuild},
		{"RebuildConcurrent", testRebuildConcurrent},
		{"Concurrent", testConcurrent},
		{"DirtyRegions", testDirtyRegions},
		{"WriteHistory", testWriteHistory},
		{"CrashDurability", testCrashDurability},
		{"CrashMetadata", testCrashMetadata},
		{"Closed", testClosed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := &Harness{t: t, env: newEnv(t)}
			t.Cleanup(h.close)
			tc.fn(t, h)
		})
	}
}

// Harness holds the store a test works on.
type Harness struct {
	t     *testing.T
	env   Env
	store *replica.Store
}

// Store returns the open store, opening it if needed.
func (h *Harness) Store() *replica.Store {
	if h.store == nil {
		h.store = h.env.Open(h.t)
	}
	return h.store
}

func (h *Harness) close() {
	if h.store != nil {
		if err := h.store.Close(); err != nil {
			h.t.Errorf("closing store: %v", err)
		}
		h.store = nil
	}
}

// Reopen closes the store cleanly and opens it again.
func (h *Harness) Reopen() *replica.Store {
	h.t.Helper()
	if h.store != nil {
		if err := h.store.Close(); err != nil {
			h.t.Fatalf("closing store: %v", err)
		}
		h.store = nil
	}
	return h.Store()
}

// Crash abandons the store without closing it, crashes the environment
// and opens the store again.
func (h *Harness) Crash(seed int64) *replica.Store {
	h.t.Helper()
	h.store = nil
	h.env.Crash(h.t, seed)
	return h.Store()
}

// Replica returns replica id of the open store.
func (h *Harness) Replica(id string) *replica.Replica {
	h.t.Helper()
	r, err := h.Store().Get(id)
	if err != nil {
		h.t.Fatalf("Get(%s): %v", id, err)
	}
	return r
}

// Create creates a replica of size bytes.
func (h *Harness) Create(id string, size uint64) *replica.Replica {
	h.t.Helper()
	r, err := h.Store().Create(replica.Spec{ID: id, VolumeID: "vol-" + id, Size: size})
	if err != nil {
		h.t.Fatalf("Create(%s, %d): %v", id, size, err)
	}
	return r
}

// Seed returns the seed of a randomised test, logging it (STOR_SEED
// overrides).
func Seed(t testing.TB) int64 {
	t.Helper()
	seed := time.Now().UnixNano()
	if s := os.Getenv("STOR_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("STOR_SEED: %v", err)
		}
		seed = v
	}
	t.Logf("seed %d (replay with STOR_SEED=%d)", seed, seed)
	return seed
}

// Logger returns a logger that writes to t.Log.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

var _ io.Writer = logWriter{}

// op is the Op the suite uses unless a test says otherwise.
var op = replica.Op{Epoch: 1, Generation: 1}

func must(t testing.TB, err error, what string, args ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", fmt.Sprintf(what, args...), err)
	}
}

func wantErr(t testing.TB, err, want error, what string, args ...any) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: got error %v, want %v", fmt.Sprintf(what, args...), err, want)
	}
}

// randBytes returns n bytes that are never a whole zero block.
func randBytes(rng *rand.Rand, n int) []byte {
	p := make([]byte, n)
	rng.Read(p)
	for i := 0; i < n; i += replica.SectorSize {
		p[i] |= 1
	}
	return p
}

func read(t testing.TB, r *replica.Replica, o replica.Op, off, n int64) []byte {
	t.Helper()
	p := make([]byte, n)
	must(t, r.ReadAt(o, p, off), "ReadAt(%d, %d)", off, n)
	return p
}

func readAll(t testing.TB, r *replica.Replica, o replica.Op) []byte {
	t.Helper()
	size := int64(r.Size())
	out := make([]byte, 0, size)
	for off := int64(0); off < size; off += replica.MaxIO {
		out = append(out, read(t, r, o, off, min(replica.MaxIO, size-off))...)
	}
	return out
}

func readSnapAll(t testing.TB, r *replica.Replica, o replica.Op, id string, size int64) []byte {
	t.Helper()
	out := make([]byte, 0, size)
	for off := int64(0); off < size; off += replica.MaxIO {
		p := make([]byte, min(replica.MaxIO, size-off))
		must(t, r.ReadSnapshotAt(o, id, p, off), "ReadSnapshotAt(%s, %d)", id, off)
		out = append(out, p...)
	}
	return out
}

// sameBytes fails with the first differing block.
func sameBytes(t testing.TB, got, want []byte, what string, args ...any) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	if len(got) != len(want) {
		t.Fatalf("%s: read %d bytes, want %d", fmt.Sprintf(what, args...), len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			b := i / replica.BlockSize
			t.Fatalf("%s: first difference at byte %d (block %d): got %x..., want %x...",
				fmt.Sprintf(what, args...), i, b, got[i:min(i+8, len(got))], want[i:min(i+8, len(want))])
		}
	}
}

// checkExtents checks the form of an extent list: ordered, coalesced
// (neither overlapping nor adjacent), non-empty, inside [from, size).
func checkExtents(t testing.TB, exts []replica.Extent, from, size int64) {
	t.Helper()
	prevEnd := int64(-1)
	for i, e := range exts {
		if e.Len <= 0 || e.Off < from || e.Off+e.Len > size || e.Off <= prevEnd {
			t.Fatalf("extent %d %+v is malformed (from %d, size %d, previous end %d): %+v", i, e, from, size, prevEnd, exts)
		}
		prevEnd = e.Off + e.Len
	}
}

func covered(exts []replica.Extent, off, n int64) bool {
	for _, e := range exts {
		if e.Off <= off && off+n <= e.Off+e.Len {
			return true
		}
	}
	return false
}

// model is the expected content of a volume.
type model struct {
	mu   sync.Mutex
	data []byte
}

func (m *model) write(p []byte, off int64) {
	m.mu.Lock()
	copy(m.data[off:], p)
	m.mu.Unlock()
}

func (m *model) zero(off, n int64) {
	m.mu.Lock()
	clear(m.data[off : off+n])
	m.mu.Unlock()
}

func (m *model) snapshot() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return bytes.Clone(m.data)
}

// randRange returns a sector-aligned range of at most maxLen bytes inside
// size; biased to sometimes be block aligned.
func randRange(rng *rand.Rand, size, maxLen int64) (off, n int64) {
	sectors := size / replica.SectorSize
	off = rng.Int63n(sectors) * replica.SectorSize
	n = (1 + rng.Int63n(maxLen/replica.SectorSize)) * replica.SectorSize
	if rng.Intn(2) == 0 {
		off = off / replica.BlockSize * replica.BlockSize
		n = (n + replica.BlockSize - 1) / replica.BlockSize * replica.BlockSize
	}
	n = min(n, size-off)
	return off, n
}
