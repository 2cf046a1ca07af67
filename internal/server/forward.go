package server

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	storpb "github.com/stor-io/stor/api/proto"
)

// forwardedKey marks a call a follower forwarded, so that a server that is
// not the leader either answers it or refuses it, never forwards it again.
const forwardedKey = "stor-forwarded-by"

// localMethods are answered by whichever server receives them.
var localMethods = map[string]bool{
	storpb.ClusterService_Status_FullMethodName: true,
	healthpb.Health_Check_FullMethodName:        true,
	// Issuing is not Raft state: any server with the issuing CA answers.
	storpb.ClusterService_IssueNodeCertificate_FullMethodName: true,
}

// forwarder sends unary calls that reach a follower to the leader. Writes
// must be proposed on the leader, and linearizable reads are served there,
// so every unary call but Status and the health check is forwarded.
type forwarder struct {
	s *Server

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn // leader control address -> conn
}

func (f *forwarder) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if localMethods[info.FullMethod] || f.s.store.IsLeader() {
		resp, err := handler(ctx, req)
		return resp, toStatus(err)
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedKey)) > 0 {
		return nil, status.Errorf(codes.Unavailable, "%s is not the leader (leadership moved while the call was forwarded)", f.s.cfg.ID)
	}
	gone := f.s.store.LeaderGone() // before the leader is read
	leaderID, addr, err := f.s.store.LeaderAddress()
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "no leader: %s", strings.ReplaceAll(err.Error(), "raftstore: ", ""))
	}
	reply, err := newReply(info.FullMethod)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	conn, err := f.conn(addr)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "leader %s at %s: %v", leaderID, addr, err)
	}
	ctx = metadata.AppendToOutgoingContext(ctx, forwardedKey, f.s.cfg.ID)
	if id, ok := callerOf(ctx); ok {
		ctx = metadata.AppendToOutgoingContext(ctx, callerKey, id.String())
	}
	// A call forwarded to a leader this server then loses (it stops
	// hearing from it: a path that drops packets, which no connection
	// error reports) is given up as Unavailable, which the client retries
	// through another server; otherwise it would wait for the caller's
	// deadline. As after any Unavailable that follows a forward, the
	// leader may have applied the call before it was given up: the
	// client's retry then meets what it did (the creating calls are
	// idempotent by name).
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go f.cancelOnLoss(fctx, cancel, gone, leaderID)
	if err := conn.Invoke(fctx, info.FullMethod, req, reply); err != nil {
		if ctx.Err() == nil && fctx.Err() != nil && status.Code(err) == codes.Canceled {
			return nil, status.Errorf(codes.Unavailable, "%s lost its leader %s while the call was forwarded to it: %v", f.s.cfg.ID, leaderID, err)
		}
		return nil, err
	}
	return reply, nil
}

// cancelOnLoss cancels a call forwarded to leader once this server's
// leader is another or none, until ctx ends. gone is the store's
// LeaderGone from before leader was read. A new term reports the leader
// changing twice (to none, then to the winner): a call that read the
// winner after the first may see gone close at the second, and goes on.
func (f *forwarder) cancelOnLoss(ctx context.Context, cancel context.CancelFunc, gone <-chan struct{}, leader string) {
	for {
		select {
		case <-gone:
		case <-ctx.Done():
			return
		}
		gone = f.s.store.LeaderGone() // before the leader is read again
		if id, _ := f.s.store.Leader(); id != leader {
			cancel()
			return
		}
	}
}

// newReply makes an empty response message for a full method name
// ("/stor.v1.VolumeService/CreateVolume") from the proto registry.
func newReply(fullMethod string) (protoreflect.ProtoMessage, error) {
	parts := strings.Split(strings.TrimPrefix(fullMethod, "/"), "/")
	if len(parts) != 2 {
		return nil, fmt.Errorf("forward: bad method name %q", fullMethod)
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(parts[0]))
	if err != nil {
		return nil, fmt.Errorf("forward: %s: %w", parts[0], err)
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil, fmt.Errorf("forward: %s is not a service", parts[0])
	}
	md := sd.Methods().ByName(protoreflect.Name(parts[1]))
	if md == nil {
		return nil, fmt.Errorf("forward: %s has no method %s", parts[0], parts[1])
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
	if err != nil {
		return nil, fmt.Errorf("forward: %s: %w", md.Output().FullName(), err)
	}
	return mt.New().Interface(), nil
}

// conn returns a cached connection to a leader address. Connections to
// addresses that are no longer the leader stay cached; there are at most
// as many as there have been leaders, and Close closes them all.
func (f *forwarder) conn(addr string) (*grpc.ClientConn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c, ok := f.conns[addr]; ok {
		return c, nil
	}
	c, err := f.s.dialPeer(addr)
	if err != nil {
		return nil, err
	}
	if f.conns == nil {
		f.conns = map[string]*grpc.ClientConn{}
	}
	f.conns[addr] = c
	return c, nil
}

func (f *forwarder) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		c.Close()
	}
	f.conns = nil
}

// peerKeepalive is how a connection to another server's control port
// finds a path that has stopped passing packets without breaking (a
// firewall rule dropping only that port, say), which no connection error
// reports and which Raft's own traffic, flowing on its port, does not
// show either: with a call in flight and nothing read for Time, it pings,
// and a ping unanswered for Timeout closes the connection, failing its
// calls Unavailable (a forwarded call is then retried by its client
// through another server): 10-15 s after the path stopped. gRPC also sets
// the socket's TCP_USER_TIMEOUT to Timeout, so data unacknowledged for 5 s
// closes it sooner; a link down that long has already cost Raft its
// leader. Time is grpc-go's minimum, and the servers' KeepaliveMinTime
// (APILimits) may not exceed it.
var peerKeepalive = keepalive.ClientParameters{Time: maxKeepaliveMinTime, Timeout: 5 * time.Second}

// dialPeer opens a client connection to another server through the Dial seam.
func (s *Server) dialPeer(addr string) (*grpc.ClientConn, error) {
	creds := grpc.WithTransportCredentials(insecure.NewCredentials())
	if s.cfg.TLS != nil {
		creds = s.cfg.TLS.GRPCDialCredentials()
	}
	return grpc.NewClient("passthrough:///"+addr, creds,
		grpc.WithKeepaliveParams(peerKeepalive),
		grpc.WithChainUnaryInterceptor(s.nameCluster),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
			return s.cfg.Dial(ctx, "tcp", a)
		}),
	)
}
