package server

import (
	"context"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
)

// Every call a server makes to another server's control port (a call a
// follower forwards to its leader, a heartbeat, a progress report) names
// the caller's cluster, and a server of another cluster refuses it. The
// sequence it closes is the Raft hello's (raftstore's cluster check): a
// server keeps calling an address it learnt for a peer (its leader, a
// seed) after that peer is gone, and the address (a pod IP, a port) may
// by then be another cluster's server's. Without the check, that server
// applied what was meant for this cluster (a volume made or deleted by
// name in the wrong cluster), and answered a heartbeat with "no record of
// you", which the caller takes for its own removal.
//
// A caller of no cluster yet names none and is heard; a joining server
// asks its seed's Status first and then names the seed's cluster, so its
// join checks nothing (a data dir of another cluster is refused by the
// joiner itself, joinVia). A receiver of no cluster yet checks nothing
// (it has no leader to forward to, and answers Unavailable). Status
// and the health check answer any caller: they are how a peer learns
// which cluster a server is of. A call naming no cluster (an operator's
// or the CSI driver's, or a server of a version before this check) is
// heard as before.

// clusterKey is the metadata key naming the calling server's cluster.
const clusterKey = "stor-cluster"

// anyCluster are the methods a server answers whatever cluster names the
// call.
var anyCluster = map[string]bool{
	storpb.ClusterService_Status_FullMethodName: true,
	healthpb.Health_Check_FullMethodName:        true,
}

// nameCluster is the client interceptor of the connections to other
// servers (dialPeer): it names this server's cluster on each call.
func (s *Server) nameCluster(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	// No store yet: Start asks the seeds' Status (existingCluster)
	// before it opens its data dir.
	if s.store != nil {
		if id := s.store.ClusterID(); id != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, clusterKey, id)
		}
	}
	return invoke(ctx, method, req, reply, cc, opts...)
}

// checkCluster is the server interceptor that refuses a call naming
// another cluster than this server's, as Unavailable: the caller (a
// follower forwarding, a heartbeat) is talking to a stale address, and
// the client of a forwarded call retries through another server.
func (s *Server) checkCluster(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if anyCluster[info.FullMethod] {
		return handler(ctx, req)
	}
	md, _ := metadata.FromIncomingContext(ctx)
	theirs := md.Get(clusterKey)
	if len(theirs) == 0 {
		return handler(ctx, req)
	}
	ours := s.store.ClusterID()
	if ours == "" || theirs[0] == ours {
		return handler(ctx, req)
	}
	s.peerRefusals.say(s, info.FullMethod, theirs[0], ours)
	return nil, status.Errorf(codes.Unavailable,
		"server %s is of cluster %s, %s %s: the caller reached it at an address a server of its own cluster had (a reused IP or port)",
		s.cfg.ID, ours, otherClusterMsg, theirs[0])
}

// otherClusterMsg is in the message of checkCluster's refusals.
const otherClusterMsg = "not of the caller's cluster"

// otherClusterRefused reports whether err is a refusal by a server of
// another cluster (checkCluster).
func otherClusterRefused(err error) bool {
	return status.Code(err) == codes.Unavailable && strings.Contains(status.Convert(err).Message(), otherClusterMsg)
}

// refusals rate-limits the log line of refused calls of another cluster
// (a stale heartbeat repeats every HeartbeatInterval).
type refusals struct {
	mu   sync.Mutex
	said time.Time
}

func (r *refusals) say(s *Server, method, theirs, ours string) {
	r.mu.Lock()
	quiet := time.Since(r.said) < 10*time.Second
	if !quiet {
		r.said = time.Now()
	}
	r.mu.Unlock()
	if !quiet {
		s.logger.Warn("a server of another cluster called this server: refused (a server whose peer had this address once: a reused IP or port)",
			"method", method, "their_cluster", theirs, "cluster", ours)
	}
}
