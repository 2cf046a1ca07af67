package server_test

import (
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// healthClient dials addr the way a kubelet gRPC probe does.
func healthClient(t *testing.T, addr string) healthpb.HealthClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

func check(t *testing.T, h healthpb.HealthClient, service string) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	resp, err := h.Check(ctxT(t, 2*time.Second), &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		t.Fatalf("health check %q: %v", service, err)
	}
	return resp.Status
}

func waitHealth(t *testing.T, h healthpb.HealthClient, service string, want healthpb.HealthCheckResponse_ServingStatus, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := check(t, h, service)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("health %q is %v after %v, want %v", service, got, within, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestHealthReadinessFollowsLeader(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	hs := make([]healthpb.HealthClient, len(c.Nodes))
	for i, n := range c.Nodes {
		hs[i] = healthClient(t, n.Addr)
		waitHealth(t, hs[i], server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 10*time.Second)
		if got := check(t, hs[i], server.HealthLiveness); got != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("node %d liveness %v", i, got)
		}
	}
	_, err := hs[0].Check(ctxT(t, 2*time.Second), &healthpb.HealthCheckRequest{Service: "readyz"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("unknown health service: %v, want NotFound", err)
	}

	// A follower cut off from the others loses its leader: not ready, so a
	// Service stops sending it clients, but alive, so it is not restarted.
	victim := (leader + 1) % 3
	c.Partition(victim)
	waitHealth(t, hs[victim], server.HealthReadiness, healthpb.HealthCheckResponse_NOT_SERVING, 15*time.Second)
	if got := check(t, hs[victim], server.HealthLiveness); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("partitioned node liveness %v, want SERVING", got)
	}
	c.Heal()
	waitHealth(t, hs[victim], server.HealthReadiness, healthpb.HealthCheckResponse_SERVING, 15*time.Second)
}

func TestHealthNotReadyBeforeJoining(t *testing.T) {
	cfg := servertest.TestConfig()
	cfg.ID = "stor-server-1" // not ordinal 0: joins, never bootstraps
	cfg.DataDir = t.TempDir()
	cfg.Listen, cfg.RaftListen, cfg.DataListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Join = []string{"127.0.0.1:1"} // nothing listens on port 1
	s, err := server.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Kill() })
	h := healthClient(t, s.Addr())
	if got := check(t, h, server.HealthLiveness); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("liveness %v, want SERVING", got)
	}
	// Give a join attempt time to fail; readiness must stay NOT_SERVING.
	time.Sleep(500 * time.Millisecond)
	if got := check(t, h, server.HealthReadiness); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("readiness of a server that never joined: %v, want NOT_SERVING", got)
	}
}
