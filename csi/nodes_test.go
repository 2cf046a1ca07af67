package csi

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// waitReady polls Ready (what /readyz answers) until it is nil.
func waitReady(t *testing.T, d *Driver, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := d.Ready(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready within %v: %v", within, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A node plugin whose node id is a Kubernetes node name that runs no
// stor-server registers itself at start; ControllerPublish to it then
// succeeds, to an id that never registered is NOT_FOUND, and to a
// stor-server id (a server attaching as a client) still succeeds.
func TestPublishToRegisteredNode(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	att := newFakeAttacher(cl.Volumes)
	host, _, _ := fakeHost(att)
	endpoint, d := startDriverAs(t, c, t.TempDir(), "worker-7", "zone-w", att, host)
	conn := dialCSI(t, endpoint)
	ctrl, node := csipb.NewControllerClient(conn), csipb.NewNodeClient(conn)
	waitReady(t, d, time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	for _, s := range c.Nodes {
		if s.ID == "worker-7" {
			t.Fatal("fixture: worker-7 is a server id")
		}
	}
	info, err := node.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
	if err != nil || info.GetNodeId() != "worker-7" {
		t.Fatalf("NodeGetInfo: %v, %v", info, err)
	}
	reg, err := cl.Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: "worker-7"})
	if err != nil || reg.GetNode().GetZone() != "zone-w" {
		t.Fatalf("the cluster's record of worker-7: %v, %v", reg, err)
	}

	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "on-worker", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	publish := func(nodeID string) error {
		_, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeID, VolumeCapability: rwoCap()})
		return err
	}
	attachedTo := func() string {
		v, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
		if err != nil {
			t.Fatal(err)
		}
		return v.GetVolume().GetAttachment().GetNodeId()
	}
	unpublish := func(nodeID string) {
		t.Helper()
		if _, err := ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: nodeID}); err != nil {
			t.Fatal(err)
		}
	}

	if err := publish("worker-8"); status.Code(err) != codes.NotFound {
		t.Fatalf("publish to the unregistered worker-8: %v, want NotFound", err)
	}
	if got := attachedTo(); got != "" {
		t.Fatalf("a refused publish attached the volume to %q", got)
	}
	if err := publish("worker-7"); err != nil {
		t.Fatalf("publish to the registered worker-7: %v", err)
	}
	if got := attachedTo(); got != "worker-7" {
		t.Fatalf("volume attached to %q after publish to worker-7", got)
	}
	unpublish("worker-7")
	server := c.Nodes[1].ID
	if err := publish(server); err != nil {
		t.Fatalf("publish to stor-server %s (never registered as a node): %v", server, err)
	}
	unpublish(server)
}

// fakeRegistry is a ClusterService whose RegisterNode fails with fail
// until it is told to succeed; its other methods are unused (nil).
type fakeRegistry struct {
	storpb.ClusterServiceClient

	mu    sync.Mutex
	fail  error // guarded by mu; nil: succeed
	calls int
	got   *storpb.Node
}

func (f *fakeRegistry) RegisterNode(_ context.Context, req *storpb.RegisterNodeRequest, _ ...grpc.CallOption) (*storpb.RegisterNodeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.fail != nil {
		return nil, f.fail
	}
	f.got = req.GetNode()
	return &storpb.RegisterNodeResponse{Node: req.GetNode()}, nil
}

func (f *fakeRegistry) set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = err
}

func (f *fakeRegistry) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

func newRegistryDriver(t *testing.T, reg *fakeRegistry) *Driver {
	t.Helper()
	att := newFakeAttacher(nil) // no staged volumes: never called
	host, _, _ := fakeHost(att)
	d, err := New(Config{
		Mode: ModeNode, NodeID: "worker-3", Zone: "zone-c", StateDir: t.TempDir(),
		Cluster:  Cluster{Cluster: reg, Volumes: storpb.NewVolumeServiceClient(nil), Snapshots: storpb.NewSnapshotServiceClient(nil)},
		Attacher: att, Host: host, Logger: testLogger(t), CallTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	return d
}

// isReady reports whether Ready (/readyz) is nil.
func isReady(d *Driver) bool { return d.Ready(context.Background()) == nil }

// Start retries RegisterNode while the cluster does not answer, and the
// node is not ready (/readyz) until it succeeds; a refused id and the end
// of ctx stop it.
func TestNodeRegistersWithRetry(t *testing.T) {
	t.Run("unreachable, then up", func(t *testing.T) {
		reg := &fakeRegistry{fail: status.Error(codes.Unavailable, "no leader")}
		d := newRegistryDriver(t, reg)
		done := make(chan error, 1)
		go func() { done <- d.Start(context.Background()) }()
		deadline := time.Now().Add(30 * time.Second)
		for reg.count() < 3 { // at least two retries
			if time.Now().After(deadline) {
				t.Fatalf("RegisterNode called %d times in 30s", reg.count())
			}
			time.Sleep(20 * time.Millisecond)
		}
		select {
		case err := <-done:
			t.Fatalf("Start returned while the cluster was unreachable: %v", err)
		default:
		}
		if isReady(d) {
			t.Fatal("ready before the node registered")
		}
		reg.set(nil)
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Start: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Start did not return within 30s of the cluster answering")
		}
		if !isReady(d) {
			t.Fatal("not ready after registering")
		}
		reg.mu.Lock()
		defer reg.mu.Unlock()
		if reg.got.GetId() != "worker-3" || reg.got.GetZone() != "zone-c" {
			t.Fatalf("registered %v, want worker-3 in zone-c", reg.got)
		}
	})
	t.Run("bounded by ctx", func(t *testing.T) {
		reg := &fakeRegistry{fail: status.Error(codes.Unavailable, "no leader")}
		d := newRegistryDriver(t, reg)
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		err := d.Start(ctx)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Start with an unreachable cluster: %v, want context.DeadlineExceeded", err)
		}
		if isReady(d) {
			t.Fatal("ready without registering")
		}
	})
	t.Run("refused id", func(t *testing.T) {
		reg := &fakeRegistry{fail: status.Error(codes.InvalidArgument, "node id")}
		d := newRegistryDriver(t, reg)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Start(ctx); clusterCode(err) != codes.InvalidArgument {
			t.Fatalf("Start with a refused id: %v, want InvalidArgument", err)
		}
		if n := reg.count(); n != 1 {
			t.Fatalf("a refused id was tried %d times, want 1", n)
		}
		if isReady(d) {
			t.Fatal("ready with a refused node id")
		}
		if !d.node.recovered.Load() {
			t.Fatal("a refused node id kept the plugin from recovering its staged volumes")
		}
	})
}
