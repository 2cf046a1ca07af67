package csi

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// The per-node volume limit ControllerPublish enforces is the node's own:
// each node plugin registers its --max-volumes with the cluster, and the
// controller (which has no such setting) refuses a publish beyond it with
// RESOURCE_EXHAUSTED, through the csi code table. Two nodes with
// different limits: the one with 1 takes one volume, the one with 3 takes
// three.
func TestPublishLimitIsTheNodes(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	cluster := Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	limits := map[string]int64{"small-node": 1, "big-node": 3}
	for node, lim := range limits {
		att := newFakeAttacher(cl.Volumes)
		host, _, _ := fakeHost(att)
		nd, err := New(Config{
			Mode: ModeNode, NodeID: node, MaxVolumesPerNode: lim, StateDir: filepath.Join(t.TempDir(), "state"),
			Cluster: cluster, Attacher: att, Host: host, Logger: testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nd.Close)
		if err := nd.Start(ctx); err != nil {
			t.Fatal(err)
		}
		info, err := nd.node.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
		if err != nil || info.GetMaxVolumesPerNode() != lim {
			t.Fatalf("%s NodeGetInfo: %v, %v; want max_volumes_per_node %d", node, info, err, lim)
		}
		reg, err := cl.Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: node})
		if err != nil || reg.GetNode().GetMaxVolumes() != lim {
			t.Fatalf("the cluster's record of %s: %v, %v; want max_volumes %d", node, reg, err, lim)
		}
	}

	d, err := New(Config{Mode: ModeController, Cluster: cluster, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctrl := &controllerServer{d: d}
	publish := func(node string, i int) error {
		t.Helper()
		v, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: fmt.Sprintf("%s-%d", node, i), CapacityRange: &csipb.CapacityRange{RequiredBytes: 4 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
		})
		if err != nil {
			t.Fatal(err)
		}
		_, err = ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{
			VolumeId: v.GetVolume().GetVolumeId(), NodeId: node, VolumeCapability: rwoCap(),
		})
		return toStatus(err)
	}
	for node, lim := range limits {
		for i := range lim {
			if err := publish(node, int(i)); err != nil {
				t.Fatalf("publish %d of %d to %s: %v", i+1, lim, node, err)
			}
		}
		if err := publish(node, int(lim)); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("publish %d to %s, whose plugin registered a limit of %d: %v, want ResourceExhausted", lim+1, node, lim, err)
		}
	}
}

// slowAttach delays every AttachVolume: the Raft commit of a busy cluster.
type slowAttach struct {
	storpb.VolumeServiceClient
	delay time.Duration
}

func (s slowAttach) AttachVolume(ctx context.Context, in *storpb.AttachVolumeRequest, opts ...grpc.CallOption) (*storpb.AttachVolumeResponse, error) {
	time.Sleep(s.delay)
	return s.VolumeServiceClient.AttachVolume(ctx, in, opts...)
}

// Two publishes of different volumes to a node one short of its limit at
// once (csi-attacher runs several workers): each counted the node's
// volumes under its own volume's lock, found room, and both attached, one
// past the limit, and the second NodeStage found no nbd device. The count
// and the attach are now under the node's lock.
func TestConcurrentPublishesKeepTheNodesLimit(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	att := newFakeAttacher(cl.Volumes)
	host, _, _ := fakeHost(att)
	nd, err := New(Config{Mode: ModeNode, NodeID: "small-node", MaxVolumesPerNode: 1, StateDir: filepath.Join(t.TempDir(), "state"),
		Cluster: Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots}, Attacher: att, Host: host, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nd.Close)
	if err := nd.Start(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{Mode: ModeController, Logger: testLogger(t),
		Cluster: Cluster{Cluster: cl.Cluster, Volumes: slowAttach{cl.Volumes, 300 * time.Millisecond}, Snapshots: cl.Snapshots}})
	if err != nil {
		t.Fatal(err)
	}
	ctrl := &controllerServer{d: d}
	var ids []string
	for i := range 2 {
		v, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: fmt.Sprintf("race-%d", i), CapacityRange: &csipb.CapacityRange{RequiredBytes: 4 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
		})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, v.GetVolume().GetVolumeId())
	}
	errs := make(chan error, len(ids))
	for _, id := range ids {
		go func() {
			_, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "small-node", VolumeCapability: rwoCap()})
			errs <- err
		}()
	}
	ok := 0
	for range ids {
		if err := <-errs; err == nil {
			ok++
		}
	}
	resp, err := cl.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	attached := 0
	for _, v := range resp.GetVolumes() {
		if v.GetAttachment().GetNodeId() == "small-node" {
			attached++
		}
	}
	if ok != 1 || attached != 1 {
		t.Fatalf("two publishes at once to a node with a limit of 1: %d succeeded, %d volumes attached there; want 1 and 1", ok, attached)
	}
}
