package csi

import (
	"context"
	"fmt"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// TestListingsFollowClusterPages: the cluster answers at most 3 entries a
// page (its default page size here); the controller's ListVolumes and
// ListSnapshots follow the cluster's pages, and page the result by CSI's
// max_entries and starting_token, each entry exactly once.
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
	seen := map[string]bool{}
	token := ""
	for page := 0; page == 0 || token != ""; page++ {
		if page > vols {
			t.Fatal("ListVolumes: no last page")
		}
		resp, err := u.ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{MaxEntries: 3, StartingToken: token})
		if err != nil || len(resp.Entries) > 3 {
			t.Fatalf("ListVolumes page %d: %d entries, err %v", page, len(resp.GetEntries()), err)
		}
		for _, e := range resp.Entries {
			if id := e.GetVolume().GetVolumeId(); seen[id] {
				t.Fatalf("volume %s listed twice", id)
			} else {
				seen[id] = true
			}
		}
		token = resp.NextToken
	}
	if len(seen) != vols {
		t.Errorf("ListVolumes pages listed %d volumes, want %d", len(seen), vols)
	}

	snapResp, err := u.ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SourceVolumeId: first})
	if err != nil || len(snapResp.Entries) != snaps {
		t.Fatalf("ListSnapshots: %d entries, err %v; want %d", len(snapResp.GetEntries()), err, snaps)
	}
}
