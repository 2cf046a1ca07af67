package client_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
)

// This file is an external test package: servertest, whose Network
// stalls a connection, itself imports client.

// statusServer answers Status with its id.
type statusServer struct {
	storpb.UnimplementedClusterServiceServer
	id string
}

func (s *statusServer) Status(context.Context, *storpb.StatusRequest) (*storpb.StatusResponse, error) {
	return &storpb.StatusResponse{ClusterId: s.id}, nil
}

// serveStatus serves a statusServer on 127.0.0.1:0 with the servers'
// keepalive policy (internal/server APILimits) until the test ends.
func serveStatus(t *testing.T, id string) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}))
	storpb.RegisterClusterServiceServer(srv, &statusServer{id: id})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// A call in flight to a server whose path stops passing packets without
// breaking (no connection error reports it) used to wait for its
// deadline. The keepalive finds the dead connection and fails the call
// Unavailable, and its retry goes to another server.
func TestACallToAServerWhosePathStallsMovesOn(t *testing.T) {
	a, b := serveStatus(t, "stalled"), serveStatus(t, "healthy")
	network := servertest.NewNetwork()
	network.Register(a, 1)
	network.Register(b, 2)
	dialer := network.Dialer(0)
	c, err := client.Dial([]string{a, b}, grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		return dialer(ctx, "tcp", addr)
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for seen := map[string]bool{}; len(seen) < 2; { // both connections open
		resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
		if err != nil {
			t.Fatalf("Status before the stall: %v", err)
		}
		seen[resp.GetClusterId()] = true
	}

	network.Stall(0, 1)
	defer network.Heal()
	const calls = 4 // round robin sends some to the stalled server
	start := time.Now()
	errs := make(chan error, calls)
	for range calls {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
			defer cancel()
			resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
			if err == nil && resp.GetClusterId() != "healthy" {
				err = fmt.Errorf("answered by %q", resp.GetClusterId())
			}
			errs <- err
		}()
	}
	for range calls {
		if err := <-errs; err != nil {
			t.Fatalf("a call made as one server's path stalled: %v after %v; want the healthy server's answer", err, time.Since(start).Round(time.Millisecond))
		}
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Fatalf("the calls made as one server's path stalled took %v; want the keepalive's 20 s or so", took.Round(time.Millisecond))
	}
	t.Logf("every call answered by the healthy server within %v", time.Since(start).Round(time.Millisecond))
}
