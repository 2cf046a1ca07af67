package csi

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// TestControllerAndNodeUnderTLS: on a TLS cluster, a controller with a
// csi-controller certificate provisions and publishes; the node's engine,
// with the csi-node certificate of the node it was published to, opens the
// volume over the control API and the data ports and writes; another
// node's certificate cannot open it.
func TestControllerAndNodeUnderTLS(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3, TLS: true})
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	dial := func(id pki.Identity) (*client.Client, *pki.Source) {
		src := c.TLSSource(id)
		cl, err := client.Dial(addrs, src.GRPCDialCredentials())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cl.Close() })
		return cl, src
	}
	ctlCl, _ := dial(pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"})
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	d, err := New(Config{
		Mode: ModeController, Endpoint: "unix://" + sock,
		Cluster: Cluster{Cluster: ctlCl.Cluster, Volumes: ctlCl.Volumes, Snapshots: ctlCl.Snapshots},
		Logger:  testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("driver Run: %v", err)
		}
	})
	ctrl := csipb.NewControllerClient(dialCSI(t, "unix://"+sock))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	n1, n1Src := dial(pki.Identity{Role: pki.RoleCSINode, Name: "n1"})
	n2, n2Src := dial(pki.Identity{Role: pki.RoleCSINode, Name: "n2"})
	for name, cl := range map[string]*client.Client{"n1": n1, "n2": n2} {
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: name, MaxVolumes: 8}})
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("register %s: %v", name, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if _, err := n1.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: "n2"}}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("n1 registers n2: %v, want PermissionDenied", err)
	}

	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "tls", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	if _, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "n1", VolumeCapability: rwoCap()}); err != nil {
		t.Fatal(err)
	}
	open := func(node string, cl *client.Client, src *pki.Source) (*engine.Engine, error) {
		return engine.Open(ctx, engine.Config{
			Volume: id, VolumeIsID: true, NodeID: node, RequireAttached: true,
			Control:   engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster, Snapshots: cl.Snapshots},
			Connect:   engine.WireConnector(wire.ClientConfig{Dial: src.Dialer(nil, pki.RoleServer)}),
			IOTimeout: 5 * time.Second, Logger: testLogger(t),
		})
	}
	if _, err := open("n2", n2, n2Src); status.Code(err) != codes.FailedPrecondition && status.Code(err) != codes.PermissionDenied {
		t.Fatalf("n2's engine opens a volume published to n1: %v, want refused", err)
	} else {
		t.Logf("n2's engine: %v", err)
	}
	e, err := open("n1", n1, n1Src)
	if err != nil {
		t.Fatalf("n1's engine: %v", err)
	}
	p := bytes.Repeat([]byte{0x5a}, 64<<10)
	if err := e.WriteAt(ctx, p, 0, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(p))
	if err := e.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("read back: %v, equal %v", err, bytes.Equal(got, p))
	}
	if err := e.Close(ctx, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "n1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := n1.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: id}}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a node deletes a volume: %v, want PermissionDenied", err)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}
