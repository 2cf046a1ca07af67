package csi

import (
	"context"
	"fmt"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// TestListingsFollowClusterPages: the cluster answers at most 3 entries a
// page (its default page size here); the controller's ListVolumes and
// ListSnapshots follow the cluster's pages, and page the result by CSI's
// max_entries and starting_token, each entry exactly once, in id order.
func TestListingsFollowClusterPages(t *testing.T) {
	const vols, snaps = 8, 5
	u := newDriverUnderTestOn(t, servertest.Options{Servers: 1, Configure: func(_ int, cfg *server.Config) {
		cfg.API.DefaultPageSize, cfg.API.MaxPageSize = 3, 3
	}})
	cl := clusterClient(t, u.c)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var first string
	for i := range vols {
		resp, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: fmt.Sprintf("pv-%d", i), SizeBytes: 1 << 20, ReplicaCount: 1})
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = resp.Volume.Id
		}
	}
	for i := range snaps {
		if _, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{Name: fmt.Sprintf("snap-%d", i), VolumeId: first}); err != nil {
			t.Fatal(err)
		}
	}

	all, err := u.ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{})
	if err != nil || len(all.Entries) != vols || all.NextToken != "" {
		t.Fatalf("ListVolumes: %d entries, next %q, err %v; want all %d", len(all.GetEntries()), all.GetNextToken(), err, vols)
	}
	// CSI pages of 3 end where the cluster's do; pages of 2 end inside
	// them, and the next page resumes inside the cluster's page.
	for _, max := range []int32{2, 3} {
		seen := map[string]bool{}
		token, last := "", ""
		for page := 0; page == 0 || token != ""; page++ {
			if page > vols {
				t.Fatal("ListVolumes: no last page")
			}
			resp, err := u.ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: max, StartingToken: token})
			if err != nil || len(resp.Entries) > int(max) {
				t.Fatalf("ListVolumes page %d of %d: %d entries, err %v", page, max, len(resp.GetEntries()), err)
			}
			for _, e := range resp.Entries {
				id := e.GetVolume().GetVolumeId()
				if seen[id] {
					t.Fatalf("volume %s listed twice", id)
				}
				if id <= last {
					t.Fatalf("pages of %d: volume %s listed after %s", max, id, last)
				}
				seen[id], last = true, id
			}
			token = resp.NextToken
		}
		if len(seen) != vols {
			t.Errorf("ListVolumes pages of %d listed %d volumes, want %d", max, len(seen), vols)
		}
	}

	snapResp, err := u.ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: first})
	if err != nil || len(snapResp.Entries) != snaps {
		t.Fatalf("ListSnapshots: %d entries, err %v; want %d", len(snapResp.GetEntries()), err, snaps)
	}
}

// TestListSnapshotsPagesUnderTheMessageLimit: with no max_entries, a
// listing larger than maxListBytes comes in pages that fit it, each
// snapshot exactly once. Without the bound the controller answered every
// snapshot in one response: 50,000 are 5.0 MB as CSI entries, over the 4
// MiB a CO's gRPC client takes (issue 16). The bound is set here to
// about two entries.
func TestListSnapshotsPagesUnderTheMessageLimit(t *testing.T) {
	const snaps = 7
	defer func(n int) { maxListBytes = n }(maxListBytes)
	maxListBytes = 200
	u := newDriverUnderTestOn(t, servertest.Options{Servers: 1})
	cl := clusterClient(t, u.c)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "pv", SizeBytes: 1 << 20, ReplicaCount: 1})
	if err != nil {
		t.Fatal(err)
	}
	for i := range snaps {
		if _, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{Name: fmt.Sprintf("snap-%d", i), VolumeId: vol.Volume.Id}); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{}
	token, pages := "", 0
	for ; pages == 0 || token != ""; pages++ {
		if pages > snaps {
			t.Fatal("ListSnapshots: no last page")
		}
		resp, err := u.ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{StartingToken: token})
		if err != nil {
			t.Fatalf("ListSnapshots page %d: %v", pages, err)
		}
		if n := proto.Size(resp); n > maxListBytes+100 && len(resp.Entries) > 1 {
			t.Errorf("ListSnapshots page %d: %d entries, %d bytes, over the bound %d", pages, len(resp.Entries), n, maxListBytes)
		}
		for _, e := range resp.Entries {
			if id := e.GetSnapshot().GetSnapshotId(); seen[id] {
				t.Fatalf("snapshot %s listed twice", id)
			} else {
				seen[id] = true
			}
		}
		token = resp.NextToken
	}
	if len(seen) != snaps || pages < 3 {
		t.Errorf("ListSnapshots listed %d snapshots in %d pages, want %d in several", len(seen), pages, snaps)
	}
}
