package replica_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"maps"
	"testing"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/errorfs"
	"github.com/stor-io/stor/replica/replicatest"
)

// readGen reads the counter a short-circuit reader compares.
// noRevoke is the revoke of a view these tests end by hand: they check
// the read generation, not a connection.
func noRevoke() {}

func readGen(t *testing.T, d *replica.DirectFiles) uint64 {
	t.Helper()
	var b [8]byte
	if _, err := d.Gen.ReadAt(b[:], 0); err != nil {
		t.Fatalf("read readgen: %v", err)
	}
	return binary.NativeEndian.Uint64(b[:])
}

// TestOpenDirect: the head's data file read directly holds what was
// written (and zeroes where nothing was), and every change that must end
// a short-circuit read advances the counter before OpenDirect is allowed
// again; snapshots, rebuilds and old epochs are refused.
func TestOpenDirect(t *testing.T) {
	dir := t.TempDir()
	cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 3, Generation: 1}
	data := bytes.Repeat([]byte{0xa5}, 8192)
	if err := r.WriteAt(o, data, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := r.OpenDirect(replica.Op{Epoch: 2}, noRevoke); !errors.Is(err, replica.ErrStaleEpoch) {
		t.Fatalf("OpenDirect at an old epoch: %v, want ErrStaleEpoch", err)
	}
	if _, err := r.OpenDirect(o, nil); !errors.Is(err, replica.ErrInvalid) {
		t.Fatalf("OpenDirect without a revoke: %v, want ErrInvalid", err)
	}
	d, err := r.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if got := readGen(t, d); got != d.Generation {
		t.Fatalf("readgen %d, OpenDirect said %d", got, d.Generation)
	}
	got := make([]byte, 16384)
	readData := func(d *replica.DirectFiles) {
		t.Helper()
		clear(got)
		// Past the end of the sparse file the volume reads as zeroes.
		if _, err := d.Layers[len(d.Layers)-1].ReadAt(got, 0); err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("read the data file: %v", err)
		}
	}
	readData(d)
	want := make([]byte, 16384)
	copy(want[4096:], data)
	if !bytes.Equal(got, want) {
		t.Fatal("the data file does not hold what was written (zeroes around it)")
	}
	// The engine's own writes do not invalidate.
	if err := r.WriteAt(o, data[:4096], 0); err != nil {
		t.Fatal(err)
	}
	if g := readGen(t, d); g != d.Generation {
		t.Fatalf("a write advanced readgen to %d", g)
	}

	last := d.Generation
	advanced := func(what string) {
		t.Helper()
		g := readGen(t, d)
		if g <= last {
			t.Fatalf("%s: readgen %d, not past %d", what, g, last)
		}
		last = g
	}
	o.Epoch = 4
	if err := r.Fence(o.Epoch); err != nil {
		t.Fatal(err)
	}
	advanced("epoch raised")
	if err := r.Fence(o.Epoch); err != nil {
		t.Fatal(err)
	}
	if g := readGen(t, d); g != last {
		t.Fatalf("fencing at the same epoch advanced readgen to %d", g)
	}
	if err := r.Grow(o, 2<<20); err != nil {
		t.Fatal(err)
	}
	advanced("grown")
	if err := r.BeginRebuild(o); err != nil {
		t.Fatal(err)
	}
	advanced("rebuild begun")
	if _, err := r.OpenDirect(o, noRevoke); !errors.Is(err, replica.ErrNotDirect) {
		t.Fatalf("OpenDirect during a rebuild: %v, want ErrNotDirect", err)
	}
	if err := r.EndRebuild(o); err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(o, "s1"); err != nil {
		t.Fatal(err)
	}
	advanced("snapshot cut")
	ds, err := r.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatalf("OpenDirect with a snapshot layer: %v", err)
	}
	// Two layers: the snapshot's holds blocks 0-3, the new head nothing.
	if len(ds.Layers) != 2 || len(ds.Index) != 2 || len(ds.Index[1]) != 0 ||
		len(ds.Index[0]) != 1 || ds.Index[0][0] != [2]uint64{0, 3} {
		t.Fatalf("OpenDirect with a snapshot layer: %d layers, indexes %v; want the snapshot's [0, 3) and an empty head", len(ds.Layers), ds.Index)
	}
	ds.Close()
	if err := r.DeleteSnapshot(o, "s1"); err != nil {
		t.Fatal(err)
	}
	advanced("snapshot layer dropped")
	d2, err := r.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatalf("OpenDirect after the snapshot was merged: %v", err)
	}
	if d2.Generation != last {
		t.Fatalf("OpenDirect says %d, readgen %d", d2.Generation, last)
	}
	readData(d2)
	copy(want, data[:4096])
	if !bytes.Equal(got, want) {
		t.Fatal("after the merge the head's data file does not hold the volume")
	}
	d2.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	advanced("closed")
	s = openStore(t, cfg)
	defer s.Close()
	advanced("opened by a new store")
}

// TestDirectInvalidationFailureStopsTheChange: when the counter cannot be
// advanced, the change it announces is not made, and every view still
// open is ended by the revoke it was opened with (once; not one whose
// opener said it was done).
func TestDirectInvalidationFailureStopsTheChange(t *testing.T) {
	dir := t.TempDir()
	efs := errorfs.New(replica.OS(), 1)
	s := openStore(t, replica.Config{Dir: dir, FS: efs, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
	defer s.Close()
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(1); err != nil {
		t.Fatal(err)
	}
	revoked := map[string]int{}
	open := func(name string) *replica.DirectFiles {
		d, err := r.OpenDirect(replica.Op{Epoch: 1}, func() { revoked[name]++ })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	open("open")
	open("ended").Done()
	efs.Add(errorfs.Rule{Path: "readgen", Ops: errorfs.OpWrite})
	for range 2 {
		if err := r.Fence(2); err == nil {
			t.Fatal("the epoch was raised although readgen could not be advanced")
		}
	}
	if r.Epoch() != 1 {
		t.Fatalf("epoch %d after the failed raise, want 1", r.Epoch())
	}
	if want := map[string]int{"open": 1}; !maps.Equal(revoked, want) {
		t.Fatalf("views revoked %v, want %v", revoked, want)
	}
}

// TestOpenDirectAfterACrash: a write that reached the head's file but not
// its index (the index is made durable only at a flush) reads as zeroes
// through the server after a crash; a direct read must see the same, so
// opening the replica punches such blocks out of the file.
func TestOpenDirectAfterACrash(t *testing.T) {
	dir := t.TempDir()
	cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1}
	if err := r.WriteAt(o, bytes.Repeat([]byte{0xa5}, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(o); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteAt(o, bytes.Repeat([]byte{0x5a}, 8192), 65536); err != nil {
		t.Fatal(err)
	}
	// The process dies: the store is abandoned without Close (the page
	// cache keeps the data; the index's new record was never written).
	s2 := openStore(t, cfg)
	defer s2.Close()
	r2, err := s2.Get("r1")
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 1<<17)
	if err := r2.ReadAt(o, want, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(want[:4096], bytes.Repeat([]byte{0xa5}, 4096)) {
		t.Fatal("the flushed write is gone")
	}
	d, err := r2.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got := make([]byte, len(want))
	if _, err := d.Layers[len(d.Layers)-1].ReadAt(got, 0); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the data file holds what the server does not read (block 16: %x..., server: %x...)", got[65536:65540], want[65536:65540])
	}
}

// TestOpenDirectNeverRaisesTheEpoch: only the data protocol, which the
// server authorises, may raise a replica's epoch; a direct open at a
// higher epoch is refused and changes nothing.
func TestOpenDirectNeverRaisesTheEpoch(t *testing.T) {
	s := openStore(t, replica.Config{Dir: t.TempDir(), Logger: replicatest.Logger(t), RegionSize: testRegionSize})
	defer s.Close()
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Fence(3); err != nil {
		t.Fatal(err)
	}
	if _, err := r.OpenDirect(replica.Op{Epoch: 1 << 62}, noRevoke); !errors.Is(err, replica.ErrNotDirect) {
		t.Fatalf("OpenDirect at a higher epoch: %v, want ErrNotDirect", err)
	}
	if e := r.Epoch(); e != 3 {
		t.Fatalf("epoch %d after a direct open at a higher one, want 3", e)
	}
}

// TestFailedReplicaEndsDirectReads: a replica that fails (here: a failed
// flush) advances the read generation, so a view opened before reads
// through the server from then on, and refuses new views.
func TestFailedReplicaEndsDirectReads(t *testing.T) {
	efs := errorfs.New(replica.OS(), 1)
	s := openStore(t, replica.Config{Dir: t.TempDir(), FS: efs, Logger: replicatest.Logger(t), RegionSize: testRegionSize})
	defer s.Close()
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 1}
	if err := r.WriteAt(o, make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	d, err := r.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	efs.Add(errorfs.Rule{Path: ".data", Ops: errorfs.OpSync})
	if err := r.Flush(o); err == nil {
		t.Fatal("the flush did not fail")
	}
	if g := readGen(t, d); g == d.Generation {
		t.Fatal("the replica failed but readgen did not move")
	}
	if _, err := r.OpenDirect(o, noRevoke); err == nil {
		t.Fatal("a failed replica opened for direct reads")
	}
}

// TestOpenDirectAfterARestartWithSnapshots: OpenDirect of a replica whose
// snapshot layers OpenStore left unread loads them first, so the index it
// hands out names the blocks each snapshot layer holds (an empty one
// would send a reader to zeroes, or to the wrong layer).
func TestOpenDirectAfterARestartWithSnapshots(t *testing.T) {
	dir := t.TempDir()
	cfg := replica.Config{Dir: dir, Logger: replicatest.Logger(t), RegionSize: testRegionSize}
	s := openStore(t, cfg)
	r, err := s.Create(replica.Spec{ID: "r1", VolumeID: "v1", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	o := replica.Op{Epoch: 3, Generation: 1}
	if err := r.WriteAt(o, pattern(1), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.CreateSnapshot(o, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteAt(o, pattern(2), 2*replica.BlockSize); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = openStore(t, cfg)
	defer s.Close()
	r = get(t, s, "r1")
	d, err := r.OpenDirect(o, noRevoke)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	want := [][][2]uint64{{{0, 1}}, {{2, 3}}}
	if len(d.Index) != len(want) {
		t.Fatalf("index of %d layers, want %d", len(d.Index), len(want))
	}
	for i := range want {
		if len(d.Index[i]) != 1 || d.Index[i][0] != want[i][0] {
			t.Errorf("layer %d's index %v, want %v", i, d.Index[i], want[i])
		}
	}
	got := make([]byte, replica.BlockSize)
	if _, err := d.Layers[0].ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(1)) {
		t.Errorf("the snapshot layer's data file holds %x... at block 0", got[:4])
	}
}
