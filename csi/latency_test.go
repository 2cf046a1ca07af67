package csi

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// TestCSILatency measures CreateVolume, CreateSnapshot and
// ControllerExpandVolume through the CSI socket against an in-process
// 3-server cluster, p50 and p99 over $STOR_CSI_BENCH_N calls each
// (default 200), beside the same cluster calls made directly (the
// baseline: the ratio is what the CSI layer adds). make bench-csi runs
// it; it skips unless $STOR_CSI_BENCH is set.
func TestCSILatency(t *testing.T) {
	if os.Getenv("STOR_CSI_BENCH") == "" {
		t.Skip("a measurement: make bench-csi (STOR_CSI_BENCH=1)")
	}
	n := 200
	if s := os.Getenv("STOR_CSI_BENCH_N"); s != "" {
		fmt.Sscan(s, &n)
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	endpoint, _ := startDriver(t, c, t.TempDir(), newFakeAttacher(cl.Volumes), nil)
	ctrl := csipb.NewControllerClient(dialCSI(t, endpoint))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	timeIt := func(what string, f func(i int) error) []time.Duration {
		d := make([]time.Duration, 0, n)
		for i := range n {
			start := time.Now()
			if err := f(i); err != nil {
				t.Fatalf("%s %d: %v", what, i, err)
			}
			d = append(d, time.Since(start))
		}
		slices.Sort(d)
		return d
	}
	pct := func(d []time.Duration, p float64) time.Duration { return d[int(p*float64(len(d)-1))] }
	report := func(what string, csiD, base []time.Duration) {
		t.Logf("%-24s n=%d  CSI p50 %-9v p99 %-9v  direct p50 %-9v p99 %-9v  ratio p50 %.2f",
			what, n, pct(csiD, .5).Round(10*time.Microsecond), pct(csiD, .99).Round(10*time.Microsecond),
			pct(base, .5).Round(10*time.Microsecond), pct(base, .99).Round(10*time.Microsecond),
			float64(pct(csiD, .5))/float64(pct(base, .5)))
	}
	capa := []*csipb.VolumeCapability{mountCap()}
	ids := make([]string, n)

	create := timeIt("CreateVolume", func(i int) error {
		r, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: fmt.Sprintf("bench-%d", i),
			CapacityRange: &csipb.CapacityRange{RequiredBytes: 64 << 20}, VolumeCapabilities: capa})
		ids[i] = r.GetVolume().GetVolumeId()
		return err
	})
	createBase := timeIt("direct CreateVolume", func(i int) error {
		_, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: fmt.Sprintf("base-%d", i),
			SizeBytes: 64 << 20, ReplicaCount: 3, Parameters: map[string]string{}})
		return err
	})
	report("CreateVolume", create, createBase)

	snap := timeIt("CreateSnapshot", func(i int) error {
		_, err := ctrl.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: ids[i], Name: fmt.Sprintf("bench-snap-%d", i)})
		return err
	})
	snapBase := timeIt("direct CreateSnapshot", func(i int) error {
		_, err := cl.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: ids[i], Name: fmt.Sprintf("base-snap-%d", i)})
		return err
	})
	report("CreateSnapshot", snap, snapBase)

	expand := timeIt("ControllerExpandVolume", func(i int) error {
		_, err := ctrl.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: ids[i],
			CapacityRange: &csipb.CapacityRange{RequiredBytes: 128 << 20}})
		return err
	})
	expandBase := timeIt("direct ExpandVolume", func(i int) error {
		_, err := cl.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: ids[i]}, SizeBytes: 192 << 20})
		return err
	})
	report("ControllerExpandVolume", expand, expandBase)
}
