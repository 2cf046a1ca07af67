package ctl

import (
	"bytes"
	"context"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// testNow is the clock stor-ctl runs with in these tests.
var testNow = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// ---------------------------------------------------------------- fakes

type fakeCluster struct {
	storpb.UnimplementedClusterServiceServer
	status      *storpb.StatusResponse
	servers     []*storpb.Server
	nodes       []*storpb.Node
	unavailable bool // answer every call Unavailable ("no leader")

	mu   sync.Mutex
	left []string
}

func (f *fakeCluster) Status(context.Context, *storpb.StatusRequest) (*storpb.StatusResponse, error) {
	if f.unavailable {
		return nil, status.Error(codes.Unavailable, "no leader")
	}
	return f.status, nil
}

func (f *fakeCluster) ListServers(context.Context, *storpb.ListServersRequest) (*storpb.ListServersResponse, error) {
	return &storpb.ListServersResponse{Servers: f.servers}, nil
}

func (f *fakeCluster) ListNodes(context.Context, *storpb.ListNodesRequest) (*storpb.ListNodesResponse, error) {
	return &storpb.ListNodesResponse{Nodes: f.nodes}, nil
}

func (f *fakeCluster) Leave(_ context.Context, req *storpb.LeaveRequest) (*storpb.LeaveResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.left = append(f.left, req.GetServerId())
	return &storpb.LeaveResponse{}, nil
}

// fakeVolumes serves a fixed set of volumes. ListVolumes answers in two
// pages: the first pageSplit volumes, then the rest.
type fakeVolumes struct {
	storpb.UnimplementedVolumeServiceServer
	volumes   []*storpb.Volume
	pageSplit int
	// errFor makes GetVolume of that name fail with the error.
	errFor map[string]error
	// retained names the volumes DeleteVolume keeps for their snapshots.
	retained map[string]bool

	mu         sync.Mutex
	creates    []*storpb.CreateVolumeRequest
	gets       []*storpb.VolumeRef
	listReqs   []*storpb.ListVolumesRequest
	deletes    []*storpb.VolumeRef
	expansions []*storpb.ExpandVolumeRequest
	replaces   []*storpb.ReplaceReplicaRequest
}

func (f *fakeVolumes) ReplaceReplica(_ context.Context, req *storpb.ReplaceReplicaRequest) (*storpb.ReplaceReplicaResponse, error) {
	f.mu.Lock()
	f.replaces = append(f.replaces, req)
	f.mu.Unlock()
	v, err := f.find(req.GetVolume())
	if err != nil {
		return nil, err
	}
	if req.GetReplicaId() == "r-1" && req.GetRemoveOnly() {
		return nil, status.Error(codes.FailedPrecondition, `replica "r-1" is the last healthy replica of volume "db"`)
	}
	return &storpb.ReplaceReplicaResponse{Volume: v}, nil
}

func (f *fakeVolumes) find(ref *storpb.VolumeRef) (*storpb.Volume, error) {
	for _, v := range f.volumes {
		if (ref.GetId() != "" && v.GetId() == ref.GetId()) || (ref.GetName() != "" && v.GetName() == ref.GetName()) {
			return v, nil
		}
	}
	if ref.GetId() != "" {
		return nil, status.Errorf(codes.NotFound, "volume id %q not found", ref.GetId())
	}
	return nil, status.Errorf(codes.NotFound, "volume %q not found", ref.GetName())
}

func (f *fakeVolumes) CreateVolume(_ context.Context, req *storpb.CreateVolumeRequest) (*storpb.CreateVolumeResponse, error) {
	f.mu.Lock()
	f.creates = append(f.creates, req)
	f.mu.Unlock()
	return &storpb.CreateVolumeResponse{Volume: &storpb.Volume{
		Id:           "vol-new",
		Name:         req.GetName(),
		SizeBytes:    req.GetSizeBytes(),
		ReplicaCount: req.GetReplicaCount(),
		Parameters:   req.GetParameters(),
		State:        storpb.VolumeState_VOLUME_STATE_AVAILABLE,
		Generation:   1,
	}}, nil
}

func (f *fakeVolumes) GetVolume(_ context.Context, req *storpb.GetVolumeRequest) (*storpb.GetVolumeResponse, error) {
	f.mu.Lock()
	f.gets = append(f.gets, req.GetVolume())
	f.mu.Unlock()
	if err := f.errFor[req.GetVolume().GetName()]; err != nil {
		return nil, err
	}
	v, err := f.find(req.GetVolume())
	if err != nil {
		return nil, err
	}
	return &storpb.GetVolumeResponse{Volume: v}, nil
}

func (f *fakeVolumes) ListVolumes(_ context.Context, req *storpb.ListVolumesRequest) (*storpb.ListVolumesResponse, error) {
	f.mu.Lock()
	f.listReqs = append(f.listReqs, req)
	f.mu.Unlock()
	switch req.GetPageToken() {
	case "":
		return &storpb.ListVolumesResponse{Volumes: f.volumes[:f.pageSplit], NextPageToken: "page-2"}, nil
	case "page-2":
		return &storpb.ListVolumesResponse{Volumes: f.volumes[f.pageSplit:]}, nil
	}
	return nil, status.Errorf(codes.InvalidArgument, "bad page token %q", req.GetPageToken())
}

func (f *fakeVolumes) DeleteVolume(_ context.Context, req *storpb.DeleteVolumeRequest) (*storpb.DeleteVolumeResponse, error) {
	f.mu.Lock()
	f.deletes = append(f.deletes, req.GetVolume())
	f.mu.Unlock()
	v, err := f.find(req.GetVolume())
	if err != nil {
		return nil, err
	}
	if f.retained[v.GetName()] {
		kept := proto.Clone(v).(*storpb.Volume)
		kept.State, kept.DeletedUnixNano = storpb.VolumeState_VOLUME_STATE_DELETED, testNow.UnixNano()
		return &storpb.DeleteVolumeResponse{Retained: kept}, nil
	}
	return &storpb.DeleteVolumeResponse{}, nil
}

func (f *fakeVolumes) ExpandVolume(_ context.Context, req *storpb.ExpandVolumeRequest) (*storpb.ExpandVolumeResponse, error) {
	f.mu.Lock()
	f.expansions = append(f.expansions, req)
	f.mu.Unlock()
	v, err := f.find(req.GetVolume())
	if err != nil {
		return nil, err
	}
	if req.GetSizeBytes() < v.GetSizeBytes() {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q: cannot shrink from %d to %d bytes", v.GetName(), v.GetSizeBytes(), req.GetSizeBytes())
	}
	grown := proto.Clone(v).(*storpb.Volume)
	grown.SizeBytes = req.GetSizeBytes()
	return &storpb.ExpandVolumeResponse{Volume: grown}, nil
}

type fakeSnapshots struct {
	storpb.UnimplementedSnapshotServiceServer
	snapshots []*storpb.Snapshot

	mu       sync.Mutex
	creates  []*storpb.CreateSnapshotRequest
	listReqs []*storpb.ListSnapshotsRequest
	deletes  []*storpb.SnapshotRef
}

func (f *fakeSnapshots) CreateSnapshot(_ context.Context, req *storpb.CreateSnapshotRequest) (*storpb.CreateSnapshotResponse, error) {
	f.mu.Lock()
	f.creates = append(f.creates, req)
	f.mu.Unlock()
	return &storpb.CreateSnapshotResponse{Snapshot: &storpb.Snapshot{
		Id: "snap-new", Name: req.GetName(), VolumeId: req.GetVolumeId(), ReadyToUse: true,
	}}, nil
}

func (f *fakeSnapshots) GetSnapshot(_ context.Context, req *storpb.GetSnapshotRequest) (*storpb.GetSnapshotResponse, error) {
	for _, s := range f.snapshots {
		if s.GetName() == req.GetSnapshot().GetName() || s.GetId() == req.GetSnapshot().GetId() {
			return &storpb.GetSnapshotResponse{Snapshot: s}, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "snapshot %q not found", req.GetSnapshot().GetName())
}

func (f *fakeSnapshots) ListSnapshots(_ context.Context, req *storpb.ListSnapshotsRequest) (*storpb.ListSnapshotsResponse, error) {
	f.mu.Lock()
	f.listReqs = append(f.listReqs, req)
	f.mu.Unlock()
	resp := &storpb.ListSnapshotsResponse{}
	for _, s := range f.snapshots {
		if req.GetVolumeId() == "" || s.GetVolumeId() == req.GetVolumeId() {
			resp.Snapshots = append(resp.Snapshots, s)
		}
	}
	return resp, nil
}

func (f *fakeSnapshots) DeleteSnapshot(_ context.Context, req *storpb.DeleteSnapshotRequest) (*storpb.DeleteSnapshotResponse, error) {
	f.mu.Lock()
	f.deletes = append(f.deletes, req.GetSnapshot())
	f.mu.Unlock()
	return &storpb.DeleteSnapshotResponse{}, nil
}

// ---------------------------------------------------------------- harness

type fakeCluster3 struct {
	addr      string
	cluster   *fakeCluster
	volumes   *fakeVolumes
	snapshots *fakeSnapshots
}

func healthy(id, server string) *storpb.Replica {
	return &storpb.Replica{Id: id, ServerId: server, State: storpb.ReplicaState_REPLICA_STATE_HEALTHY, Generation: 1}
}

// newFake serves fakes holding a small cluster on 127.0.0.1:0.
func newFake(t *testing.T) *fakeCluster3 {
	t.Helper()
	f := &fakeCluster3{
		cluster: &fakeCluster{
			status: &storpb.StatusResponse{
				ClusterId: "c-7f3a", ServerId: "s1", RaftState: "Leader",
				LeaderId: "s1", LeaderAddress: "10.0.0.1:7400",
				Term: 4, LastIndex: 120, CommitIndex: 119, AppliedIndex: 118,
				Members: []*storpb.Member{
					{Id: "s1", RaftAddress: "10.0.0.1:7401", Address: "10.0.0.1:7400", Suffrage: storpb.Suffrage_SUFFRAGE_VOTER, State: storpb.ServerState_SERVER_STATE_UP},
					{Id: "s4", RaftAddress: "10.0.0.4:7401", Suffrage: storpb.Suffrage_SUFFRAGE_NONVOTER},
				},
			},
			servers: []*storpb.Server{
				{Id: "s1", Address: "10.0.0.1:7400", Zone: "a", State: storpb.ServerState_SERVER_STATE_UP,
					CapacityBytes: 1 << 40, AllocatedBytes: 30 << 30, UsedBytes: 12 << 30, LastSeenUnixNano: testNow.Add(-2 * time.Second).UnixNano()},
				{Id: "s2", Address: "10.0.0.2:7400", State: storpb.ServerState_SERVER_STATE_DOWN,
					CapacityBytes: 512 << 30},
			},
			nodes: []*storpb.Node{
				{Id: "worker-1", Zone: "a", Labels: map[string]string{"pool": "gpu", "arch": "arm64"},
					RegisteredUnixNano:     testNow.Add(-3 * 24 * time.Hour).UnixNano(),
					LastRegisteredUnixNano: testNow.Add(-5 * time.Minute).UnixNano()},
				{Id: "worker-2", RegisteredUnixNano: testNow.Add(-7 * time.Second).UnixNano(),
					LastRegisteredUnixNano: testNow.Add(-7 * time.Second).UnixNano()},
			},
		},
		volumes: &fakeVolumes{
			volumes: []*storpb.Volume{
				{Id: "vol-1", Name: "db", SizeBytes: 10 << 30, ReplicaCount: 3, State: storpb.VolumeState_VOLUME_STATE_AVAILABLE,
					Epoch: 7, Generation: 12, CreatedUnixNano: time.Date(2026, 2, 1, 8, 30, 0, 0, time.UTC).UnixNano(),
					Attachment: &storpb.Attachment{NodeId: "node-a", Mode: storpb.AccessMode_ACCESS_MODE_READ_WRITE},
					Replicas: []*storpb.Replica{
						healthy("r-1", "s1"), healthy("r-2", "s2"),
						{Id: "r-3", ServerId: "s3", State: storpb.ReplicaState_REPLICA_STATE_REBUILDING, Generation: 12,
							RebuildFromGeneration: 9, RebuildDoneBytes: 3 << 30, RebuildTotalBytes: 4 << 30,
							StateSinceUnixNano: testNow.Add(-90 * time.Second).UnixNano()},
					}},
				{Id: "vol-2", Name: "logs", SizeBytes: 1610612736, ReplicaCount: 2, State: storpb.VolumeState_VOLUME_STATE_CREATING,
					Replicas: []*storpb.Replica{healthy("r-4", "s1"), healthy("r-5", "s2")}},
				{Id: "vol-3", Name: "cache", SizeBytes: 512 << 20, ReplicaCount: 1, State: storpb.VolumeState_VOLUME_STATE_AVAILABLE,
					Replicas: []*storpb.Replica{healthy("r-6", "s3")}},
			},
			pageSplit: 2,
			errFor: map[string]error{
				"busy":   status.Error(codes.FailedPrecondition, `volume "busy" is attached to node-b`),
				"silent": status.Error(codes.PermissionDenied, ""),
			},
		},
		snapshots: &fakeSnapshots{
			snapshots: []*storpb.Snapshot{
				{Id: "snap-1", Name: "nightly", VolumeId: "vol-1", SizeBytes: 10 << 30, ReadyToUse: true,
					CreatedUnixNano: time.Date(2026, 2, 28, 0, 0, 0, 0, time.UTC).UnixNano(),
					Replicas: []*storpb.SnapshotReplica{
						{ReplicaId: "vol-1-r1", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT},
						{ReplicaId: "vol-1-r2", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST},
						{ReplicaId: "vol-1-r3", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_MISSED},
					}},
				{Id: "snap-2", Name: "pre-upgrade", VolumeId: "vol-2", SizeBytes: 1 << 30},
			},
		},
	}
	f.addr = serve(t, f.cluster, f.volumes, f.snapshots)
	return f
}

func serve(t *testing.T, cluster *fakeCluster, volumes *fakeVolumes, snapshots *fakeSnapshots) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	storpb.RegisterClusterServiceServer(srv, cluster)
	storpb.RegisterVolumeServiceServer(srv, volumes)
	storpb.RegisterSnapshotServiceServer(srv, snapshots)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return addr
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs stor-ctl in-process with args, with --insecure (the test
// clusters are plaintext on loopback) unless args choose TLS or
// --insecure themselves.
func run(t *testing.T, args ...string) result {
	t.Helper()
	return runAsIs(t, plaintext(args)...)
}

// plaintext prepends --insecure to args unless they name --insecure or a
// --tls- flag.
func plaintext(args []string) []string {
	for _, a := range args {
		if a == "--insecure" || strings.HasPrefix(a, "--tls-") {
			return args
		}
	}
	return append([]string{"--insecure"}, args...)
}

// runAsIs runs stor-ctl in-process with exactly args.
func runAsIs(t *testing.T, args ...string) result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := execute(&app{stdout: &stdout, stderr: &stderr, now: func() time.Time { return testNow }}, args)
	return result{code, stdout.String(), stderr.String()}
}

// mustRun runs stor-ctl and fails the test unless it exits 0.
func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	r := run(t, args...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("stor-ctl %s: exit %d, stderr %q", strings.Join(args, " "), r.code, r.stderr)
	}
	return r.stdout
}

var cellSep = regexp.MustCompile(`\s{2,}`)

// cells splits a table or details line into its cells (columns are at
// least two spaces apart; cells hold at most single spaces).
func cells(line string) []string {
	return cellSep.Split(strings.TrimSpace(line), -1)
}

// rowStarting returns the cells of the first line whose first cell is
// first.
func rowStarting(t *testing.T, out, first string) []string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if c := cells(line); c[0] == first {
			return c
		}
	}
	t.Fatalf("no line starting with %q in output:\n%s", first, out)
	return nil
}

func assertCells(t *testing.T, out string, want ...string) {
	t.Helper()
	got := rowStarting(t, out, want[0])
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("row %q = %q, want %q\noutput:\n%s", want[0], got, want, out)
	}
}

// ---------------------------------------------------------------- tests

func TestClusterStatus(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "cluster", "status")
	for _, want := range [][]string{
		{"CLUSTER ID:", "c-7f3a"},
		{"SERVER:", "s1"},
		{"RAFT STATE:", "Leader"},
		{"LEADER:", "s1 (10.0.0.1:7400)"},
		{"TERM:", "4"},
		{"LAST INDEX:", "120"},
		{"COMMIT INDEX:", "119"},
		{"APPLIED INDEX:", "118"},
		{"ID", "RAFT ADDRESS", "ADDRESS", "SUFFRAGE", "STATE"},
		{"s1", "10.0.0.1:7401", "10.0.0.1:7400", "voter", "up"},
		{"s4", "10.0.0.4:7401", "-", "nonvoter", "-"},
	} {
		assertCells(t, out, want...)
	}
}

func TestServerList(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "server", "list")
	assertCells(t, out, "ID", "ADDRESS", "ZONE", "STATE", "CAPACITY", "PROVISIONED", "PROVISIONABLE", "USED", "LAST SEEN")
	// The fake answers no over-provisioning ratio, as a cluster older than
	// it does: 100%.
	assertCells(t, out, "s1", "10.0.0.1:7400", "a", "up", "1 TiB", "30 GiB", "994 GiB", "12 GiB", "2s ago")
	assertCells(t, out, "s2", "10.0.0.2:7400", "-", "down", "512 GiB", "0 B", "512 GiB", "-", "-")
}

func TestNodeList(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "node", "list")
	assertCells(t, out, "ID", "ZONE", "LABELS", "REGISTERED", "LAST REGISTERED")
	assertCells(t, out, "worker-1", "a", "arch=arm64,pool=gpu", "3d ago", "5m ago")
	assertCells(t, out, "worker-2", "-", "-", "7s ago", "7s ago")
}

func TestServerRemove(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "server", "remove", "s2")
	if !strings.Contains(out, `server "s2" removed`) {
		t.Errorf("output %q does not confirm the removal", out)
	}
	if got := f.cluster.left; len(got) != 1 || got[0] != "s2" {
		t.Fatalf("Leave calls = %q, want [s2]", got)
	}
}

func TestVolumeCreateSendsRequest(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "volume", "create", "pg", "--size", "10GiB", "--replicas", "3",
		"--param", "fs=xfs", "--param", "tier=fast", "--zone", "a", "--zone", "b", "--node", "s2")

	if len(f.volumes.creates) != 1 {
		t.Fatalf("server saw %d CreateVolume calls, want 1", len(f.volumes.creates))
	}
	want := &storpb.CreateVolumeRequest{
		Name:         "pg",
		SizeBytes:    10737418240,
		ReplicaCount: 3,
		Parameters:   map[string]string{"fs": "xfs", "tier": "fast"},
		Accessibility: &storpb.TopologyRequirement{
			Requisite: []*storpb.Topology{{Segments: map[string]string{"zone": "a"}}, {Segments: map[string]string{"zone": "b"}}},
			Preferred: []*storpb.Topology{{Segments: map[string]string{"node": "s2"}}},
		},
	}
	if got := f.volumes.creates[0]; !proto.Equal(got, want) {
		t.Fatalf("CreateVolume request =\n%v\nwant\n%v", got, want)
	}
	// The created volume is printed as "volume get" prints it.
	assertCells(t, out, "NAME:", "pg")
	assertCells(t, out, "SIZE:", "10 GiB")
	assertCells(t, out, "REPLICAS:", "3")
	assertCells(t, out, "PARAMETERS:", "fs=xfs,tier=fast")
}

func TestVolumeCreateDefaultsLeaveTheServerToChoose(t *testing.T) {
	f := newFake(t)
	mustRun(t, "--server", f.addr, "volume", "create", "small", "--size", "1.5GiB")
	got := f.volumes.creates[0]
	if got.GetSizeBytes() != 1610612736 || got.GetReplicaCount() != 0 || got.GetAccessibility() != nil || got.GetParameters() != nil {
		t.Fatalf("CreateVolume request = %v, want size 1610612736 and nothing else set", got)
	}
}

func TestVolumeGet(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "volume", "get", "db")
	for _, want := range [][]string{
		{"ID:", "vol-1"},
		{"NAME:", "db"},
		{"SIZE:", "10 GiB"},
		{"REPLICAS:", "3"},
		{"STATE:", "available"},
		{"EPOCH:", "7"},
		{"GENERATION:", "12"},
		{"ATTACHED:", "node-a (read-write)"},
		{"CREATED:", "2026-02-01T08:30:00Z"},
		{"REPLICA", "SERVER", "STATE", "GENERATION", "REBUILD", "SINCE"},
		{"r-1", "s1", "healthy", "1", "-", "-"},
		{"r-3", "s3", "rebuilding", "12", "delta 75%", "1m ago"},
	} {
		assertCells(t, out, want...)
	}
	if ref := f.volumes.gets[0]; ref.GetName() != "db" || ref.GetId() != "" {
		t.Fatalf("GetVolume ref = %v, want name db", ref)
	}

	// Detached.
	out = mustRun(t, "--server", f.addr, "volume", "get", "cache")
	assertCells(t, out, "ATTACHED:", "-")
}

func TestVolumeGetByID(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "volume", "get", "--id", "vol-2")
	assertCells(t, out, "NAME:", "logs")
	assertCells(t, out, "SIZE:", "1.5 GiB")
	if ref := f.volumes.gets[0]; ref.GetId() != "vol-2" || ref.GetName() != "" {
		t.Fatalf("GetVolume ref = %v, want id vol-2", ref)
	}
}

func TestVolumeListPages(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "volume", "list")
	assertCells(t, out, "NAME", "ID", "SIZE", "REPLICAS", "STATE", "ATTACHED")
	assertCells(t, out, "db", "vol-1", "10 GiB", "2/3", "available", "node-a")
	assertCells(t, out, "logs", "vol-2", "1.5 GiB", "2/2", "creating", "-")
	assertCells(t, out, "cache", "vol-3", "512 MiB", "1/1", "available", "-") // from the second page
	if lines := strings.Count(strings.TrimSpace(out), "\n") + 1; lines != 4 {
		t.Errorf("volume list printed %d lines, want a header and 3 volumes:\n%s", lines, out)
	}

	reqs := f.volumes.listReqs
	if len(reqs) != 2 {
		t.Fatalf("server saw %d ListVolumes calls, want 2 (two pages)", len(reqs))
	}
	for i, wantToken := range []string{"", "page-2"} {
		if reqs[i].GetPageToken() != wantToken || reqs[i].GetPageSize() != 500 {
			t.Errorf("ListVolumes call %d = %v, want page_size 500, page_token %q", i, reqs[i], wantToken)
		}
	}
}

// A volume deleted while it has snapshots is kept for them: stor-ctl says
// so when it deletes it, lists it only with --deleted, and get says when
// it was deleted and what keeps it.
func TestVolumeDeletedKeptForSnapshots(t *testing.T) {
	f := newFake(t)
	f.volumes.retained = map[string]bool{"db": true}
	out := mustRun(t, "--server", f.addr, "volume", "delete", "db")
	if !strings.Contains(out, `volume "db" deleted; its data (id vol-1) is kept for its snapshots until the last is deleted`) {
		t.Errorf("delete of a volume kept for its snapshots printed %q", out)
	}
	mustRun(t, "--server", f.addr, "volume", "list")
	mustRun(t, "--server", f.addr, "volume", "list", "--deleted")
	reqs := f.volumes.listReqs
	if len(reqs) != 4 || reqs[0].GetIncludeDeleted() || reqs[1].GetIncludeDeleted() || !reqs[2].GetIncludeDeleted() || !reqs[3].GetIncludeDeleted() {
		t.Errorf("ListVolumes requests %v: want include_deleted only with --deleted", reqs)
	}
	f.volumes.volumes = append(f.volumes.volumes, &storpb.Volume{Id: "vol-9", Name: "old", SizeBytes: 1 << 30, ReplicaCount: 1,
		State: storpb.VolumeState_VOLUME_STATE_DELETED, DeletedUnixNano: testNow.Add(-time.Hour).UnixNano()})
	out = mustRun(t, "--server", f.addr, "volume", "get", "--id", "vol-9")
	assertCells(t, out, "STATE:", "deleted")
	if !strings.Contains(out, "kept only for its snapshots") || !strings.Contains(out, "stor-ctl snapshot list --id vol-9") {
		t.Errorf("get of a deleted volume does not say what keeps it:\n%s", out)
	}
}

func TestVolumeDeleteAndExpand(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "volume", "delete", "logs")
	if !strings.Contains(out, `volume "logs" deleted`) {
		t.Errorf("delete output %q does not confirm", out)
	}
	if ref := f.volumes.deletes[0]; ref.GetName() != "logs" {
		t.Fatalf("DeleteVolume ref = %v, want name logs", ref)
	}

	out = mustRun(t, "--server", f.addr, "volume", "expand", "db", "--size", "20GiB")
	if got := f.volumes.expansions[0]; got.GetVolume().GetName() != "db" || got.GetSizeBytes() != 20<<30 {
		t.Fatalf("ExpandVolume request = %v, want db to 21474836480 bytes", got)
	}
	assertCells(t, out, "SIZE:", "20 GiB")

	r := run(t, "--server", f.addr, "volume", "expand", "db", "--size", "1GiB")
	if r.code != 1 || r.stderr != "stor-ctl: volume \"db\": cannot shrink from 10737418240 to 1073741824 bytes\n" {
		t.Fatalf("shrink: exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestSnapshotCreateResolvesVolumeName(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "snapshot", "create", "db", "before-migration")
	if len(f.snapshots.creates) != 1 {
		t.Fatalf("server saw %d CreateSnapshot calls, want 1", len(f.snapshots.creates))
	}
	if got := f.snapshots.creates[0]; got.GetVolumeId() != "vol-1" || got.GetName() != "before-migration" {
		t.Fatalf("CreateSnapshot request = %v, want volume_id vol-1, name before-migration", got)
	}
	assertCells(t, out, "NAME:", "before-migration")
	assertCells(t, out, "VOLUME ID:", "vol-1")
	assertCells(t, out, "READY:", "yes")

	// An unknown volume stops before CreateSnapshot.
	r := run(t, "--server", f.addr, "snapshot", "create", "nope", "x")
	if r.code != 1 || r.stderr != "stor-ctl: volume \"nope\" not found\n" {
		t.Fatalf("unknown volume: exit %d, stderr %q", r.code, r.stderr)
	}
	if len(f.snapshots.creates) != 1 {
		t.Fatalf("CreateSnapshot was called for an unknown volume")
	}
}

func TestSnapshotListGetDelete(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "snapshot", "list")
	assertCells(t, out, "NAME", "ID", "VOLUME ID", "SIZE", "READY", "COPIES", "CREATED")
	// Ready, with one copy left of three: one replacement from lost.
	assertCells(t, out, "nightly", "snap-1", "vol-1", "10 GiB", "yes", "1/3", "2026-02-28T00:00:00Z")
	assertCells(t, out, "pre-upgrade", "snap-2", "vol-2", "1 GiB", "no", "-", "-")

	out = mustRun(t, "--server", f.addr, "snapshot", "list", "logs")
	if got := f.snapshots.listReqs[1]; got.GetVolumeId() != "vol-2" || got.GetPageSize() != 500 {
		t.Fatalf("ListSnapshots request = %v, want volume_id vol-2, page_size 500", got)
	}
	if strings.Contains(out, "nightly") || !strings.Contains(out, "pre-upgrade") {
		t.Fatalf("snapshot list logs:\n%s\nwant only pre-upgrade", out)
	}

	out = mustRun(t, "--server", f.addr, "snapshot", "get", "nightly")
	assertCells(t, out, "ID:", "snap-1")
	assertCells(t, out, "SIZE:", "10 GiB")
	assertCells(t, out, "REPLICAS:", "vol-1-r1=cut vol-1-r2=lost vol-1-r3=missed")

	mustRun(t, "--server", f.addr, "snapshot", "delete", "--id", "snap-2")
	if ref := f.snapshots.deletes[0]; ref.GetId() != "snap-2" || ref.GetName() != "" {
		t.Fatalf("DeleteSnapshot ref = %v, want id snap-2", ref)
	}
}

func TestJSONOutput(t *testing.T) {
	f := newFake(t)
	allVolumes := &storpb.ListVolumesResponse{Volumes: f.volumes.volumes}
	for _, tc := range []struct {
		args []string
		into proto.Message
		want proto.Message
	}{
		{[]string{"cluster", "status"}, &storpb.StatusResponse{}, f.cluster.status},
		{[]string{"server", "list"}, &storpb.ListServersResponse{}, &storpb.ListServersResponse{Servers: f.cluster.servers}},
		{[]string{"node", "list"}, &storpb.ListNodesResponse{}, &storpb.ListNodesResponse{Nodes: f.cluster.nodes}},
		{[]string{"volume", "get", "db"}, &storpb.Volume{}, f.volumes.volumes[0]},
		{[]string{"volume", "list"}, &storpb.ListVolumesResponse{}, allVolumes},
		{[]string{"snapshot", "get", "nightly"}, &storpb.Snapshot{}, f.snapshots.snapshots[0]},
		{[]string{"snapshot", "list"}, &storpb.ListSnapshotsResponse{}, &storpb.ListSnapshotsResponse{Snapshots: f.snapshots.snapshots}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			out := mustRun(t, append([]string{"--server", f.addr, "-o", "json"}, tc.args...)...)
			if err := protojson.Unmarshal([]byte(out), tc.into); err != nil {
				t.Fatalf("output does not parse as %T: %v\n%s", tc.into, err, out)
			}
			if !proto.Equal(tc.into, tc.want) {
				t.Fatalf("parsed output =\n%v\nwant\n%v", tc.into, tc.want)
			}
		})
	}

	// EmitUnpopulated: zero fields are present, so scripts can rely on them.
	out := mustRun(t, "--server", f.addr, "--output=json", "volume", "get", "cache")
	if !strings.Contains(out, `"epoch"`) || !strings.Contains(out, `"attachment"`) {
		t.Errorf("JSON of a detached volume lacks unpopulated fields:\n%s", out)
	}
}

func TestServerErrors(t *testing.T) {
	f := newFake(t)
	for _, tc := range []struct {
		name       string
		args       []string
		wantStderr string
	}{
		{"not found", []string{"volume", "get", "missing"}, `stor-ctl: volume "missing" not found`},
		{"not found by id", []string{"volume", "delete", "--id", "vol-9"}, `stor-ctl: volume id "vol-9" not found`},
		{"failed precondition", []string{"volume", "get", "busy"}, `stor-ctl: volume "busy" is attached to node-b`},
		{"empty message shows the code", []string{"volume", "get", "silent"}, `stor-ctl: PermissionDenied`},
		{"snapshot not found", []string{"-o", "json", "snapshot", "get", "gone"}, `stor-ctl: snapshot "gone" not found`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := run(t, append([]string{"--server", f.addr}, tc.args...)...)
			if r.code != 1 {
				t.Errorf("exit code = %d, want 1", r.code)
			}
			if r.stderr != tc.wantStderr+"\n" {
				t.Errorf("stderr = %q, want the single line %q", r.stderr, tc.wantStderr)
			}
			if r.stdout != "" {
				t.Errorf("stdout = %q, want nothing", r.stdout)
			}
		})
	}
}

func TestUnavailableUntilTimeout(t *testing.T) {
	f := newFake(t)
	f.cluster.unavailable = true
	start := time.Now()
	r := run(t, "--server", f.addr, "--timeout", "300ms", "cluster", "status")
	if elapsed := time.Since(start); elapsed < 250*time.Millisecond || elapsed > 5*time.Second {
		t.Errorf("gave up after %v, want about the 300ms timeout", elapsed)
	}
	want := "stor-ctl: cluster unavailable at " + f.addr + ": no leader\n"
	if r.code != 1 || r.stderr != want {
		t.Fatalf("exit %d, stderr %q; want 1, %q", r.code, r.stderr, want)
	}
}

func TestServerAddresses(t *testing.T) {
	f := newFake(t)
	dead := deadAddr(t)

	t.Run("STOR_SERVER is used without --server", func(t *testing.T) {
		t.Setenv("STOR_SERVER", f.addr)
		out := mustRun(t, "volume", "get", "db")
		assertCells(t, out, "ID:", "vol-1")
	})
	t.Run("--server wins over STOR_SERVER", func(t *testing.T) {
		t.Setenv("STOR_SERVER", dead)
		mustRun(t, "--server", f.addr, "volume", "get", "db")

		t.Setenv("STOR_SERVER", f.addr)
		r := run(t, "--server", dead, "--timeout", "200ms", "volume", "get", "db")
		if r.code != 1 || !strings.HasPrefix(r.stderr, "stor-ctl: cluster unavailable at "+dead+": ") {
			t.Fatalf("exit %d, stderr %q; want unavailable at %s", r.code, r.stderr, dead)
		}
	})
	t.Run("a comma-separated list skips a dead server", func(t *testing.T) {
		t.Setenv("STOR_SERVER", dead+", "+f.addr)
		out := mustRun(t, "volume", "get", "db")
		assertCells(t, out, "ID:", "vol-1")
	})
	t.Run("the default is 127.0.0.1:7400", func(t *testing.T) {
		t.Setenv("STOR_SERVER", "")
		r := run(t, "--timeout", "100ms", "volume", "get", "db")
		if r.code == 0 {
			t.Skip("something answers on 127.0.0.1:7400")
		}
		if !strings.Contains(r.stderr, " at 127.0.0.1:7400") {
			t.Fatalf("exit %d, stderr %q; want the default address tried", r.code, r.stderr)
		}
	})
}

func TestUsageErrors(t *testing.T) {
	f := newFake(t)
	for _, tc := range []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"unknown command", []string{"volume", "lst"}, `unknown command "lst" for "stor-ctl volume"`},
		{"unknown top-level command", []string{"volumes"}, `unknown command "volumes" for "stor-ctl" (did you mean "volume"?)`},
		{"unknown flag", []string{"volume", "list", "--bogus"}, "unknown flag: --bogus"},
		{"missing argument", []string{"volume", "get"}, "volume get expects NAME, got 0 argument(s)"},
		{"extra argument", []string{"volume", "list", "x"}, `volume list expects no arguments, got ["x"]`},
		{"snapshot list takes one volume", []string{"snapshot", "list", "a", "b"}, "snapshot list expects at most VOLUME"},
		{"missing size", []string{"volume", "create", "x"}, "--size is required"},
		{"bad size", []string{"volume", "create", "x", "--size", "ten"}, `--size: invalid size "ten"`},
		{"zero size", []string{"volume", "create", "x", "--size", "0GiB"}, "greater than zero"},
		{"negative size", []string{"volume", "expand", "x", "--size", "-1GiB"}, "negative"},
		{"bad replicas", []string{"volume", "create", "x", "--size", "1GiB", "--replicas", "-1"}, `invalid argument "-1" for "--replicas"`},
		{"bad param", []string{"volume", "create", "x", "--size", "1GiB", "--param", "novalue"}, `invalid --param "novalue": want key=value`},
		{"duplicate param", []string{"volume", "create", "x", "--size", "1GiB", "--param", "a=1", "--param", "a=2"}, `"a" given twice`},
		{"bad output", []string{"-o", "yaml", "volume", "list"}, `invalid --output "yaml": want table or json`},
		{"bad timeout", []string{"--timeout", "0s", "volume", "list"}, "invalid --timeout"},
		{"empty server", []string{"--server", " , ", "volume", "list"}, `invalid --server " , ": no address`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := run(t, append([]string{"--server", f.addr}, tc.args...)...)
			if r.code != 2 {
				t.Errorf("exit code = %d, want 2", r.code)
			}
			if !strings.HasPrefix(r.stderr, "stor-ctl: ") || strings.Count(r.stderr, "\n") != 1 || !strings.Contains(r.stderr, tc.wantErr) {
				t.Errorf("stderr = %q, want one line containing %q", r.stderr, tc.wantErr)
			}
		})
	}
	if n := len(f.volumes.creates) + len(f.volumes.listReqs) + len(f.volumes.gets) + len(f.volumes.expansions); n != 0 {
		t.Fatalf("bad command lines reached the server %d times", n)
	}
}

func TestHelpExitsZero(t *testing.T) {
	for _, args := range [][]string{nil, {"--help"}, {"volume"}, {"volume", "create", "--help"}} {
		r := run(t, args...)
		if r.code != 0 || r.stderr != "" || !strings.Contains(r.stdout, "Usage:") {
			t.Errorf("stor-ctl %q: exit %d, stderr %q, stdout without usage", args, r.code, r.stderr)
		}
	}
}

func TestNewRootCommand(t *testing.T) {
	f := newFake(t)
	var stdout, stderr bytes.Buffer
	cmd := NewRootCommand(&stdout, &stderr)
	cmd.SetArgs([]string{"--insecure", "--server", f.addr, "volume", "list"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout.String(), "cache") {
		t.Fatalf("volume list output lacks the second page:\n%s", stdout.String())
	}
}

func TestReplicaCommands(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "replica", "list", "db")
	assertCells(t, out, "REPLICA", "SERVER", "STATE", "GENERATION", "REBUILD", "SINCE")
	assertCells(t, out, "r-2", "s2", "healthy", "1", "-", "-")
	assertCells(t, out, "r-3", "s3", "rebuilding", "12", "delta 75%", "1m ago")

	mustRun(t, "--server", f.addr, "replica", "add", "db", "--on", "s9")
	mustRun(t, "--server", f.addr, "replica", "remove", "db", "r-2")
	mustRun(t, "--server", f.addr, "replica", "remove", "db", "r-3", "--replace")
	want := []*storpb.ReplaceReplicaRequest{
		{Volume: &storpb.VolumeRef{Name: "db"}, ServerId: "s9"},
		{Volume: &storpb.VolumeRef{Name: "db"}, ReplicaId: "r-2", RemoveOnly: true},
		{Volume: &storpb.VolumeRef{Name: "db"}, ReplicaId: "r-3"},
	}
	for i, w := range want {
		if !proto.Equal(f.volumes.replaces[i], w) {
			t.Fatalf("request %d = %v, want %v", i, f.volumes.replaces[i], w)
		}
	}
	r := run(t, "--server", f.addr, "replica", "remove", "db", "r-1")
	if r.code != 1 || !strings.Contains(r.stderr, "last healthy replica") || strings.Count(r.stderr, "\n") != 1 {
		t.Fatalf("removing the last healthy replica: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := run(t, "--server", f.addr, "replica", "remove", "db"); r.code != 2 {
		t.Fatalf("remove without a replica id: exit %d", r.code)
	}
}

func TestVolumeCreateClone(t *testing.T) {
	f := newFake(t)
	out := mustRun(t, "--server", f.addr, "-o", "json", "volume", "create", "restore", "--from-snapshot", "nightly")
	got := f.volumes.creates[len(f.volumes.creates)-1]
	if got.GetContentSource().GetSnapshotId() != "snap-1" || got.GetSizeBytes() != 10<<30 {
		t.Fatalf("clone from snapshot: request %v; want snapshot snap-1 and the snapshot's size", got)
	}
	var v storpb.Volume
	if err := protojson.Unmarshal([]byte(out), &v); err != nil || v.GetName() != "restore" {
		t.Fatalf("-o json output %q: %v", out, err)
	}

	mustRun(t, "--server", f.addr, "volume", "create", "copy", "--from-volume", "db", "--size", "20GiB")
	got = f.volumes.creates[len(f.volumes.creates)-1]
	if got.GetContentSource().GetVolumeId() != "vol-1" || got.GetSizeBytes() != 20<<30 {
		t.Fatalf("clone from volume: request %v; want volume vol-1 and 20 GiB", got)
	}

	n := len(f.volumes.creates)
	if r := run(t, "--server", f.addr, "volume", "create", "x", "--from-volume", "db", "--from-snapshot", "nightly"); r.code != 2 {
		t.Fatalf("both sources: exit %d, stderr %q; want a usage error", r.code, r.stderr)
	}
	if r := run(t, "--server", f.addr, "volume", "create", "x", "--from-snapshot", "gone"); r.code != 1 || !strings.Contains(r.stderr, `"gone" not found`) {
		t.Fatalf("unknown snapshot: exit %d, stderr %q", r.code, r.stderr)
	}
	if len(f.volumes.creates) != n {
		t.Fatalf("CreateVolume was called for a refused clone")
	}
}

func TestSnapshotShowsWhyNotReady(t *testing.T) {
	f := newFake(t)
	f.snapshots.snapshots[1].StatusMessage = "waiting for replicas to cut the snapshot: r-5 (server s2)"
	f.snapshots.snapshots[1].Replicas = []*storpb.SnapshotReplica{
		{ReplicaId: "r-4", ServerId: "s1", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT},
		{ReplicaId: "r-5", ServerId: "s2", State: storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING},
	}
	out := mustRun(t, "--server", f.addr, "snapshot", "get", "pre-upgrade")
	assertCells(t, out, "READY:", "no")
	if !strings.Contains(out, "waiting for replicas to cut the snapshot: r-5 (server s2)") || !strings.Contains(out, "r-4=cut r-5=pending") {
		t.Fatalf("snapshot get does not say why it is not ready:\n%s", out)
	}
}

// TestClusterTextIsEscaped: names, labels, parameters, status messages and
// error texts that come from the cluster reach the terminal with their
// control characters escaped, in tables, detail views and errors (a
// volume named with an OSC title sequence and a screen clear used to be
// printed raw).
func TestClusterTextIsEscaped(t *testing.T) {
	const evil = "evil\x1b]0;pwned\x07\x1b[2J\r\nfake-line\u202e\u009b31m"
	f := newFake(t)
	f.volumes.volumes = append(f.volumes.volumes, &storpb.Volume{
		Id: "vol-evil", Name: evil, SizeBytes: 1 << 30, ReplicaCount: 1, State: storpb.VolumeState_VOLUME_STATE_AVAILABLE,
		Parameters: map[string]string{"k\x1b[1m": "v\nnext"},
		Attachment: &storpb.Attachment{NodeId: evil},
	})
	f.cluster.nodes = append(f.cluster.nodes, &storpb.Node{Id: evil, Labels: map[string]string{"x": evil}})
	f.volumes.errFor = map[string]error{"boom": status.Error(codes.FailedPrecondition, "volume is attached to "+evil)}

	for _, args := range [][]string{
		{"volume", "list"},
		{"volume", "get", "--id", "vol-evil"},
		{"node", "list"},
		{"volume", "get", "boom"},
		{"-o", "json", "volume", "get", "--id", "vol-evil"},
	} {
		r := run(t, append([]string{"--server", f.addr}, args...)...)
		out := r.stdout + r.stderr
		if !strings.Contains(out, `\x1b`) && !strings.Contains(out, `\u001b`) {
			t.Errorf("stor-ctl %v: the escape sequence is not shown escaped:\n%s", args, out)
		}
		for _, c := range out {
			if c != '\n' && c != '\t' && (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) || c == '\u202e') {
				t.Errorf("stor-ctl %v printed control character %U raw:\n%q", args, c, out)
				break
			}
		}
		if strings.Contains(out, "\nfake-line") {
			t.Errorf("stor-ctl %v: a name started a line of its own:\n%s", args, out)
		}
	}
}

func TestEscape(t *testing.T) {
	for in, want := range map[string]string{
		"plain-name_1.2":  "plain-name_1.2",
		"ümlaut ok":       "ümlaut ok",
		"a\x1b[31mb":      `a\x1b[31mb`,
		"two\nlines\ttab": `two\nlines\ttab`,
		"bidi\u202eevil":  `bidi\u202eevil`,
		"c1\u009bcsi":     `c1\u009bcsi`,
		"del\x7f":         `del\x7f`,
		"bad\xffutf8":     `bad\xffutf8`,
	} {
		if got := escape(in); got != want {
			t.Errorf("escape(%q) = %q, want %q", in, got, want)
		}
	}
	var b strings.Builder
	escapingWriter{&b}.Write([]byte("ok\n\x1b[2J\r\tend\x7f"))
	if got, want := b.String(), "ok\n\\x1b[2J\\x0d\tend\\x7f"; got != want {
		t.Errorf("escapingWriter wrote %q, want %q", got, want)
	}
	if got, want := string(escapeJSON([]byte("{\"a\": \"x\u202ey\u009b\"}\n"))), `{"a": "x\u202ey\u009b"}`+"\n"; got != want {
		t.Errorf("escapeJSON = %q, want %q", got, want)
	}
}
