// Package client is the Go client of the stor control API (ClusterService,
// VolumeService and SnapshotService in api/proto).
//
// A Client holds one gRPC connection to a cluster, given by one or more
// control addresses. Any server accepts any call (it forwards to the Raft
// leader), so the connection balances calls round-robin over every address
// that accepts a connection. That is also what lets a retry leave a server
// that is reachable but cut off from its peers: it answers every call
// Unavailable ("no leader"), and with pick_first (which moves on only when a
// connection fails) a client stuck to it had no control plane at all while
// the rest of the cluster had a leader (the jepsen harness saw 100 s of it).
//
// Unary calls that fail with codes.Unavailable are retried with capped
// exponential backoff (50ms doubling to 500ms) until the call's context is
// done. Servers answer Unavailable while the cluster has no leader or the
// leader just changed, and gRPC answers it while no address is reachable;
// the control API promises such calls are safe to retry (the creating calls
// are idempotent by name). A leader failover is therefore invisible to
// callers, apart from latency. A call made with a context that has no
// deadline retries for as long as the cluster is unavailable. Streams
// (VolumeService.WatchVolume) are not retried: a watcher must reopen its
// stream itself, because it has to decide where to resume.
//
// A connection whose path stops passing packets without breaking (which
// no connection error reports) is found by its keepalive: a call in flight
// on it fails Unavailable 10-15 s after the path stopped, sooner if data
// it sent goes unacknowledged for 5 s (gRPC sets TCP_USER_TIMEOUT), and is
// retried through another server, where it would otherwise wait for its
// deadline. (In TestACallToAServerWhosePathStallsMovesOn, whose stalled
// connection also holds gRPC's closing GOAWAY for its 5 s, 20.1 s.)
//
// Transport security: Dial uses insecure transport credentials unless its
// options carry others (a cluster with TLS: pki.Source.GRPCDialCredentials).
//
// A Client is safe for concurrent use.
package client

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// Errors returned by Dial.
var (
	// ErrNoAddress is returned by Dial when it is given no address.
	ErrNoAddress = errors.New("client: no control address given")
)

// Retry backoff for calls answered codes.Unavailable.
const (
	retryInitialBackoff = 50 * time.Millisecond
	retryMaxBackoff     = 500 * time.Millisecond
)

// keepaliveParams is a Client's gRPC keepalive: with a call in flight and
// nothing read for Time it pings, and a ping unanswered for Timeout closes
// the connection, failing its calls Unavailable. Time is grpc-go's
// minimum; the servers tolerate pings this often (their KeepaliveMinTime
// is 10 s).
var keepaliveParams = keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second}

// resolverScheme names the static resolver each Client registers on its own
// connection (grpc.WithResolvers), so it never clashes with global ones.
const resolverScheme = "stor"

// Client is a connection to a stor cluster and the control API's service
// clients over it.
type Client struct {
	Cluster   storpb.ClusterServiceClient
	Volumes   storpb.VolumeServiceClient
	Snapshots storpb.SnapshotServiceClient

	conn *grpc.ClientConn
}

// Dial connects to a stor cluster given one or more control addresses
// ("host:port"). Calls go round-robin to the reachable addresses; a unary call that fails with
// codes.Unavailable is retried with capped exponential backoff (start 50ms,
// cap 500ms) until its context is done, which makes a leader failover
// invisible to callers. When the context ends while retrying, the call
// returns the last Unavailable error, which says why the cluster could not
// answer. The stream call (WatchVolume) is not retried.
//
// Dial uses insecure transport credentials unless opts carry others
// (pki.Source.GRPCDialCredentials: mutual TLS).
// opts are applied after Dial's own options and may override them.
//
// Dial does not wait for a connection; the first call makes it.
func Dial(addrs []string, opts ...grpc.DialOption) (*Client, error) {
	if len(addrs) == 0 {
		return nil, ErrNoAddress
	}
	state := resolver.State{}
	for _, a := range addrs {
		a = strings.TrimSpace(a)
		if a == "" {
			return nil, fmt.Errorf("client: empty control address in %q", addrs)
		}
		addr := resolver.Address{Addr: a}
		state.Addresses = append(state.Addresses, addr)
		state.Endpoints = append(state.Endpoints, resolver.Endpoint{Addresses: []resolver.Address{addr}})
	}
	r := manual.NewBuilderWithScheme(resolverScheme)
	r.InitialState(state)

	all := append([]grpc.DialOption{
		grpc.WithResolvers(r),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`),
		grpc.WithChainUnaryInterceptor(retryUnavailable),
		grpc.WithKeepaliveParams(keepaliveParams),
	}, opts...)
	conn, err := grpc.NewClient(resolverScheme+":///cluster", all...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", strings.Join(addrs, ","), err)
	}
	return &Client{
		Cluster:   storpb.NewClusterServiceClient(conn),
		Volumes:   storpb.NewVolumeServiceClient(conn),
		Snapshots: storpb.NewSnapshotServiceClient(conn),
		conn:      conn,
	}, nil
}

// Close closes the connection. Calls in flight fail with codes.Canceled.
func (c *Client) Close() error {
	return c.conn.Close()
}

// retryUnavailable is a unary client interceptor that repeats a call answered
// codes.Unavailable, waiting retryInitialBackoff, doubling up to
// retryMaxBackoff, until the call succeeds, fails otherwise, or ctx is done.
func retryUnavailable(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	backoff := retryInitialBackoff
	var lastUnavailable error
	for {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if status.Code(err) != codes.Unavailable {
			if err != nil && lastUnavailable != nil && ctx.Err() != nil {
				// The deadline struck during a retry; why the cluster could
				// not answer says more than "deadline exceeded".
				return lastUnavailable
			}
			return err
		}
		lastUnavailable = err
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		backoff = min(2*backoff, retryMaxBackoff)
	}
}
