package csi

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

func churnVolume(id string, bad bool) *storpb.Volume {
	v := &storpb.Volume{Id: id, SizeBytes: 1 << 20, ReplicaCount: 1}
	st := storpb.ReplicaState_REPLICA_STATE_HEALTHY
	if bad {
		st = storpb.ReplicaState_REPLICA_STATE_FAULTY
	}
	v.Replicas = []*storpb.Replica{{Id: "r" + id, ServerId: "s", State: st}}
	return v
}

// newChurnController lists 200 volumes (v0000, v0010, ...; a third of
// them with a faulty replica) and 200 snapshots (s0000, ...; of v0000,
// v0010 and v0020 in turn) from a fakeListings cutting its pages short at
// random.
func newChurnController(t *testing.T, seed uint64) (*controllerServer, *fakeListings) {
	f := &fakeListings{cut: rand.New(rand.NewPCG(seed, 7))}
	for i := range 200 {
		f.vols = append(f.vols, churnVolume(fmt.Sprintf("v%04d", i*10), f.cut.IntN(3) == 0))
		f.snaps = append(f.snaps, &storpb.Snapshot{Id: fmt.Sprintf("s%04d", i*10), VolumeId: fmt.Sprintf("v%04d", (i%3)*10)})
	}
	return serveListings(t, f), f
}

// TestListChurn: random max_entries per page, random short cluster
// pages, a small byte bound, and random creates and deletes between
// pages (including the last id listed). Every id that existed
// throughout is listed exactly once, ids strictly increase, pages
// respect max_entries.
func TestListChurn(t *testing.T) {
	defer func(n int) { maxListBytes = n }(maxListBytes)
	for seed := range uint64(60) {
		for _, kind := range []string{"vols", "snaps", "snapsOfV0010", "health"} {
			ctrl, f := newChurnController(t, seed)
			maxListBytes = []int{1 << 20, 60, 200}[seed%3]
			ctx := context.Background()
			r := rand.New(rand.NewPCG(seed, 99))
			ids := func() map[string]bool { // ids the listing should show now
				f.mu.Lock()
				defer f.mu.Unlock()
				m := map[string]bool{}
				switch kind {
				case "vols", "health":
					for _, v := range f.vols {
						if kind == "vols" || len(health(v).GetHealthStatuses()) > 0 {
							m[v.Id] = true
						}
					}
				default:
					for _, s := range f.snaps {
						if kind == "snaps" || s.VolumeId == "v0010" {
							m[s.Id] = true
						}
					}
				}
				return m
			}
			throughout := ids()
			ever := ids()
			var listed []string
			token := ""
			for page := 0; page == 0 || token != ""; page++ {
				if page > 2000 {
					t.Fatalf("%s seed %d: no end", kind, seed)
				}
				max := int32(r.IntN(6))
				var got []string
				var next string
				var err error
				switch kind {
				case "vols":
					resp, e := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: max, StartingToken: token})
					for _, e := range resp.GetEntries() {
						got = append(got, e.GetVolume().GetVolumeId())
					}
					next, err = resp.GetNextToken(), e
				case "health":
					resp, e := ctrl.ControllerListVolumeHealth(ctx, &csipb.ControllerListVolumeHealthRequest{MaxEntries: max, StartingToken: token})
					for _, e := range resp.GetEntries() {
						got = append(got, e.GetVolumeId())
					}
					next, err = resp.GetNextToken(), e
				default:
					src := ""
					if kind == "snapsOfV0010" {
						src = "v0010"
					}
					resp, e := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{MaxEntries: max, StartingToken: token, SourceVolumeId: src})
					for _, e := range resp.GetEntries() {
						got = append(got, e.GetSnapshot().GetSnapshotId())
					}
					next, err = resp.GetNextToken(), e
				}
				if err != nil {
					t.Fatalf("%s seed %d page %d: %v", kind, seed, page, err)
				}
				if max > 0 && len(got) > int(max) {
					t.Fatalf("%s seed %d page %d: %d entries > max %d", kind, seed, page, len(got), max)
				}
				if next != "" && len(got) == 0 {
					t.Fatalf("%s seed %d page %d: empty page with a next token", kind, seed, page)
				}
				listed = append(listed, got...)
				token = next
				// churn: delete the last listed, a random one, insert some.
				f.mu.Lock()
				if len(got) > 0 && r.IntN(2) == 0 {
					last := got[len(got)-1]
					f.vols = slices.DeleteFunc(f.vols, func(v *storpb.Volume) bool { return v.Id == last })
					f.snaps = slices.DeleteFunc(f.snaps, func(s *storpb.Snapshot) bool { return s.Id == last })
				}
				if n := len(f.vols); n > 0 {
					i := r.IntN(n)
					f.vols = slices.Delete(f.vols, i, i+1)
				}
				if n := len(f.snaps); n > 0 {
					i := r.IntN(n)
					f.snaps = slices.Delete(f.snaps, i, i+1)
				}
				for range 2 {
					n := r.IntN(2000)
					vid := fmt.Sprintf("v%04d", n)
					if i, found := slices.BinarySearchFunc(f.vols, vid, func(v *storpb.Volume, id string) int { return strings.Compare(v.Id, id) }); !found {
						f.vols = slices.Insert(f.vols, i, churnVolume(vid, r.IntN(2) == 0))
					}
					sid := fmt.Sprintf("s%04d", n)
					if i, found := slices.BinarySearchFunc(f.snaps, sid, func(s *storpb.Snapshot, id string) int { return strings.Compare(s.Id, id) }); !found {
						f.snaps = slices.Insert(f.snaps, i, &storpb.Snapshot{Id: sid, VolumeId: fmt.Sprintf("v%04d", (n%3)*10)})
					}
				}
				f.mu.Unlock()
				now := ids()
				for id := range throughout {
					if !now[id] {
						delete(throughout, id)
					}
				}
				for id := range now {
					ever[id] = true
				}
			}
			seen := map[string]bool{}
			for i, id := range listed {
				if seen[id] {
					t.Fatalf("%s seed %d: %s listed twice", kind, seed, id)
				}
				seen[id] = true
				if i > 0 && id <= listed[i-1] {
					t.Fatalf("%s seed %d: %s after %s", kind, seed, id, listed[i-1])
				}
				if !ever[id] {
					t.Fatalf("%s seed %d: %s never existed", kind, seed, id)
				}
			}
			for id := range throughout {
				if !seen[id] {
					t.Fatalf("%s seed %d: %s existed throughout, not listed", kind, seed, id)
				}
			}
		}
	}
}

// TestListTokenOfOtherFilters: a ListSnapshots token is of the listing
// with the filters it was made under; given with others it is ABORTED
// (it used to skip the other volume's snapshots up to the token's last
// id, or list nothing for a snapshot_id), and with the same ones it goes
// on.
func TestListTokenOfOtherFilters(t *testing.T) {
	ctrl, _ := newChurnController(t, 1)
	ctx := context.Background()
	resp, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: "v0010", MaxEntries: 30})
	if err != nil || resp.NextToken == "" {
		t.Fatalf("%v %v", resp, err)
	}
	r, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: "v0000", StartingToken: resp.NextToken})
	if status.Code(toStatus(err)) != codes.Aborted {
		t.Errorf("ListSnapshots(source v0000) from a source-v0010 token: %d entries, %v; want Aborted", len(r.GetEntries()), err)
	}
	if _, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: "v0010", StartingToken: resp.NextToken}); err != nil {
		t.Errorf("ListSnapshots(source v0010) from its own token: %v", err)
	}
	all, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{MaxEntries: 100})
	if err != nil {
		t.Fatal(err)
	}
	one, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SnapshotId: "s0000", StartingToken: all.NextToken})
	if status.Code(toStatus(err)) != codes.Aborted {
		t.Errorf("ListSnapshots(snapshot_id s0000) with an unfiltered token: %d entries, %v; want Aborted", len(one.GetEntries()), err)
	}
}

// TestListForgedTokens: garbage, huge and hand-made tokens do not panic;
// those encode did not make are ABORTED with a short message (a 3 MiB
// token is not echoed back), and a hand-made one inside the listing gives
// a page of it or ABORTED, never another error.
func TestListForgedTokens(t *testing.T) {
	ctrl, _ := newChurnController(t, 2)
	ctx := context.Background()
	bad := []string{"!!!", strings.Repeat("A", 3<<20), listToken{kind: listSnapshots}.encode()}
	made := []string{
		listToken{kind: listSnapshots, cluster: "t/zzzz", after: "\x00"}.encode(),
		listToken{kind: listSnapshots, cluster: "", after: "\xff"}.encode(),
		listToken{kind: listSnapshots, cluster: "garbage", after: "a"}.encode(),
	}
	for i, tok := range append(bad, made...) {
		r, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: tok})
		code := status.Code(toStatus(err))
		t.Logf("token %d: %d entries, next %q, code %v, msg len %d", i, len(r.GetEntries()), r.GetNextToken(), code, len(fmt.Sprint(err)))
		if i < len(bad) && code != codes.Aborted {
			t.Errorf("token %d (%d bytes): %v, want Aborted", i, len(tok), code)
		}
		if code != codes.OK && code != codes.Aborted {
			t.Errorf("token %d: %v, want a page or Aborted", i, err)
		}
		if n := len(fmt.Sprint(err)); n > 1024 {
			t.Errorf("token %d (%d bytes): an error message of %d bytes", i, len(tok), n)
		}
	}
}

// TestListRealClusterChurn: the real cluster (pages of 3), volumes kept
// deleted for their snapshots (skipped by the cluster but its page
// token passes them), and the last volume listed deleted between pages.
func TestListRealClusterChurn(t *testing.T) {
	u := newDriverUnderTestOn(t, servertest.Options{Servers: 1, Configure: func(_ int, cfg *server.Config) {
		cfg.API.DefaultPageSize, cfg.API.MaxPageSize = 3, 3
	}})
	cl := clusterClient(t, u.c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ids []string
	for i := range 16 {
		resp, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: fmt.Sprintf("pv-%d", i), SizeBytes: 1 << 20, ReplicaCount: 1})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, resp.Volume.Id)
	}
	slices.Sort(ids)
	// Every third volume: a snapshot, then deleted (kept, not listed).
	gone := map[string]bool{}
	for i, id := range ids {
		if i%3 != 1 {
			continue
		}
		if _, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{Name: "s-" + id, VolumeId: id}); err != nil {
			t.Fatal(err)
		}
		if _, err := cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: id}}); err != nil {
			t.Fatal(err)
		}
		gone[id] = true
	}
	for _, max := range []int32{1, 2, 3, 4} {
		var listed []string
		token := ""
		for page := 0; page == 0 || token != ""; page++ {
			if page > 40 {
				t.Fatal("no end")
			}
			resp, err := u.ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: max, StartingToken: token})
			if err != nil {
				t.Fatalf("max %d page %d: %v", max, page, err)
			}
			for _, e := range resp.Entries {
				listed = append(listed, e.GetVolume().GetVolumeId())
			}
			token = resp.NextToken
			if n := len(resp.Entries); n > 0 && page%2 == 0 && max == 2 {
				last := resp.Entries[n-1].GetVolume().GetVolumeId()
				if _, err := cl.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: last}}); err != nil {
					t.Fatal(err)
				}
				gone[last] = true
			}
		}
		var want []string
		for _, id := range ids {
			if !gone[id] || slices.Contains(listed, id) {
				want = append(want, id)
			}
		}
		if !slices.Equal(listed, want) {
			t.Errorf("max %d: listed %v\nwant %v", max, listed, want)
		}
	}
}
