package csi

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// fakeListings is a cluster's volume and snapshot records, listed over
// gRPC on loopback as the stor API lists them: in id order, at most 1,000
// a page (100 if page_size is 0), with a page token that resumes after
// the page's last id. The token is not the stor cluster's own format: the
// controller must treat it as opaque. It counts the list calls it answers
// and the records they return. With cut set, every page is cut short
// at a random size (1 to the size asked), as the cluster's byte bound
// would.
type fakeListings struct {
	mu      sync.Mutex
	vols    []*storpb.Volume   // sorted by id
	snaps   []*storpb.Snapshot // sorted by id
	cut     *rand.Rand
	calls   int
	records int
}

func (f *fakeListings) counts() (calls, records int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls, f.records
}

// deleteSnapshot removes a snapshot, as a DeleteSnapshot between two
// list calls would.
func (f *fakeListings) deleteSnapshot(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snaps = slices.DeleteFunc(f.snaps, func(s *storpb.Snapshot) bool { return s.GetId() == id })
}

const fakeTokenPrefix = "after/"

// fakePage is one page of all, sorted by id, of the records keep takes;
// f.mu is held.
func fakePage[T interface{ GetId() string }](f *fakeListings, all []T, keep func(T) bool, token string, size uint32) ([]T, string, error) {
	start := 0
	if token != "" {
		after, ok := strings.CutPrefix(token, fakeTokenPrefix)
		if !ok {
			return nil, "", status.Errorf(codes.InvalidArgument, "page token %q was not issued by this cluster", token)
		}
		start = sort.Search(len(all), func(i int) bool { return all[i].GetId() > after })
	}
	limit := int(size)
	if limit == 0 {
		limit = 100
	}
	limit = min(limit, 1000)
	if f.cut != nil {
		limit = 1 + f.cut.IntN(limit)
	}
	var out []T
	next := ""
	for _, r := range all[start:] {
		if !keep(r) {
			continue
		}
		if len(out) == limit {
			next = fakeTokenPrefix + out[len(out)-1].GetId()
			break
		}
		out = append(out, r)
	}
	f.calls++
	f.records += len(out)
	return out, next, nil
}

type fakeVolumeService struct {
	storpb.UnimplementedVolumeServiceServer
	f *fakeListings
}

func (s fakeVolumeService) ListVolumes(_ context.Context, req *storpb.ListVolumesRequest) (*storpb.ListVolumesResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	vols, next, err := fakePage(s.f, s.f.vols, func(*storpb.Volume) bool { return true }, req.GetPageToken(), req.GetPageSize())
	return &storpb.ListVolumesResponse{Volumes: vols, NextPageToken: next}, err
}

type fakeSnapshotService struct {
	storpb.UnimplementedSnapshotServiceServer
	f *fakeListings
}

func (s fakeSnapshotService) ListSnapshots(_ context.Context, req *storpb.ListSnapshotsRequest) (*storpb.ListSnapshotsResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	keep := func(sn *storpb.Snapshot) bool {
		return req.GetVolumeId() == "" || sn.GetVolumeId() == req.GetVolumeId()
	}
	snaps, next, err := fakePage(s.f, s.f.snaps, keep, req.GetPageToken(), req.GetPageSize())
	return &storpb.ListSnapshotsResponse{Snapshots: snaps, NextPageToken: next}, err
}

func (s fakeSnapshotService) GetSnapshot(_ context.Context, req *storpb.GetSnapshotRequest) (*storpb.GetSnapshotResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	for _, sn := range s.f.snaps {
		if sn.Id == req.GetSnapshot().GetId() {
			return &storpb.GetSnapshotResponse{Snapshot: sn}, nil
		}
	}
	return nil, status.Error(codes.NotFound, "no snapshot")
}

// fakeID is a random id shaped like the cluster's (a UUID).
func fakeID(r *rand.Rand) string {
	return fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", r.Uint32(), r.Uint32()&0xffff, r.Uint32()&0xfff, r.Uint32()&0xfff, r.Uint64()&(1<<48-1))
}

// newFakeListingController serves vols volumes (every tenth with a
// faulty replica) and snaps snapshots of them from a fakeListings, and
// returns a controller that lists them.
func newFakeListingController(t testing.TB, vols, snaps int) (*controllerServer, *fakeListings) {
	t.Helper()
	r := rand.New(rand.NewPCG(16, uint64(vols+snaps)))
	f := &fakeListings{}
	servers := []string{"server-1", "server-2", "server-3"}
	for i := range vols {
		v := &storpb.Volume{Id: fakeID(r), Name: fmt.Sprintf("pvc-%d", i), SizeBytes: 16 << 20, State: storpb.VolumeState_VOLUME_STATE_AVAILABLE}
		for j, s := range servers {
			st := storpb.ReplicaState_REPLICA_STATE_HEALTHY
			if i%10 == 0 && j == 0 {
				st = storpb.ReplicaState_REPLICA_STATE_FAULTY
			}
			v.Replicas = append(v.Replicas, &storpb.Replica{Id: fakeID(r), ServerId: s, State: st, Generation: 1})
		}
		f.vols = append(f.vols, v)
	}
	for i := range snaps {
		v := f.vols[i%vols]
		s := &storpb.Snapshot{
			Id: fakeID(r), Name: fmt.Sprintf("snapshot-%d", i), VolumeId: v.Id, SizeBytes: v.SizeBytes,
			CreatedUnixNano: time.Date(2026, 11, 24, 0, 0, i, 0, time.UTC).UnixNano(), ReadyToUse: true, CutEpoch: 1,
		}
		for _, rep := range v.Replicas {
			s.Replicas = append(s.Replicas, &storpb.SnapshotReplica{ReplicaId: rep.Id, ServerId: rep.ServerId, State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT})
		}
		f.snaps = append(f.snaps, s)
	}
	slices.SortFunc(f.vols, func(a, b *storpb.Volume) int { return strings.Compare(a.Id, b.Id) })
	slices.SortFunc(f.snaps, func(a, b *storpb.Snapshot) int { return strings.Compare(a.Id, b.Id) })
	return serveListings(t, f), f
}

// serveListings serves f over gRPC on loopback and returns a controller
// that lists from it.
func serveListings(t testing.TB, f *fakeListings) *controllerServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	storpb.RegisterVolumeServiceServer(srv, fakeVolumeService{f: f})
	storpb.RegisterSnapshotServiceServer(srv, fakeSnapshotService{f: f})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	d, err := New(Config{Mode: ModeController, Logger: testLogger(t), Cluster: Cluster{
		Cluster: storpb.NewClusterServiceClient(conn), Volumes: storpb.NewVolumeServiceClient(conn), Snapshots: storpb.NewSnapshotServiceClient(conn),
	}})
	if err != nil {
		t.Fatal(err)
	}
	return &controllerServer{d: d}
}

// envInt is the environment variable name as an int, or def if unset.
func envInt(t testing.TB, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive count", name, s)
	}
	return n
}

// pageAll follows a CSI listing's next_token from the first page, each
// page asked for max entries, and returns the ids listed and the pages.
// after, if set, runs after each page with the ids it listed.
func pageAll(t *testing.T, what string, max, total int, list func(token string) ([]string, string, error), after func([]string)) (ids []string, pages int) {
	t.Helper()
	token := ""
	for ; pages == 0 || token != ""; pages++ {
		if pages > total/max+1 {
			t.Fatalf("%s: no last page after %d pages", what, pages)
		}
		got, next, err := list(token)
		if err != nil {
			t.Fatalf("%s page %d: %v", what, pages, err)
		}
		if len(got) > max {
			t.Fatalf("%s page %d: %d entries, more than max_entries %d", what, pages, len(got), max)
		}
		if next != "" && len(got) < max {
			t.Fatalf("%s page %d: %d entries of %d and a next token", what, pages, len(got), max)
		}
		ids = append(ids, got...)
		if after != nil {
			after(got)
		}
		token = next
	}
	return ids, pages
}

// checkListed fails unless got is want: every id once, in id order.
func checkListed(t *testing.T, what string, got, want []string) {
	t.Helper()
	if slices.Equal(got, want) {
		return
	}
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			t.Fatalf("%s listed %d ids; entry %d is %q, want %q", what, len(got), i, got[i], want[i])
		}
	}
	t.Fatalf("%s listed %d ids, want %d", what, len(got), len(want))
}

// TestListPagesReadTheClusterOnce: a CO paging through 2,000 snapshots
// (and 2,000 volumes, and their 200 unhealthy ones) 10 at a time gets
// each once, in id order, and the controller reads each cluster record
// about once over the whole paging: about one cluster list call a CSI
// page. It read the whole cluster listing (4 calls of 500) for every CSI
// page, so paging through 50,000 snapshots 100 at a time read 25 million
// records (issue 16). STOR_SCALE_SNAPSHOTS and STOR_SCALE_PAGE set the
// snapshot count and the page size, for a timing (docs/BENCHMARKS.md).
func TestListPagesReadTheClusterOnce(t *testing.T) {
	snaps := envInt(t, "STOR_SCALE_SNAPSHOTS", 2000)
	max := envInt(t, "STOR_SCALE_PAGE", 10)
	vols := min(snaps, 2000)
	ctrl, f := newFakeListingController(t, vols, snaps)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	var want []string
	for _, s := range f.snaps {
		want = append(want, s.Id)
	}
	start := time.Now()
	got, pages := pageAll(t, "ListSnapshots", max, snaps, func(token string) ([]string, string, error) {
		resp, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{MaxEntries: int32(max), StartingToken: token})
		var ids []string
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetSnapshot().GetSnapshotId())
		}
		return ids, resp.GetNextToken(), err
	}, nil)
	took := time.Since(start)
	checkListed(t, "ListSnapshots", got, want)
	calls, records := f.counts()
	t.Logf("ListSnapshots: %d snapshots in %d pages of %d: %v, %d cluster calls, %d records read", snaps, pages, max, took, calls, records)
	if calls > pages+2 || records > snaps+max {
		t.Errorf("ListSnapshots: %d pages made %d cluster list calls reading %d records; want at most %d calls and %d records",
			pages, calls, records, pages+2, snaps+max)
	}

	want = want[:0]
	var bad []string
	for i, v := range f.vols {
		want = append(want, v.Id)
		if len(health(f.vols[i]).GetHealthStatuses()) > 0 {
			bad = append(bad, v.Id)
		}
	}
	calls0, records0 := f.counts()
	got, pages = pageAll(t, "ListVolumes", max, vols, func(token string) ([]string, string, error) {
		resp, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: int32(max), StartingToken: token})
		var ids []string
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetVolume().GetVolumeId())
		}
		return ids, resp.GetNextToken(), err
	}, nil)
	checkListed(t, "ListVolumes", got, want)
	calls, records = f.counts()
	calls, records = calls-calls0, records-records0
	t.Logf("ListVolumes: %d volumes in %d pages of %d: %d cluster calls, %d records read", vols, pages, max, calls, records)
	if calls > pages+2 || records > vols+max {
		t.Errorf("ListVolumes: %d pages made %d cluster list calls reading %d records; want at most %d calls and %d records",
			pages, calls, records, pages+2, vols+max)
	}

	// The unhealthy volumes are one in ten: a page reads on until it has
	// max of them, and reads again at most the cluster page (500) where
	// the previous one ended.
	calls0, records0 = f.counts()
	got, pages = pageAll(t, "ControllerListVolumeHealth", max, len(bad), func(token string) ([]string, string, error) {
		resp, err := ctrl.ControllerListVolumeHealth(ctx, &csipb.ControllerListVolumeHealthRequest{MaxEntries: int32(max), StartingToken: token})
		var ids []string
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetVolumeId())
		}
		return ids, resp.GetNextToken(), err
	}, nil)
	checkListed(t, "ControllerListVolumeHealth", got, bad)
	calls, records = f.counts()
	calls, records = calls-calls0, records-records0
	t.Logf("ControllerListVolumeHealth: %d of %d volumes in %d pages of %d: %d cluster calls, %d records read", len(bad), vols, pages, max, calls, records)
	if lim := vols + 500*pages; records > lim {
		t.Errorf("ControllerListVolumeHealth: %d pages read %d records; want at most %d", pages, records, lim)
	}
}

// TestListSnapshotsOverDeletes: snapshots deleted between two pages move
// no other: a CO that deletes every snapshot a page listed, and the next
// one not yet listed, still gets every other snapshot once, in order.
// With offsets for tokens, each delete of a listed snapshot moved the
// next page past one never listed.
func TestListSnapshotsOverDeletes(t *testing.T) {
	const snaps, max = 60, 4
	ctrl, f := newFakeListingController(t, 6, snaps)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	all := make([]string, 0, snaps)
	for _, s := range f.snaps {
		all = append(all, s.Id)
	}
	deleted := map[string]bool{}
	got, _ := pageAll(t, "ListSnapshots", max, snaps, func(token string) ([]string, string, error) {
		resp, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{MaxEntries: max, StartingToken: token})
		var ids []string
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetSnapshot().GetSnapshotId())
		}
		return ids, resp.GetNextToken(), err
	}, func(listed []string) {
		for _, id := range listed {
			f.deleteSnapshot(id)
		}
		if len(listed) == 0 {
			return
		}
		if i := slices.Index(all, listed[len(listed)-1]); i+1 < len(all) {
			f.deleteSnapshot(all[i+1])
			deleted[all[i+1]] = true
		}
	})
	var want []string
	for _, id := range all {
		if !deleted[id] {
			want = append(want, id)
		}
	}
	checkListed(t, "ListSnapshots", got, want)
}

// A starting token this driver did not give, or gave for another
// listing, is ABORTED (the spec's code, csi-sanity's expectation).
func TestListTokensRefused(t *testing.T) {
	ctrl, _ := newFakeListingController(t, 10, 10)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vols, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: 2})
	if err != nil || vols.GetNextToken() == "" {
		t.Fatalf("ListVolumes: %v, %v; want a next token", vols, err)
	}
	snaps, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{MaxEntries: 2})
	if err != nil || snaps.GetNextToken() == "" {
		t.Fatalf("ListSnapshots: %v, %v; want a next token", snaps, err)
	}
	for _, tok := range []string{"invalid-token", "2", "-1", "99"} {
		_, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{StartingToken: tok})
		if status.Code(toStatus(err)) != codes.Aborted {
			t.Errorf("ListVolumes from token %q: %v, want Aborted", tok, err)
		}
		_, err = ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: tok})
		if status.Code(toStatus(err)) != codes.Aborted {
			t.Errorf("ListSnapshots from token %q: %v, want Aborted", tok, err)
		}
		_, err = ctrl.ControllerListVolumeHealth(ctx, &csipb.ControllerListVolumeHealthRequest{StartingToken: tok})
		if status.Code(toStatus(err)) != codes.Aborted {
			t.Errorf("ControllerListVolumeHealth from token %q: %v, want Aborted", tok, err)
		}
	}
	if _, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: vols.GetNextToken()}); status.Code(toStatus(err)) != codes.Aborted {
		t.Errorf("ListSnapshots from a ListVolumes token: %v, want Aborted", err)
	}
	if _, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{StartingToken: snaps.GetNextToken()}); status.Code(toStatus(err)) != codes.Aborted {
		t.Errorf("ListVolumes from a ListSnapshots token: %v, want Aborted", err)
	}
	if _, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: -1}); status.Code(toStatus(err)) != codes.InvalidArgument {
		t.Errorf("ListVolumes with max_entries -1: %v, want InvalidArgument", err)
	}
}
