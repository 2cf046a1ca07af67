package raftstore

import (
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// TestScaleSnapshots measures the state machine with many snapshots
// (issue 16: 50,000 snapshots per cluster). It drives the FSM directly,
// as Raft would, not through the API or the data path: STOR_SCALE_VOLUMES
// volumes of 3 replicas on 3 servers, STOR_SCALE_SNAPSHOTS_PER_VOLUME
// (default 5) snapshots of each, every one cut by all three replicas. It
// reports the time to apply them (per tenth, to show whether a create
// costs more as the state grows), the Go heap and the state file, a Raft
// snapshot (Snapshot, Persist to a file, Restore into another FSM),
// paging through every snapshot as ListSnapshots does with the server's
// default page bounds (each page's response must fit gRPC's 4 MiB), one
// volume's snapshots, and the latency of reading one snapshot by name:
//
//	STOR_SCALE_VOLUMES=10000 go test -run TestScaleSnapshots -v ./raftstore/
func TestScaleSnapshots(t *testing.T) {
	nVol, _ := strconv.Atoi(os.Getenv("STOR_SCALE_VOLUMES"))
	if nVol <= 0 {
		t.Skip("set STOR_SCALE_VOLUMES (e.g. 10000) to run")
	}
	perVol := 5
	if n, _ := strconv.Atoi(os.Getenv("STOR_SCALE_SNAPSHOTS_PER_VOLUME")); n > 0 {
		perVol = n
	}
	const batch = 256 // entries per ApplyBatch, about what Raft hands a busy FSM
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir := t.TempDir()
	f, err := OpenFSM(filepath.Join(dir, "meta.db"), quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	apply := func(cmds []command) {
		for len(cmds) > 0 {
			n := min(batch, len(cmds))
			for i, r := range applyCommands(t, f, cmds[:n]...) {
				if r.err != nil {
					t.Fatalf("%v %s: %v", cmds[i].Op, cmds[i].ID, r.err)
				}
			}
			cmds = cmds[n:]
		}
	}
	apply([]command{cmdInitCluster("scale"),
		cmdRegisterServer("s1", "a", 1<<50, nil), cmdRegisterServer("s2", "b", 1<<50, nil), cmdRegisterServer("s3", "c", 1<<50, nil)})
	start := time.Now()
	var cmds []command
	for i := range nVol {
		cmds = append(cmds, cmdCreateVolume(fmt.Sprintf("vol-%05d", i), fmt.Sprintf("pvc-%05d", i), 16*mib, 3))
	}
	apply(cmds)
	t.Logf("create %d volumes: %v", nVol, time.Since(start).Round(time.Millisecond))

	// Snapshots, each created and then cut on all three replicas, in
	// rounds over the volumes; the time is reported per tenth.
	nSnap := nVol * perVol
	cmds = cmds[:0]
	for k := range perVol {
		for i := range nVol {
			id := fmt.Sprintf("snap-%05d-%d", i, k)
			vol := fmt.Sprintf("vol-%05d", i)
			cmds = append(cmds, cmdCreateSnapshot(id, vol, "name-"+id),
				cmdRecordCut(id, 0, []string{vol + "-r1", vol + "-r2", vol + "-r3"}, nil))
		}
	}
	start = time.Now()
	var tenths []time.Duration
	step := len(cmds) / 10
	for i := 0; i < len(cmds); i += step {
		s := time.Now()
		apply(cmds[i:min(i+step, len(cmds))])
		tenths = append(tenths, time.Since(s).Round(time.Millisecond))
	}
	total := time.Since(start)
	t.Logf("create and cut %d snapshots: %v (%.0f µs per snapshot); per tenth: %v",
		nSnap, total.Round(time.Millisecond), float64(total.Microseconds())/float64(nSnap), tenths)
	cmds = nil

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fi, err := os.Stat(f.path)
	if err != nil {
		t.Fatal(err)
	}
	status, _ := os.ReadFile("/proc/self/status")
	rss := ""
	for _, l := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			rss = strings.Join(strings.Fields(l)[1:], " ")
		}
	}
	t.Logf("Go heap in use: %.1f MiB; process RSS %s (the state file is mapped); state file %.1f MiB",
		float64(ms.HeapAlloc)/mib, rss, float64(fi.Size())/mib)

	// A Raft snapshot: what a leader sends a server that fell behind, and
	// what a restarted server restores.
	start = time.Now()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	tSnap := time.Since(start)
	sinkPath := filepath.Join(dir, "snap.bin")
	sink := &fileSink{path: sinkPath}
	start = time.Now()
	if err := snap.Persist(sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	tPersist := time.Since(start)
	g, err := OpenFSM(filepath.Join(dir, "other.db"), quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	rc, err := os.Open(sinkPath)
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := g.Restore(rc); err != nil {
		t.Fatal(err)
	}
	tRestore := time.Since(start)
	t.Logf("Raft snapshot of %.1f MiB: Snapshot %v, Persist (write+fsync) %v, Restore %v",
		float64(sink.n)/mib, tSnap.Round(time.Millisecond), tPersist.Round(time.Millisecond), tRestore.Round(time.Millisecond))
	if g.AppliedIndex() != f.AppliedIndex() {
		t.Fatalf("restored applied index %d, want %d", g.AppliedIndex(), f.AppliedIndex())
	}

	// ListSnapshots of all of them with the server's default page bounds
	// (internal/server APILimits: 100 a page by default, at most 1000 and
	// 1 MiB), each page encoded as the response to check it fits gRPC's
	// default 4 MiB message limit.
	for _, size := range []int{100, 1000} {
		start = time.Now()
		token, seen, pages, maxBytes := "", 0, 0, 0
		for {
			resp := &storpb.ListSnapshotsResponse{}
			err := g.View(func(r *Reader) error {
				var err error
				resp.Snapshots, resp.NextPageToken, err = r.ListSnapshots("", Page{Token: token, Limit: size, MaxBytes: 1 << 20})
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			b, err := proto.Marshal(resp)
			if err != nil {
				t.Fatal(err)
			}
			maxBytes = max(maxBytes, len(b))
			seen += len(resp.Snapshots)
			pages++
			if token = resp.NextPageToken; token == "" {
				break
			}
		}
		el := time.Since(start)
		if seen != nSnap {
			t.Fatalf("listed %d snapshots, want %d", seen, nSnap)
		}
		if maxBytes >= 4<<20 {
			t.Fatalf("a page of %d snapshots is %d bytes, over gRPC's 4 MiB", size, maxBytes)
		}
		t.Logf("list all %d snapshots, pages of %d: %d pages in %v (%.2f ms a page), largest response %d KiB",
			seen, size, pages, el.Round(time.Millisecond), float64(el.Microseconds())/1000/float64(pages), maxBytes>>10)
	}

	// What every server's data-plane reconcile reads (internal/server,
	// once a second and after every change): every volume and snapshot.
	var full []time.Duration
	for range 5 {
		s := time.Now()
		err := g.View(func(r *Reader) error {
			vols, _, err := r.Volumes("", 0)
			if err != nil || len(vols) != nVol {
				return fmt.Errorf("%d volumes, %v", len(vols), err)
			}
			snaps, _, err := r.Snapshots("", "", 0)
			if err != nil || len(snaps) != nSnap {
				return fmt.Errorf("%d snapshots, %v", len(snaps), err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		full = append(full, time.Since(s))
	}
	slices.Sort(full)
	t.Logf("read every volume and snapshot (a data-plane reconcile's view): median of 5 %v", full[2].Round(time.Millisecond))

	// One volume's snapshots, and one snapshot by name (GetSnapshot), for
	// 1,000 random volumes each.
	rnd := rand.New(rand.NewPCG(1, 2))
	var lat, latList []time.Duration
	for range 1000 {
		i := rnd.IntN(nVol)
		name := fmt.Sprintf("name-snap-%05d-%d", i, rnd.IntN(perVol))
		vol := fmt.Sprintf("vol-%05d", i)
		s := time.Now()
		err := g.View(func(r *Reader) error {
			_, err := r.SnapshotByRef(&storpb.SnapshotRef{Name: name})
			return err
		})
		lat = append(lat, time.Since(s))
		if err != nil {
			t.Fatal(err)
		}
		s = time.Now()
		var got []*storpb.Snapshot
		err = g.View(func(r *Reader) error {
			var err error
			got, _, err = r.ListSnapshots(vol, Page{Limit: 100, MaxBytes: 1 << 20})
			return err
		})
		latList = append(latList, time.Since(s))
		if err != nil || len(got) != perVol {
			t.Fatalf("ListSnapshots(%s): %d, %v; want %d", vol, len(got), err, perVol)
		}
	}
	slices.Sort(lat)
	slices.Sort(latList)
	t.Logf("GetSnapshot by name: median %v, p99 %v; ListSnapshots of one volume: median %v, p99 %v",
		lat[len(lat)/2], lat[len(lat)*99/100], latList[len(latList)/2], latList[len(latList)*99/100])

	// Deleting: the first round's snapshots of 1,000 volumes.
	cmds = cmds[:0]
	for i := range min(nVol, 1000) {
		cmds = append(cmds, cmdDeleteSnapshot(fmt.Sprintf("snap-%05d-0", i)))
	}
	start = time.Now()
	apply(cmds)
	el := time.Since(start)
	t.Logf("delete %d snapshots: %v (%.0f µs per snapshot)", len(cmds), el.Round(time.Millisecond), float64(el.Microseconds())/float64(len(cmds)))
}

// fileSink is a raft.SnapshotSink writing a file, synced on Close.
type fileSink struct {
	path string
	fh   *os.File
	n    int
}

func (s *fileSink) Write(p []byte) (int, error) {
	if s.fh == nil {
		fh, err := os.Create(s.path)
		if err != nil {
			return 0, err
		}
		s.fh = fh
	}
	n, err := s.fh.Write(p)
	s.n += n
	return n, err
}

func (s *fileSink) Close() error {
	if err := s.fh.Sync(); err != nil {
		s.fh.Close()
		return err
	}
	return s.fh.Close()
}

func (s *fileSink) ID() string    { return "file" }
func (s *fileSink) Cancel() error { return s.fh.Close() }

var _ raft.SnapshotSink = (*fileSink)(nil)
