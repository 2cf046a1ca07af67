package csi

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// fakeStatusCluster is a ClusterService whose Status blocks until the
// call's context ends (a cluster that does not answer) unless leader is
// set, and whose RegisterNode succeeds.
type fakeStatusCluster struct {
	storpb.ClusterServiceClient

	mu          sync.Mutex
	leader      string // guarded by mu; "" blocks Status
	statusCalls int
}

func (f *fakeStatusCluster) Status(ctx context.Context, _ *storpb.StatusRequest, _ ...grpc.CallOption) (*storpb.StatusResponse, error) {
	f.mu.Lock()
	f.statusCalls++
	leader := f.leader
	f.mu.Unlock()
	if leader == "" {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return &storpb.StatusResponse{LeaderId: leader}, nil
}

func (f *fakeStatusCluster) RegisterNode(_ context.Context, req *storpb.RegisterNodeRequest, _ ...grpc.CallOption) (*storpb.RegisterNodeResponse, error) {
	return &storpb.RegisterNodeResponse{Node: req.GetNode()}, nil
}

func (f *fakeStatusCluster) set(leader string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leader = leader
}

func (f *fakeStatusCluster) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.statusCalls
}

func newStatusDriver(t *testing.T, fc *fakeStatusCluster, mode Mode, health string) *Driver {
	t.Helper()
	att := newFakeAttacher(nil)
	host, _, _ := fakeHost(att)
	dir := t.TempDir()
	cfg := Config{
		Mode: mode, Endpoint: "unix://" + filepath.Join(dir, "csi.sock"), HealthListen: health,
		Cluster:  Cluster{Cluster: fc, Volumes: storpb.NewVolumeServiceClient(nil), Snapshots: storpb.NewSnapshotServiceClient(nil)},
		Attacher: att, Host: host, Logger: testLogger(t), CallTimeout: 5 * time.Second,
	}
	if mode.node() {
		cfg.NodeID, cfg.StateDir = "worker-1", filepath.Join(dir, "state")
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Probe answers ready at once, without asking the cluster, while the
// cluster does not answer and before the node has recovered: the
// livenessprobe sidecar restarts the container on an error or on
// ready=false, within its one-second timeout.
func TestProbeIsCheapAndLocal(t *testing.T) {
	for _, mode := range []Mode{ModeController, ModeNode, ModeAll} {
		t.Run(string(mode), func(t *testing.T) {
			fc := &fakeStatusCluster{} // no leader: Status blocks
			d := newStatusDriver(t, fc, mode, "")
			t.Cleanup(d.Close)
			ctx, cancel := context.WithTimeout(context.Background(), time.Second) // the sidecar's --probe-timeout
			defer cancel()
			start := time.Now()
			r, err := d.Probe(ctx, &csipb.ProbeRequest{})
			if err != nil || !r.GetReady().GetValue() {
				t.Fatalf("Probe with a leaderless cluster, recovery not run: %v, %v (after %v); want ready", r, err, time.Since(start))
			}
			if n := fc.calls(); n != 0 {
				t.Fatalf("Probe asked the cluster for its status %d times; it must be local", n)
			}
		})
	}
}

// get fetches http://addr/path, returning the status code and body.
func get(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// Run serves /healthz and /readyz on HealthListen: /healthz is 200 while
// the CSI endpoint is served, whatever the cluster does; /readyz is 503
// while the cluster has no leader (controller) and 200 once it has one
// and the node has registered and recovered.
func TestHealthEndpoints(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	fc := &fakeStatusCluster{}
	d := newStatusDriver(t, fc, ModeAll, addr)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30s of cancel")
		}
	}()

	wait := func(path string, want int, contains string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			code, body := get(t, addr, path)
			if code == want && strings.Contains(body, contains) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d %q, want %d with %q", path, code, body, want, contains)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	wait("/healthz", http.StatusOK, "ok")
	wait("/readyz", http.StatusServiceUnavailable, "the cluster does not answer")
	if code, _ := get(t, addr, "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz %d with a leaderless cluster, want 200", code)
	}
	fc.set("s1")
	wait("/readyz", http.StatusOK, "ok")
	fc.set("")
	wait("/readyz", http.StatusServiceUnavailable, "the cluster does not answer")
}

// /metrics on HealthListen counts CSI calls by method and code, with
// their latency: a Probe and a failing ControllerGetVolume (no volume id)
// each show up once.
func TestMetricsEndpoint(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	d := newStatusDriver(t, &fakeStatusCluster{leader: "s1"}, ModeController, addr)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30s of cancel")
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if code, _ := get(t, addr, "/healthz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("/healthz not 200 within 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := grpc.NewClient(d.cfg.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	if _, err := csipb.NewIdentityClient(conn).Probe(cctx, &csipb.ProbeRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := csipb.NewControllerClient(conn).ControllerGetVolume(cctx, &csipb.ControllerGetVolumeRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ControllerGetVolume without an id: %v, want InvalidArgument", err)
	}
	code, body := get(t, addr, "/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	for _, want := range []string{
		`stor_csi_rpcs_total{code="OK",method="Probe"} 1`,
		`stor_csi_rpcs_total{code="InvalidArgument",method="ControllerGetVolume"} 1`,
		`stor_csi_rpc_duration_seconds_count{method="Probe"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
