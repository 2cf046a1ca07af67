package csi

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"path/filepath"
	"slices"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

func TestRoundSize(t *testing.T) {
	for _, tc := range []struct {
		req, lim int64
		want     uint64
		code     codes.Code
	}{
		{0, 0, DefaultVolumeSize, codes.OK},
		{1, 0, 4096, codes.OK},
		{4096, 0, 4096, codes.OK},
		{4097, 0, 8192, codes.OK},
		{10 << 30, 0, 10 << 30, codes.OK},
		{4097, 8192, 8192, codes.OK},
		{4097, 5000, 0, codes.OutOfRange},
		{0, 100, 0, codes.OutOfRange},
		{0, 1 << 20, 1 << 20, codes.OK},
		{10, 5, 0, codes.InvalidArgument},
		{-1, 0, 0, codes.InvalidArgument},
		{MaxVolumeSize + 1, 0, 0, codes.OutOfRange},
	} {
		got, err := roundSize(&csipb.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim})
		if code := status.Code(toStatus(err)); code != tc.code || (err == nil && got != tc.want) {
			t.Errorf("roundSize(%d, %d) = %d, %v; want %d, %v", tc.req, tc.lim, got, err, tc.want, tc.code)
		}
	}
}

func TestParseParams(t *testing.T) {
	for _, tc := range []struct {
		in       map[string]string
		replicas uint32
		fs       string
		ok       bool
	}{
		{nil, DefaultReplicas, "", true},
		{map[string]string{"replicas": "1"}, 1, "", true},
		{map[string]string{"replicas": "7", "fsType": "XFS"}, 7, "xfs", true},
		{map[string]string{"csi.storage.k8s.io/pvc/name": "x"}, DefaultReplicas, "", true},
		{map[string]string{"replicas": "0"}, 0, "", false},
		{map[string]string{"replicas": "8"}, 0, "", false},
		{map[string]string{"replicas": "two"}, 0, "", false},
		{map[string]string{"fsType": "btrfs"}, 0, "", false},
		{map[string]string{"tier": "fast"}, 0, "", false},
	} {
		p, err := parseParams(tc.in)
		if tc.ok != (err == nil) || (err == nil && (p.replicas != tc.replicas || p.fsType != tc.fs)) {
			t.Errorf("parseParams(%v) = %+v, %v; want replicas %d fs %q ok %v", tc.in, p, err, tc.replicas, tc.fs, tc.ok)
		}
		if err != nil && status.Code(toStatus(err)) != codes.InvalidArgument {
			t.Errorf("parseParams(%v): code %v, want InvalidArgument", tc.in, status.Code(toStatus(err)))
		}
	}
}

func TestSanitizeStripsSecrets(t *testing.T) {
	got := sanitize(&csipb.NodeStageVolumeRequest{VolumeId: "v1", Secrets: map[string]string{"password": "hunter2"}})
	if bytes.Contains([]byte(got), []byte("hunter2")) || !bytes.Contains([]byte(got), []byte("v1")) {
		t.Fatalf("sanitized request %s", got)
	}
}

// dialCSI connects to a driver's endpoint.
func dialCSI(t *testing.T, endpoint string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func clusterClient(t *testing.T, c *servertest.Cluster) *client.Client {
	t.Helper()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	cl, err := client.Dial(addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func rwoCap() *csipb.VolumeCapability {
	return &csipb.VolumeCapability{
		AccessType: &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}},
		AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// Fencing through CSI: ControllerPublish to B of a volume published to A
// is FAILED_PRECONDITION; a repeated publish to A returns the same
// context without a new epoch; after Unpublish from A and Publish to B
// (and B's engine open, as NodeStage does), A's engine can no longer
// write, and B's can.
func TestPublishFencing(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	endpoint, _ := startDriver(t, c, t.TempDir(), newFakeAttacher(cl.Volumes), nil)
	ctrl := csipb.NewControllerClient(dialCSI(t, endpoint))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	nodeA, nodeB := c.Nodes[0].ID, c.Nodes[1].ID

	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "fence", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	pubA, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeA, VolumeCapability: rwoCap()})
	if err != nil {
		t.Fatal(err)
	}
	open := func(node string) *engine.Engine {
		t.Helper()
		e, err := engine.Open(ctx, engine.Config{
			Volume: id, VolumeIsID: true, NodeID: node,
			Control: engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster},
			Connect: engine.WireConnector(wire.ClientConfig{}), Logger: testLogger(t),
		})
		if err != nil {
			t.Fatalf("engine open on %s: %v", node, err)
		}
		t.Cleanup(func() { e.Close(context.Background(), false) })
		return e
	}
	epoch := func() uint64 {
		v, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
		if err != nil {
			t.Fatal(err)
		}
		return v.GetVolume().GetEpoch()
	}
	engA := open(nodeA) // NodeStage on A
	p := bytes.Repeat([]byte{0xa5}, 4096)
	if err := engA.WriteAt(ctx, p, 0, true); err != nil {
		t.Fatalf("A writes: %v", err)
	}

	_, err = ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeB, VolumeCapability: rwoCap()})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish to B while published to A: %v, want FailedPrecondition", err)
	}
	before := epoch()
	again, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeA, VolumeCapability: rwoCap()})
	if err != nil || !maps.Equal(again.GetPublishContext(), pubA.GetPublishContext()) {
		t.Fatalf("publish to A again: %v, context %v, want %v", err, again.GetPublishContext(), pubA.GetPublishContext())
	}
	if after := epoch(); after != before {
		t.Fatalf("a repeated publish to the same node moved the epoch from %d to %d", before, after)
	}
	if err := engA.WriteAt(ctx, p, 4096, true); err != nil {
		t.Fatalf("A writes after a repeated publish: %v", err)
	}
	_, err = ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{
		VolumeId: id, NodeId: "no-such-node", VolumeCapability: rwoCap()})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("publish to an unknown node: %v, want NotFound", err)
	}

	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: nodeA}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeB, VolumeCapability: rwoCap()}); err != nil {
		t.Fatalf("publish to B after unpublish from A: %v", err)
	}
	engB := open(nodeB)
	q := bytes.Repeat([]byte{0x5a}, 4096)
	if err := engB.WriteAt(ctx, q, 0, true); err != nil {
		t.Fatalf("B writes: %v", err)
	}
	err = engA.WriteAt(ctx, p, 0, true)
	if !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("A writes after B's publish: %v, want engine.ErrFenced", err)
	}
	got := make([]byte, 4096)
	if err := engB.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, q) {
		t.Fatalf("B reads back: %v, equal %v", err, bytes.Equal(got, q))
	}
	// Deleting a published volume is refused.
	if _, err := ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: id}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("delete while published: %v, want FailedPrecondition", err)
	}
}

// A node plugin restart recovers every staged volume from its state dir
// before it is ready (/readyz): the new instance's attacher is asked to attach
// each (internal/attach then resumes the kernel device), and the volume
// can be unstaged by the new instance.
func TestNodeRestartRecovers(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	cl := clusterClient(t, c)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	att1 := newFakeAttacher(cl.Volumes)
	host1, _, _ := fakeHost(att1)
	endpoint, d1 := startDriver(t, c, filepath.Join(dir, "run1"), att1, host1)
	conn := dialCSI(t, endpoint)
	ctrl, node := csipb.NewControllerClient(conn), csipb.NewNodeClient(conn)
	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "restart", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{mountCap()},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	staging := filepath.Join(dir, "staging")
	if _, err := node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap()}); err != nil {
		t.Fatal(err)
	}
	d1.Close() // as a SIGTERM'd plugin leaves things: nothing detached

	// The second instance shares the first's state dir.
	att2 := newFakeAttacher(cl.Volumes)
	host2, mounter2, _ := fakeHost(att2)
	d2, err := New(Config{
		Mode: ModeNode, NodeID: c.Nodes[0].ID, StateDir: d1.cfg.StateDir,
		Cluster:  Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots},
		Attacher: att2, Host: host2, Logger: testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Ready(ctx); err == nil {
		t.Fatal("ready (/readyz) before recovery")
	}
	if err := d2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d2.Ready(ctx); err != nil {
		t.Fatalf("not ready (/readyz) after recovery: %v", err)
	}
	if _, _, ok := att2.Served(id); !ok || att2.attachN != 1 {
		t.Fatalf("the restarted plugin did not reattach the staged volume (served %v, attaches %d)", ok, att2.attachN)
	}

	// As after a reboot: host2's mount table is empty, so nothing is
	// mounted at the staging path although the device is served again.
	// Publishing the bare directory would give the pod the node's root
	// disk: the publish mounts the served device there first, as a
	// NodeStage would, and a NodeStage after it finds it mounted.
	target := filepath.Join(dir, "target")
	pub := &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap()}
	if _, err := d2.node.NodePublishVolume(ctx, pub); err != nil {
		t.Fatalf("publish with nothing mounted at the staging path: %v", err)
	}
	dev, _, _ := att2.Served(id)
	if mps, _ := mounter2.List(); !slices.ContainsFunc(mps, func(m mount.MountPoint) bool { return m.Path == staging && m.Device == dev }) {
		t.Fatalf("published, and the staging path is not mounted from the volume's device %s: %v", dev, mps)
	}
	if _, err := d2.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap()}); err != nil {
		t.Fatal(err)
	}
	mps, _ := mounter2.List()
	if at := slices.DeleteFunc(mps, func(m mount.MountPoint) bool { return m.Path != staging }); len(at) != 1 || at[0].Device != dev {
		t.Fatalf("after the NodeStage the staging path is mounted otherwise than once from %s: %v", dev, at)
	}
	if att2.attachN != 1 {
		t.Fatalf("the publish or the stage attached again (%d attaches): the served device is the one to mount", att2.attachN)
	}
	if _, err := d2.node.NodePublishVolume(ctx, pub); err != nil {
		t.Fatalf("publish again: %v", err)
	}
	if _, err := d2.node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := d2.node.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := att2.Served(id); ok {
		t.Fatal("unstage left the volume served")
	}
}

// driverUnderTest is a driver in mode all on a fake attacher and mount-utils'
// fake mounter, against a 3-server in-process cluster, with its clients.
type driverUnderTest struct {
	c       *servertest.Cluster
	d       *Driver
	ctrl    csipb.ControllerClient
	node    csipb.NodeClient
	att     *fakeAttacher
	mounter *mount.FakeMounter
	resized *[]string
	dir     string
}

func newDriverUnderTest(t *testing.T) *driverUnderTest {
	t.Helper()
	return newDriverUnderTestOn(t, servertest.Options{Servers: 3})
}

// newDriverUnderTestOn is newDriverUnderTest on a cluster started with opts.
func newDriverUnderTestOn(t *testing.T, opts servertest.Options) *driverUnderTest {
	t.Helper()
	c := servertest.NewCluster(t, opts)
	u := &driverUnderTest{c: c, att: newFakeAttacher(clusterClient(t, c).Volumes), dir: t.TempDir()}
	var host *Host
	host, u.mounter, u.resized = fakeHost(u.att)
	var endpoint string
	endpoint, u.d = startDriver(t, c, u.dir, u.att, host)
	conn := dialCSI(t, endpoint)
	u.ctrl, u.node = csipb.NewControllerClient(conn), csipb.NewNodeClient(conn)
	return u
}

// Too few servers in the requisite topology is RESOURCE_EXHAUSTED, the CSI
// spec's code for "unable to provision in accessible_topology" and the one
// that makes csi-provisioner reschedule a WaitForFirstConsumer claim
// (FAILED_PRECONDITION would not).
func TestCreateVolumeTooFewServersInTopology(t *testing.T) {
	u := newDriverUnderTest(t)
	ctrl, d := u.ctrl, u.d
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		name string
		req  *csipb.CreateVolumeRequest
	}{
		{"no server in the requisite zone", &csipb.CreateVolumeRequest{
			Name: "zoned", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
			AccessibilityRequirements: &csipb.TopologyRequirement{
				Requisite: []*csipb.Topology{{Segments: map[string]string{d.zoneKey(): "zone-x"}}},
			},
		}},
		{"more replicas than servers", &csipb.CreateVolumeRequest{
			Name: "four", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()},
			Parameters:         map[string]string{ParamReplicas: "4"},
		}},
	} {
		if _, err := ctrl.CreateVolume(ctx, tc.req); status.Code(err) != codes.ResourceExhausted {
			t.Errorf("%s: %v, want ResourceExhausted", tc.name, err)
		}
	}
}

// A second NodePublish at the same target with another read-only flag or
// access type is ALREADY_EXISTS (CSI spec); the same publish again is OK.
func TestNodePublishIncompatibleAgain(t *testing.T) {
	u := newDriverUnderTest(t)
	ctrl, node, dir := u.ctrl, u.node, u.dir
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "twice", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{mountCap()},
	})
	if err != nil {
		t.Fatal(err)
	}
	id, staging, target := vol.GetVolume().GetVolumeId(), filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	if _, err := node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap()}); err != nil {
		t.Fatal(err)
	}
	pub := func(cap *csipb.VolumeCapability, ro bool) error {
		_, err := node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: target, VolumeCapability: cap, Readonly: ro})
		return err
	}
	if err := pub(mountCap(), false); err != nil {
		t.Fatal(err)
	}
	if err := pub(mountCap(), false); err != nil {
		t.Fatalf("the same publish again: %v", err)
	}
	if err := pub(mountCap(), true); status.Code(err) != codes.AlreadyExists {
		t.Errorf("publish again read-only: %v, want AlreadyExists", err)
	}
	if err := pub(rwoCap(), false); status.Code(err) != codes.AlreadyExists {
		t.Errorf("publish again as a block device: %v, want AlreadyExists", err)
	}
	if _, err := node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if err := pub(mountCap(), true); err != nil {
		t.Fatalf("read-only publish after the unpublish: %v", err)
	}
	if err := pub(mountCap(), false); status.Code(err) != codes.AlreadyExists {
		t.Errorf("read-write publish where it is published read-only: %v, want AlreadyExists", err)
	}
}

// NodeStage mounts XFS with nouuid (a clone carries its source's UUID and
// must mount beside it) and grows the filesystem to the device (a restore
// or clone into a larger claim holds its source's smaller filesystem).
func TestNodeStageXFSNoUUIDAndGrow(t *testing.T) {
	u := newDriverUnderTest(t)
	ctrl, node, dir, att, mounter, resized := u.ctrl, u.node, u.dir, u.att, u.mounter, u.resized
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "xfs", CapacityRange: &csipb.CapacityRange{RequiredBytes: 320 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{mountCapFS("xfs")},
	})
	if err != nil {
		t.Fatal(err)
	}
	id, staging := vol.GetVolume().GetVolumeId(), filepath.Join(dir, "staging")
	if _, err := node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCapFS("xfs")}); err != nil {
		t.Fatal(err)
	}
	mps, _ := mounter.List()
	i := slices.IndexFunc(mps, func(m mount.MountPoint) bool { return m.Path == staging })
	if i < 0 || !slices.Contains(mps[i].Opts, "nouuid") {
		t.Errorf("xfs staged without nouuid: %v", mps)
	}
	dev, _, _ := att.Served(id)
	if !slices.Contains(*resized, dev+" "+staging) {
		t.Errorf("NodeStage did not grow the filesystem (resizes %q)", *resized)
	}
}

// DeleteVolume of a volume with a snapshot is OK, and OK again: the
// snapshot outlives its volume, as Kubernetes assumes (a PVC deleted while
// its VolumeSnapshot lives; before, the provisioner retried the PV's
// deletion forever). The deleted volume is gone for CSI (get, list,
// publish) and its name is free, but a volume restored from the snapshot
// afterwards holds the snapshot's data; deleting the snapshot (OK, again
// OK) then removes the old volume and frees its space.
func TestDeleteVolumeWithSnapshotThenRestore(t *testing.T) {
	u := newDriverUnderTest(t)
	ctrl, c := u.ctrl, u.c
	cl := clusterClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	node := c.Nodes[0].ID
	const size = 1 << 20
	allocated := func() uint64 {
		t.Helper()
		resp, err := cl.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var n uint64
		for _, s := range resp.GetServers() {
			n += s.GetAllocatedBytes()
		}
		return n
	}
	baseline := allocated()
	create := func(name string, bytes int64, src *csipb.VolumeContentSource) string {
		t.Helper()
		vol, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: bytes},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, VolumeContentSource: src,
		})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		return vol.GetVolume().GetVolumeId()
	}
	// withEngine publishes the volume, runs fn on an engine opened on the
	// node (as NodeStage does), closes it and unpublishes.
	withEngine := func(id string, fn func(e *engine.Engine)) {
		t.Helper()
		if _, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: rwoCap()}); err != nil {
			t.Fatalf("publish %s: %v", id, err)
		}
		e, err := engine.Open(ctx, engine.Config{
			Volume: id, VolumeIsID: true, NodeID: node,
			Control: engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster, Snapshots: cl.Snapshots},
			Connect: engine.WireConnector(wire.ClientConfig{}), Logger: testLogger(t),
		})
		if err != nil {
			t.Fatalf("engine open %s: %v", id, err)
		}
		fn(e)
		if err := e.Close(ctx, false); err != nil {
			t.Fatalf("engine close %s: %v", id, err)
		}
		if _, err := ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node}); err != nil {
			t.Fatalf("unpublish %s: %v", id, err)
		}
	}
	pattern := func(fill byte) []byte {
		p := make([]byte, size)
		for i := range p {
			p[i] = fill ^ byte(i/4096)
		}
		return p
	}
	write := func(p []byte) func(e *engine.Engine) {
		return func(e *engine.Engine) {
			if err := e.WriteAt(ctx, p, 0, true); err != nil {
				t.Fatal(err)
			}
		}
	}

	id := create("pvc-src", size, nil)
	snapData := pattern(0xa5)
	withEngine(id, write(snapData))
	snap, err := ctrl.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: id, Name: "snap-src"})
	if err != nil {
		t.Fatal(err)
	}
	snapID := snap.GetSnapshot().GetSnapshotId()
	for deadline := time.Now().Add(30 * time.Second); !snap.GetSnapshot().GetReadyToUse(); {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot not ready after 30s: %v", snap)
		}
		time.Sleep(100 * time.Millisecond)
		l, err := ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SnapshotId: snapID})
		if err != nil || len(l.GetEntries()) != 1 {
			t.Fatalf("ListSnapshots: %v %v", l, err)
		}
		snap = &csipb.CreateSnapshotResponse{Snapshot: l.GetEntries()[0].GetSnapshot()}
	}
	withEngine(id, write(pattern(0x3c))) // the head moves on; the snapshot must not

	for i := range 2 { // the provisioner retries: every answer is OK
		if _, err := ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatalf("DeleteVolume of a volume with a snapshot (call %d): %v", i+1, err)
		}
	}
	if _, err := ctrl.ControllerGetVolume(ctx, &csipb.ControllerGetVolumeRequest{VolumeId: id}); status.Code(err) != codes.NotFound {
		t.Errorf("ControllerGetVolume of the deleted volume: %v, want NotFound", err)
	}
	if _, err := ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: rwoCap()}); status.Code(err) != codes.NotFound {
		t.Errorf("ControllerPublishVolume of the deleted volume: %v, want NotFound", err)
	}
	list, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list.GetEntries() {
		if e.GetVolume().GetVolumeId() == id {
			t.Errorf("ListVolumes lists the deleted volume: %v", e)
		}
	}
	if again := create("pvc-src", size, nil); again == id {
		t.Errorf("CreateVolume with the deleted volume's name answered the deleted volume %s", id)
	} else if _, err := ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: again}); err != nil {
		t.Fatal(err)
	}

	// Restore into a larger volume: the snapshot's bytes, zeros beyond.
	restored := create("pvc-restored", 2*size, &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
		Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}})
	waitFilled(t, ctx, cl, restored)
	withEngine(restored, func(e *engine.Engine) {
		got := make([]byte, 2*size)
		if err := e.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[:size], snapData) {
			t.Error("the restored volume does not hold the snapshot's data")
		}
		if !bytes.Equal(got[size:], make([]byte, size)) {
			t.Error("the restored volume is not zero beyond the snapshot's size")
		}
	})

	for i := range 2 {
		if _, err := ctrl.DeleteSnapshot(ctx, &csipb.DeleteSnapshotRequest{SnapshotId: snapID}); err != nil {
			t.Fatalf("DeleteSnapshot (call %d): %v", i+1, err)
		}
	}
	if _, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}}); status.Code(err) != codes.NotFound {
		t.Errorf("the deleted volume after its last snapshot was deleted: %v, want NotFound", err)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: restored}); err != nil {
		t.Fatal(err)
	}
	if got := allocated(); got != baseline {
		t.Errorf("servers have %d bytes allocated after every volume went, want %d as before", got, baseline)
	}
}
