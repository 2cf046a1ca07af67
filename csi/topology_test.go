package csi

import (
	"context"
	"math"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

func TestCapacity(t *testing.T) {
	const g = 1 << 30
	for _, tc := range []struct {
		name           string
		free           []uint64
		replicas       int
		avail, maximum uint64
	}{
		{"fewer servers than replicas", []uint64{g, g}, 3, 0, 0},
		{"three equal", []uint64{g, g, g}, 3, g, g},
		{"three unequal, replicas 3", []uint64{3 * g, 2 * g, g}, 3, g, g},
		// Two replicas over 3+2+1 GiB: at most min(6/2, (2+1)/1) = 3 GiB
		// of volumes; the largest volume is the second largest free space.
		{"three unequal, replicas 2", []uint64{3 * g, 2 * g, g}, 2, 3 * g, 2 * g},
		// One huge server cannot hold two replicas of one volume.
		{"one huge server", []uint64{100 * g, g, g}, 2, 2 * g, g},
		{"one replica", []uint64{g, 2 * g}, 1, 3 * g, 2 * g},
		{"rounded down to blocks", []uint64{g + 100, g + 100}, 2, g, g},
		{"unreported capacity is unlimited", []uint64{math.MaxUint64, math.MaxUint64}, 2, math.MaxInt64 / BlockSize * BlockSize, MaxVolumeSize},
		{"none", nil, 1, 0, 0},
	} {
		avail, maximum := capacity(tc.free, tc.replicas)
		if avail != tc.avail || maximum != tc.maximum {
			t.Errorf("%s: capacity(%v, %d) = %d, %d; want %d, %d", tc.name, tc.free, tc.replicas, avail, maximum, tc.avail, tc.maximum)
		}
	}
}

func TestCapacityZones(t *testing.T) {
	nodes := []*storpb.Node{{Id: "w1", Zone: "a"}, {Id: "w2", Zone: "b"}, {Id: "w3"}}
	if _, all := capacityZones("", false, nodes); !all {
		t.Error("a segment without a zone restricts placement")
	}
	zones, all := capacityZones("c", true, nodes)
	if all || len(zones) != 3 || !zones["a"] || !zones["b"] || !zones["c"] {
		t.Errorf("zone c with nodes in a, b and none: %v, all %v; want a, b, c", zones, all)
	}
}

// zonedCluster is three servers in zones zone-a, zone-b, zone-c with the
// given capacities, each on Kubernetes node k8s-<zone>, and a driver
// (controller and node) whose node is worker-a in zone-a; worker-b and
// worker-c register as their node plugins would.
func zonedCluster(t *testing.T, capacities [3]uint64) (*servertest.Cluster, *Driver, csipb.ControllerClient) {
	t.Helper()
	zones := []string{"zone-a", "zone-b", "zone-c"}
	c := servertest.NewCluster(t, servertest.Options{Servers: 3, Configure: func(i int, cfg *server.Config) {
		cfg.Zone, cfg.Capacity, cfg.KubernetesNode = zones[i], capacities[i], "k8s-"+zones[i]
	}})
	cl := clusterClient(t, c)
	att := newFakeAttacher(cl.Volumes)
	host, _, _ := fakeHost(att)
	endpoint, d := startDriverAs(t, c, t.TempDir(), "worker-a", "zone-a", att, host)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, n := range []*storpb.Node{{Id: "worker-b", Zone: "zone-b"}, {Id: "worker-c", Zone: "zone-c"}} {
		if _, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: n}); err != nil {
			t.Fatal(err)
		}
	}
	return c, d, csipb.NewControllerClient(dialCSI(t, endpoint))
}

// provisionerRequirement is the accessibility requirement csi-provisioner
// builds for a WaitForFirstConsumer claim without --strict-topology: the
// requisite holds the segment of every node, the preferred ones are the
// same with the selected node's first.
func provisionerRequirement(d *Driver, selected int, segs ...map[string]string) *csipb.TopologyRequirement {
	var req, pref []*csipb.Topology
	for i := range segs {
		req = append(req, &csipb.Topology{Segments: segs[i]})
		pref = append(pref, &csipb.Topology{Segments: segs[(selected+i)%len(segs)]})
	}
	return &csipb.TopologyRequirement{Requisite: req, Preferred: pref}
}

func (d *Driver) seg(node, zone string) map[string]string {
	m := map[string]string{d.nodeKey(): node}
	if zone != "" {
		m[d.zoneKey()] = zone
	}
	return m
}

// GetCapacity for the segments csi-provisioner's capacity controller asks
// about (a Kubernetes node that runs no stor-server, with its zone; a zone
// alone) answers what CreateVolume then really gives: with three servers
// in three zones and three replicas, the smallest server's free space.
// Before, a node segment had to name a server id (every real node got 0,
// and the scheduler rejected every node for every WaitForFirstConsumer
// claim), and a zone segment counted only that zone's one server (0 for
// three replicas).
func TestGetCapacityIsWhatAClaimGets(t *testing.T) {
	const g = 1 << 30
	_, d, ctrl := zonedCluster(t, [3]uint64{3 * g, 2 * g, g + 5*BlockSize})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	params := map[string]string{ParamReplicas: "3"}
	want := int64(g + 5*BlockSize)
	for _, seg := range []map[string]string{
		d.seg("worker-a", "zone-a"),
		{d.zoneKey(): "zone-b"},
		nil,
	} {
		var topo *csipb.Topology
		if seg != nil {
			topo = &csipb.Topology{Segments: seg}
		}
		got, err := ctrl.GetCapacity(ctx, &csipb.GetCapacityRequest{
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: params, AccessibleTopology: topo,
		})
		if err != nil {
			t.Fatalf("GetCapacity %v: %v", seg, err)
		}
		if got.GetAvailableCapacity() != want || got.GetMaximumVolumeSize().GetValue() != want {
			t.Errorf("GetCapacity %v: available %d, maximum %d; want %d and %d", seg, got.GetAvailableCapacity(), got.GetMaximumVolumeSize().GetValue(), want, want)
		}
	}
	access := provisionerRequirement(d, 0, d.seg("worker-a", "zone-a"), d.seg("worker-b", "zone-b"), d.seg("worker-c", "zone-c"))
	create := func(name string, size int64) error {
		_, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: params,
			AccessibilityRequirements: access,
		})
		return err
	}
	if err := create("too-big", want+BlockSize); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("CreateVolume one block above the maximum: %v, want ResourceExhausted", err)
	}
	if err := create("just-fits", want); err != nil {
		t.Fatalf("CreateVolume of the maximum GetCapacity gave: %v", err)
	}
}

// hasAccess reports whether a node with these labels matches the node
// affinity csi-provisioner makes of an accessible topology
// (GenerateVolumeNodeAffinity: one term per topology, every segment
// required; no topology, no affinity).
func hasAccess(accessible []*csipb.Topology, labels map[string]string) bool {
	if len(accessible) == 0 {
		return true
	}
	for _, t := range accessible {
		ok := true
		for k, v := range t.GetSegments() {
			if l, has := labels[k]; !has || l != v {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// A volume created from requisite segments that each carry a node key
// comes back with the zones only: a node added later in one of those zones
// can use the PV. Before, the accessible topology was the requisite
// itself, every node of that moment: a PV nodeAffinity that refuses every
// node added later.
func TestAccessibleTopologyHasNoNode(t *testing.T) {
	_, d, ctrl := zonedCluster(t, [3]uint64{1 << 40, 1 << 40, 1 << 40})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	later := d.seg("worker-new", "zone-b") // a node added after provisioning
	check := func(what string, got []*csipb.Topology, wantZones int) {
		t.Helper()
		zones := map[string]bool{}
		for _, tp := range got {
			if _, ok := tp.GetSegments()[d.nodeKey()]; ok || len(tp.GetSegments()) != 1 {
				t.Errorf("%s: accessible topology %v holds more than a zone", what, got)
			}
			zones[tp.GetSegments()[d.zoneKey()]] = true
		}
		if len(got) != wantZones || len(zones) != wantZones {
			t.Errorf("%s: accessible topology %v, want %d distinct zones", what, got, wantZones)
		}
		if !hasAccess(got, later) {
			t.Errorf("%s: accessible topology %v refuses a node added later (%v)", what, got, later)
		}
	}
	// Two nodes in zone-a, one each in zone-b and zone-c.
	access := provisionerRequirement(d, 1, d.seg("worker-a", "zone-a"), d.seg("worker-a2", "zone-a"), d.seg("worker-b", "zone-b"), d.seg("worker-c", "zone-c"))
	req := &csipb.CreateVolumeRequest{
		Name: "zoned", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, AccessibilityRequirements: access,
	}
	for _, again := range []string{"CreateVolume", "CreateVolume again"} {
		resp, err := ctrl.CreateVolume(ctx, req)
		if err != nil {
			t.Fatalf("%s: %v", again, err)
		}
		check(again, resp.GetVolume().GetAccessibleTopology(), 3)
	}
	got, err := ctrl.ListVolumes(ctx, &csipb.ListVolumesRequest{})
	if err != nil || len(got.GetEntries()) != 1 {
		t.Fatalf("ListVolumes: %v, %v", got, err)
	}
	check("ListVolumes", got.GetEntries()[0].GetVolume().GetAccessibleTopology(), 3)

	// Nodes without a zone: nothing constrains access.
	resp, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "anywhere", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities:        []*csipb.VolumeCapability{rwoCap()},
		AccessibilityRequirements: provisionerRequirement(d, 0, d.seg("worker-x", ""), d.seg("worker-y", "")),
	})
	if err != nil {
		t.Fatal(err)
	}
	if tp := resp.GetVolume().GetAccessibleTopology(); len(tp) != 0 {
		t.Errorf("requisite nodes without a zone: accessible topology %v, want none", tp)
	}
}

// Data locality: a CreateVolume whose preferred topology names the
// Kubernetes node a server runs on (not its id, as deploy/ gives servers
// pod names) puts the replica on that server. Before, the "node" segment
// matched server ids only, and the replica went by capacity and id.
func TestCreateVolumePrefersKubernetesNode(t *testing.T) {
	const g = 1 << 30
	// zone-c's server is the smallest: without locality it ranks last.
	c, d, ctrl := zonedCluster(t, [3]uint64{3 * g, 3 * g, 2 * g})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	servers, err := c.Client(0).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range servers.GetServers() {
		if s.GetKubernetesNode() != "k8s-"+s.GetZone() {
			t.Errorf("server %s registered Kubernetes node %q, want %q", s.GetId(), s.GetKubernetesNode(), "k8s-"+s.GetZone())
		}
	}
	resp, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: "local", CapacityRange: &csipb.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: map[string]string{ParamReplicas: "1"},
		AccessibilityRequirements: provisionerRequirement(d, 2,
			d.seg("k8s-zone-a", "zone-a"), d.seg("k8s-zone-b", "zone-b"), d.seg("k8s-zone-c", "zone-c")),
	})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Client(0).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: resp.GetVolume().GetVolumeId()}})
	if err != nil {
		t.Fatal(err)
	}
	if r := v.GetVolume().GetReplicas(); len(r) != 1 || r[0].GetServerId() != c.Nodes[2].ID {
		t.Errorf("replicas %v, want one on %s (Kubernetes node k8s-zone-c)", r, c.Nodes[2].ID)
	}
}

// GetCapacity counts free space with the cluster's over-provisioning
// ratio, as placement does: the maximum it answers is what CreateVolume
// places, at 300% and again after the ratio is lowered.
func TestGetCapacityFollowsOverProvisioning(t *testing.T) {
	const g = 1 << 30
	c, _, ctrl := zonedCluster(t, [3]uint64{g, g, g})
	cl := clusterClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	params := map[string]string{ParamReplicas: "3"}
	setRatio := func(percent uint32) {
		t.Helper()
		if _, err := cl.Cluster.SetClusterConfig(ctx, &storpb.SetClusterConfigRequest{Config: &storpb.ClusterConfig{OverProvisioningPercent: percent}}); err != nil {
			t.Fatalf("SetClusterConfig %d%%: %v", percent, err)
		}
	}
	capacity := func() (available, maximum int64) {
		t.Helper()
		got, err := ctrl.GetCapacity(ctx, &csipb.GetCapacityRequest{VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: params})
		if err != nil {
			t.Fatalf("GetCapacity: %v", err)
		}
		return got.GetAvailableCapacity(), got.GetMaximumVolumeSize().GetValue()
	}
	create := func(name string, size int64) error {
		_, err := ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
			Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: params,
		})
		return err
	}
	setRatio(300)
	if avail, maxSize := capacity(); avail != 3*g || maxSize != 3*g {
		t.Fatalf("GetCapacity at 300%%: available %d, maximum %d; want %d", avail, maxSize, 3*g)
	}
	if err := create("too-big", 3*g+BlockSize); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("CreateVolume one block above the maximum: %v, want ResourceExhausted", err)
	}
	if err := create("fits", 2*g); err != nil {
		t.Fatalf("CreateVolume of 2 GiB at 300%%: %v", err)
	}
	if avail, maxSize := capacity(); avail != g || maxSize != g {
		t.Fatalf("GetCapacity at 300%% with 2 GiB provisioned: available %d, maximum %d; want %d", avail, maxSize, g)
	}
	setRatio(100)
	if avail, maxSize := capacity(); avail != 0 || maxSize != 0 {
		t.Fatalf("GetCapacity back at 100%% with 2 GiB provisioned: available %d, maximum %d; want 0", avail, maxSize)
	}
	if err := create("refused", BlockSize); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("CreateVolume back at 100%%: %v, want ResourceExhausted", err)
	}
}

// GetCapacity leaves out cordoned servers, as placement does: with one of
// three servers cordoned a 3-replica volume fits nowhere.
func TestGetCapacitySkipsCordonedServers(t *testing.T) {
	const g = 1 << 30
	c, _, ctrl := zonedCluster(t, [3]uint64{g, g, g})
	cl := clusterClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	capacity := func() int64 {
		t.Helper()
		got, err := ctrl.GetCapacity(ctx, &csipb.GetCapacityRequest{VolumeCapabilities: []*csipb.VolumeCapability{rwoCap()}, Parameters: map[string]string{ParamReplicas: "3"}})
		if err != nil {
			t.Fatalf("GetCapacity: %v", err)
		}
		return got.GetMaximumVolumeSize().GetValue()
	}
	cordon := func(on bool) {
		t.Helper()
		if _, err := cl.Cluster.CordonServer(ctx, &storpb.CordonServerRequest{ServerId: c.Nodes[0].ID, Cordoned: on}); err != nil {
			t.Fatalf("CordonServer %v: %v", on, err)
		}
	}
	cordon(true)
	if got := capacity(); got != 0 {
		t.Fatalf("GetCapacity with one of three servers cordoned: maximum %d, want 0", got)
	}
	cordon(false)
	if got := capacity(); got != g {
		t.Fatalf("GetCapacity after uncordon: maximum %d, want %d", got, g)
	}
}
