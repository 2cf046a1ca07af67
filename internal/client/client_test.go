package client

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// fakeCluster answers Status with Unavailable ("no leader") for the first
// unavailable calls, then with its cluster id. ListServers is always
// NotFound.
type fakeCluster struct {
	storpb.UnimplementedClusterServiceServer
	id          string
	unavailable int64

	statusCalls      atomic.Int64
	listServersCalls atomic.Int64
}

func (f *fakeCluster) Status(context.Context, *storpb.StatusRequest) (*storpb.StatusResponse, error) {
	if n := f.statusCalls.Add(1); n <= f.unavailable {
		return nil, status.Error(codes.Unavailable, "no leader")
	}
	return &storpb.StatusResponse{ClusterId: f.id}, nil
}

func (f *fakeCluster) ListServers(context.Context, *storpb.ListServersRequest) (*storpb.ListServersResponse, error) {
	f.listServersCalls.Add(1)
	return nil, status.Error(codes.NotFound, `server "s9" not found`)
}

// fakeVolumes fails every WatchVolume stream with Unavailable.
type fakeVolumes struct {
	storpb.UnimplementedVolumeServiceServer
	watchCalls atomic.Int64
}

func (f *fakeVolumes) WatchVolume(*storpb.WatchVolumeRequest, grpc.ServerStreamingServer[storpb.VolumeEvent]) error {
	f.watchCalls.Add(1)
	return status.Error(codes.Unavailable, "no leader")
}

// startServer serves the fakes on 127.0.0.1:0 until the test ends or stop
// is called, and returns the address.
func startServer(t *testing.T, cluster *fakeCluster, volumes *fakeVolumes) (addr string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	if cluster != nil {
		storpb.RegisterClusterServiceServer(srv, cluster)
	}
	if volumes != nil {
		storpb.RegisterVolumeServiceServer(srv, volumes)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	stop = func() {
		srv.Stop()
		<-done
	}
	t.Cleanup(stop)
	return lis.Addr().String(), stop
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

func dial(t *testing.T, addrs ...string) *Client {
	t.Helper()
	c, err := Dial(addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestDialRejectsNoAddress(t *testing.T) {
	for _, tc := range []struct {
		name  string
		addrs []string
	}{
		{"nil", nil},
		{"empty", []string{}},
		{"blank entry", []string{"127.0.0.1:7400", " "}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Dial(tc.addrs)
			if err == nil {
				c.Close()
				t.Fatalf("Dial(%q) succeeded, want an error", tc.addrs)
			}
			if len(tc.addrs) == 0 && !errors.Is(err, ErrNoAddress) {
				t.Fatalf("Dial(%q) = %v, want ErrNoAddress", tc.addrs, err)
			}
		})
	}
}

func TestUnavailableIsRetriedPastDeadAddress(t *testing.T) {
	fake := &fakeCluster{id: "cluster-1", unavailable: 3}
	live, _ := startServer(t, fake, nil)
	c := dial(t, deadAddr(t), live)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	if resp.GetClusterId() != "cluster-1" {
		t.Fatalf("cluster id = %q, want cluster-1", resp.GetClusterId())
	}
	if got := fake.statusCalls.Load(); got != 4 {
		t.Fatalf("server saw %d Status calls, want 4 (3 Unavailable + 1 success)", got)
	}
	// Three backoffs: 50ms + 100ms + 200ms.
	if elapsed := time.Since(start); elapsed < 350*time.Millisecond {
		t.Fatalf("call took %v, want at least 350ms of backoff", elapsed)
	}
}

func TestDeadlineStopsRetries(t *testing.T) {
	fake := &fakeCluster{id: "cluster-1", unavailable: 1 << 40}
	live, _ := startServer(t, fake, nil)
	c := dial(t, live)

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
	elapsed := time.Since(start)
	switch status.Code(err) {
	case codes.Unavailable:
		if !strings.Contains(status.Convert(err).Message(), "no leader") {
			t.Fatalf("Unavailable error %v does not carry the server's message", err)
		}
	case codes.DeadlineExceeded:
	default:
		t.Fatalf("Status error = %v, want Unavailable or DeadlineExceeded", err)
	}
	if elapsed > 2*time.Second {
		t.Fatalf("retries went on for %v past a 300ms deadline", elapsed)
	}
	// Attempts at about 0, 50ms, 150ms; the next would be at 350ms.
	if got := fake.statusCalls.Load(); got < 2 || got > 4 {
		t.Fatalf("server saw %d Status calls within 300ms, want 2..4", got)
	}
}

func TestOtherErrorsAreNotRetried(t *testing.T) {
	fake := &fakeCluster{id: "cluster-1"}
	live, _ := startServer(t, fake, nil)
	c := dial(t, live)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("ListServers error = %v, want NotFound", err)
	}
	if got := fake.listServersCalls.Load(); got != 1 {
		t.Fatalf("server saw %d ListServers calls, want 1", got)
	}
}

func TestStreamIsNotRetried(t *testing.T) {
	fake := &fakeVolumes{}
	live, _ := startServer(t, nil, fake)
	c := dial(t, live)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stream, err := c.Volumes.WatchVolume(ctx, &storpb.WatchVolumeRequest{Volume: &storpb.VolumeRef{Name: "db"}})
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("WatchVolume error = %v, want Unavailable", err)
	}
	if got := fake.watchCalls.Load(); got != 1 {
		t.Fatalf("server saw %d WatchVolume calls, want 1", got)
	}
}

func TestServerFailoverIsInvisible(t *testing.T) {
	first := &fakeCluster{id: "via-first"}
	second := &fakeCluster{id: "via-second"}
	firstAddr, stopFirst := startServer(t, first, nil)
	secondAddr, _ := startServer(t, second, nil)
	c := dial(t, firstAddr, secondAddr)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Cluster.Status(ctx, &storpb.StatusRequest{}); err != nil {
		t.Fatalf("Status: %v", err)
	}
	stopFirst()
	for i := range 3 {
		resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
		if err != nil {
			t.Fatalf("Status %d after the first server stopped: %v", i, err)
		}
		if resp.GetClusterId() != "via-second" {
			t.Fatalf("call %d after failover answered by %q, want via-second", i, resp.GetClusterId())
		}
	}
}

// A server that accepts connections but is cut off from its peers answers
// every call Unavailable ("no leader"); the retries must reach another
// server that can answer, not stay on the first address.
func TestRetryLeavesAServerWithoutLeader(t *testing.T) {
	cutOff := &fakeCluster{id: "never", unavailable: 1 << 62}
	healthy := &fakeCluster{id: "cluster-1"}
	a, _ := startServer(t, cutOff, nil)
	b, _ := startServer(t, healthy, nil)
	c := dial(t, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := range 4 {
		resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
		if err != nil || resp.GetClusterId() != "cluster-1" {
			t.Fatalf("call %d: %v, %v; want the answer of the server that has a leader (the cut-off one was asked %d times)",
				i, resp, err, cutOff.statusCalls.Load())
		}
	}
}
